"""Freed memory given back to the system between a stage's passes (`ilcp.training.log`): the
call releases freed heap pages, and every trainer makes it as it starts and after each validation."""

import ctypes.util
from pathlib import Path

import pytest

from ilcp.config import load_config
from ilcp.training import log
from ilcp.training.log import GiveBackFreedMemory, give_back_freed_memory, make_trainer

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
    monkeypatch.setattr(log, "give_back_freed_memory", lambda: calls.append(1))
    callback = GiveBackFreedMemory()
    callback.on_fit_start(None, None)
    callback.on_validation_end(None, None)
    assert len(calls) == 2
