"""The sender-state cache's contents: each file carries a digest of its tensors, so damage inside
the data (a flipped byte, states zeroed or doubled, rows swapped, one NaN, an edited offset) is
refused in one line naming the file and computed again, never trained on; a file without a digest
is stale; states are finite; a file in the cache folder's place and a reused pid are named."""

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ilcp.config import load_config
from ilcp.training import train
from ilcp.training import state_cache
from ilcp.training.extraction import cached_pooled_states, cached_token_states
from ilcp.training.state_cache import (CacheMismatch, check_contents, clear_dead_writers, process_start,
                                       write_safetensors)

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"
TEXTS = [f"John went to room {i}. " * (1 + i % 4) + "Mary took the apple." for i in range(10)]
IDS = [f"r{i}" for i in range(len(TEXTS))]
KEY = {"task": "integrity-test"}


@pytest.fixture
def said(capture_log):
    return capture_log("ilcp.training")


def _tokens(tiny_lm, cache_dir):
    return cached_token_states(tiny_lm, TEXTS, IDS, KEY, cache_dir=cache_dir, batch_size=3, progress=False)


def _region(path: Path, name: str) -> tuple[int, int]:
    """Where tensor ``name``'s bytes are in the file: (begin, end)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def _edit(path: Path, name: str, change) -> None:
    """Rewrite tensor ``name``'s bytes in place with ``change(array)`` (float32 states, int64 offsets)."""
    begin, end = _region(path, name)
    raw = bytearray(path.read_bytes())
    values = np.frombuffer(bytes(raw[begin:end]), dtype=np.int64 if name == "offsets" else np.float32).copy()
    change(values)
    raw[begin:end] = values.tobytes()
    with open(path, "r+b") as f:  # in place, as a damaged disk or an edit would
        f.write(raw)


def _flip(values):
    values.view(np.uint8)[101] ^= 0x01


def _nan(values):
    values[3] = np.nan


def _zero(values):
    values[:] = 0


def _double(values):
    values *= 2


def _swap(dim):
    def swap(values):
        rows = values.reshape(-1, dim)
        rows[[0, 1]] = rows[[1, 0]]
    return swap


def _offset(values):
    values[1] += 1


def _refused_and_recomputed(tiny_lm, tmp_path, said, why: str, undamaged):
    said.clear()
    states, path, hit = _tokens(tiny_lm, tmp_path)
    refusals = [line for line in said if "refused" in line]
    assert not hit and len(refusals) == 1 and why in refusals[0] and str(path) in refusals[0], said
    assert "\n" not in refusals[0]
    assert torch.equal(states.flat, undamaged.flat) and torch.equal(states.offsets, undamaged.offsets)
    again, _, hit = _tokens(tiny_lm, tmp_path)
    assert hit and torch.equal(again.flat, undamaged.flat)


@pytest.mark.parametrize("damage", ["flip", "nan", "zero", "double", "swap", "offset"])
def test_damage_inside_the_data_is_refused_and_recomputed(tiny_lm, tmp_path, said, damage):
    undamaged, path, _ = _tokens(tiny_lm, tmp_path)
    undamaged = type(undamaged)(undamaged.flat.clone(), undamaged.offsets.clone())
    change = {"flip": _flip, "nan": _nan, "zero": _zero, "double": _double, "swap": _swap(tiny_lm.hidden_size),
              "offset": _offset}[damage]
    _edit(path, "offsets" if damage == "offset" else "states", change)
    _refused_and_recomputed(tiny_lm, tmp_path, said, "do not match their digest", undamaged)


def test_a_damaged_pooled_cache_is_refused_too(tiny_lm, tmp_path, said):
    pooled, path, _ = cached_pooled_states(tiny_lm, TEXTS, IDS, KEY, cache_dir=tmp_path, progress=False)
    pooled = pooled.clone()
    _edit(path, "pooled", _nan)
    said.clear()
    again, _, hit = cached_pooled_states(tiny_lm, TEXTS, IDS, KEY, cache_dir=tmp_path, progress=False)
    assert not hit and torch.equal(again, pooled)
    assert len([line for line in said if "refused" in line and str(path) in line and "digest" in line]) == 1


def test_a_file_without_a_digest_is_stale_and_recomputed(tiny_lm, tmp_path, said):
    undamaged, path, _ = _tokens(tiny_lm, tmp_path)
    undamaged = type(undamaged)(undamaged.flat.clone(), undamaged.offsets.clone())
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    assert meta["digest"].startswith("sha256:")
    del meta["digest"]
    save_file(load_file(str(path)), str(path), metadata=meta)  # as written before caches carried a digest
    _refused_and_recomputed(tiny_lm, tmp_path, said, "no digest", undamaged)


def test_non_finite_states_are_refused_even_with_a_matching_digest(tmp_path):
    path = tmp_path / "states.safetensors"
    for dtype in (torch.float32, torch.bfloat16):
        for bad in (float("nan"), float("inf")):
            values = torch.ones(5, 4, dtype=dtype)
            values[3, 2] = bad
            write_safetensors(path, [("pooled", dtype, [5, 4])],
                              lambda f, name: f.write(values.view(torch.uint8).numpy().tobytes()))
            with pytest.raises(CacheMismatch, match="NaN or an infinity"):
                check_contents(path)
            values[3, 2] = 0
            write_safetensors(path, [("pooled", dtype, [5, 4])],
                              lambda f, name: f.write(values.view(torch.uint8).numpy().tobytes()))
            check_contents(path)


def test_states_the_lm_computes_non_finite_are_refused_not_trained_on(tiny_lm, tmp_path, monkeypatch):
    from ilcp.training import extraction

    original = extraction.PoolingModule.predict_step

    def step(self, batch, batch_idx):
        out = original(self, batch, batch_idx)
        out["states"][0, 0] = float("nan")
        return out

    monkeypatch.setattr(extraction.PoolingModule, "predict_step", step)
    with pytest.raises(ValueError, match="NaN or an infinity") as caught:
        _tokens(tiny_lm, tmp_path)
    assert "trainer.precision=32-true" in str(caught.value) and "\n" not in str(caught.value)
    assert not list((tmp_path / "pooled").glob("*.safetensors"))


def test_the_check_reads_the_file_in_blocks(tmp_path, monkeypatch):
    from ilcp.training import state_cache

    monkeypatch.setattr(state_cache, "CHECK_BLOCK", 64)  # many blocks, one not full
    path = tmp_path / "states.safetensors"
    values = torch.arange(1000, dtype=torch.float32)
    write_safetensors(path, [("pooled", torch.float32, [1000])], lambda f, name: f.write(values.numpy().tobytes()))
    check_contents(path)
    _edit(path, "pooled", lambda v: v.__setitem__(999, np.nan))
    with pytest.raises(CacheMismatch, match="digest"):
        check_contents(path)


def test_a_file_where_the_cache_folder_goes_is_named(tiny_lm, tmp_path):
    (tmp_path / "pooled").write_text("not a folder")
    with pytest.raises(ValueError) as caught:
        _tokens(tiny_lm, tmp_path)
    message = str(caught.value)
    assert str(tmp_path / "pooled") in message and "lm.cache_dir" in message and "Errno" not in message
    assert "\n" not in message


def test_a_partial_folder_of_a_reused_pid_is_cleared(tmp_path):
    if process_start(os.getpid()) is None:
        pytest.skip("no /proc here: a process's start time cannot be read")
    target = tmp_path / "pooled" / "x.safetensors"
    target.parent.mkdir()
    parent = os.getppid()  # alive, and not this process
    live = target.parent / f".{target.name}.{parent}-{process_start(parent)}.partial"
    reused = target.parent / f".{target.name}.{parent}-1.partial"
    gone = target.parent / f".{target.name}.{2 ** 22 + 17}-5.partial"
    for folder in (live, reused, gone):
        folder.mkdir()
    clear_dead_writers(target)
    assert live.is_dir() and not reused.exists() and not gone.exists()


_MAPPED = """
import sys, time
from ilcp.lm import load_lm, TINY_LM
from ilcp.training.extraction import cached_token_states
from ilcp.training.state_cache import CacheChanged

lm = load_lm(TINY_LM)
texts = [f"John went to room {i}. " * 40 for i in range(64)]
states, path, _ = cached_token_states(lm, texts, [f"r{i}" for i in range(64)], {"task": "truncated"},
                                      cache_dir=sys.argv[1], progress=False)
print(path, flush=True)
try:
    while True:  # a trainer reading its rows
        total = sum(float(states[i].sum()) for i in range(len(states)))
except CacheChanged as e:
    print(e, file=sys.stderr, flush=True)
    sys.exit(3)
"""


def _truncate_when_mapped(proc: subprocess.Popen, path: Path) -> float:
    """Truncate ``path`` in place (as another program would) while ``proc`` maps it; seconds the
    open waited, which is how long the mapping process took to stop and let go."""
    start = time.monotonic()
    with open(path, "r+b") as f:  # held by the kernel while the reader holds its lease
        waited = time.monotonic() - start
        f.truncate(4096)
    return waited


def test_a_file_truncated_under_its_map_stops_its_reader_in_one_line(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _MAPPED, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    path = Path(proc.stdout.readline().strip())
    assert path.is_file(), proc.communicate(timeout=60)
    time.sleep(0.5)  # reading
    waited = _truncate_when_mapped(proc, path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err[-2000:]  # stopped by CacheChanged, not killed by SIGBUS (-7)
    assert str(path) in err and "opened for writing or truncated" in err and "Bus error" not in err
    assert waited < 10, waited  # the kernel holds the truncation only until the reader has stopped
    assert path.stat().st_size == 4096  # and the other program's truncation then happens


def test_train_stops_in_one_line_when_its_cache_is_truncated_under_it(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cache, out = tmp_path / "cache", tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--config", str(TINY), f"out_dir={out}",
                             f"lm.cache_dir={cache}", "compressor.epochs=100000", "handoff.variants=[ilcp]"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    lines = []
    for line in proc.stderr:  # until stage 1 trains on the mapped rows
        lines.append(line)
        if "stage 1 (compressor):" in line:
            break
    else:
        pytest.fail("".join(lines)[-3000:])
    train_file = max((cache / "pooled").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    time.sleep(0.5)
    waited = _truncate_when_mapped(proc, train_file)
    rest = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 2, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    assert last.startswith("error: the sender-state cache file ") and str(train_file) in last, rest[-3000:]
    assert "Traceback" not in rest and "Bus error" not in rest
    assert waited < 10, waited
    assert not (out / "tiny" / "model.safetensors").exists()  # nothing exported


def test_a_lease_ends_with_its_map(tmp_path, tiny_lm):
    states, path, _ = _tokens(tiny_lm, tmp_path)
    assert any(p == path for p in state_cache._LEASES.values())
    del states
    gc.collect()
    assert not any(p == path for p in state_cache._LEASES.values())
    with open(path, "r+b") as f:  # no lease left: an open for writing goes through at once
        f.truncate(8)


def _export(run_dir: Path) -> dict:
    return load_file(str(run_dir / "model.safetensors"))


def test_a_run_on_a_damaged_cache_recomputes_it_and_exports_what_an_undamaged_run_does(tmp_path, tiny_lm, said):
    base = [f"lm.cache_dir={tmp_path / 'cache'}", "handoff.variants=[ilcp]"]
    first = train(load_config(TINY, [f"out_dir={tmp_path / 'a'}", *base]), lm=tiny_lm)
    files = sorted((tmp_path / "cache" / "pooled").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    damaged = files[-1]  # the training rows' states, the largest
    name = "states" if "states" in load_file(str(damaged)) else "pooled"
    _edit(damaged, name, _nan)  # the issue's reproduction: one float32 NaN in the states' bytes
    said.clear()
    second = train(load_config(TINY, [f"out_dir={tmp_path / 'a'}", *base]), lm=tiny_lm, overwrite=True)
    refusals = [line for line in said if "refused" in line]
    assert len(refusals) == 1 and str(damaged) in refusals[0] and "digest" in refusals[0], said
    a, b = _export(first.run_dir), _export(second.run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(bool(torch.isfinite(t.float()).all()) for t in b.values())
