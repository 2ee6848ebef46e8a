"""A CPU training process's resident memory (`ilcp.host_memory`): oneDNN's kernel caches capped,
so that batches of new shapes do not grow the heap; freed memory given back to the system between a
stage's passes (the call releases freed heap pages; every trainer makes it as it starts and after
each validation)."""

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ilcp import host_memory
from ilcp.config import load_config
from ilcp.host_memory import give_back_freed_memory
from ilcp.training.log import GiveBackFreedMemory, make_trainer

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def anonymous_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


@pytest.mark.skipif(not Path("/proc/self/status").is_file() or ctypes.util.find_library("c") is None
                    or not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim"),
                    reason="needs Linux's /proc and glibc's malloc_trim")
def test_freed_heap_pages_go_back_to_the_system():
    # 200 MB in 32 KB blocks (below glibc's mapping threshold: they come from the heap), all freed
    # but the last, which keeps the heap's top in place so that free() alone cannot shrink it.
    blocks = [bytearray(b"x" * 32768) for _ in range(6400)]
    held = anonymous_mb()
    del blocks[:-1]
    freed = anonymous_mb()
    give_back_freed_memory()
    given = anonymous_mb()
    assert freed > held - 50  # free() kept most of the pages
    assert freed - given > 120  # the call gave them back
    del blocks


def test_every_trainer_gives_freed_memory_back_as_it_starts_and_after_each_validation(tmp_path, monkeypatch):
    cfg = load_config(TINY, [f"out_dir={tmp_path}"])
    assert any(isinstance(c, GiveBackFreedMemory) for c in make_trainer(cfg, tmp_path, "x", []).callbacks)
    calls = []
    monkeypatch.setattr(host_memory, "give_back_freed_memory", lambda: calls.append(1))
    callback = GiveBackFreedMemory()
    callback.on_fit_start(None, None)
    callback.on_validation_end(None, None)
    assert len(calls) == 2


def test_kernel_caches_are_capped_unless_the_environment_sets_them(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "500")  # a user's own choice stays
    assert host_memory.bound_kernel_caches(16) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "500"}
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    for bad in (0, -1, True, 2.5, "64"):
        with pytest.raises(ValueError, match="kernel cache capacity"):
            host_memory.bound_kernel_caches(bad)


GROWTH = """
import ctypes, sys
if sys.argv[1] != "default":
    from ilcp.host_memory import bound_kernel_caches
    bound_kernel_caches(int(sys.argv[1]))
import torch

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
torch.set_num_threads(1)
layer = torch.nn.Linear(64, 64)

def step(rows):
    x = torch.randn(rows, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()

for rows in range(1, 9):
    step(rows)
before = mallinfo2().uordblks
for rows in range(9, 69):  # 60 batches of new shapes, as varied sequence lengths give
    step(rows)
print((mallinfo2().uordblks - before) / 1e6)
"""


def heap_growth_mb(capacity: str) -> float:
    """The heap in use gained over 60 bfloat16 training steps of a linear layer, each of a new
    batch shape, in a fresh process whose kernel caches `capacity` sets ('default': left alone)."""
    env = {k: v for k, v in os.environ.items() if k not in host_memory.KERNEL_CACHE_VARIABLES}
    out = subprocess.run([sys.executable, "-c", GROWTH, capacity], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc's mallinfo2")
def test_capped_kernel_caches_keep_batches_of_new_shapes_from_growing_the_heap():
    default = heap_growth_mb("default")
    if default < 10:
        pytest.skip(f"this CPU's bfloat16 kernels grow no cache ({default:.1f} MB over 60 new shapes)")
    assert heap_growth_mb("4") < default / 10


def test_a_run_caps_the_kernel_caches_before_it_starts(tmp_path, monkeypatch):
    for name in host_memory.KERNEL_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    from ilcp.training import train

    with pytest.raises(ValueError, match="discard-last"):  # refused before it writes anything, after the caps
        train(load_config(TINY, [f"out_dir={tmp_path}"]), discard_last=True)
    assert all(os.environ[name] == str(host_memory.KERNEL_CACHE_CAPACITY) for name in host_memory.KERNEL_CACHE_VARIABLES)
