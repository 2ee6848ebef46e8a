"""Leave-tasks-out training: data.heldout_tasks keeps named tasks of the training task out of every
stage (pretraining texts included), the export records them, and eval reports them as held out.
Also the mix of tasks of any sources (mix:squad|babi:all) that such a training task is built from."""

import json

import pytest

from ilcp.config import load_config
from ilcp.tasks import MixTask, held_out, resolve_task

from conftest import TINY_CONFIG


def test_a_mix_of_sources_is_balanced_and_reported_task_by_task():
    mix = resolve_task("mix:squad|babi:1+2")
    assert isinstance(mix, MixTask) and mix.name == "mix:squad|babi:1|babi:2"
    assert [p.name for p in mix.parts()] == ["squad", "babi:1", "babi:2"]
    rows = mix.load("train", limit=30, parts={"squad": {"limit": 10}, "babi:1": {"variant": "en", "limit": 10},
                                               "babi:2": {"variant": "en", "limit": 10}}).to_list()
    assert [r["id"].split("/")[0] for r in rows[:6]] == ["squad", "babi:1", "babi:2"] * 2  # taken in turn
    assert {part: sum(r["id"].startswith(part + "/") for r in rows) for part in ("squad", "babi:1", "babi:2")} == {
        "squad": 10, "babi:1": 10, "babi:2": 10}
    assert len({r["id"] for r in rows}) == 30
    with pytest.raises(ValueError, match="two tasks or more"):
        resolve_task("mix:squad|squad")
    with pytest.raises(ValueError, match="cannot hold a mix"):
        resolve_task("mix:squad|mix:babi:1|babi:2")


def test_held_out_removes_exactly_the_named_tasks():
    assert held_out(resolve_task("babi:all"), ["babi:2", "babi:3"]).name == \
        "babi:1+6+7+8+9+10+11+15+16+17+18+19+20"
    assert held_out(resolve_task("mix:squad|babi:1+2"), ["babi:2"]).name == "mix:squad|babi:1"
    assert held_out(resolve_task("mix:squad|babi:1"), ["squad"]).name == "babi:1"
    assert held_out(resolve_task("babi:1+2"), []).name == "babi:1+2"
    with pytest.raises(ValueError, match="'babi:4' is not one of the tasks"):
        held_out(resolve_task("babi:1+2"), ["babi:4"])
    with pytest.raises(ValueError, match="holds out every task"):
        held_out(resolve_task("babi:1+2"), ["babi:1", "babi:2"])
    with pytest.raises(ValueError, match="data.heldout_tasks: unknown task 'nonsense'"):
        load_config(TINY_CONFIG, ["data.heldout_tasks=[nonsense]"])


def _spied_train(cfg, lm, monkeypatch):
    from ilcp.training import pipeline, train

    seen = []
    original = pipeline.prepare_data

    def spy(cfg, lm):
        train_rows, val_rows = original(cfg, lm)
        seen.extend(r["task"] for r in train_rows.rows + val_rows.rows)
        return train_rows, val_rows

    monkeypatch.setattr(pipeline, "prepare_data", spy)
    return train(cfg, lm=lm), seen


def test_a_held_out_tasks_rows_reach_no_stage_and_eval_reports_it_held_out(tmp_path, tiny_lm, monkeypatch):
    from ilcp.evaluation.run import evaluate

    common = [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "data.task=babi:1+2",
              "reconstruct.steps=2", "reconstruct.val_every_steps=2"]
    _, without_holdout = _spied_train(load_config(TINY_CONFIG, common + ["run_name=all"]), tiny_lm, monkeypatch)
    assert "babi-qa2" in without_holdout  # the control: task 2 is trained on when nothing is held out
    result, seen = _spied_train(load_config(TINY_CONFIG, common + ["run_name=held", "data.heldout_tasks=[babi:2]"]),
                                tiny_lm, monkeypatch)
    assert seen and set(seen) == {"babi-qa1"}  # every stage reads these rows: none of task 2
    config = json.loads((result.run_dir / "config.json").read_text())
    assert config["task"] == "babi:1" and config["heldout_tasks"] == ["babi:2"]
    results = evaluate(result.run_dir, methods=["no_context"], limit=2, latency_n=0, lengths=(), lm=tiny_lm,
                       log=lambda _: None, max_new_tokens=2, batch_size=4)
    assert {t: v["seen_in_training"] for t, v in results["tasks"].items()} == {"babi:1": True, "babi:2": False}


def test_pretraining_texts_may_not_read_a_held_out_task(tmp_path, tiny_lm):
    from ilcp.training import train

    cfg = load_config(TINY_CONFIG, [f"out_dir={tmp_path}", "data.task=babi:1+2", "data.heldout_tasks=[babi:2]",
                                    "compressor.pooling=slots", "compressor.answer_head_weight=0",
                                    "reconstruct.steps=2", "reconstruct.texts=[task,babi:2]"])
    with pytest.raises(ValueError, match="reconstruct.texts: 'babi:2' holds babi:2"):
        train(cfg, lm=tiny_lm)
    assert not (tmp_path / "tiny" / "config.json").exists()
