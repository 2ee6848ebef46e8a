"""The receiver's time to first token at each way of running the frozen LM, against one bare
forward of the same number of positions.

    python benchmarks/receiver_speed.py --ckpt checkpoints/default
    python benchmarks/receiver_speed.py --ckpt checkpoints/default --requests 20 --json /tmp/receiver_speed.json
    OMP_NUM_THREADS=1 python benchmarks/receiver_speed.py --ckpt checkpoints/tiny --requests 2 --long-requests 1

Three columns, each with its own copy of the run's LM:
- float32: float32 weights, no autocast (precision "32-true");
- bf16 recast: float32 weights under bfloat16 autocast, which casts every weight at every
  forward (what "bf16-mixed" did before the LM was held);
- bf16 held: `ilcp.precision.hold`, the linear weights cast to bfloat16 once and long prefills
  in `ilcp.attention`'s blocked attention (what "bf16-mixed" does now, and so the default
  precision on a CPU with AVX512-BF16 or AMX).
Rows: no_context and ilcp on the first --requests questions of bAbI task 1 (short requests) and
cold_read on the first --long-requests of babilong:1:2k (a 2k-token prefill). Each request is
timed as eval.py times it (`ilcp.evaluation.timing.time_request`: receive, then the prefill to
the first token), one at a time after one warm-up per column, the columns taking turns request
by request so that a change in machine load hits all alike; p50 printed. Beside it, in the same
process and precision, one bare forward of as many positions (random rows through the model with
a fresh cache, the last position's logits, as the receiver's prefill computes them): the
difference is the receiver's fixed overhead (parsing and projecting the payload, building and
embedding the prompt, the first token's argmax).

Printed ratios: float32 TTFT / bf16-held TTFT per row (at or above 1: the held default is no
slower than float32), and the same for bf16 recast (what holding changed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

COLUMNS = {"float32": "32-true", "bf16 recast": "bf16-mixed", "bf16 held": "bf16-mixed"}
SHORT_METHODS = ("no_context", "ilcp")
LONG_TASK = "babilong:1:2k"


def bare_forward_s(model, positions: int, hidden: int, precision: str, repeats: int) -> float:
    """Median seconds of one forward of ``positions`` random rows (fresh cache, last logits only)."""
    import torch

    from ilcp import compat
    from ilcp.precision import autocast

    rows = torch.randn(1, positions, hidden) * 0.02
    seconds = []
    for i in range(repeats + 1):
        with torch.no_grad(), autocast(precision, "cpu"):
            start = time.perf_counter()
            out = model(inputs_embeds=rows, use_cache=True, **compat.cache_kwargs(model, compat.new_dynamic_cache(model)),
                        **compat.logits_to_keep_kwargs(model, 1))
            out.logits[:, -1].argmax(-1).tolist()
            if i:  # the first one warms up
                seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def load_columns(ckpt: str | Path) -> dict[str, object]:
    """One `EvalContext` per column, each on its own copy of the run's LM."""
    from ilcp.evaluation import EvalContext
    from ilcp.export import load_export_lm, read_config, read_export
    from ilcp.handoff import ILCPHandoff
    from ilcp.precision import hold

    config = read_config(ckpt)
    run = read_export(ckpt)
    contexts = {}
    for column, precision in COLUMNS.items():
        lm = load_export_lm(config, Path(ckpt) / "config.json")
        if column == "bf16 held":
            hold(lm, precision)
        handoff = ILCPHandoff.from_export(run, lm, precision=precision) if run.encoder is not None else None
        contexts[column] = EvalContext(lm=lm, run=run, handoff=handoff, max_new_tokens=1)
    return contexts


def measure(contexts: dict, rows_by_method: dict[str, list[dict]]) -> list[dict]:
    """One dict per method: p50 TTFT per column, prefill positions, and the median of as many bare
    forwards of those positions as there were requests, per column."""
    from ilcp.evaluation import make_method
    from ilcp.evaluation.timing import time_request
    from ilcp.precision import autocast

    results = []
    for name, rows in rows_by_method.items():
        methods = {}
        for column, ctx in contexts.items():
            m = make_method(name)
            m.bind(ctx)
            methods[column] = m
        ttft: dict[str, list[float]] = {c: [] for c in contexts}
        positions = []
        for i, row in enumerate([rows[0], *rows]):  # the first request warms each column up
            for column, m in methods.items():
                with autocast(COLUMNS[column], "cpu"):
                    timed = time_request(m, row, max_new_tokens=1)
                if i:
                    ttft[column].append(timed.receiver_ttft_s)
                    if column == "float32":
                        positions.append(timed.prefill_positions)
        p = round(statistics.median(positions))
        result = {"method": name, "requests": len(rows), "positions": p}
        for column, ctx in contexts.items():
            result[f"{column} ttft_s"] = statistics.median(ttft[column])
            result[f"{column} forward_s"] = bare_forward_s(ctx.lm.model, p, ctx.lm.hidden_size, COLUMNS[column],
                                                           len(rows))
        for column in ("bf16 recast", "bf16 held"):
            result[f"float32 / {column}"] = result["float32 ttft_s"] / result[f"{column} ttft_s"]
        results.append(result)
        print(f"  {name}: {p} positions, TTFT float32 {result['float32 ttft_s'] * 1e3:.1f} ms, bf16 held "
              f"{result['bf16 held ttft_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    return results


def table(results: list[dict]) -> str:
    """The results as a Markdown table (milliseconds)."""
    lines = ["| method | positions | column | receiver TTFT ms | one forward ms | overhead ms | float32 / column |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in results:
        for column in COLUMNS:
            ttft, forward = r[f"{column} ttft_s"] * 1e3, r[f"{column} forward_s"] * 1e3
            ratio = "1.00x" if column == "float32" else f"{r[f'float32 / {column}']:.2f}x"
            lines.append(f"| {r['method']} | {r['positions']} | {column} | {ttft:.1f} | {forward:.1f} | "
                         f"{ttft - forward:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a run directory written by train.py (with ilcp weights)")
    p.add_argument("--requests", type=int, default=10, help="timed short requests per method and column")
    p.add_argument("--long-requests", type=int, default=3, help="timed 2k-token requests per column")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.requests < 1 or args.long_requests < 1:
        p.error("--requests and --long-requests must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")

    import torch

    from ilcp.export import ExportError
    from ilcp.precision import cpu_flags, resolve
    from ilcp.tasks import load_babi, load_task

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        contexts = load_columns(args.ckpt)
    except ExportError as e:
        p.error(str(e))
    if contexts["float32"].handoff is None:
        p.error(f"{args.ckpt} has no ilcp weights: train with 'ilcp' among handoff.variants")
    tokenizer = contexts["float32"].lm.tokenizer
    rows = {name: load_babi(1, "test", limit=args.requests).to_list() for name in SHORT_METHODS}
    rows["cold_read"] = load_task(LONG_TASK, "test", tokenizer=tokenizer, limit=args.long_requests).to_list()
    flags = cpu_flags()
    machine = {"avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags, "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "auto_precision": resolve("auto", "cpu")}
    print(f"{args.ckpt}: LM {contexts['float32'].lm.spec}; avx512_bf16 {'yes' if machine['avx512_bf16'] else 'no'}, "
          f"amx_bf16 {'yes' if machine['amx_bf16'] else 'no'}; torch {machine['torch']} with "
          f"{machine['torch_threads']} thread(s); precision auto -> {machine['auto_precision']}", flush=True)
    results = measure(contexts, rows)
    print()
    print(table(results))
    short = [r for r in results if r["method"] in SHORT_METHODS]
    long = next(r for r in results if r["method"] == "cold_read")
    print()
    print("short requests, float32 TTFT / bf16-held TTFT: "
          + ", ".join(f"{r['method']} {r['float32 / bf16 held']:.2f}x" for r in short)
          + f" (at or above 1: no slower); {LONG_TASK} cold_read: {long['float32 / bf16 held']:.2f}x")
    if args.json:
        from ilcp.io import atomic_write_json

        atomic_write_json(Path(args.json), {"ckpt": str(args.ckpt), "requests": args.requests,
                                            "long_requests": args.long_requests, **machine, "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
