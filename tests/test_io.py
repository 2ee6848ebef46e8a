"""Atomic writes: the whole file or the previous one, with the usual permissions."""

import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from ilcp.io import atomic_save_safetensors, atomic_write_json


def test_written_files_get_the_umask_permissions_not_mkstemps_0600(tmp_path):
    umask = os.umask(0)
    os.umask(umask)
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    atomic_save_safetensors({"t": torch.zeros(2)}, tmp_path / "t.safetensors")
    for name in ("a.json", "t.safetensors"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask
    assert torch.equal(load_file(str(tmp_path / "t.safetensors"))["t"], torch.zeros(2))


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    import ilcp.io

    path = tmp_path / "model.safetensors"
    atomic_save_safetensors({"t": torch.ones(2)}, path)

    def half_then_fail(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(ilcp.io, "save_file", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_save_safetensors({"t": torch.zeros(2)}, path)
    assert torch.equal(load_file(str(path))["t"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
