"""Receiver cold start: time to first token of the text handoff against the ILCP handoff.

    python benchmarks/handoff_latency.py --ckpt checkpoints/default
    python benchmarks/handoff_latency.py --ckpt checkpoints/tiny --requests 3 --iterations 200

For facts contexts of about 128, 512 and 2,048 tokens (`--lengths`), each request is timed one
at a time (after one untimed warm-up per method), exactly as eval.py times it: the receiver's
time to first token is its own work on the received message (parse, project or embed the
prompt) plus the prefill. Printed per length: p50 / p99 for no_context (the question alone),
cold_read (the whole context text) and ilcp (K memory vectors from the latent), the ratio
cold_read / ilcp, and ilcp / no_context (what the K memory vectors add to the question alone).
Then the payload path alone, without the LM forward on either side: pack + to_bytes +
from_bytes + unpack + project, p50 / p99 over `--iterations` rounds.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from ilcp.evaluation import EvalContext, make_method
from ilcp.evaluation.timing import time_request
from ilcp.export import read_config, read_export
from ilcp.handoff import ILCPHandoff
from ilcp.lm import load_lm
from ilcp.tasks import count_tokens, facts_for_length, make_facts
from ilcp.wire.payload import TransportPayload, pack, unpack

METHODS = ("no_context", "cold_read", "ilcp")


def percentiles(seconds: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds."""
    p50, p99 = np.percentile(np.asarray(seconds) * 1000.0, [50, 99])
    return float(p50), float(p99)


def receiver_ttft(ctx: EvalContext, lengths: list[int], requests: int, max_new_tokens: int) -> None:
    methods = {name: make_method(name) for name in METHODS}
    for m in methods.values():
        m.bind(ctx)
    print(f"receiver time to first token, ms (p50 / p99 over {requests} requests each)")
    print(f"{'target':>7} {'tokens':>7} | {'no_context':>15} | {'cold_read':>15} | {'ilcp':>15} | "
          f"{'cold_read/ilcp':>14} | {'ilcp/no_context':>15}")
    warmed = set()
    for target in lengths:
        settings = facts_for_length(target, ctx.lm.tokenizer)
        rows = make_facts(requests, split="test", **settings).to_list()
        tokens = sum(count_tokens(r["context"], ctx.lm.tokenizer) for r in rows) / len(rows)
        p50 = {}
        cells = []
        for name, m in methods.items():
            if name not in warmed:
                time_request(m, rows[0], max_new_tokens=max_new_tokens)
                warmed.add(name)
            ttft = [time_request(m, r, max_new_tokens=max_new_tokens).receiver_ttft_s for r in rows]
            p50[name], p99 = percentiles(ttft)
            cells.append(f"{p50[name]:7.1f} / {p99:5.1f}")
        print(f"{target:>7} {tokens:>7.0f} | " + " | ".join(f"{c:>15}" for c in cells)
              + f" | {p50['cold_read'] / p50['ilcp']:>13.2f}x | {p50['ilcp'] / p50['no_context']:>14.2f}x", flush=True)


def payload_path(handoff: ILCPHandoff, iterations: int) -> None:
    z = handoff.send("Cedar is owned by Alice. Birch was launched in 1994.").latent  # (Z,)
    fp, device, dtype = handoff.fingerprint, handoff.device, handoff.lm.dtype
    stages = {"pack": [], "to_bytes": [], "from_bytes": [], "unpack": [], "project": [], "total": []}
    with torch.no_grad():
        for i in range(iterations + 10):
            t0 = time.perf_counter()
            payload = pack(z, lm_fingerprint=fp, dtype=handoff.payload_dtype)
            t1 = time.perf_counter()
            wire = payload.to_bytes()
            t2 = time.perf_counter()
            received = TransportPayload.from_bytes(wire, expected_fingerprint=fp, device=device)
            t3 = time.perf_counter()
            latent = unpack(received, device, dtype=torch.float32)
            t4 = time.perf_counter()
            memory = handoff.encoder.memory(latent.unsqueeze(0), dtype=dtype)
            if memory.device.type == "cuda":
                torch.cuda.synchronize(memory.device)
            t5 = time.perf_counter()
            if i >= 10:  # the first rounds warm allocators and caches
                for key, seconds in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
                    stages[key].append(seconds)
    print(f"\npayload path ({len(wire)} bytes on the wire, {payload.byte_length()} tensor bytes, "
          f"memory {tuple(memory.shape)}), ms over {iterations} rounds")
    for key, seconds in stages.items():
        p50, p99 = percentiles(seconds)
        print(f"  {key:>10}: p50 {p50:8.4f}  p99 {p99:8.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a run directory written by train.py")
    parser.add_argument("--lengths", default="128,512,2048", help="target context lengths in tokens")
    parser.add_argument("--requests", type=int, default=5, help="timed requests per length and method")
    parser.add_argument("--iterations", type=int, default=1000, help="rounds of the payload-path timing")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="answer token budget per request")
    parser.add_argument("--device", default=None, help="where the LM runs (default: cuda if available, else cpu)")
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        if not lengths or min(lengths) < 1 or args.requests < 1 or args.iterations < 1:
            raise ValueError("--lengths, --requests and --iterations must be positive")
        config = read_config(args.ckpt)
    except ValueError as e:
        parser.error(str(e))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lm = load_lm(config["lm"]["spec"], dtype=config["lm"].get("dtype", "float32"), device=device)
    handoff = ILCPHandoff.from_pretrained(args.ckpt, lm=lm)
    run = read_export(args.ckpt)
    print(f"{args.ckpt}: LM {lm.spec} on {device}, latent {handoff.latent_dim} floats, K = {handoff.num_memory_tokens}, "
          f"torch threads {torch.get_num_threads()}\n")
    receiver_ttft(EvalContext(lm=lm, run=run, handoff=handoff), lengths, args.requests, args.max_new_tokens)
    payload_path(handoff, args.iterations)
    return 0


if __name__ == "__main__":
    sys.exit(main())
