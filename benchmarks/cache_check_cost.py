"""What checking a sender-state cache file costs before a run trains on it: its digest and the
finiteness of its states (`ilcp.training.state_cache.check_contents`), on a file the size of the
babilong-story cache.

    python benchmarks/cache_check_cost.py                     # 1.53 M token states of width 576, bfloat16
    python benchmarks/cache_check_cost.py --tokens 100000 --json /tmp/check.json

The file is written through the cache's own streaming writer (`write_safetensors`, which computes
the digest as it writes) from random normal states, into a temporary folder. The check is timed
twice: with the file's pages dropped from the page cache first (``cold``: read from the disk, as a
run that finds the cache from an earlier day) and again at once (``warm``: from the page cache, as
right after extraction). Each line gives seconds, GB/s and the process's peak anonymous memory
during the check (the file is read in blocks, never whole). Linux only (/proc, fadvise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ilcp.training.state_cache import check_contents, read_cache, states_in_cache, write_safetensors


def anonymous_bytes() -> int:
    """This process's resident anonymous memory (``RssAnon``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (this needs Linux)")


def synthesize(path: Path, tokens: int, rows: int, dim: int, dtype: torch.dtype, seed: int = 0) -> None:
    """A token-states cache file of ``tokens`` states in ``rows`` rows, random normal values."""
    offsets = np.linspace(0, tokens, rows + 1).astype(np.int64)
    generator = torch.Generator().manual_seed(seed)
    chunk = 1 << 16

    def fill(f, name):
        if name == "offsets":
            f.write(memoryview(offsets))
            return
        for start in range(0, tokens, chunk):
            block = torch.randn(min(chunk, tokens - start), dim, generator=generator).to(dtype)
            f.write(memoryview(block.view(torch.uint8).numpy()))

    write_safetensors(path, [("offsets", torch.int64, [rows + 1]), ("states", dtype, [tokens, dim])], fill,
                      {"dtype": str(dtype).removeprefix("torch.")})


def drop_from_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def timed(fn) -> tuple[float, int]:
    """(seconds, peak anonymous bytes above the start) of ``fn()``, memory sampled every 5 ms."""
    start_memory, peak, stop = anonymous_bytes(), [0], threading.Event()

    def sample():
        while not stop.wait(0.005):
            peak[0] = max(peak[0], anonymous_bytes() - start_memory)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.perf_counter()
    fn()
    seconds = time.perf_counter() - began
    stop.set()
    sampler.join()
    return seconds, max(peak[0], anonymous_bytes() - start_memory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1_530_000, help="token states (babilong-story: 1.53 M)")
    parser.add_argument("--rows", type=int, default=3000, help="contexts (babilong-story: 3,000)")
    parser.add_argument("--dim", type=int, default=576, help="state width (SmolLM2-135M: 576)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--dir", default=None, help="where the file is written (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    with tempfile.TemporaryDirectory(prefix="ilcp-check-", dir=args.dir) as tmp:
        path = Path(tmp) / "states.safetensors"
        began = time.perf_counter()
        synthesize(path, args.tokens, args.rows, args.dim, dtype)
        written = time.perf_counter() - began
        size = path.stat().st_size
        print(f"{path.name}: {size / 1e9:.3f} GB ({args.tokens:,} token states of {args.dim} {args.dtype}, "
              f"{args.rows:,} rows), written with its digest in {written:.1f} s")
        figures = {"bytes": size, "tokens": args.tokens, "rows": args.rows, "dim": args.dim, "dtype": args.dtype,
                   "write_seconds": round(written, 2)}
        for label in ("cold", "warm"):
            if label == "cold":
                drop_from_page_cache(path)
            seconds, memory = timed(lambda: check_contents(path))
            figures[label] = {"seconds": round(seconds, 3), "gb_per_s": round(size / seconds / 1e9, 3),
                              "peak_anonymous_mib": round(memory / 2 ** 20, 1)}
            print(f"check ({label}): {seconds:.2f} s, {size / seconds / 1e9:.2f} GB/s, peak anonymous memory "
                  f"+{memory / 2 ** 20:.1f} MiB")
        expect = {"offsets": (torch.int64, [args.rows + 1]), "states": (dtype, [None, args.dim])}
        seconds, _ = timed(lambda: states_in_cache(read_cache(path, expect), True, args.rows))
        figures["map_seconds"] = round(seconds, 4)
        print(f"mapping it (header, sizes, offsets): {seconds * 1000:.1f} ms")
    figures["machine"] = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "python": platform.python_version(), "torch": torch.__version__}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
