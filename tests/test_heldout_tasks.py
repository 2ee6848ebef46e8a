"""Leave-tasks-out training: data.heldout_tasks keeps named tasks of the training task out of every
stage (pretraining texts included), the export records them, and eval reports them as held out.
Also the mix of tasks of any sources (mix:squad|babi:all) that such a training task is built from."""

import json
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from ilcp import cli
from ilcp.config import load_config
from ilcp.tasks import MixTask, held_out, load_task, resolve_task
from ilcp.export_integrity import redigest

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
from test_bad_inputs import cli_error, listing

LEGACY = Path(__file__).resolve().parent / "data" / "exports" / "legacy-num-queries"


def part_of(row: dict) -> str:
    """The single task a training row came from: a mix's rows carry it as their id's prefix, a bAbI
    mix's rows as their ``task`` column (``babi-qaN``)."""
    if "/" in row["id"]:
        return row["id"].split("/")[0]
    return resolve_task(row["task"]).name


# -------------------------------------------------------------------- the mix of sources


def test_a_mix_of_sources_is_balanced_and_reported_task_by_task():
    mix = resolve_task("mix:squad|babi:1+2")
    assert isinstance(mix, MixTask) and mix.name == "mix:squad|babi:1|babi:2"
    assert [p.name for p in mix.parts()] == ["squad", "babi:1", "babi:2"]
    assert resolve_task(" mix: squad | babi:all ").parts()[1:] == resolve_task("babi:all").parts()
    rows = mix.load("train", limit=30, parts={"squad": {"limit": 10}, "babi:1": {"variant": "en", "limit": 10},
                                               "babi:2": {"variant": "en", "limit": 10}}).to_list()
    assert [part_of(r) for r in rows[:6]] == ["squad", "babi:1", "babi:2"] * 2  # taken in turn
    assert Counter(part_of(r) for r in rows) == {"squad": 10, "babi:1": 10, "babi:2": 10}
    assert len({r["id"] for r in rows}) == 30
    with pytest.raises(ValueError, match="two tasks or more"):
        resolve_task("mix:squad|squad")
    with pytest.raises(ValueError, match="cannot hold a mix"):
        resolve_task("mix:squad|mix:babi:1|babi:2")


def test_the_training_rows_of_a_mix_are_balanced_with_and_without_held_out_tasks():
    from ilcp.training.data import load_rows

    def parts(task, heldout, size):
        cfg = load_config(TINY_CONFIG, [f"data.task={task}", f"data.heldout_tasks={heldout}"])
        rows, _ = load_rows(cfg, "train", size)
        return [part_of(r) for r in rows]

    every = parts("mix:squad|babi:1|babi:2", "[]", 30)
    assert Counter(every) == {"squad": 10, "babi:1": 10, "babi:2": 10}
    assert all(len(set(every[i:i + 3])) == 3 for i in range(0, 30, 3))  # any prefix is balanced
    kept = parts("mix:squad|babi:1|babi:2", "[babi:2]", 30)
    assert Counter(kept) == {"squad": 15, "babi:1": 15}
    twelve = parts("babi:all", "[babi:2,babi-qa11,babi:16]", 24)
    assert Counter(twelve) == {t.name: 2 for t in resolve_task("babi:all").parts()
                               if t.name not in ("babi:2", "babi:11", "babi:16")}


def test_held_out_removes_exactly_the_named_tasks():
    assert held_out(resolve_task("babi:all"), ["babi:2", "babi:3"]).name == \
        "babi:1+6+7+8+9+10+11+15+16+17+18+19+20"
    assert held_out(resolve_task("mix:squad|babi:1+2"), ["babi:2"]).name == "mix:squad|babi:1"
    assert held_out(resolve_task("mix:squad|babi:1|babi:2"), ["squad"]).name == "babi:1+2"  # stays a bAbI mix
    assert held_out(resolve_task("babilong:1+7+8:0.5k"), ["babilong:7:0.5k"]).name == "babilong:1+8:0.5k"
    assert held_out(resolve_task("mix:squad|babi:1"), ["squad"]).name == "babi:1"
    assert held_out(resolve_task("babi:1+2"), []).name == "babi:1+2"


SLOTS_PRETRAINING = ["compressor.memory.kind=slots", "compressor.answer_head_weight=0", "reconstruct.steps=2"]


@pytest.mark.parametrize("overrides,words", [
    pytest.param(["data.task=babi:1+2", "data.heldout_tasks=[babi:4]"],
                 ["data.heldout_tasks: 'babi:4' is not one of the tasks 'babi:1+2' trains on"], id="not a task of it"),
    pytest.param(["data.task=babi:1", "data.heldout_tasks=[babi:2]"],
                 ["data.heldout_tasks: 'babi:2' is not one of the tasks 'babi:1'"], id="a single training task"),
    pytest.param(["data.task=babi:1+2", "data.heldout_tasks=[babi:1,babi:2]"],
                 ["data.heldout_tasks holds out every task of 'babi:1+2'"], id="every task held out"),
    pytest.param(["data.task=babi:all", "data.heldout_tasks=[babi:2+3]"],
                 ["data.heldout_tasks: 'babi:2+3' is a mix: name its tasks one by one (babi:2, babi:3)"],
                 id="a mix held out"),
    pytest.param(["data.task=babi:1+2", "data.heldout_tasks=[nonsense]"],
                 ["data.heldout_tasks: unknown task 'nonsense'"], id="unknown held-out task"),
    pytest.param(["data.task=babi:1+2", "data.heldout_tasks=babi:2"],
                 ["config field 'data.heldout_tasks' expects list, got 'babi:2'"], id="held-out tasks not a list"),
    pytest.param(["data.task=babi:1+2", "data.heldout_tasks=[babi:2]", *SLOTS_PRETRAINING,
                  "reconstruct.texts=[task,babi:all]"],
                 ["reconstruct.texts: 'babi:all' holds babi:2, which data.heldout_tasks keeps out"],
                 id="pretraining texts hold a held-out task"),
    pytest.param(["data.task=mix:squad"], ["data.task", "a mix needs two tasks or more"], id="a mix of one task"),
    pytest.param(["data.task=mix:squad||babi:1"], ["data.task", "separated by '|'", "'mix:squad||babi:1'"],
                 id="a mix with an empty part"),
    pytest.param(["data.task=mix:squad|trivia"], ["data.task", "unknown task 'trivia'"], id="a mix with an unknown part"),
])
def test_bad_mixes_and_held_out_tasks_are_one_line_and_write_nothing(overrides, words, tmp_path, capsys):
    argv = ["--config", str(TINY_CONFIG), f"out_dir={tmp_path / 'runs'}", f"lm.cache_dir={tmp_path / 'cache'}",
            *overrides]
    before = listing(tmp_path)
    code, line = cli_error(cli.train_main, argv, capsys)
    assert code == 2
    for word in words:
        assert word in line, (word, line)
    assert listing(tmp_path) == before


# -------------------------------------------------------------------- no held-out row reaches a stage


def _train_spied(tmp_path, tiny_lm, name: str, overrides: list[str]):
    """Train a tiny run, recording the rows every stage receives: stage 1 (the compressor), the
    pretraining stage (its rows and the texts it reads) and stage 2 (the answer data module)."""
    from ilcp.training import pipeline, reconstruction_stage, train

    seen: dict[str, list[dict]] = {}

    def spy(stage, function, rows_at):
        def wrapped(*args, **kwargs):
            for i in rows_at:
                seen.setdefault(stage, []).extend(getattr(args[i], "rows", args[i]))
            result = function(*args, **kwargs)
            if stage == "pretraining texts":
                seen.setdefault(stage, []).extend(result.rows)
            return result
        return wrapped

    cfg = load_config(TINY_CONFIG, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", f"run_name={name}",
                                    "data.task=babi:1+2", "compressor.memory.kind=slots", "compressor.answer_head_weight=0",
                                    "reconstruct.steps=2", "reconstruct.val_every_steps=2",
                                    "reconstruct.texts=[task,prose]", "reconstruct.texts_per_source=4",
                                    *overrides])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "train_compressor", spy("compressor", pipeline.train_compressor, (2, 3)))
        patch.setattr(pipeline, "train_reconstruction", spy("reconstruct", pipeline.train_reconstruction, (3, 4)))
        patch.setattr(pipeline, "HandoffDataModule", spy("answers", pipeline.HandoffDataModule, (0, 1)))
        patch.setattr(reconstruction_stage, "pretraining_rows",
                      spy("pretraining texts", reconstruction_stage.pretraining_rows, ()))
        result = train(cfg, lm=tiny_lm)
    return result, seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_lm):
    """The same tiny run trained on babi:1+2 twice: everything, and with babi:2 held out."""
    out = tmp_path_factory.mktemp("heldout")
    every, every_seen = _train_spied(out, tiny_lm, "every", [])
    held, held_seen = _train_spied(out, tiny_lm, "held", ["data.heldout_tasks=[babi-qa2]"])
    # bAbI task 2's contexts of the splits training reads (none of them is also a task 1 context)
    task2 = {r["context"] for split in ("train", "validation") for r in load_task("babi:2", split, variant="en")}
    task2 -= {r["context"] for split in ("train", "validation") for r in load_task("babi:1", split, variant="en")}
    return SimpleNamespace(every=every, every_seen=every_seen, held=held, held_seen=held_seen, task2=task2)


def test_a_held_out_tasks_rows_reach_no_training_stage(runs):
    stages = {"compressor", "reconstruct", "pretraining texts", "answers"}
    assert set(runs.every_seen) == set(runs.held_seen) == stages
    # the control: without the filter, task 2's rows reach every stage
    for stage in stages:
        assert runs.task2 & {r["context"] for r in runs.every_seen[stage]}, stage
    assert {part_of(r) for r in runs.every_seen["answers"]} == {"babi:1", "babi:2"}
    # held out: no stage receives one of its rows, by the row's task or by its context
    for stage in stages:
        rows = runs.held_seen[stage]
        assert rows, stage
        assert not runs.task2 & {r["context"] for r in rows}, stage
        assert all(part_of(r) == "babi:1" for r in rows if r.get("task")), stage


def test_the_export_records_the_held_out_tasks_and_eval_reports_them_held_out(runs, tiny_lm, tmp_path):
    from ilcp.evaluation.run import evaluate

    config = json.loads((runs.held.run_dir / "config.json").read_text())
    assert config["task"] == "babi:1" and config["heldout_tasks"] == ["babi:2"]
    assert "heldout_tasks" not in json.loads((runs.every.run_dir / "config.json").read_text())

    def seen(run_dir, **settings):
        results = evaluate(run_dir, methods=["no_context"], limit=2, latency_n=0, lengths=(), lm=tiny_lm,
                           log=lambda _: None, max_new_tokens=2, batch_size=4, **settings)
        return {task: entry["seen_in_training"] for task, entry in results["tasks"].items()}

    # by default: the trained task, then the held-out one, marked held out in results.md too
    assert seen(runs.held.run_dir, out=tmp_path / "out") == {"babi:1": True, "babi:2": False}
    assert "| babi:2 (held out) |" in (tmp_path / "out" / "results.md").read_text()
    # asked for by the training task's own name, a held-out part is still held out
    assert seen(runs.held.run_dir, tasks=["babi:1+2"], only_tasks=True) == {"babi:1": True, "babi:2": False}
    assert seen(runs.every.run_dir) == {"babi:1": True, "babi:2": True}
    # an export whose task still names the held-out part reports it held out
    edited = Path(shutil.copytree(runs.held.run_dir, tmp_path / "edited"))
    (edited / "config.json").write_text(json.dumps(redigest({**config, "task": "babi:1+2"})))
    assert seen(edited) == {"babi:1": True, "babi:2": False}


def test_an_export_written_before_heldout_tasks_loads_with_none_held_out(tiny_lm):
    from ilcp.evaluation.run import evaluate
    from ilcp.evaluation.session import heldout_tasks, trained_tasks
    from ilcp.export import read_config

    config = read_config(LEGACY)
    assert "heldout_tasks" not in config
    assert heldout_tasks(config, LEGACY) == [] and trained_tasks(config, LEGACY) == {"babi:1"}
    results = evaluate(LEGACY, methods=["no_context", "ilcp"], limit=2, latency_n=0, lengths=(), lm=tiny_lm,
                       log=lambda _: None, max_new_tokens=2, batch_size=4)
    assert {task: entry["seen_in_training"] for task, entry in results["tasks"].items()} == {"babi:1": True}


def test_eval_refuses_a_bad_heldout_entry_and_a_bad_mix_in_one_line(runs, tmp_path, capsys):
    config = json.loads((runs.held.run_dir / "config.json").read_text())
    quick = ["--limit", "1", "--latency-n", "0", "--lengths", "", "--no-progress", "--out", str(tmp_path / "out"),
             "--methods", "no_context"]
    for entry, words in ((["trivia"], ["config.json: heldout_tasks: unknown task 'trivia'"]),
                         ("babi:2", ["config.json: heldout_tasks must be a list of task names, got 'babi:2'"])):
        run = Path(shutil.copytree(runs.held.run_dir, tmp_path / "run"))
        (run / "config.json").write_text(json.dumps(redigest({**config, "heldout_tasks": entry})))
        before = listing(tmp_path)
        code, line = cli_error(cli.eval_main, ["--ckpt", str(run), *quick], capsys)
        assert code == 2 and all(word in line for word in words), line
        assert listing(tmp_path) == before
        shutil.rmtree(run)
    before = listing(tmp_path)
    code, line = cli_error(cli.eval_main, ["--ckpt", str(runs.held.run_dir), *quick, "--tasks", "mix:squad|trivia"],
                           capsys)
    assert code == 2 and "unknown task 'trivia'" in line, line
    assert listing(tmp_path) == before


@pytest.mark.parametrize("texts, message", [
    ("[task,babi:2]", "reconstruct.texts: 'babi:2' holds babi:2"),
    # babilong:2:0.5k is built from babi:2's stories: pretraining on it would leak the held-out task
    ("[task,babilong:1+2:0.5k]", "reconstruct.texts: 'babilong:1\\+2:0.5k' holds babi:2"),
], ids=["the held-out task", "a BABILong text of its stories"])
def test_pretraining_texts_may_not_read_a_held_out_task(texts, message, tmp_path, tiny_lm):
    from ilcp.training import train

    cfg = load_config(TINY_CONFIG, [f"out_dir={tmp_path}", "data.task=babi:1+2", "data.heldout_tasks=[babi:2]",
                                    "compressor.memory.kind=slots", "compressor.answer_head_weight=0",
                                    "reconstruct.steps=2", f"reconstruct.texts={texts}"])
    with pytest.raises(ValueError, match=message):
        train(cfg, lm=tiny_lm)
    assert not (tmp_path / "tiny" / "config.json").exists()


def test_results_json_records_the_held_out_tasks(runs, tiny_lm):
    from ilcp.evaluation.run import evaluate

    def run_entry(run_dir):
        return evaluate(run_dir, methods=["no_context"], limit=1, latency_n=0, lengths=(), lm=tiny_lm,
                        log=lambda _: None, max_new_tokens=2, batch_size=4)["run"]

    assert run_entry(runs.held.run_dir)["heldout_tasks"] == ["babi:2"]
    assert "heldout_tasks" not in run_entry(runs.every.run_dir)  # a run that held nothing out: as before
