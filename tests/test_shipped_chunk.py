"""The chunk memory shipped in the repository: the pretrained writer (pretrained/smollm2-chunk8) and
the general handoff trained on it (pretrained/smollm2-general-chunk8), each under 20 MiB, read with
every digest checked, for the embedded SmolLM2, with cards that say how they were made and measured."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ilcp.config import load_config
from ilcp.encoder.chunk_files import read_writer_state
from ilcp.export import read_export

REPO = Path(__file__).resolve().parent.parent
WRITER = REPO / "pretrained" / "smollm2-chunk8"
GENERAL = REPO / "pretrained" / "smollm2-general-chunk8"


def test_both_are_checked_folders_under_20_mib_with_their_cards():
    for folder in (WRITER, GENERAL):
        assert sum(p.stat().st_size for p in folder.iterdir()) < 20 << 20
        assert "## How it was made" in (folder / "README.md").read_text()
    config = json.loads((WRITER / "config.json").read_text())
    assert config["pretraining"]["steps"] >= 1500 and {r["vectors"] for r in config["readback"]} == {1, 4, 16}
    card = (WRITER / "README.md").read_text()
    assert f"{config['pretraining']['steps']} steps of 32 chunks" in card and "hours trained" in card
    run = read_export(GENERAL)  # schema, config.json's digest, the weights' sha256
    assert run.encoder is not None and set(run.soft_prompts) == {"cold_read_tuned", "prompt_tuned"}
    assert "| babi:11 (held out) |" in (GENERAL / "README.md").read_text()


def test_the_general_handoff_holds_the_shipped_writer_unchanged():
    settings = json.loads((WRITER / "config.json").read_text())["writer"]
    writer = read_writer_state(WRITER, settings)
    weights = load_file(str(GENERAL / "model.safetensors"))
    for name, tensor in writer.items():
        torch.testing.assert_close(weights[f"pooler.writer.{name}"], tensor)


def test_the_general_recipe_starts_from_the_shipped_writer(tmp_path):
    cfg = load_config(REPO / "configs" / "general-chunk.yaml", [f"out_dir={tmp_path}"])
    assert (REPO / cfg.compressor.memory.writer_from).resolve() == WRITER.resolve()
    assert cfg.data.heldout_tasks == ["babi:2", "babi:11", "babi:16"] and not cfg.handoff.finetune_encoder


@pytest.mark.slow
def test_both_are_for_the_embedded_smollm2(smollm2):
    assert json.loads((WRITER / "config.json").read_text())["lm"]["fingerprint"] == smollm2.fingerprint
    assert json.loads((GENERAL / "config.json").read_text())["lm"]["fingerprint"] == smollm2.fingerprint
