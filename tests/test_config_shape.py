"""The memory kind is its own section of the training config (``compressor.memory``), and the
earlier flat shape is refused in one line naming the key that holds each setting now; exports
written before load unchanged through one reading of their ``pooling`` entries
(`ilcp.encoder.kinds.legacy_pooling`); a run started before resumes."""

import json
from pathlib import Path

import pytest
import yaml

from ilcp.config import MOVED, load_config, save_config
from ilcp.encoder.kinds import AttentionMemory, CodecMemory, MeanMemory, legacy_pooling, memory_kind_for
from ilcp.encoder.slot_memory import SlotMemory
from ilcp.encoder.spec import EncoderSpec
from ilcp.export import read_export
from ilcp.training.pipeline import check_resumed_settings

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"
DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_shape_config_is_refused_naming_the_new_key(old, tmp_path):
    value = {"compressor.pooling": "slots", "compressor.slot_adapter_targets": "[q_proj]"}.get(old, "4")
    with pytest.raises(ValueError) as info:
        load_config(TINY, [f"{old}={value}"])
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{old} is now {MOVED[old]}"), message
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"compressor": {key: yaml.safe_load(value)}}))
    with pytest.raises(ValueError, match=f"is now {MOVED[old]}"):
        load_config(path)


def test_the_new_shape_round_trips_through_the_saved_config(tmp_path):
    for overrides in ([], ["compressor.memory.kind=slots", "compressor.memory.adapter_rank=2",
                           "compressor.answer_head_weight=0"],
                      ["compressor.memory.kind=concat", "compressor.memory.chunk_tokens=2",
                       "compressor.answer_head_weight=0"]):
        cfg = load_config(TINY, overrides)
        save_config(cfg, tmp_path / "train_config.yaml")
        again = load_config(tmp_path / "train_config.yaml")
        assert again.compressor.memory == cfg.compressor.memory and again.to_dict() == cfg.to_dict()
        assert check_resumed_settings(cfg, tmp_path / "train_config.yaml") == {}


def test_a_run_saved_in_the_old_shape_resumes(tmp_path):
    cfg = load_config(TINY, ["compressor.memory.kind=slots", "compressor.memory.max_slots=12",
                             "compressor.answer_head_weight=0"])
    old = cfg.to_dict()
    memory = old["compressor"].pop("memory")
    old["compressor"].update(pooling="slots", pool_queries=4, chunk_tokens=0, tokens_per_slot=16, min_slots=1,
                             max_slots=12, slot_adapter_rank=0, slot_adapter_targets=memory["adapter_targets"])
    (tmp_path / "train_config.yaml").write_text(yaml.safe_dump(old))
    assert check_resumed_settings(cfg, tmp_path / "train_config.yaml") == {}
    changed = load_config(TINY, ["compressor.memory.kind=slots", "compressor.answer_head_weight=0"])
    with pytest.raises(ValueError, match="compressor.memory.max_slots: 12 -> 64"):
        check_resumed_settings(changed, tmp_path / "train_config.yaml")


@pytest.mark.parametrize("old, kind", [
    ({}, MeanMemory()),
    ({"kind": "mean", "chunk_tokens": 0}, MeanMemory()),
    ({"kind": "mean", "chunk_tokens": 10}, MeanMemory(chunk_tokens=10)),
    ({"kind": "attention", "num_queries": 4}, AttentionMemory(pool_queries=4)),
    ({"kind": "attention", "pool_queries": 4, "chunk_tokens": 8}, AttentionMemory(pool_queries=4, chunk_tokens=8)),
    ({"kind": "concat", "chunk_tokens": 4}, CodecMemory(chunk_tokens=4)),
    ({"kind": "slots", "tokens_per_slot": 16, "min_slots": 1, "max_slots": 32}, SlotMemory(16, 1, 32)),
])
def test_every_pooling_shape_exports_wrote_reads_as_its_kind(old, kind):
    read = memory_kind_for({**old, "layers": [-1], "max_length": 512})
    assert read == kind
    assert memory_kind_for(read.entries()) == kind  # and what it writes reads back the same
    assert set(legacy_pooling(old)) >= set(old) - {"num_queries"}


@pytest.mark.parametrize("where", [DATA / "export_v1", DATA / "exports" / "legacy-num-queries",
                                   REPO / "pretrained" / "smollm2-memory"])
def test_exports_written_before_load_unchanged(where):
    config = json.loads((where / "config.json").read_text())
    run = read_export(where)  # digests and signature-free reading, as written
    written = run.spec.to_config()["pooling"]
    expected = legacy_pooling(config["pooling"])
    assert written == expected  # the same entries (the queries under their current name)
    assert EncoderSpec.from_encoder(run.encoder, run.spec.layers, run.spec.max_length) == run.spec


@pytest.mark.parametrize("name", ["chunked", "codec", "snap"])
def test_kept_configs_of_each_kind_read(name):
    config = json.loads((DATA / f"export_v1_{name}.config.json").read_text())
    spec = EncoderSpec.from_config(config)
    assert spec.to_config()["pooling"] == legacy_pooling(config["pooling"])
