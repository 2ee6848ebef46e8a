"""Bounds are declared, and the declarations are what refuses: every float setting of the training
config has a declared range (a learning rate of 1e38 is refused in one line before anything
runs, where Adam would overflow), and an export whose config.json declares shapes its weights
file does not hold is refused from the file's safetensors header, before anything is built."""

import json
import shutil
import time

import pytest

from ilcp import cli
from ilcp.config import TrainConfig, load_config
from ilcp.encoder.spec import EncoderSpec
from ilcp.export import ExportError, read_export
from ilcp.export_integrity import redigest
from ilcp.settings import declared
from ilcp.weights_header import HeaderError, safetensors_shapes


def _sections():
    return [(f.name, f.default_factory()) for f in TrainConfig.__dataclass_fields__.values()
            if callable(getattr(f, "default_factory", None))]


def test_every_float_setting_declares_its_range():
    unbounded = []
    for section, instance in _sections():
        for d in declared(instance):
            if d.type is float or d.type == "float":
                low = d.meta.get("minimum") is not None or d.meta.get("above") is not None
                high = d.meta.get("maximum") is not None or d.meta.get("below") is not None
                if not (low and high):
                    unbounded.append(f"{section}.{d.name}")
    assert unbounded == []
    assert len([1 for _, inst in _sections() for d in declared(inst) if d.type is float]) >= 20


@pytest.mark.parametrize("setting", ["compressor.lr", "handoff.lr", "handoff.encoder_lr", "reconstruct.lr",
                                     "reconstruct.encoder_lr", "compressor.pooler_lr"])
def test_a_huge_learning_rate_is_refused_in_one_line(setting):
    with pytest.raises(ValueError) as info:
        load_config(None, [f"{setting}=1e38"])
    assert str(info.value) == f"{setting} must be <= 1,000.0, got 1e+38"


def test_the_command_line_refuses_it_before_training(capsys):
    with pytest.raises(SystemExit) as info:
        cli.train_main(["compressor.lr=1e38"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("compressor.lr must be <= 1,000.0, got 1e+38")
    assert "Traceback" not in "\n".join(err)


def test_the_header_is_read_without_the_tensors(tiny_run, tmp_path):
    shapes = safetensors_shapes(tiny_run.run_dir / "model.safetensors")
    c = tiny_run.cfg.compressor
    assert shapes["compressor.mu_head.weight"] == (c.latent_dim, c.hidden_dim)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")
    with pytest.raises(HeaderError, match="header length"):
        safetensors_shapes(bad)
    bad.write_bytes((4).to_bytes(8, "little") + b"nope")
    with pytest.raises(HeaderError, match="not JSON"):
        safetensors_shapes(bad)


def test_an_export_declaring_other_shapes_is_refused_before_anything_is_built(tiny_run, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(tiny_run.run_dir, run)
    config = json.loads((run / "config.json").read_text())
    config["compressor"]["hidden_dim"] = 23000
    (run / "config.json").write_text(json.dumps(redigest(config)))  # the digest recomputed: only the shapes differ

    def no_build(*args, **kwargs):
        raise AssertionError("the encoder was built before the shapes were compared")

    monkeypatch.setattr(EncoderSpec, "build", no_build)
    start = time.perf_counter()
    with pytest.raises(ExportError) as info:
        read_export(run)
    assert time.perf_counter() - start < 1.0
    message = str(info.value)
    assert "\n" not in message and "model.safetensors" in message and "declares" in message, message
