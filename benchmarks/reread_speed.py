"""Time the reread selector's attention pass on long contexts, in one forward and in chunks.

Reread scores a sender's positions by the attention they draw while the sender reads its whole
context a second time: a forward of T rows after the T cached ones, with eager attention. In one
forward every layer's weights ([heads, T, 2T]) are held at once (about 9 GB in float32 for
SmolLM2 at 2k tokens); `ilcp.rclc.selectors.base.attention_to_sender_chunks` feeds the rows a
chunk at a time so that only one chunk's weights exist. This prints, per context, both timings
and the largest difference between their scores (the chunks change nothing but rounding).

    python benchmarks/reread_speed.py                         # babilong:1:2k, 3 contexts
    python benchmarks/reread_speed.py --task babilong:1:1k --n 5 --json /tmp/reread.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ilcp.io import atomic_write_json
from ilcp.lm import load_lm
from ilcp.provenance import provenance
from ilcp.rclc import sender_from_hf
from ilcp.rclc.selectors import base, reread
from ilcp.receiver.rclc_prompts import receiver_framing
from ilcp.tasks import load_task


def _timed_profile(sender, chunk_elements: int) -> tuple[float, torch.Tensor]:
    previous = base.ATTENTION_CHUNK_ELEMENTS
    base.ATTENTION_CHUNK_ELEMENTS = chunk_elements
    try:
        start = time.perf_counter()
        profile = reread.profile(sender, None)
        return time.perf_counter() - start, profile.tail
    finally:
        base.ATTENTION_CHUNK_ELEMENTS = previous


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="babilong:1:2k")
    parser.add_argument("--n", type=int, default=3, help="contexts (validation split)")
    parser.add_argument("--chunk-elements", type=int, default=base.ATTENTION_CHUNK_ELEMENTS,
                        help="the chunked pass's bound on attention weights held at once")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.n < 1 or args.chunk_elements < 1:
        parser.error("--n and --chunk-elements must be at least 1")

    lm = load_lm()
    framing = receiver_framing(lm.tokenizer)
    try:
        rows = load_task(args.task, "validation", limit=args.n, tokenizer=lm.tokenizer).to_list()
    except ValueError as e:
        parser.error(str(e))
    results = []
    print(f"reread attention pass, {args.task}, {torch.get_num_threads()} threads "
          f"(chunk bound {args.chunk_elements:,} weights)")
    print("| context | positions | one forward s | chunked s | largest score difference |")
    print("|---|---|---|---|---|")
    for i, row in enumerate(rows):
        sender = sender_from_hf(lm.model, lm.tokenizer, framing.lead + row["context"].strip())
        with torch.inference_mode():
            chunked_s, chunked = _timed_profile(sender, args.chunk_elements)
            whole_s, whole = _timed_profile(sender, 1 << 62)
        diff = float((chunked - whole).abs().max())
        results.append({"positions": sender.positions, "one_forward_s": whole_s, "chunked_s": chunked_s,
                        "max_score_difference": diff})
        print(f"| {i} | {sender.positions:,} | {whole_s:.1f} | {chunked_s:.1f} | {diff:.1e} |")
    if args.json:
        atomic_write_json(Path(args.json), {"provenance": provenance(), "task": args.task,
                                            "threads": torch.get_num_threads(),
                                            "chunk_elements": args.chunk_elements, "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
