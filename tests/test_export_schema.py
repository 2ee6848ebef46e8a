"""The exported encoder settings (`EncoderSpec`) and the memory kinds they name.

tests/data/export_v1/ is the tiny config's export (configs/tiny.yaml, trained on the tiny Qwen3)
as the code before `EncoderSpec` wrote it; tests/data/export_v1_{chunked,codec,snap}.config.json
are the config.json of the same run with one latent per chunk of 4 tokens, as a codec (concat
pooling, in_prompt, format vectors), and with a dot-scored hard vocabulary snap. Exports of that
format must keep loading into the same encoder, and the spec must write them back unchanged but
for the attention queries' entry, which exports now name as the training config does
(``pooling.pool_queries``, once ``pooling.num_queries``).
"""

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from ilcp.encoder import kinds as memory_kinds
from ilcp.encoder.spec import EncoderSpec
from ilcp.export import ExportError, build_encoder, encoder_state, read_config, read_export
from ilcp.export_writing import save_encoder
from ilcp.encoder.kinds import (AttentionMemory, CodecMemory, MeanMemory, MemoryKind, memory_kind_for,
                               register_memory_kind)
from ilcp.settings import setting
from ilcp.export_integrity import redigest

DATA = Path(__file__).resolve().parent / "data"
KEPT = DATA / "export_v1"
RUN_KEYS = {"config_digest", "digests", "files", "format", "format_version", "lm", "metrics", "package_version", "task",
            "task_settings", "train_config"}


def _kept_config(name: str) -> dict:
    return json.loads((DATA / f"export_v1_{name}.config.json").read_text())


def _encoder_entries(config: dict) -> str:
    return json.dumps({k: v for k, v in config.items() if k not in RUN_KEYS}, sort_keys=True)


def _renamed(config: dict) -> dict:
    """A kept config with its queries under today's name: what the spec writes back."""
    config = json.loads(json.dumps(config))
    if "num_queries" in config["pooling"]:
        config["pooling"]["pool_queries"] = config["pooling"].pop("num_queries")
    return config


def test_an_export_written_before_the_spec_loads_into_the_same_encoder():
    run = read_export(KEPT)
    config = run.config
    encoder = run.encoder
    assert (encoder.pooling, encoder.pooler.num_queries, encoder.chunk_tokens) == ("attention", 4, 0)
    assert (encoder.placement, encoder.vocabulary_snap, encoder.format_prompt) == ("prefix", "none", None)
    assert (encoder.latent_dim, encoder.num_memory_tokens, encoder.vae.input_dim) == (8, 2, 256)
    saved = load_file(str(KEPT / "model.safetensors"))
    state = encoder_state(encoder)
    assert sorted(state) == sorted(saved) and all(torch.equal(state[k], saved[k]) for k in saved)
    assert set(run.soft_prompts) == {"prompt_tuned", "cold_read_tuned"}
    spec = EncoderSpec.from_config(config, KEPT / "config.json")
    assert spec.memory == AttentionMemory(pool_queries=4) and run.spec == spec
    assert "num_queries" in config["pooling"] and spec.to_config()["pooling"]["pool_queries"] == 4
    assert json.dumps(spec.to_config(), sort_keys=True) == _encoder_entries(_renamed(config))  # key for key
    assert EncoderSpec.from_encoder(encoder, spec.layers, spec.max_length) == spec


@pytest.mark.parametrize("name, memory", [
    ("chunked", AttentionMemory(pool_queries=4, chunk_tokens=4)),
    ("codec", CodecMemory(4)),
    ("snap", AttentionMemory(pool_queries=4)),
])
def test_kept_configs_of_each_kind_rebuild_and_write_back_unchanged(name, memory):
    config = _kept_config(name)
    spec = EncoderSpec.from_config(config, f"{name}/config.json")
    assert spec.memory == memory and memory.kind == {"snap": "attention", "chunked": "attention", "codec": "concat"}[name]
    assert json.dumps(spec.to_config(), sort_keys=True) == _encoder_entries(_renamed(config))
    hidden = config["lm"]["hidden_size"]
    encoder = spec.build(hidden)
    assert encoder.chunk_tokens == memory.chunk_tokens and encoder.placement == config.get("memory_placement", "prefix")
    assert EncoderSpec.from_encoder(encoder, spec.layers, spec.max_length) == spec
    state = encoder_state(encoder)
    assert any(k.startswith("pooler.") for k in state) == (name != "codec")
    if name == "codec":
        assert tuple(state["format.vectors"].shape) == (config["format_vectors"], hidden)
    if name == "snap":
        assert (encoder.vocabulary_snap, encoder.snap_temperature, encoder.snap_metric) == ("hard", 1.0, "dot")
    rebuilt = build_encoder(config, state)  # the path read_export takes
    assert EncoderSpec.from_encoder(rebuilt, spec.layers, spec.max_length) == spec


def test_the_tiny_run_writes_what_the_spec_writes(tiny_run):
    config = read_config(tiny_run.run_dir)
    spec = EncoderSpec.from_config(config)
    assert json.dumps(spec.to_config(), sort_keys=True) == _encoder_entries(config)
    kept = _renamed(json.loads((KEPT / "config.json").read_text()))
    kept["pooling"]["max_length"] = config["pooling"]["max_length"]  # the LM's limit, which may have moved
    assert _encoder_entries(config) == _encoder_entries(kept)


def test_the_registry_holds_the_five_kinds_and_reads_what_names_lists():
    assert list(memory_kinds.memory_kinds()) == ["mean", "attention", "concat", "slots", "chunk"]
    assert memory_kind_for({"kind": "mean"}) == MeanMemory()
    assert memory_kind_for({"kind": "mean", "chunk_tokens": 0}) == MeanMemory()
    assert memory_kind_for({"kind": "mean", "chunk_tokens": 3}) == MeanMemory(chunk_tokens=3)
    assert memory_kind_for({}) == MeanMemory()  # the oldest exports name no kind: the mean
    assert memory_kind_for({"kind": "attention", "num_queries": 2}) == AttentionMemory(pool_queries=2)
    with pytest.raises(ValueError, match="already registered"):
        @register_memory_kind
        @dataclass(frozen=True)
        class Other(MeanMemory):
            kind: ClassVar[str] = "mean"


def test_a_new_kind_is_one_registered_dataclass(monkeypatch):
    monkeypatch.setattr(memory_kinds, "_KINDS", dict(memory_kinds._KINDS))  # registered for this test only

    @register_memory_kind
    @dataclass(frozen=True)
    class StridedMemory(MemoryKind):
        """Codec chunks, recorded under a kind of their own: only its settings and its pooler."""

        kind: ClassVar[str] = "strided"
        chunk_tokens: int = setting(2, "tokens per chunk", minimum=1)

        def pooler(self, state_dim, hidden_size=None):
            return CodecMemory(self.chunk_tokens).pooler(state_dim)

    config = _kept_config("codec")
    config["pooling"]["kind"] = "strided"
    spec = EncoderSpec.from_config(config)
    assert spec.memory == StridedMemory(4) and spec.to_config()["pooling"]["kind"] == "strided"
    encoder = spec.build(64)
    assert encoder.chunk_tokens == 4 and EncoderSpec.from_encoder(encoder, spec.layers, spec.max_length) == spec
    assert "strided" in memory_kinds.memory_kinds()
    config["pooling"]["chunk_tokens"] = 0
    with pytest.raises(ExportError, match="'pooling.chunk_tokens' must be >= 1"):
        EncoderSpec.from_config(config)


BAD = {
    "temperature 0": (lambda c: c["vocabulary_snap"].update(temperature=0),
                      "'vocabulary_snap.temperature' must be > 0"),
    "snap not an object": (lambda c: c.update(vocabulary_snap="hard"), "'vocabulary_snap.mode'"),
    "no snap mode": (lambda c: c["vocabulary_snap"].pop("mode"), "missing 'vocabulary_snap.mode'"),
    "negative chunks": (lambda c: c["pooling"].update(chunk_tokens=-1), "'pooling.chunk_tokens' must be >= 0"),
    "bool chunks": (lambda c: c["pooling"].update(chunk_tokens=False), "'pooling.chunk_tokens' must be int"),
    "placement": (lambda c: c.update(memory_placement="middle"), "'memory_placement' must be one of"),
    "format vectors": (lambda c: c.update(format_vectors=-1), "'format_vectors' must be >= 0"),
    "beta": (lambda c: c["compressor"].update(beta=float("inf")), "'compressor.beta' must be a number"),
    "empty layers": (lambda c: c["pooling"].update(layers=[]), "'pooling.layers' must be a non-empty list of ints"),
    "unknown pooling": (lambda c: c["pooling"].update(kind="max"), "unknown pooling kind 'max'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_entry_is_one_line_naming_the_file_and_the_entry(case, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(KEPT, run)
    config = _kept_config("snap")
    config["files"], config["digests"] = json.loads((KEPT / "config.json").read_text())["files"], {}
    BAD[case][0](config)
    (run / "config.json").write_text(json.dumps(redigest(config)))  # its config_digest written anew
    with pytest.raises(ExportError) as info:
        read_config(run)
    message = str(info.value)
    assert "\n" not in message and str(run / "config.json") in message and BAD[case][1] in message, message


def test_a_spec_checks_its_values_when_built_in_code():
    spec = EncoderSpec.from_config(json.loads((KEPT / "config.json").read_text()))
    with pytest.raises(ValueError, match="memory_placement"):
        replace(spec, memory_placement="middle")
    with pytest.raises(ValueError, match="latent_dim"):
        replace(spec, latent_dim=0)
    with pytest.raises(ValueError, match="pool_queries"):
        replace(spec, memory=AttentionMemory(pool_queries=0))  # the kind checks its own settings
    with pytest.raises(ValueError, match="memory kind"):
        replace(spec, memory="attention")
    assert replace(spec, layers=[0, -1]).layers == (0, -1)


def test_saving_an_encoder_writes_its_own_settings_not_the_old_configs(tmp_path):
    config = _kept_config("codec")  # in_prompt, two format vectors
    encoder = EncoderSpec.from_config(config).build(config["lm"]["hidden_size"])
    encoder.configure_receiver("prefix", "soft", 0.5)
    encoder.format_prompt = None
    saved = read_config(save_encoder(encoder, config, tmp_path / "saved"))
    assert "memory_placement" not in saved and "format_vectors" not in saved
    assert saved["vocabulary_snap"] == {"mode": "soft", "temperature": 0.5, "metric": "cosine"}
    assert saved["pooling"] == config["pooling"] and saved["files"] == {"ilcp": "model.safetensors"}
