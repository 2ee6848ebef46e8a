"""The pretrained encoder shipped in the repository (pretrained/smollm2-memory): an export of the
embedded SmolLM2's memory pretraining under 20 MiB, read with every digest checked, the encoder
`configs/pretrain.yaml` describes, started from by `compressor.init_from` with the latents it
sends; a changed byte is refused in one line; its card says how it was made and read back."""

import shutil
from pathlib import Path

import pytest
import torch

from ilcp.config import load_config
from ilcp.export import ExportError, read_export
from ilcp.handoff import ILCPHandoff
from ilcp.training.init_from import pretrained_encoder, settings_it_needs

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "pretrained" / "smollm2-memory"
TEXT = ("The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, "
        "a region in France.")


def test_it_is_a_checked_export_under_20_mib_with_its_card():
    files = sorted(p.name for p in SHIPPED.iterdir())
    assert files == ["README.md", "config.json", "metrics.json", "model.safetensors", "train_config.yaml"]
    assert sum(p.stat().st_size for p in SHIPPED.iterdir()) < 20 << 20
    run = read_export(SHIPPED)  # schema, config.json's digest, the weights' sha256
    assert run.encoder is not None and not run.soft_prompts
    card = (SHIPPED / "README.md").read_text()
    assert "python train.py --config configs/pretrain.yaml" in card and "## How it was made" in card


def test_it_is_the_encoder_the_pretraining_recipe_describes(tmp_path):
    cfg = load_config(REPO / "configs" / "pretrain.yaml", [f"out_dir={tmp_path}"])
    assert settings_it_needs(cfg, read_export(SHIPPED).spec) == {}


def test_the_general_recipe_starts_from_it_without_pretraining_again(tmp_path):
    cfg = load_config(REPO / "configs" / "general.yaml", [f"out_dir={tmp_path}"])
    assert Path(cfg.compressor.init_from).resolve() == SHIPPED and not cfg.reconstruct.enabled
    assert settings_it_needs(cfg, read_export(SHIPPED).spec) == {}


def test_a_run_starts_from_it_with_the_latents_it_sends(smollm2, tmp_path):
    cfg = load_config(REPO / "configs" / "pretrain.yaml", [f"out_dir={tmp_path}", f"compressor.init_from={SHIPPED}"])
    encoder = pretrained_encoder(cfg, smollm2, 8192)
    shipped = ILCPHandoff.from_pretrained(SHIPPED, lm=smollm2)
    ours, theirs = encoder.state_dict(), shipped.encoder.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    sent = shipped.send(TEXT)  # at the export's compute precision (bfloat16 autocast): close, not equal
    with torch.no_grad():
        mine = encoder.latent(*encoder.sender_states([TEXT]))[0]
    assert mine.shape == sent.latent.shape and torch.allclose(mine, sent.latent.float(), atol=0.1 * float(mine.abs().max()))


def test_a_changed_byte_is_refused_in_one_line(tmp_path):
    copy = tmp_path / "shipped"
    shutil.copytree(SHIPPED, copy)
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-5] ^= 0x01
    (copy / "model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(ExportError, match="model.safetensors") as e:
        read_export(copy)
    assert "\n" not in str(e.value)
