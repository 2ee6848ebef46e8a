"""A tampered export is refused with one ExportError line naming the file and the problem."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ilcp.export import ExportError, read_export
from ilcp.handoff import ILCPHandoff
from ilcp.export_integrity import redigest


def _config(d):
    return json.loads((d / "config.json").read_text())


def _write_config(d, config):
    """config.json edited by someone who also writes its new config_digest (the deeper checks' case)."""
    (d / "config.json").write_text(json.dumps(redigest(config)))


def _set(d, dotted, value, delete=False):
    config = _config(d)
    node = config
    *parents, last = dotted.split(".")
    for p in parents:
        node = node[p]
    if delete:
        del node[last]
    else:
        node[last] = value
    _write_config(d, config)


def _rewrite_weights(d, fname, change, keep_digest=False):
    state = load_file(str(d / fname))
    change(state)
    save_file(state, str(d / fname))
    if keep_digest:  # a deliberate edit with its digest recomputed: the tensor checks must catch it
        from ilcp.export_integrity import file_digest

        config = _config(d)
        config["digests"][fname] = file_digest(d / fname)
        _write_config(d, config)


def _nan(state):
    state["projector.value_head.bias"][0] = float("nan")


def _inf(state):
    state["compressor.mu_head.weight"][0, 0] = float("inf")


def _int64(state):
    state["projector.gate_head.bias"] = state["projector.gate_head.bias"].long()


def _half(state):
    state["compressor.mu_head.bias"] = state["compressor.mu_head.bias"].half()


def _extra(state):
    state["compressor.extra"] = torch.zeros(2)


def _missing(state):
    del state["projector.trunk.0.weight"]


def _shape(state):
    state["projector.trunk.0.bias"] = torch.zeros(3)


def _zero_std(state):
    state["compressor.input_std"][0] = 0.0


CASES = {
    "config is a list": lambda d: (d / "config.json").write_text("[1, 2]"),
    "config is null": lambda d: (d / "config.json").write_text("null"),
    "config is not JSON": lambda d: (d / "config.json").write_text("{oops"),
    "config is not UTF-8": lambda d: (d / "config.json").write_bytes(b"\xff\xfe{"),
    "no lm": lambda d: _set(d, "lm", None, delete=True),
    "no fingerprint": lambda d: _set(d, "lm.fingerprint", None, delete=True),
    "no compressor": lambda d: _set(d, "compressor", None, delete=True),
    "no pool_queries": lambda d: _set(d, "pooling.pool_queries", None, delete=True),
    "queries named twice": lambda d: _set(d, "pooling.num_queries", 4),
    "string latent_dim": lambda d: _set(d, "latent_dim", "32"),
    "zero latent_dim": lambda d: _set(d, "latent_dim", 0),
    "bool hidden": lambda d: _set(d, "projector.hidden", True),
    "max_length 0": lambda d: _set(d, "pooling.max_length", 0),
    "max_length negative": lambda d: _set(d, "pooling.max_length", -5),
    "layers not ints": lambda d: _set(d, "pooling.layers", ["last"]),
    "unknown pooling": lambda d: _set(d, "pooling.kind", "max"),
    "file outside (..)": lambda d: _set(d, "files.ilcp", "../model.safetensors"),
    "file outside (absolute)": lambda d: _set(d, "files.ilcp", "/etc/passwd"),
    "unknown file entry": lambda d: _set(d, "files.other", "x.safetensors"),
    "missing weights file": lambda d: (d / "model.safetensors").unlink(),
    "truncated weights": lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100]),
    "not safetensors": lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64),
    "weights changed after export": lambda d: _rewrite_weights(d, "model.safetensors", _nan),
    "NaN weights": lambda d: _rewrite_weights(d, "model.safetensors", _nan, keep_digest=True),
    "Inf weights": lambda d: _rewrite_weights(d, "model.safetensors", _inf, keep_digest=True),
    "int64 weights": lambda d: _rewrite_weights(d, "model.safetensors", _int64, keep_digest=True),
    "float16 weights": lambda d: _rewrite_weights(d, "model.safetensors", _half, keep_digest=True),
    "extra tensor": lambda d: _rewrite_weights(d, "model.safetensors", _extra, keep_digest=True),
    "missing tensor": lambda d: _rewrite_weights(d, "model.safetensors", _missing, keep_digest=True),
    "wrong shape": lambda d: _rewrite_weights(d, "model.safetensors", _shape, keep_digest=True),
    "zero input_std": lambda d: _rewrite_weights(d, "model.safetensors", _zero_std, keep_digest=True),
    "truncated soft prompt": lambda d: _rewrite_weights(
        d, "prompt_tuned.safetensors", lambda s: s.update(soft_prompt=s["soft_prompt"][:1]), keep_digest=True),
    "soft prompt renamed": lambda d: _rewrite_weights(
        d, "cold_read_tuned.safetensors", lambda s: s.update(other=s.pop("soft_prompt")), keep_digest=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tampered_export_is_refused_with_one_clear_line(case, tiny_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run.run_dir, run_dir)
    CASES[case](run_dir)
    with pytest.raises(ExportError) as info:
        read_export(run_dir)
    message = str(info.value)
    assert "\n" not in message and str(run_dir) in message, message


def test_untampered_copy_loads_and_pooling_layer_out_of_range_is_refused(tiny_run, tiny_lm, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run.run_dir, run_dir)
    read_export(run_dir)
    _set(run_dir, "pooling.layers", [99])
    with pytest.raises(ExportError, match="layers"):
        ILCPHandoff.from_pretrained(run_dir, lm=tiny_lm)
