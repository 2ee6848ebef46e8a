"""Time the answer stage's loss on mixed-length batches, as one padded forward and in length groups.

A training batch of `configs/general.yaml` mixes SQuAD paragraphs with bAbI stories; padded to its
longest row, its forward computes about 2.4 times its real positions. The answer stage runs each
batch as one forward per group of similar lengths (`ilcp.encoder.pooling.length_groups`). This
times the stage's own loss (`HandoffModule._teacher_forced`, cold_read_tuned reading the text, the
costliest variant) both ways on the same random training batches, without and with gradients (the
tuned vectors' backward), and prints the seconds per batch, the speed-up, the padded positions
per real one, and the largest difference between the two losses (rounding only).

    python benchmarks/length_groups.py                       # configs/general.yaml, 6 batches of 8
    python benchmarks/length_groups.py --config configs/squad.yaml --batches 10 --json /tmp/groups.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from ilcp.config import load_config
from ilcp.config_sections import HandoffConfig
from ilcp.io import atomic_write_json
from ilcp.lm import load_lm
from ilcp.precision import autocast, hold, resolve
from ilcp.provenance import provenance
from ilcp.training.data import load_rows
from ilcp.training.handoff_stage import HandoffModule, make_memory_source

REPO = Path(__file__).resolve().parent.parent


def time_route(module: HandoffModule, batches: list[dict], grouped: bool, grad: bool,
               precision: str) -> tuple[float, list[float]]:
    """(seconds per batch, each batch's loss) of the answer loss over ``batches``, with ``grouped``
    as ``trainer.length_groups`` sets it."""
    saved, module.grouped = module.grouped, grouped
    losses, start = [], time.perf_counter()
    try:
        for batch in batches:
            with autocast(precision, "cpu"), torch.set_grad_enabled(grad):
                loss, _ = module._teacher_forced(batch)
                if grad:
                    loss.backward()
            losses.append(float(loss.detach()))
    finally:
        module.grouped = saved
    return (time.perf_counter() - start) / len(batches), losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "general.yaml"), help="the run whose rows are read")
    parser.add_argument("--batches", type=int, default=6, help="random training batches timed each way")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lm", default=None, help="LM spec (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.batches < 1 or args.batch_size < 1:
        parser.error("--batches and --batch-size must be at least 1")
    try:
        cfg = load_config(args.config, [f"lm.spec={args.lm}"] if args.lm else [])
    except (OSError, ValueError) as e:
        parser.error(str(e))

    lm = load_lm(cfg.lm.spec)
    precision = resolve(cfg.trainer.precision, "cpu")
    hold(lm, precision)
    rows, _ = load_rows(cfg, "train", cfg.data.train_size, lm.tokenizer)
    rng = random.Random(args.seed)
    picked = [rng.sample(rows, min(args.batch_size, len(rows))) for _ in range(args.batches)]
    batches = [{k: [r[k] for r in b] for k in ("context", "question", "answer")} for b in picked]
    lengths = [[len(lm.tokenizer(c)["input_ids"]) for c in b["context"]] for b in batches]
    padded = sum(max(ls) * len(ls) for ls in lengths) / sum(sum(ls) for ls in lengths)

    hc = HandoffConfig(num_memory_tokens=4)
    module = HandoffModule(make_memory_source("cold_read_tuned", hc, lm), lm, hc)
    print(f"{cfg.data.task}: {args.batches} batches of {args.batch_size}, precision {precision}; "
          f"a padded batch computes {padded:.2f} context positions per real one", flush=True)
    print("| route | no gradient s/batch | with gradient s/batch |\n|---|---|---|")
    time_route(module, batches[:1], True, False, precision)  # warm-up
    timings, losses = {}, {}
    for name, grouped in (("one padded forward", False), ("length groups", True)):
        timings[name] = [time_route(module, batches, grouped, grad, precision) for grad in (False, True)]
        losses[name] = timings[name][0][1]
        print(f"| {name} | {timings[name][0][0]:.3f} | {timings[name][1][0]:.3f} |", flush=True)
    plain, grouped = timings["one padded forward"], timings["length groups"]
    gap = max(abs(a - b) for a, b in zip(losses["one padded forward"], losses["length groups"]))
    print(f"speed-up: {plain[0][0] / grouped[0][0]:.2f}x without gradients, {plain[1][0] / grouped[1][0]:.2f}x with; "
          f"largest loss difference {gap:.2e}")
    if args.json:
        atomic_write_json(Path(args.json), {
            "provenance": provenance(), "task": cfg.data.task, "batches": args.batches, "batch_size": args.batch_size,
            "precision": precision, "padded_per_real_position": padded, "largest_loss_difference": gap,
            "rows": [{"route": name, "no_gradient_s": t[0][0], "with_gradient_s": t[1][0]} for name, t in timings.items()]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
