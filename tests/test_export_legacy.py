"""Exports written before the attention queries' entry took the training config's name.

tests/data/exports/legacy-num-queries/ is configs/tiny.yaml's export as the code of commit e952c78
wrote it (its README.md says how): ``pooling.num_queries`` where exports now write
``pooling.pool_queries`` (``compressor.memory.pool_queries`` in the training config). It must keep
loading, unedited and with its digests, into the same encoder and send the same latent.
"""

import json
from pathlib import Path

import pytest
import torch

from ilcp.encoder.spec import EncoderSpec
from ilcp.export import ExportError, read_config, read_export
from ilcp.export_integrity import file_digest
from ilcp.handoff import ILCPHandoff
from ilcp.encoder.kinds import AttentionMemory, memory_kind_for

LEGACY = Path(__file__).resolve().parent / "data" / "exports" / "legacy-num-queries"
CONTEXT, QUESTION = "Mary moved to the hallway. John went to the garden.", "Where is John?"
# what the code that wrote the export sent for CONTEXT, and answered for QUESTION
SENT = [0.11103557795286179, 0.0763244703412056, -0.20959509909152985, -0.15321305394172668,
        -0.11068835854530334, 0.013514097779989243, -0.20791837573051453, 0.1385139375925064]
ANSWERED = ""


def test_the_kept_export_names_its_queries_the_old_way_and_its_digests_hold():
    config = json.loads((LEGACY / "config.json").read_text())
    assert config["pooling"]["num_queries"] == 4 and "pool_queries" not in config["pooling"]
    assert all(file_digest(LEGACY / name) == digest for name, digest in config["digests"].items())


def test_a_legacy_export_reads_into_its_settings():
    run = read_export(LEGACY)
    spec = run.spec
    assert spec.memory == AttentionMemory(pool_queries=4) and run.encoder.pooler.num_queries == 4
    assert (spec.layers, spec.max_length) == ((-1,), 4096)  # the LM's limit it recorded, not a default
    assert (spec.latent_dim, spec.num_memory_tokens, spec.input_dim, spec.hidden_dim) == (8, 2, 256, 32)
    assert (spec.beta, spec.projector_hidden, spec.memory_placement, spec.vocabulary_snap) == (0.1, 32, "prefix", "none")
    assert EncoderSpec.from_encoder(run.encoder, spec.layers, spec.max_length) == spec
    assert set(run.soft_prompts) == {"prompt_tuned", "cold_read_tuned"}


def test_a_legacy_export_sends_and_receives_as_the_code_that_wrote_it(tiny_lm, tmp_path):
    handoff = ILCPHandoff.from_pretrained(LEGACY, lm=tiny_lm)
    assert handoff.spec == read_export(LEGACY).spec
    assert (handoff.layers, handoff.max_length) == ((-1,), 4096)
    payload = handoff.send(CONTEXT)
    torch.testing.assert_close(payload.latent, torch.tensor(SENT), rtol=1e-5, atol=1e-6)
    answer = handoff.receive(handoff.to_wire(payload), QUESTION)
    assert answer == ANSWERED
    # saved again, it names its queries as exports now do, and sends the same latent
    saved = handoff.save_pretrained(tmp_path / "saved")
    config = read_config(saved)
    assert config["pooling"]["pool_queries"] == 4 and "num_queries" not in config["pooling"]
    again = ILCPHandoff.from_pretrained(saved, lm=tiny_lm)
    assert again.spec == handoff.spec
    assert torch.equal(again.send(CONTEXT).latent, payload.latent)


def test_a_new_export_names_its_queries_as_the_training_config_does(tiny_run):
    config = read_config(tiny_run.run_dir)
    assert tiny_run.cfg.compressor.memory.kind == "attention"
    assert config["pooling"]["pool_queries"] == tiny_run.cfg.compressor.memory.pool_queries
    assert "num_queries" not in config["pooling"]
    assert read_export(tiny_run.run_dir).spec.memory == AttentionMemory(pool_queries=tiny_run.cfg.compressor.memory.pool_queries)


def test_both_names_at_once_are_refused(tmp_path):
    with pytest.raises(ValueError, match="twice"):
        memory_kind_for({"kind": "attention", "pool_queries": 4, "num_queries": 4})
    assert memory_kind_for({"kind": "attention", "num_queries": 3}) == AttentionMemory(pool_queries=3)
    assert memory_kind_for({"kind": "attention", "pool_queries": 3}) == AttentionMemory(pool_queries=3)
    config = json.loads((LEGACY / "config.json").read_text())
    config["pooling"]["pool_queries"] = 4
    with pytest.raises(ExportError, match="names its queries twice"):
        EncoderSpec.from_config(config)
