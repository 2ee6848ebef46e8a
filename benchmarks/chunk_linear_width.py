"""How narrow a chunk writer's vectors can go before the receiver reads them back worse: the wire's
dtypes at full width, and the best linear code of k floats (the top k principal directions of the
writer's vectors on training chunks), against the beta-VAE's curves.

    python benchmarks/chunk_linear_width.py --writer pretrained/smollm2-chunk8-sender --json OUT.json

For a writer (shipped or a pretraining folder) it writes the vectors of ``--fit-chunks`` training
chunks (`chunk_pretrain.chunk_corpus`, the first epoch's order) and takes their principal
directions. On the writer's held-out sets (SQuAD validation, the books' validation passages, the
held-out bAbI tasks' stories; ``--heldout-chunks`` each) it prints the read-back (token accuracy,
exact chunks, loss) of:

- no memory, and the full-width vectors as written (float32);
- the full-width vectors after a round trip through the wire in bfloat16 and int8 (`ilcp.wire`);
- ``vector pca k``: each vector projected on the top k directions (k floats would cross);
- ``residual pca k``: the vector less its chunk's first token embedding (the writers' readable
  start) projected on the residuals' top k directions, the first token's embedding added back
  (k floats and the token's id would cross).

A linear code within 0.05 of full width says a latent of that size can hold what the receiver
reads; one far under says the writer spreads it over more directions than k.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from ilcp.io import atomic_write_json
from ilcp.lm import load_lm
from ilcp.provenance import provenance
from ilcp.training.chunk_latent import load_writer
from ilcp.training.chunk_pretrain import (ChunkBatches, ChunkPretrainConfig, ChunkReader, chunk_corpus, cut,
                                          even_sample, heldout_texts, tokenize)
from ilcp.wire.payload import TransportPayload, pack, unpack


@torch.no_grad()
def vectors_of(writer, table: torch.Tensor, chunks: torch.Tensor, batch: int = 64) -> torch.Tensor:
    return torch.cat([writer(table[chunks[i:i + batch].to(table.device)]).float() for i in range(0, len(chunks), batch)])


@torch.no_grad()
def read(reader: ChunkReader, memory: torch.Tensor | None, chunks: torch.Tensor, batch: int = 64) -> dict:
    totals = {"loss": 0.0, "token_accuracy": 0.0, "exact": 0.0}
    for i in range(0, len(chunks), batch):
        part = chunks[i:i + batch]
        s = reader.score(None if memory is None else memory[i:i + batch].unsqueeze(1), part)
        for k in totals:
            totals[k] += float(s[k]) * len(part)
    return {k: round(v / len(chunks), 4) for k, v in totals.items()}


def principal(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, directions (H, H) by decreasing variance, and each direction's share of the variance."""
    mean = x.mean(0)
    _, s, vh = torch.linalg.svd(x - mean, full_matrices=False)
    var = s.pow(2)
    return mean, vh, var / var.sum()


def project(x: torch.Tensor, mean: torch.Tensor, directions: torch.Tensor, k: int) -> torch.Tensor:
    top = directions[:k]
    return mean + ((x - mean) @ top.T) @ top


def wire(x: torch.Tensor, dtype: str) -> torch.Tensor:
    fingerprint = "0" * 16
    payload = TransportPayload.from_bytes(pack(x, lm_fingerprint=fingerprint, dtype=dtype).to_bytes(),
                                          expected_fingerprint=fingerprint)
    return unpack(payload, "cpu", dtype=torch.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--writer", type=Path, required=True, help="a shipped chunk writer or a chunk pretraining folder")
    p.add_argument("--lm", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", help="the frozen receiver's and writer's dtype")
    p.add_argument("--ks", default="32,64,128,256", help="comma-separated code widths")
    p.add_argument("--fit-chunks", type=int, default=4096, help="training chunks the directions come from")
    p.add_argument("--heldout-chunks", type=int, default=256)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",") if k]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    lm = load_lm(args.lm, dtype=args.dtype)
    writer = load_writer(args.writer, lm)
    c = writer.chunk_tokens
    reader = ChunkReader(lm)
    table = reader.table
    cfg = ChunkPretrainConfig(chunk_tokens=c)
    tokens = [ids for texts in chunk_corpus(cfg).values() for ids in tokenize(lm.tokenizer, texts)]
    fit = ChunkBatches(tokens, c, args.fit_chunks, cfg.seed).at(0)
    train = vectors_of(writer, table, fit)
    firsts = table[fit[:, 0].to(table.device)].float()
    v_mean, v_dirs, v_share = principal(train)
    r_mean, r_dirs, r_share = principal(train - firsts)
    report = {"provenance": provenance(), "writer": str(args.writer), "chunk_tokens": c, "fit_chunks": len(fit),
              "variance_share_of_top_k": {"vector": {k: round(float(v_share[:k].sum()), 4) for k in ks},
                                          "residual": {k: round(float(r_share[:k].sum()), 4) for k in ks}},
              "sets": {}}
    print(json.dumps(report["variance_share_of_top_k"]), flush=True)
    for name, texts in heldout_texts(cfg).items():
        chunks = even_sample(cut(tokenize(lm.tokenizer, texts), c), args.heldout_chunks)
        full = vectors_of(writer, table, chunks)
        first = table[chunks[:, 0].to(table.device)].float()
        rows = {"no memory": read(reader, None, chunks), "full width float32": read(reader, full, chunks)}
        for dtype in ("bfloat16", "int8"):
            rows[f"full width {dtype} wire"] = read(reader, wire(full, dtype), chunks)
        for k in ks:
            rows[f"vector pca {k}"] = read(reader, project(full, v_mean, v_dirs, k), chunks)
            rows[f"residual pca {k}"] = read(reader, first + project(full - first, r_mean, r_dirs, k), chunks)
        report["sets"][name] = rows
        for label, row in rows.items():
            print(f"{name:20s} {label:26s} acc {row['token_accuracy']:.3f} exact {row['exact']:.3f} "
                  f"loss {row['loss']:.2f}", flush=True)
    if args.json:
        atomic_write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
