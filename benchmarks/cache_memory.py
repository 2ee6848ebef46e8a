"""Peak anonymous memory of a training run per stage, at N and at 8N training rows.

Sender states are read from the memory-mapped cache, so a run's own (anonymous) memory should not
grow with its rows; the mapped pages are the file's, shared through the page cache. This trains a
recipe (default `configs/babilong-story.yaml` on the tiny LM) in a fresh process per size, samples
``RssAnon`` of /proc/self/status every few milliseconds, and prints the peak of each stage (lm,
data: the task rows and the sender states, compressor, each variant, export) and of the run.

    python benchmarks/cache_memory.py                           # 1,000 and 8,000 rows
    python benchmarks/cache_memory.py --rows 500 --factor 4 compressor.epochs=2 handoff.max_steps=20
    python benchmarks/cache_memory.py --json /tmp/memory.json

Each size extracts its states into a cache of its own (a temporary folder), so the data stage
includes the extraction. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def anonymous_bytes() -> int:
    """This process's resident anonymous memory (``RssAnon``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (this needs Linux)")


class PeakSampler:
    """The highest `anonymous_bytes` of each stage, sampled every ``interval`` seconds by a thread."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peaks, self._peak = interval, {}, anonymous_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, anonymous_bytes())

    def __enter__(self):
        self._thread.start()
        return self

    def stage_done(self, name: str) -> None:
        self.peaks[name] = max(self._peak, anonymous_bytes())
        self._peak = anonymous_bytes()

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def measure(config: str, rows: int, overrides: list[str]) -> dict:
    """Train ``config`` with ``rows`` training rows in this process: {stage: peak bytes, ...}."""
    from ilcp.config import load_config
    from ilcp.training import train

    with tempfile.TemporaryDirectory(prefix="ilcp-memory-") as tmp:
        settings = ["lm.spec=tiny-qwen3", f"data.train_size={rows}", f"out_dir={tmp}", f"lm.cache_dir={tmp}/cache",
                    "trainer.accelerator=cpu", "trainer.progress=false", *overrides]
        cfg = load_config(config, settings)
        start = anonymous_bytes()
        t0 = time.perf_counter()
        with PeakSampler() as sampler:
            result = train(cfg, on_stage_done=sampler.stage_done)
        seconds = time.perf_counter() - t0
    return {"rows": rows, "train_rows": result.metrics["train_rows"], "start_bytes": start,
            "peaks": sampler.peaks, "run_peak": max(sampler.peaks.values()), "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "babilong-story.yaml"))
    parser.add_argument("--rows", type=int, default=1000, help="N: the smaller size (default 1000)")
    parser.add_argument("--factor", type=int, default=8, help="the larger size is N x this (default 8)")
    parser.add_argument("--json", help="also write the measurements here")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="section.key=value settings, e.g. compressor.epochs=2")
    args = parser.parse_args(argv)
    if args.child is not None:  # one size, in a fresh process
        print(json.dumps(measure(args.config, args.child, args.overrides)))
        return 0
    found = []
    for rows in (args.rows, args.rows * args.factor):
        cmd = [sys.executable, __file__, "--config", args.config, "--child", str(rows), *args.overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        found.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    stages = list(found[0]["peaks"])
    mb = 1024 ** 2
    print(f"peak anonymous memory (MB) per stage, {Path(args.config).name} on the tiny LM")
    print(f"{'stage':<18}" + "".join(f"{f['train_rows']:>12,} rows" for f in found) + f"{'rise':>12}")
    for name in stages + ["run"]:
        values = [f["run_peak"] if name == "run" else f["peaks"].get(name, 0) for f in found]
        print(f"{name:<18}" + "".join(f"{v / mb:>17.0f}" for v in values) + f"{(values[-1] - values[0]) / mb:>12.0f}")
    print("seconds: " + ", ".join(f"{f['train_rows']:,} rows {f['seconds']}" for f in found))
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
