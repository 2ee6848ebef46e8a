"""ilcp.training.heap: with the mapping threshold held, a run of steps whose tensors differ in size
leaves no freed memory behind in the heap (measured in a fresh process: the setting is global)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ilcp.training import heap

REPO = Path(__file__).resolve().parent.parent

STEPS = """
import random, sys, torch
from pathlib import Path
from ilcp.training import heap

def anonymous_mb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) // 1024

if sys.argv[1] == "flat":
    assert heap.hold_heap_flat()
start, rng, survivors = anonymous_mb(), random.Random(0), []
big = torch.ones(40 << 18)  # 40 MiB freed at once: glibc raises its threshold for mapping
del big
for step in range(300):
    batch = [torch.ones(rng.randint(1 << 15, 2 << 20)) for _ in range(6)]  # a step's tensors, odd sizes
    survivors.append(torch.ones(rng.randint(100, 5000)))  # small tensors that outlive the step
    del batch
print(anonymous_mb() - start)
"""


@pytest.mark.skipif(heap._glibc() is None or not Path("/proc/self/status").is_file(), reason="glibc and /proc only")
def test_freed_tensors_of_odd_sizes_leave_the_heap_flat():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    held = int(subprocess.run([sys.executable, "-c", STEPS, "flat"], env=env, capture_output=True, text=True,
                              check=True, timeout=120).stdout.strip())
    assert held < 32, f"{held} MB still held after the steps"


def test_nothing_is_done_where_the_c_library_is_not_glibc(monkeypatch):
    monkeypatch.setattr(heap, "_libc", False)
    assert heap.hold_heap_flat() is False and heap.return_freed() is False
