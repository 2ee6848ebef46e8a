"""A stage whose training loss turns NaN or infinite stops at that step, with one line naming the
stage and the step; the command exits non-zero and nothing is exported."""

from pathlib import Path

import pytest
import torch

from ilcp import cli, export
from ilcp.config import load_config
from ilcp.training import train
from ilcp.training.compressor_stage import CompressorModule
from ilcp.training.handoff_stage import HandoffModule
from ilcp.training.log import NonFiniteLoss

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def _turns(module_class, monkeypatch, at_step: int, value: float):
    """``module_class``'s training loss becomes ``value`` from optimizer step ``at_step`` (1-based) on."""
    original = module_class.training_step

    def step(self, batch, batch_idx):
        loss = original(self, batch, batch_idx)
        return loss * value if self.global_step + 1 >= at_step else loss

    monkeypatch.setattr(module_class, "training_step", step)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_compressor_loss_stops_the_run_naming_stage_and_step(tmp_path, tiny_lm, monkeypatch, value):
    _turns(CompressorModule, monkeypatch, 2, value)
    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "handoff.variants=[ilcp]"])
    with pytest.raises(NonFiniteLoss) as caught:
        train(cfg, lm=tiny_lm)
    message = str(caught.value)
    assert "stage compressor" in message and "at step 2 " in message and str(value) in message
    assert "\n" not in message
    assert not (cfg.run_dir / export.CONFIG_FILE).exists() and not (cfg.run_dir / "model.safetensors").exists()
    assert not (cfg.run_dir / "stages" / "compressor" / "compressor.safetensors").exists()


def test_the_command_reports_a_nan_handoff_loss_in_one_line_and_exports_nothing(tmp_path, monkeypatch, capsys):
    _turns(HandoffModule, monkeypatch, 3, float("nan"))
    code = cli.train_main(["--config", str(TINY), f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}",
                           "handoff.variants=[prompt_tuned]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    errors = [line for line in err if line.startswith("error:")]
    assert len(errors) == 1 and "stage prompt_tuned" in errors[0] and "at step 3 " in errors[0], err
    run_dir = tmp_path / "tiny"
    assert (run_dir / "stages").is_dir()
    assert not (run_dir / export.CONFIG_FILE).exists() and not (run_dir / "prompt_tuned.safetensors").exists()


def test_a_finite_run_is_not_stopped(tiny_run):
    assert (tiny_run.run_dir / export.CONFIG_FILE).is_file()
    assert all(torch.isfinite(torch.tensor(v)) for v in tiny_run.result.metrics["compressor"].values())
