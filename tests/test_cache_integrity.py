"""The sender-state cache's contents: each file carries a digest of its tensors, so damage inside
the data (a flipped byte, states zeroed or doubled, rows swapped, one NaN, an edited offset) is
refused in one line naming the file and computed again, never trained on; a file without a digest
is stale; states are finite; a file in the cache folder's place and a reused pid are named."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ilcp.config import load_config
from ilcp.training import train
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


_TRUNCATED = """
import sys
from ilcp.lm import load_lm, TINY_LM
from ilcp.training.extraction import cached_token_states

lm = load_lm(TINY_LM)
texts = [f"John went to room {i}. " * 40 for i in range(64)]
states, path, _ = cached_token_states(lm, texts, [f"r{i}" for i in range(64)], {"task": "truncated"},
                                      cache_dir=sys.argv[1], progress=False)
with open(path, "r+b") as f:
    f.truncate(4096)  # in place, under the map
print(float(states.flat[-1].sum()))
"""


def test_a_file_truncated_under_its_map_ends_with_a_traceback_not_silently(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _TRUNCATED, str(tmp_path)], env=env, capture_output=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGBUS, proc.stderr.decode()[-2000:]
    assert "Bus error" in proc.stderr.decode() and "File " in proc.stderr.decode()


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
