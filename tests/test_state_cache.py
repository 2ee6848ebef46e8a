"""The sender-state cache: read through a memory map (never loaded whole), written by streaming, in
bfloat16 when the run computes in bfloat16, refused with one line and computed again when it does
not match, and never left looking complete by a kill."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ilcp.training.data import HandoffRows, collate_rows
from ilcp.training.extraction import cached_pooled_states, cached_token_states, token_states
from ilcp.training.state_cache import cache_dtype

REPO = Path(__file__).resolve().parent.parent
TEXTS = [f"John went to room {i}. " * (1 + i % 4) + "Mary took the apple." for i in range(10)]
IDS = [f"r{i}" for i in range(len(TEXTS))]
KEY = {"task": "cache-test"}


@pytest.fixture
def said(capture_log):
    """The lines the training logger says (the cache's refusals among them)."""
    return capture_log("ilcp.training")


def _mapped(path: Path) -> bool:
    """Whether this process maps ``path`` (a memory map, not a copy)."""
    return str(path) in Path("/proc/self/maps").read_text()


def _tokens(tiny_lm, cache_dir, **kw):
    return cached_token_states(tiny_lm, TEXTS, IDS, KEY, cache_dir=cache_dir, batch_size=3, progress=False, **kw)


def test_token_states_are_read_through_a_memory_map(tiny_lm, tmp_path):
    computed, path, hit = _tokens(tiny_lm, tmp_path)
    assert not hit and _mapped(path)
    read, path2, hit2 = _tokens(tiny_lm, tmp_path)
    assert hit2 and path2 == path
    expected = token_states(tiny_lm, TEXTS, progress=False)
    for i in range(len(TEXTS)):
        torch.testing.assert_close(read[i], expected[i], rtol=1e-5, atol=1e-5)
        assert torch.equal(read[i], computed[i])
    # the file is plain safetensors: its own reader agrees
    plain = load_file(str(path))
    assert torch.equal(plain["states"], read.flat) and torch.equal(plain["offsets"], read.offsets)
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["key"])["dtype"] == "float32" and f.metadata()["dtype"] == "float32"
    # training batches gather their rows from the map, as float32
    rows = HandoffRows([{"context": t, "question": "q", "answer": "a"} for t in TEXTS], read)
    batch = collate_rows([rows[i] for i in (4, 1, 7)])
    assert batch["tokens"].dtype == torch.float32
    assert torch.equal(batch["tokens"][1, : len(expected[1])], read[1])
    # a subset of rows shares the storage
    subset = read.take([7, 2])
    assert subset.flat is read.flat and torch.equal(subset[0], read[7]) and len(subset) == 2
    torch.testing.assert_close(subset.mean(), read.mean()[[7, 2]])


def test_pooled_states_are_a_memory_map_too(tiny_lm, tmp_path):
    pooled, path, hit = cached_pooled_states(tiny_lm, TEXTS, IDS, KEY, cache_dir=tmp_path, progress=False)
    assert not hit and _mapped(path) and pooled.shape == (len(TEXTS), tiny_lm.hidden_size)
    again, _, hit = cached_pooled_states(tiny_lm, TEXTS, IDS, KEY, cache_dir=tmp_path, progress=False)
    assert hit and torch.equal(again, pooled)


def test_bfloat16_runs_cache_bfloat16_and_the_key_names_the_dtype(tiny_lm, tmp_path):
    assert cache_dtype("auto", "bf16-mixed") == "bfloat16" and cache_dtype("auto", "32-true") == "float32"
    assert cache_dtype("auto", "32-true", "bfloat16") == "bfloat16" and cache_dtype("float32", "bf16-mixed") == "float32"
    with pytest.raises(ValueError, match="float16"):
        cache_dtype("float16", "32-true")
    half, half_path, _ = _tokens(tiny_lm, tmp_path, precision="bf16-mixed")
    full, full_path, _ = _tokens(tiny_lm, tmp_path, precision="bf16-mixed", dtype="float32")
    assert half.flat.dtype == torch.bfloat16 and full.flat.dtype == torch.float32 and half_path != full_path
    with safe_open(str(half_path), framework="pt") as f:
        assert f.metadata()["dtype"] == "bfloat16" and json.loads(f.metadata()["key"])["dtype"] == "bfloat16"
    data = half.flat.numel() * 2
    assert half_path.stat().st_size - data < full_path.stat().st_size - 2 * data + 1024  # half the states' bytes
    torch.testing.assert_close(half.flat.float(), full.flat, rtol=1e-2, atol=1e-2)


def _refused(tiny_lm, tmp_path, said, why: str):
    """A second call refuses the cache file with one line naming ``why``, computes it again and
    leaves a file that a third call reads."""
    said.clear()
    states, path, hit = _tokens(tiny_lm, tmp_path)
    refusals = [line for line in said if "refused" in line]
    assert not hit and len(refusals) == 1 and why in refusals[0] and str(path) in refusals[0], said
    assert "\n" not in refusals[0]
    again, _, hit = _tokens(tiny_lm, tmp_path)
    assert hit and torch.equal(again.flat, states.flat)


def test_truncated_or_padded_files_are_refused_and_recomputed(tiny_lm, tmp_path, said):
    _, path, _ = _tokens(tiny_lm, tmp_path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 10)
    _refused(tiny_lm, tmp_path, said, "truncated")
    with open(path, "ab") as f:
        f.write(b"\0" * 8)
    _refused(tiny_lm, tmp_path, said, "too long")
    path.write_bytes(b"\x05")
    _refused(tiny_lm, tmp_path, said, "truncated")
    path.write_bytes((40).to_bytes(8, "little") + b"{not json" + b" " * 31)
    _refused(tiny_lm, tmp_path, said, "not a safetensors file")


def test_another_runs_file_other_rows_dtype_or_sizes_are_refused(tiny_lm, tmp_path, said):
    _, path, _ = _tokens(tiny_lm, tmp_path)
    _, other, _ = cached_token_states(tiny_lm, TEXTS, IDS, {"task": "another"}, cache_dir=tmp_path, progress=False)
    shutil.copyfile(other, path)  # another key's file under this key's name
    _refused(tiny_lm, tmp_path, said, "other settings")
    _, fewer, _ = cached_token_states(tiny_lm, TEXTS, IDS[:-1] + ["elsewhere"], KEY, cache_dir=tmp_path,
                                      progress=False)  # same key, other rows: written under the same name
    assert fewer == path
    _refused(tiny_lm, tmp_path, said, "other rows")
    meta = {k: v for k, v in safe_open(str(path), framework="pt").metadata().items()}
    tensors = load_file(str(path))
    save_file({"states": tensors["states"].bfloat16(), "offsets": tensors["offsets"]}, str(path),
              metadata={**meta, "dtype": "bfloat16"})
    _refused(tiny_lm, tmp_path, said, "bfloat16 states where float32 ones are asked")
    save_file({"states": tensors["states"].bfloat16(), "offsets": tensors["offsets"]}, str(path), metadata=meta)
    _refused(tiny_lm, tmp_path, said, "states is BF16, not F32")
    save_file({"states": tensors["states"][:, :8].contiguous(), "offsets": tensors["offsets"]}, str(path),
              metadata=meta)
    _refused(tiny_lm, tmp_path, said, "shape")
    bad = tensors["offsets"].clone()
    bad[3] = bad[2] - 1
    save_file({"states": tensors["states"], "offsets": bad}, str(path), metadata=meta)
    _refused(tiny_lm, tmp_path, said, "offsets do not rise")
    path.unlink()
    path.mkdir()
    _refused(tiny_lm, tmp_path, said, "not a regular file")


_KILLED = """
import os, signal, sys
from ilcp.lm import load_lm, TINY_LM
from ilcp.training import extraction

where, cache = sys.argv[1], sys.argv[2]
lm = load_lm(TINY_LM)
if where == "batch":  # killed after its second batch was written to the shard
    original = extraction._ShardWriter.write_on_batch_end
    seen = []

    def write(self, *a, **k):
        original(self, *a, **k)
        seen.append(1)
        if len(seen) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    extraction._ShardWriter.write_on_batch_end = write
else:  # killed with the merged file written, before its rename
    extraction.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
texts = [f"John went to room {i}. " * (1 + i % 4) + "Mary took the apple." for i in range(10)]
extraction.cached_token_states(lm, texts, [f"r{i}" for i in range(10)], {"task": "cache-test"}, cache_dir=cache,
                               batch_size=3, progress=False)
"""


@pytest.mark.parametrize("where", ["batch", "rename"])
def test_a_kill_during_extraction_leaves_no_cache_a_later_run_reads(tiny_lm, tmp_path, where):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _KILLED, where, str(tmp_path)], env=env, capture_output=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    folder = tmp_path / "pooled"
    assert not list(folder.glob("*.safetensors")), "a killed extraction left a file under the cache's name"
    left = list(folder.glob(".*.partial"))
    assert len(left) == 1
    if where == "batch":  # the states went to disk batch by batch: two batches so far, not every row
        shard = next(left[0].rglob("rank0.states"))
        assert 0 < shard.stat().st_size < sum(len(r) for r in token_states(tiny_lm, TEXTS, progress=False)) * 64 * 4
    states, path, hit = _tokens(tiny_lm, tmp_path)
    assert not hit and path.is_file() and not list(folder.glob(".*.partial")), "the dead writer's folder is cleared"
    assert len(states) == len(TEXTS)
