"""Pooled-state extraction throughput next to the raw forward, on the same machine and batches.

    python benchmarks/pooling_throughput.py                  # embedded SmolLM2, 16 texts per cell
    python benchmarks/pooling_throughput.py --lm tiny-qwen3 --texts 8

For batch sizes 1 and 8 and contexts of 128 and 512 tokens, it times `pooled_states` (the
Lightning predict loop, masked mean of the last layer) and a plain `model(input_ids)` forward
over the same token batches, and prints tokens/s for both and their ratio.
"""

import argparse
import time

import torch

from ilcp.lm import DEFAULT_LM, load_lm
from ilcp.training.extraction import pooled_states
from ilcp.tasks import make_facts


def texts_of_length(tokenizer, n_tokens: int, count: int) -> list[str]:
    """`count` distinct facts contexts cut to exactly `n_tokens` tokens."""
    rows = make_facts(count, n_facts=16, n_distractors=8 * n_tokens // 64 + 8, seed=1)
    out = []
    for ctx in rows["context"]:
        ids = tokenizer(ctx, add_special_tokens=False).input_ids
        if len(ids) < n_tokens:
            raise ValueError(f"context has {len(ids)} tokens, fewer than {n_tokens}")
        out.append(tokenizer.decode(ids[:n_tokens]))
    return out


def raw_forward_seconds(lm, texts, batch_size: int, max_length: int) -> tuple[float, int]:
    tok, tokens, start = lm.tokenizer, 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i:i + batch_size], add_special_tokens=False, padding=True, truncation=True,
                      max_length=max_length, return_tensors="pt")
            lm.model(**enc, use_cache=False)
            tokens += int(enc["attention_mask"].sum())
    return time.perf_counter() - start, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lm", default=DEFAULT_LM)
    p.add_argument("--texts", type=int, default=16, help="texts per (batch, length) cell")
    args = p.parse_args()
    torch.manual_seed(0)
    lm = load_lm(args.lm)
    print(f"LM {lm.spec} ({sum(x.numel() for x in lm.model.parameters()) / 1e6:.0f}M params), "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'tokens':>6} {'pooled tok/s':>13} {'raw fwd tok/s':>14} {'pooled/raw':>10}")
    for n_tokens in (128, 512):
        texts = texts_of_length(lm.tokenizer, n_tokens, args.texts)
        n_real = sum(len(lm.tokenizer(t, add_special_tokens=False).input_ids) for t in texts)
        for batch in (1, 8):
            pooled_states(lm, texts[:batch], batch_size=batch, max_length=n_tokens, progress=False)  # warm-up
            start = time.perf_counter()
            pooled_states(lm, texts, batch_size=batch, max_length=n_tokens, progress=False)
            pooled_s = time.perf_counter() - start
            raw_s, raw_tokens = raw_forward_seconds(lm, texts, batch, n_tokens)
            pooled_tps, raw_tps = n_real / pooled_s, raw_tokens / raw_s
            print(f"{batch:>5} {n_tokens:>6} {pooled_tps:>13.0f} {raw_tps:>14.0f} {pooled_tps / raw_tps:>10.2f}")


if __name__ == "__main__":
    main()
