"""Receivers behind a vLLM server under load and faults (`ilcp.engines.served`).

    .venv-vllm/bin/python benchmarks/served_load.py --ckpt checkpoints/default --start -- --enforce-eager
    python benchmarks/served_load.py --ckpt checkpoints/default --server http://127.0.0.1:8000/v1 --no-fault

Agents are threads of this process, each with its own request: the sender side (the run's full
LM, loaded here once) makes one payload per bAbI question (`--task`, test split, first
`--questions`) and, with `--rclc`, the in-prompt RCLC rows of the same context at r4 (a receiver's
``pop()``); the receiving agents hold the embedding table only (`ServedReceiver`) and post
their prefix rows to the server.

1. serial: every request alone, one after another: the reference answers.
2. load: `--agents` concurrent agents (default 32 and 128) over the same requests: throughput
   (answers/s), p50 / p99 seconds from submit to answer, and how many answers equal the serial
   ones (all should).
3. refusals: a corrupt payload, one of another LM and an unsealed one for a receiver with a key
   are refused (`PayloadError`) with no request reaching the server.
4. fault (with `--start`, unless `--no-fault`): 32 agents keep handing over while the server is
   killed (SIGKILL of its process group) after `--kill-after` seconds and started again on the
   same port: every request must either answer (equal to serial) or raise `ServerError`, none
   later than `--timeout` plus a margin, nothing else, and no agent left waiting.

`--start` runs ``python -m ilcp serve CKPT --port PORT -- EXTRA`` with this interpreter (arguments
after ``--`` go to vLLM; on this CPU ``--enforce-eager`` and ``VLLM_CPU_KVCACHE_SPACE``) and always
stops it. `--json PATH` also writes the figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KEY = b"served-load-benchmark-key-012345"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m ilcp serve`` in its own process group, on a fixed port."""

    def __init__(self, ckpt: str, port: int, extra: list[str], log: Path):
        self.ckpt, self.port, self.extra, self.log = ckpt, port, extra, log
        self.url = f"http://127.0.0.1:{port}/v1"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 600.0) -> float:
        """Start and wait until /v1/models answers; returns the seconds it took."""
        started = time.monotonic()
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        command = [sys.executable, "-m", "ilcp", "serve", self.ckpt, "--port", str(self.port), "--", *self.extra]
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2):
                    return time.monotonic() - started
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not answer within {timeout:g} s; see {self.log}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(60)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def percentiles(seconds: list[float]) -> tuple[float, float]:
    if not seconds:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(np.asarray(seconds), [50, 99])
    return float(p50), float(p99)


def prepare(args):
    """(ILCP requests, RCLC requests): (kind, message, question) triples made by the sender side."""
    from ilcp import rclc
    from ilcp.handoff import ILCPHandoff
    from ilcp.tasks import load_babi

    rows = load_babi(args.task, "test", limit=args.questions).to_list()
    sender = ILCPHandoff.from_pretrained(args.ckpt)
    wires = [p.to_bytes() for p in sender.send_each([r["context"] for r in rows])]
    ilcp_requests = [("ilcp", w, r["question"]) for w, r in zip(wires, rows)]
    rclc_requests = []
    if args.rclc:
        model, tok = sender.lm.model, sender.lm.tokenizer
        for r in rows:
            x = rclc.bind(model, tok, messages=[{"role": "user", "content": r["context"]}])
            y = rclc.bind(model, tok, messages=[{"role": "system", "content": "You answer briefly."}],
                          placement="in_prompt", max_new_tokens=args.max_new_tokens)
            rclc.transfer_sync(x, y, r["question"], ratio=4)
            rclc_requests.append(("rclc-r4", y.pop(), r["question"]))
    return sender, ilcp_requests, rclc_requests


def answer(receiver, request, max_new_tokens: int) -> str:
    kind, message, question = request
    if kind == "ilcp":
        return receiver.receive(message, question, max_new_tokens, stop_at_newline=True)
    return receiver.decoder.answer(message, max_new_tokens=max_new_tokens, stop_at_newline=True)


def run_concurrent(receiver, requests, agents: int, max_new_tokens: int):
    """Each request on its own agent thread: [(answer or exception, seconds)] in request order, and
    the wall time of the whole run."""
    def one(request):
        start = time.monotonic()
        try:
            out = answer(receiver, request, max_new_tokens)
        except Exception as e:  # recorded: the fault phase counts what was raised
            out = e
        return out, time.monotonic() - start

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=agents) as pool:
        results = list(pool.map(one, requests))
    return results, time.monotonic() - started


def refusals(args, receiver, sender) -> dict:
    """Corrupt, foreign-model and unsealed payloads: refused, with no request sent."""
    import torch

    from ilcp.engines import served
    from ilcp.engines.served import ServedReceiver
    from ilcp.wire.payload import PayloadError, pack

    sent = []
    real = served._request
    served._request = lambda *a, **k: sent.append(a[0]) or real(*a, **k)
    try:
        wire = sender.send("Mary moved to the hallway.").to_bytes()
        corrupt = wire[:-6] + bytes([wire[-6] ^ 0x40]) + wire[-5:]
        foreign = pack(torch.zeros(sender.latent_dim), lm_fingerprint="0123456789abcdef").to_bytes()
        keyed = ServedReceiver.from_pretrained(args.ckpt, receiver.decoder.url, auth_key=KEY, timeout=args.timeout)
        sent.clear()
        out = {}
        for name, target, message in (("corrupt", receiver, corrupt), ("foreign model", receiver, foreign),
                                      ("unauthenticated", keyed, wire)):
            try:
                target.receive(message, "Where is Mary?")
                out[name] = "ANSWERED (not refused)"
            except PayloadError as e:
                out[name] = f"refused: {str(e)[:90]}"
        out["requests that reached the server"] = len(sent)
        return out
    finally:
        served._request = real


def fault(args, server: Server, receiver, requests, serial: list[str]) -> dict:
    """32 agents keep handing over while the server is killed after `--kill-after` seconds and
    started again; they stop 3 s after it answers again. Every request must answer (equal to
    serial) or raise ServerError; an agent that got one waits 0.2 s before its next request."""
    import itertools
    import threading

    from ilcp.engines.served import ServerError

    done = threading.Event()
    counter = itertools.count()
    lock = threading.Lock()
    results: list[tuple[int, object, float]] = []
    timeline = {}

    def agent():
        while not done.is_set():
            with lock:
                i = next(counter)
            start = time.monotonic()
            try:
                out = answer(receiver, requests[i % len(requests)], args.max_new_tokens)
            except Exception as e:  # recorded: what was raised is the measurement
                out = e
            with lock:
                results.append((i, out, time.monotonic() - start))
            if isinstance(out, Exception):
                time.sleep(0.2)

    started = time.monotonic()
    threads = [threading.Thread(target=agent, daemon=True) for _ in range(32)]
    for t in threads:
        t.start()
    try:
        time.sleep(args.kill_after)
        server.kill()
        timeline["killed at s"] = time.monotonic() - started
        timeline["restart s"] = server.start()
        time.sleep(3.0)
    finally:
        done.set()
        for t in threads:
            t.join(args.timeout + 30)
    hung = sum(t.is_alive() for t in threads)
    answered = [(out, serial[i % len(serial)]) for i, out, _ in results if isinstance(out, str)]
    errors = [out for _, out, _ in results if isinstance(out, ServerError)]
    other = [out for _, out, _ in results if not isinstance(out, (str, ServerError))]
    return {
        "requests": len(results),
        "answered": len(answered),
        "answered equal to serial": sum(a == e for a, e in answered),
        "ServerError": len(errors),
        "other exceptions": [f"{type(e).__name__}: {e}" for e in other[:5]],
        "agents still waiting at the end": hung,
        "slowest request s": max((s for _, _, s in results), default=0.0),
        "timeout s": args.timeout,
        **timeline,
        "errors seen": sorted({str(e)[:100] for e in errors})[:4],
        "wall s": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="the run directory")
    parser.add_argument("--server", default=None, help="a running server's URL (else --start)")
    parser.add_argument("--start", action="store_true", help="start the server here (and stop it)")
    parser.add_argument("--agents", default="32,128", help="concurrent agents, comma separated")
    parser.add_argument("--task", default="1", help="bAbI task (test split)")
    parser.add_argument("--questions", type=int, default=128, help="requests per kind")
    parser.add_argument("--rclc", action=argparse.BooleanOptionalAction, default=True, help="RCLC r4 requests too")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds each request may wait")
    parser.add_argument("--no-fault", action="store_true", help="skip the kill-and-restart phase")
    parser.add_argument("--kill-after", type=float, default=5.0, help="seconds into the fault run")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if (args.server is None) == (not args.start):
        parser.error("give either --server URL or --start")
    agents = [int(a) for a in args.agents.split(",") if a]

    from ilcp.engines.served import ServedReceiver

    from ilcp.io import atomic_write_json
    from ilcp.provenance import command_line, provenance

    server = None
    report: dict = {"provenance": provenance(command_line().replace("python ", ".venv-vllm/bin/python ", 1)
                                             if "venv-vllm" in sys.executable else None)}
    report["provenance"]["conditions"] = (f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', '1')}; "
                                          "the server and the agents' process on this machine")
    try:
        if args.start:
            server = Server(args.ckpt, free_port(), extra, Path(args.json or "served_load").with_suffix(".server.log"))
            report["server start s"] = server.start()
        url = server.url if server else args.server
        sender, ilcp_requests, rclc_requests = prepare(args)
        receiver = ServedReceiver.from_pretrained(args.ckpt, url, timeout=args.timeout)
        for kind, requests in (("ilcp", ilcp_requests), ("rclc-r4", rclc_requests)):
            if not requests:
                continue
            serial_start = time.monotonic()
            serial = [answer(receiver, r, args.max_new_tokens) for r in requests]
            serial_wall = time.monotonic() - serial_start
            report[f"{kind} serial"] = {"requests": len(requests), "answers/s": len(requests) / serial_wall}
            print(f"{kind}: serial {len(requests)} requests, {len(requests) / serial_wall:.1f} answers/s", flush=True)
            for n in agents:
                results, wall = run_concurrent(receiver, requests, n, args.max_new_tokens)
                failed = [r for r, _ in results if not isinstance(r, str)]
                p50, p99 = percentiles([s for r, s in results if isinstance(r, str)])
                same = sum(r == e for (r, _), e in zip(results, serial))
                report[f"{kind} agents={n}"] = {"answers/s": len(requests) / wall, "p50 s": p50, "p99 s": p99,
                                                "equal to serial": f"{same}/{len(requests)}",
                                                "failed": [f"{type(e).__name__}: {e}" for e in failed[:3]]}
                print(f"{kind}: {n:4d} agents  {len(requests) / wall:7.1f} answers/s  p50 {p50:.3f} s  "
                      f"p99 {p99:.3f} s  equal to serial {same}/{len(requests)}  failed {len(failed)}", flush=True)
            if kind == "ilcp" and server is not None and not args.no_fault:
                report["fault"] = fault(args, server, receiver, requests, serial)
                print("fault:", json.dumps(report["fault"], indent=1), flush=True)
        report["refusals"] = refusals(args, receiver, sender)
        print("refusals:", json.dumps(report["refusals"], indent=1), flush=True)
    finally:
        if server is not None:
            server.stop()
    if args.json:
        atomic_write_json(Path(args.json), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
