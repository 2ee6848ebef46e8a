"""eval's ``split``: every task asks the questions of the split named (test by default, or the
validation rows each source holds out of training), results record which, and a bad split or a
split a task cannot give is a one-line error."""

import json

import pytest

from ilcp.eval_config import EvalConfig
from ilcp.evaluation import run as eval_run
from ilcp.evaluation.run import evaluate
from ilcp.tasks import EvalTaskContext, load_babi, load_task

FAST = {"max_new_tokens": 2, "batch_size": 4, "length_n": 1}


def _ids(rows) -> set[str]:
    return {r["id"] for r in rows}


def test_the_split_is_checked_and_test_stays_the_default():
    assert EvalConfig().split == "test"
    assert EvalConfig(split="validation").split == "validation"
    with pytest.raises(ValueError, match="split must be one of test, validation, got 'train'"):
        EvalConfig(split="train")


def test_squad_validation_rows_are_the_shipped_validation_file():
    spec = eval_run.parse_task("squad")
    val = spec.eval_rows(None, EvalTaskContext(split="validation"))
    test = spec.eval_rows(None, EvalTaskContext())
    assert val.available == len(val.rows) == 308 and test.available == 506
    assert "validation split" in val.source and "test split" in test.source
    assert not (_ids(val.rows) & _ids(test.rows))
    assert _ids(val.rows) == set(load_task("squad", "validation")["id"])


def test_babi_validation_rows_are_the_stories_the_run_held_out_of_its_training_file():
    spec = eval_run.parse_task("babi:1")
    settings = {"babi_variant": "en", "seed": 3}
    built = spec.eval_rows(30, EvalTaskContext(split="validation", task_settings=settings))
    held = load_babi(1, "validation", variant="en", seed=3).to_list()
    train = load_babi(1, "train", variant="en", seed=3)
    assert [r["id"] for r in built.rows] == [r["id"] for r in held[:30]]
    assert built.available == len(held) and "validation stories of qa1" in built.source
    assert not (_ids(built.rows) & set(train["id"]))
    # another seed holds out other stories: the run's own seed decides
    other = spec.eval_rows(30, EvalTaskContext(split="validation", task_settings={"babi_variant": "en", "seed": 4}))
    assert _ids(other.rows) != _ids(built.rows)
    assert all("-test-" in r["id"] for r in spec.eval_rows(5, EvalTaskContext()).rows)


def test_facts_validation_rows_differ_from_test_and_held_out_values_have_no_validation():
    spec = eval_run.parse_task("facts")
    settings = {"n_facts": 2, "n_distractors": 0, "seed": 0}
    val = spec.eval_rows(20, EvalTaskContext(split="validation", facts_settings=settings))
    test = spec.eval_rows(20, EvalTaskContext(facts_settings=settings))
    assert "facts validation split" in val.source and "facts test split" in test.source
    assert [r["context"] for r in val.rows] != [r["context"] for r in test.rows]
    heldout = eval_run.parse_task("facts-heldout")
    with pytest.raises(ValueError, match="only its test split holds"):
        heldout.eval_rows(5, EvalTaskContext(split="validation", facts_settings={**settings, "value_split": "train"}))


def test_a_validation_evaluation_records_its_split_and_asks_validation_rows(tiny_run, tiny_lm, tmp_path):
    out = tmp_path / "val"
    results = evaluate(tiny_run.run_dir, methods=["cold_read"], limit=3, latency_n=0, lengths=(), lm=tiny_lm,
                       split="validation", out=out, **FAST)
    assert results["settings"]["split"] == "validation"
    (task, entry), = results["tasks"].items()
    assert "validation" in entry["source"] and entry["n"] == 3
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert rows and all("-validation-" in r["id"] for r in rows)
    assert "Questions of the validation split of each task" in (out / "results.md").read_text()


def test_resume_does_not_reuse_the_other_splits_parts(tiny_run, tiny_lm, tmp_path):
    from ilcp.evaluation.resume import part_key

    keys = {}
    for split in ("test", "validation"):
        session = eval_run.open_session(tiny_run.run_dir, EvalConfig(methods=["cold_read"], split=split, lengths=[]),
                                        lm=tiny_lm)
        keys[split] = part_key(session, "babi:1", "cold_read")
    assert keys["test"] != keys["validation"] and "split" not in keys["test"]


def test_eval_cli_takes_the_split_and_refuses_another(tiny_run, tmp_path, capsys):
    from ilcp.cli import build_eval_parser as eval_parser
    from ilcp.cli import eval_config

    args = eval_parser().parse_args(["--ckpt", str(tiny_run.run_dir), "--split", "validation"])
    assert eval_config(args, tmp_path / "out").split == "validation"
    with pytest.raises(SystemExit):
        eval_parser().parse_args(["--ckpt", str(tiny_run.run_dir), "--split", "train"])
    assert "invalid choice: 'train'" in capsys.readouterr().err
