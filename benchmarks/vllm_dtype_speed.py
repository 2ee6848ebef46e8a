"""The vLLM receiver's time to first token and answers with its weights in float32 and in bfloat16.

    .venv-vllm/bin/python benchmarks/vllm_dtype_speed.py --ckpt checkpoints/default
    .venv-vllm/bin/python benchmarks/vllm_dtype_speed.py --ckpt checkpoints/default --requests 20 --json /tmp/v.json

vLLM loads the frozen LM's weights once, in its ``dtype``: there is no recast per forward to
remove, so the question for a vLLM receiver is only which dtype answers faster and whether the
answers stay those of the HF decoder. Each dtype runs in a process of its own (one in-process
engine each, eager, prompt embeddings on). The prefixes are eval's, built in float32 by the run's
HF modules: no_context and ilcp on the first --requests questions of bAbI task 1 (short
requests), cold_read on the first --long-requests of babilong:1:2k (a 2k-token prefill). Each
request is one ``generate`` call of one prompt and one new token, after one warm-up; p50 printed.
Then --answers questions of bAbI task 1 are answered (8 new tokens) by ilcp and by no_context in
each dtype: exact match per dtype and how many answers the two dtypes share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHORT_METHODS = ("no_context", "ilcp")
LONG_TASK = "babilong:1:2k"


def child(ckpt: str, dtype: str, requests: int, long_requests: int, answers: int) -> dict:
    """Times and answers of one dtype's engine, in this process."""
    import torch

    from ilcp.engines.vllm import VLLMDecoder, model_directory
    from ilcp.evaluation import EvalContext, make_method
    from ilcp.evaluation.decoders import vllm_environment
    from ilcp.export import load_export_lm, read_config, read_export
    from ilcp.handoff import ILCPHandoff
    from ilcp.metrics import exact_match
    from ilcp.tasks import load_babi, load_task
    from ilcp.engines.build import create_engine

    config = read_config(ckpt)
    run = read_export(ckpt)
    lm = load_export_lm(config, Path(ckpt) / "config.json")
    handoff = ILCPHandoff.from_export(run, lm, precision="32-true")
    ctx = EvalContext(lm=lm, run=run, handoff=handoff, max_new_tokens=8)
    methods = {}
    for name in (*SHORT_METHODS, "cold_read"):
        methods[name] = make_method(name)
        methods[name].bind(ctx)
    babi = load_babi(1, "test", limit=max(requests, answers)).to_list()
    long_rows = load_task(LONG_TASK, "test", tokenizer=lm.tokenizer, limit=long_requests).to_list()
    with tempfile.TemporaryDirectory(prefix="ilcp-vllm-dtype-") as folder, vllm_environment(Path(folder)):
        llm = create_engine(model_directory(lm), dtype=dtype, max_model_len=4096)
        decoder = VLLMDecoder(lm, llm)
        out = {"dtype": dtype, "rows": []}
        for name, rows in [(m, babi[:requests]) for m in SHORT_METHODS] + [("cold_read", long_rows)]:
            with torch.no_grad():
                prefixes = methods[name].build_prefixes(rows).prefixes
            seconds = []
            for i, prefix in enumerate([prefixes[0], *prefixes]):  # the first one warms up
                start = time.perf_counter()
                decoder.decode([prefix], max_new_tokens=1)
                if i:
                    seconds.append(time.perf_counter() - start)
            out["rows"].append({"method": name, "requests": len(rows), "ttft_s": statistics.median(seconds),
                                "positions": round(statistics.median(p.shape[0] for p in prefixes))})
        out["answers"] = {}
        for name in SHORT_METHODS:
            with torch.no_grad():
                prefixes = methods[name].build_prefixes(babi[:answers]).prefixes
            said = decoder.decode(prefixes, max_new_tokens=8, stop_at_newline=True)
            out["answers"][name] = {"said": said,
                                    "exact_match": statistics.mean(exact_match(s, r["answer"]) for s, r in zip(said, babi))}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a run directory written by train.py (with ilcp weights)")
    p.add_argument("--requests", type=int, default=10, help="timed short requests per method and dtype")
    p.add_argument("--long-requests", type=int, default=3, help="timed 2k-token requests per dtype")
    p.add_argument("--answers", type=int, default=100, help="bAbI task 1 questions answered per method and dtype")
    p.add_argument("--dtypes", default="float32,bfloat16", help="the engines' dtypes, the first the reference")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.requests, args.long_requests, args.answers) < 1:
        p.error("--requests, --long-requests and --answers must be >= 1")
    if args.child:
        print(json.dumps(child(args.ckpt, args.child, args.requests, args.long_requests, args.answers)))
        return 0
    from ilcp.export import ExportError, read_export
    from ilcp.engines.build import require_vllm

    try:
        if read_export(args.ckpt).encoder is None:
            p.error(f"{args.ckpt} has no ilcp weights: train with 'ilcp' among handoff.variants")
        require_vllm()
    except (ExportError, ImportError) as e:
        p.error(str(e))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    found = []
    for dtype in args.dtypes.split(","):
        print(f"{dtype}: starting an engine ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--ckpt", args.ckpt, "--child", dtype, "--requests", str(args.requests),
               "--long-requests", str(args.long_requests), "--answers", str(args.answers)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        found.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    ref = found[0]
    print(f"{args.ckpt}: vLLM receiver, p50 time to first token (ms) by engine dtype; {ref['dtype']} / column")
    print("| method | positions | " + " | ".join(f["dtype"] for f in found) + " | "
          + " | ".join(f"{ref['dtype']} / {f['dtype']}" for f in found[1:]) + " |")
    print("|---|---:|" + "---:|" * (2 * len(found) - 1))
    for i, row in enumerate(ref["rows"]):
        times = [f["rows"][i]["ttft_s"] for f in found]
        print(f"| {row['method']} | {row['positions']} | " + " | ".join(f"{t * 1e3:.1f}" for t in times) + " | "
              + " | ".join(f"{times[0] / t:.2f}x" for t in times[1:]) + " |")
    print()
    for name in SHORT_METHODS:
        said = [f["answers"][name]["said"] for f in found]
        print(f"{name} on {len(said[0])} bAbI task 1 questions: exact match "
              + ", ".join(f"{f['dtype']} {f['answers'][name]['exact_match']:.1%}" for f in found)
              + "; answers equal to " + ref["dtype"] + "'s: "
              + ", ".join(f"{f['dtype']} {sum(a == b for a, b in zip(said[0], s))}" for f, s in zip(found[1:], said[1:])))
    if args.json:
        from ilcp.io import atomic_write_json

        atomic_write_json(Path(args.json), {"ckpt": str(args.ckpt), "engines": found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
