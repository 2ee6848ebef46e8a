"""``compressor.init_from``: a run's encoder starts from a pretrained one, read as an export is;
another LM's file, a tampered one and an encoder other than the run describes are each refused
in one line (issue 49, items 3 and 6)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from ilcp.config import load_config
from ilcp.encoder.spec import ExportError
from ilcp.export_integrity import redigest
from ilcp.handoff import ILCPHandoff
from ilcp.training.init_from import pretrained_encoder

REPO = Path(__file__).resolve().parent.parent
CONTEXTS = ["Mary moved to the bathroom. John went to the hallway.", "Daniel journeyed to the office."]


def config_from(tiny_run, tmp_path, *overrides):
    return load_config(REPO / "configs" / "tiny.yaml", [f"out_dir={tmp_path / 'runs'}",
                                                        f"lm.cache_dir={tmp_path / 'cache'}",
                                                        f"compressor.init_from={tiny_run.run_dir}", *overrides])


def test_the_encoder_starts_with_the_pretrained_weights_equal_latents(tiny_run, tiny_lm, tmp_path):
    cfg = config_from(tiny_run, tmp_path)
    encoder = pretrained_encoder(cfg, tiny_lm, max_length=64)
    reference = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)
    started = ILCPHandoff(tiny_lm, encoder, reference.config)
    for ours, theirs in zip(started.latents(CONTEXTS), reference.latents(CONTEXTS)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_a_run_started_from_an_export_trains_on_from_its_encoder(tiny_run, tiny_lm, tmp_path):
    from ilcp.training import train

    cfg = config_from(tiny_run, tmp_path, "handoff.variants=[ilcp]", "handoff.max_steps=2", "run_name=started",
                      "handoff.finetune_encoder=false")
    result = train(cfg, lm=tiny_lm)
    assert result.metrics["compressor"] == {"init_from": str(tiny_run.run_dir)}
    ours = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    theirs = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)
    # stage 2 trains the projector (the encoder stays frozen): the sender's latents are the pretrained ones
    for a, b in zip(ours.latents(CONTEXTS), theirs.latents(CONTEXTS)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def copy_export(tiny_run, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_run.run_dir, tmp_path / "pretrained"))


def test_another_lm_s_encoder_is_refused_in_one_line(tiny_run, tiny_lm, tmp_path):
    path = copy_export(tiny_run, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["lm"]["fingerprint"] = "0123456789abcdef"
    (path / "config.json").write_text(json.dumps(redigest(config)))
    cfg = config_from(tiny_run, tmp_path, f"compressor.init_from={path}")
    with pytest.raises(ExportError, match=r"compressor.init_from=.*: this export was trained on LM .* with "
                                          r"fingerprint 0123456789abcdef") as info:
        pretrained_encoder(cfg, tiny_lm, max_length=64)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("tamper", ["weights", "config"])
def test_a_tampered_file_is_refused_in_one_line(tiny_run, tiny_lm, tmp_path, tamper):
    path = copy_export(tiny_run, tmp_path)
    if tamper == "weights":
        data = bytearray((path / "model.safetensors").read_bytes())
        data[-5] ^= 0x40
        (path / "model.safetensors").write_bytes(bytes(data))
        expected = "changed after export: its sha256 differs"
    else:
        config = json.loads((path / "config.json").read_text())
        config["num_memory_tokens"] += 1
        (path / "config.json").write_text(json.dumps(config))
        expected = "was changed after it was written"
    cfg = config_from(tiny_run, tmp_path, f"compressor.init_from={path}")
    with pytest.raises(ExportError, match=expected):
        pretrained_encoder(cfg, tiny_lm, max_length=64)


def test_an_encoder_other_than_the_run_describes_names_each_setting(tiny_run, tiny_lm, tmp_path):
    cfg = config_from(tiny_run, tmp_path, "compressor.latent_dim=5", "handoff.num_memory_tokens=3")
    spec_latent = json.loads((tiny_run.run_dir / "config.json").read_text())["latent_dim"]
    with pytest.raises(ExportError, match=rf"this run: compressor.latent_dim 5, handoff.num_memory_tokens 3\); "
                                          rf"set compressor.latent_dim={spec_latent}, handoff.num_memory_tokens="):
        pretrained_encoder(cfg, tiny_lm, max_length=64)


def test_the_command_refuses_a_missing_folder_before_any_stage(tiny_run, tmp_path, capsys):
    from ilcp import cli

    code = cli.train_main(["--config", str(REPO / "configs" / "tiny.yaml"), f"out_dir={tmp_path / 'runs'}",
                           f"compressor.init_from={tmp_path / 'missing'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: compressor.init_from=") and "is not a directory" in err[-1]
    assert not (tmp_path / "runs" / "default").exists()
