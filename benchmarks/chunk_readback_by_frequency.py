"""Held-out read-back of a chunk pretraining, split by how often each token occurs in the training
corpus and by its place in the chunk: whether the writer has learned a map shared across the
vocabulary or one per frequent token.

    python benchmarks/chunk_readback_by_frequency.py --run checkpoints/chunk-c8 [--json OUT.json]

Reads the run's settings and writer (state/), the same corpus and held-out chunks as the run
(`ilcp.training.chunk_pretrain`), and prints token accuracy per frequency bucket and per place.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from ilcp.encoder.chunk import ChunkWriter
from ilcp.io import atomic_write_json
from ilcp.lm import load_lm
from ilcp.provenance import provenance
from ilcp.training.chunk_pretrain import (ChunkPretrainConfig, ChunkReader, chunk_corpus, cut, even_sample,
                                          heldout_texts, tokenize, write)

BUCKETS = ((0, 0, "0"), (1, 9, "1-9"), (10, 99, "10-99"), (100, 999, "100-999"), (1000, None, "1000+"))


def bucket(count: int) -> str:
    for low, high, name in BUCKETS:
        if count >= low and (high is None or count <= high):
            return name
    raise AssertionError(count)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a chunk pretraining folder")
    p.add_argument("--set", default="squad", help="held-out set: squad, prose or babi_heldout_tasks")
    p.add_argument("--lm", default="smollm2-135m-instruct", help="the LM the run was trained on")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    state = json.loads((args.run / "state" / "state.json").read_text())
    cfg = ChunkPretrainConfig(**state["config"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    lm = load_lm(args.lm, dtype=args.dtype)
    tok = lm.tokenizer
    counts = collections.Counter(t for texts in chunk_corpus(cfg).values() for ids in tokenize(tok, texts) for t in ids)
    held = even_sample(cut(tokenize(tok, heldout_texts(cfg)[args.set]), cfg.window_tokens), cfg.heldout_chunks)
    writer = ChunkWriter(lm.hidden_size, cfg.chunk_tokens, width=cfg.width, inner=cfg.inner)
    writer.load_state_dict(load_file(str(args.run / "state" / "writer.safetensors")))
    reader = ChunkReader(lm)
    with torch.no_grad():
        right = reader.logits(write(writer.eval(), reader, held), held).argmax(-1) == held
    by_bucket = collections.defaultdict(list)
    for token, ok in zip(held.flatten().tolist(), right.flatten().tolist()):
        by_bucket[bucket(counts.get(token, 0))].append(ok)
    report = {
        "provenance": provenance(),
        "run": str(args.run), "step": state["step"], "set": args.set,
        "by_training_frequency": [{"occurrences in the training corpus": name, "held-out tokens": len(by_bucket[name]),
                                   "token accuracy": round(sum(by_bucket[name]) / max(1, len(by_bucket[name])), 3)}
                                  for _, _, name in BUCKETS],
        "by_place_in_chunk": [round(float(x), 3) for x in right.float().mean(0)],
    }
    print(json.dumps(report, indent=1))
    if args.json:
        atomic_write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
