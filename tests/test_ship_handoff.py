"""scripts/ship_handoff.py: a trained run's whole export shipped with a card read from its eval, so
that `ILCPHandoff.from_pretrained(FOLDER)` answers with no training."""

import importlib.util
import json
from pathlib import Path

import pytest

from ilcp.export import read_export
from ilcp.handoff import ILCPHandoff

REPO = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name.replace(".py", ""), REPO / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ship_handoff = _script("scripts/ship_handoff.py")
eval_script = _script("eval.py")


@pytest.fixture(scope="module")
def evaluated(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    assert eval_script.main(["--ckpt", str(tiny_run.run_dir), "--tasks", "babi:1", "--limit", "4", "--latency-n", "0",
                             "--lengths", "", "--max-new-tokens", "2", "--methods", "cold_read_tuned,prompt_tuned,ilcp",
                             "--out", str(out), "--no-progress"]) == 0
    return tiny_run.run_dir, out / "results.json"


def test_a_shipped_handoff_is_the_checked_export_with_its_evaluation_and_answers(evaluated, tiny_lm, tmp_path):
    run, results = evaluated
    out = ship_handoff.ship(run, tmp_path / "handoff", results, command="python train.py --config configs/tiny.yaml")
    config = json.loads((run / "config.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == sorted(
        {"README.md", "config.json", "train_config.yaml", "metrics.json", *config["files"].values()})
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
    assert read_export(out).encoder is not None
    card = (out / "README.md").read_text()
    measured = json.loads(results.read_text())["tasks"]["babi:1"]["methods"]["ilcp"]["exact_match"]
    assert f"| babi:1 | {100 * measured:.1f}" in card and "python train.py --config configs/tiny.yaml" in card
    ilcp = json.loads((run / "metrics.json").read_text())["variants"]["ilcp"]
    assert f"the export holds ilcp at step {ilcp['best_step']} of {ilcp['steps']}" in card
    memory = ILCPHandoff.from_pretrained(out, lm=tiny_lm).open(
        ILCPHandoff.from_pretrained(out, lm=tiny_lm).send("Mary went to the garden.").to_bytes())
    assert isinstance(memory.ask("Where is Mary?", max_new_tokens=2), str)


def test_shipping_refuses_an_existing_folder_and_foreign_results_in_one_line(evaluated, tmp_path, capsys):
    run, results = evaluated
    (tmp_path / "taken").mkdir()
    args = [str(run), "--results", str(results)]
    assert ship_handoff.main([*args, "--out", str(tmp_path / "taken")]) == 2
    assert "exists: pass --overwrite" in capsys.readouterr().err
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({**json.loads(results.read_text()), "run": {"fingerprint": "0000"}}))
    assert ship_handoff.main([str(run), "--results", str(foreign), "--out", str(tmp_path / "new")]) == 2
    assert "is not an evaluation of" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_baselines_from_another_evaluation_of_the_same_questions_fill_the_card(evaluated, tmp_path, capsys):
    run, results = evaluated
    full = json.loads(results.read_text())
    ilcp_only = json.loads(json.dumps(full))
    for task in ilcp_only["tasks"].values():
        task["methods"] = {"ilcp": task["methods"]["ilcp"]}
    alone = tmp_path / "ilcp.json"
    alone.write_text(json.dumps(ilcp_only))
    out = ship_handoff.ship(run, tmp_path / "handoff", alone, baselines_file=results)
    card = (out / "README.md").read_text()
    text = full["tasks"]["babi:1"]["methods"]["cold_read_tuned"]["exact_match"]
    assert f"cold_read_tuned and prompt_tuned are from `{results}`, the same questions" in card
    assert f"| {100 * text:.1f} [" in card.split("| babi:1 |")[1].split("\n")[0]
    with_text = json.loads(json.dumps(full))  # a run that evaluated its own text baseline takes the other row only
    for task in with_text["tasks"].values():
        del task["methods"]["prompt_tuned"]
    own = tmp_path / "own.json"
    own.write_text(json.dumps(with_text))
    card = (ship_handoff.ship(run, tmp_path / "handoff2", own, baselines_file=results) / "README.md").read_text()
    assert f"; prompt_tuned is from `{results}`, the same questions" in card
    fewer = json.loads(results.read_text())
    fewer["tasks"]["babi:1"]["n"] = 3
    other = tmp_path / "other.json"
    other.write_text(json.dumps(fewer))
    assert ship_handoff.main([str(run), "--results", str(alone), "--baselines", str(other),
                              "--out", str(tmp_path / "new")]) == 2
    assert "did not ask babi:1's 4 questions (3 questions)" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_the_cards_means_leave_out_a_method_not_measured_and_name_the_tie_rule():
    results = {"run": {"heldout_tasks": ["babi:2"]}, "tasks": {
        "babi:1": {"methods": {"ilcp": {"exact_match": 0.5}, "cold_read_tuned": {"exact_match": 0.25}}},
        "babi:2": {"methods": {"ilcp": {"exact_match": 0.1}, "cold_read_tuned": {"exact_match": 0.2},
                               "prompt_tuned": {"exact_match": 0.0}}}}}
    line = ship_handoff.summary(results)
    assert "trained bAbI tasks (1), mean exact match: ilcp 50.0, cold_read_tuned 25.0, prompt_tuned -" in line
    assert "held-out tasks (1), mean exact match: ilcp 10.0, cold_read_tuned 20.0, prompt_tuned 0.0" in line
    curve = [{"step": 60, "val/exact_match": 0.25, "val/loss": 2.0}, {"step": 120, "val/exact_match": 0.25,
                                                                        "val/loss": 1.5}]
    earlier = {"variants": {"ilcp": {"best_step": 60, "steps": 120, "best_val_exact_match": 0.25, "curve": curve}}}
    assert "ties keep the earlier step" in ship_handoff._kept(earlier)
    selected = [{**r, "val/select": r["val/exact_match"] - r["val/loss"] / (1 + r["val/loss"]) / 64} for r in curve]
    now = {"variants": {"ilcp": {"best_step": 120, "steps": 120, "best_val_exact_match": 0.25, "curve": selected}}}
    assert "a tie goes to the lower validation loss" in ship_handoff._kept(now)
