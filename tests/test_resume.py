"""Resume anywhere on the tiny config: a stage is done with all its files or redone; no temporary
files left; changed settings refused (a raised step budget recorded); a finished run resumed keeps
its earlier sessions' time; a failed start blocks nothing; --overwrite deletes only a run directory."""

import json
import shutil
from pathlib import Path

import pytest

from ilcp import training
from ilcp.config import load_config
from ilcp.export import read_export
from ilcp.training import train
from ilcp.training.handoff_stage import best_checkpoint

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def _base(tmp_path):
    return [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "handoff.variants=[ilcp,prompt_tuned]"]


def test_a_stage_whose_metrics_are_missing_is_redone_and_temporary_files_are_cleared(tmp_path, tiny_lm):
    first = train(load_config(TINY, _base(tmp_path)), lm=tiny_lm)
    stage = first.run_dir / "stages" / "prompt_tuned"
    (stage / "metrics.json").unlink()  # killed between the two writes of an older layout
    litter = stage / ".prompt_tuned.safetensors.0123456789ab.tmp"
    litter.write_bytes(b"half a file")
    resumed = train(load_config(TINY, _base(tmp_path)), lm=tiny_lm, resume=True)
    assert (stage / "metrics.json").is_file() and not litter.exists()
    assert resumed.metrics["variants"]["prompt_tuned"]["steps"] == 4
    assert read_export(resumed.run_dir).soft_prompts["prompt_tuned"].shape[0] == 2


def test_resume_with_changed_settings_is_refused_and_a_raised_budget_recorded(tmp_path, tiny_lm):
    train(load_config(TINY, _base(tmp_path)), lm=tiny_lm)
    with pytest.raises(ValueError, match="compressor.latent_dim"):
        train(load_config(TINY, _base(tmp_path) + ["compressor.latent_dim=4"]), lm=tiny_lm, resume=True)
    with pytest.raises(ValueError, match="handoff.max_steps: 4 -> 2"):
        train(load_config(TINY, _base(tmp_path) + ["handoff.max_steps=2"]), lm=tiny_lm, resume=True)
    run_dir = tmp_path / "tiny"
    shutil.rmtree(run_dir / "stages" / "prompt_tuned")
    resumed = train(load_config(TINY, _base(tmp_path) + ["handoff.max_steps=6"]), lm=tiny_lm, resume=True)
    assert json.loads((run_dir / "resumes.json").read_text()) == [{"handoff.max_steps": [4, 6]}]
    assert resumed.metrics["variants"]["prompt_tuned"]["steps"] == 6


def test_a_finished_run_resumed_keeps_its_earlier_sessions_time(tmp_path, tiny_lm):
    first = train(load_config(TINY, _base(tmp_path)), lm=tiny_lm).metrics
    resumed = train(load_config(TINY, _base(tmp_path)), lm=tiny_lm, resume=True).metrics
    written = json.loads((tmp_path / "tiny" / "metrics.json").read_text())
    assert written == resumed and len(written["sessions"]) == 2
    assert written["sessions"][0] == {"stage_seconds": first["stage_seconds"], "total_seconds": first["total_seconds"]}
    assert written["total_seconds"] == pytest.approx(sum(s["total_seconds"] for s in written["sessions"]), abs=0.2)
    for stage, seconds in first["stage_seconds"].items():  # the stages the resume reloaded keep their time
        assert written["stage_seconds"][stage] >= seconds
    again = train(load_config(TINY, _base(tmp_path)), lm=tiny_lm, resume=True).metrics
    assert len(again["sessions"]) == 3 and again["sessions"][:2] == written["sessions"]


def test_a_failed_start_does_not_block_the_corrected_command(tmp_path, tiny_lm, monkeypatch):
    def broken(cfg, lm):
        raise ValueError("task 'babi:1' has no train rows")

    monkeypatch.setattr(training.pipeline, "prepare_data", broken)
    with pytest.raises(ValueError, match="no train rows"):
        train(load_config(TINY, _base(tmp_path)), lm=tiny_lm)
    monkeypatch.undo()
    result = train(load_config(TINY, _base(tmp_path)), lm=tiny_lm)  # neither --resume nor --overwrite
    assert (result.run_dir / "config.json").is_file()


def test_overwrite_deletes_only_a_run_directory(tmp_path, tiny_lm):
    precious = tmp_path / "tiny"
    precious.mkdir()
    (precious / "notes.txt").write_text("not a run")
    with pytest.raises(FileExistsError, match="not a run directory"):
        train(load_config(TINY, _base(tmp_path)), lm=tiny_lm, overwrite=True)
    assert (precious / "notes.txt").read_text() == "not a run"


def test_the_best_checkpoint_is_looked_up_in_this_stage_folder(tmp_path):
    stage = tmp_path / "moved" / "stages" / "ilcp"
    (stage / "checkpoints").mkdir(parents=True)
    (stage / "checkpoints" / "best-step=4.ckpt").write_bytes(b"")
    old = "/somewhere/else/stages/ilcp/checkpoints/best-step=4.ckpt"
    assert best_checkpoint(old, stage) == stage / "checkpoints" / "best-step=4.ckpt"
    assert best_checkpoint("", stage) is None
    assert best_checkpoint("/x/best-step=9.ckpt", stage) is None


def test_a_setting_added_after_the_run_started_resumes_at_its_default(tmp_path, tiny_lm):
    import yaml

    first = train(load_config(TINY, _base(tmp_path)), lm=tiny_lm)
    saved = first.run_dir / "train_config.yaml"
    config = yaml.safe_load(saved.read_text())
    del config["handoff"]["memory_placement"]  # as a run written before the setting existed
    saved.write_text(yaml.safe_dump(config))
    train(load_config(TINY, _base(tmp_path)), lm=tiny_lm, resume=True)
    with pytest.raises(ValueError, match="handoff.memory_placement: 'prefix' -> 'in_prompt'"):
        train(load_config(TINY, _base(tmp_path) + ["handoff.memory_placement=in_prompt"]), lm=tiny_lm, resume=True)
    # a raised budget together with a refused change records nothing
    with pytest.raises(ValueError, match="compressor.latent_dim"):
        train(load_config(TINY, _base(tmp_path) + ["handoff.max_steps=6", "compressor.latent_dim=4"]), lm=tiny_lm,
              resume=True)
    assert not (first.run_dir / "resumes.json").exists()


def test_overwrite_with_an_lm_that_does_not_load_keeps_the_old_run(tmp_path, tiny_lm):
    from ilcp.lm import LMLoadError

    first = train(load_config(TINY, _base(tmp_path)), lm=tiny_lm)
    before = sorted(p.relative_to(first.run_dir) for p in first.run_dir.rglob("*"))
    with pytest.raises(LMLoadError, match="unknown LM spec"):
        train(load_config(TINY, _base(tmp_path) + ["lm.spec=no-such-lm"]), overwrite=True)
    assert sorted(p.relative_to(first.run_dir) for p in first.run_dir.rglob("*")) == before
    read_export(first.run_dir)


def test_a_truncated_last_checkpoint_is_refused_then_discarded_and_every_temporary_file_cleared(tmp_path, tiny_lm):
    first = train(load_config(TINY, _base(tmp_path)), lm=tiny_lm)
    stage = first.run_dir / "stages" / "prompt_tuned"
    (stage / "prompt_tuned.safetensors").unlink()  # killed before the stage was marked done
    ckpt = stage / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    litter = [first.run_dir / ".tmpAb3De9",  # safetensors' own temporary file, left by a kill
              stage / ".tmpZZ0912", stage / ".metrics.json.0123456789ab.tmp"]  # and this package's
    for path in litter:
        path.write_bytes(b"")
    before = sorted(p.relative_to(first.run_dir) for p in first.run_dir.rglob("*"))
    with pytest.raises(ValueError, match=r"last\.ckpt cannot be resumed from: it is truncated.*--discard-last"):
        train(load_config(TINY, _base(tmp_path)), lm=tiny_lm, resume=True)
    assert sorted(p.relative_to(first.run_dir) for p in first.run_dir.rglob("*")) == before  # nothing touched
    with pytest.raises(ValueError, match="goes with --resume"):
        train(load_config(TINY, _base(tmp_path)), lm=tiny_lm, discard_last=True)
    resumed = train(load_config(TINY, _base(tmp_path)), lm=tiny_lm, resume=True, discard_last=True)
    assert not any(path.exists() for path in litter)
    assert resumed.metrics["variants"]["prompt_tuned"]["steps"] == 4
    assert read_export(resumed.run_dir).soft_prompts["prompt_tuned"].shape[0] == 2
    kept = (first.run_dir / ".tmp-notes.txt", first.run_dir / "tmpAb3De9")  # not temporary files of a write
    for path in kept:
        path.write_text("mine")
    train(load_config(TINY, _base(tmp_path)), lm=tiny_lm, resume=True)
    assert all(path.read_text() == "mine" for path in kept)
