"""A run killed (SIGKILL) at any stage boundary and started again with --resume: the stages done
before the kill are loaded, not trained again, with their metrics and logs untouched; the run
finishes with a complete, loadable export equal to an uninterrupted run's, and leaves no
temporary file. The kill comes from `train`'s ``on_stage_done`` hook, in a driver process that
SIGKILLs itself once the stage is done. The tiny config with a reconstruction stage has every
boundary."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ilcp.config import load_config
from ilcp.export import read_export
from ilcp.handoff import ILCPHandoff
from ilcp.training import train

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"
SETTINGS = ["reconstruct.steps=2", "reconstruct.val_every_steps=2"]
VARIANTS = ["ilcp", "prompt_tuned", "cold_read_tuned"]
BOUNDARIES = ["data", "compressor", "reconstruct", *VARIANTS]  # in the order the run passes them
LOADED = {"data": "read from cache", "compressor": "stage 1 (compressor): finished earlier, loaded",
          "reconstruct": "reconstruction: finished earlier, loaded",
          **{v: f"stage 2 ({v}): finished earlier, loaded" for v in VARIANTS}}
TRAINED = {"data": "computed in", "compressor": "stage 1 (compressor): 2", "reconstruct": "reconstruction: 32 distinct",
           **{v: f"stage 2 ({v}): 1" for v in VARIANTS}}  # the parameter counts start with 1 or 2


# train.py's run, but the process kills itself once stage argv[1] is done, as a crash there would
KILLING_DRIVER = """
import os, signal, sys
from ilcp.cli import setup_logging
from ilcp.config import load_config
from ilcp.training import train

def kill_after(name):
    if name == sys.argv[1]:
        os.kill(os.getpid(), signal.SIGKILL)

setup_logging()
train(load_config(sys.argv[2], sys.argv[3:]), on_stage_done=kill_after)
"""


def _train_py(out: Path, *extra: str, kill_after: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ILCP_CACHE": str(out / "cache")}
    settings = [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", *SETTINGS, *extra]
    if kill_after:
        cmd = [sys.executable, "-c", KILLING_DRIVER, kill_after, str(TINY), *settings]
    else:
        cmd = [sys.executable, str(REPO / "train.py"), "--config", str(TINY), *settings]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_lm):
    out = tmp_path_factory.mktemp("uninterrupted")
    return train(load_config(TINY, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", *SETTINGS]), lm=tiny_lm)


def _stage_files(run_dir: Path) -> dict[str, bytes]:
    """Every stage's metrics.json and CSV log, by path."""
    files = list((run_dir / "stages").glob("*/metrics.json")) + list((run_dir / "logs").glob("*/metrics.csv"))
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files}


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_a_run_killed_after_a_stage_resumes_there(boundary, tmp_path, uninterrupted, tiny_lm):
    killed = _train_py(tmp_path, kill_after=boundary)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = tmp_path / "tiny"
    assert not (run_dir / "config.json").exists(), "killed before the export"
    before = _stage_files(run_dir)

    resumed = _train_py(tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = BOUNDARIES[: BOUNDARIES.index(boundary) + 1]
    for stage in BOUNDARIES:
        if stage in done:
            assert LOADED[stage] in resumed.stderr and TRAINED[stage] not in resumed.stderr, stage
        else:
            assert TRAINED[stage] in resumed.stderr and LOADED[stage] not in resumed.stderr, stage

    # what the finished stages wrote is kept as it was, and is what the run reports
    after = _stage_files(run_dir)
    assert {k: after[k] for k in before} == before
    assert len(before) == 2 * (len(done) - 1)  # metrics.json and a CSV log per trained stage
    metrics = json.loads((run_dir / "metrics.json").read_text())
    reported = {"compressor": metrics["compressor"], "reconstruct": metrics["reconstruct"], **metrics["variants"]}
    for stage in done[1:]:
        assert reported[stage] == json.loads(before[f"stages/{stage}/metrics.json"]), stage

    assert not list(tmp_path.rglob("*.tmp"))
    run = read_export(run_dir)  # every file checked against the digests of config.json
    handoff = ILCPHandoff.from_pretrained(run_dir, lm=tiny_lm)
    assert isinstance(handoff.receive(handoff.send("Mary went to the hall."), "Where is Mary?", max_new_tokens=2), str)
    reference = read_export(uninterrupted.run_dir)
    for name in ("model.safetensors", "prompt_tuned.safetensors", "cold_read_tuned.safetensors"):
        got, ref = load_file(str(run_dir / name)), load_file(str(uninterrupted.run_dir / name))
        assert got.keys() == ref.keys()
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=0, msg=f"{name}: {key}")
    assert run.config["digests"].keys() == reference.config["digests"].keys()


def test_a_stage_resumed_from_its_checkpoint_keeps_the_validation_rows_logged_before(tmp_path, tiny_lm):
    """Lightning's CSV logger deletes a stage's metrics.csv when it starts again: the rows of the
    interrupted attempt are kept in logs/NAME.earlier and stay in the stage's curve."""
    base = [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "handoff.variants=[prompt_tuned]"]
    first = train(load_config(TINY, base), lm=tiny_lm)
    stage, logs = first.run_dir / "stages" / "prompt_tuned", first.run_dir / "logs" / "prompt_tuned"
    assert [r["step"] for r in first.metrics["variants"]["prompt_tuned"]["curve"]] == [2, 4]
    for name in ("prompt_tuned.safetensors", "metrics.json"):  # interrupted after its last checkpoint
        (stage / name).unlink()
    resumed = train(load_config(TINY, base + ["handoff.max_steps=8"]), lm=tiny_lm, resume=True)
    curve = resumed.metrics["variants"]["prompt_tuned"]["curve"]
    assert [r["step"] for r in curve] == [2, 4, 6, 8]
    assert curve[:2] == first.metrics["variants"]["prompt_tuned"]["curve"]
    assert [p.name for p in logs.iterdir()] == ["metrics.csv"]
    assert [p.name for p in logs.with_name("prompt_tuned.earlier").iterdir()] == ["metrics.0.csv"]
