"""eval.py and ilcp.evaluation on a tiny trained run: outputs, metrics, skipped methods, errors,
the method registry, and the bootstrap."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from ilcp.evaluation import run as eval_run
from ilcp.evaluation import session as eval_session
from ilcp.evaluation.methods import DEFAULT_METHODS, ColdRead, ILCPMethod
from ilcp.evaluation.registry import FAMILIES, EvalContext, HandoffMethod, Sent, make_method, register_method
from ilcp.stats import bootstrap_interval, latency_summary
from ilcp.evaluation.run import evaluate
from ilcp.export import ExportError, read_export
from ilcp.handoff import ILCPHandoff
from ilcp.tasks import make_facts
from ilcp.export_integrity import redigest

REPO = Path(__file__).resolve().parent.parent


def _load_eval_script():
    """eval.py, the entry point at the repository root, as a module (it is not in the package)."""
    spec = importlib.util.spec_from_file_location("eval_script", REPO / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


eval_script = _load_eval_script()

METRICS = ("n", "exact_match", "exact_match_ci", "contains", "contains_ci", "f1", "wire_bytes", "tensor_bytes",
           "prefill_positions", "latency")
LATENCY = ("sender_s", "receiver_ttft_s", "receiver_total_s", "handoff_s")
FAST = {"max_new_tokens": 2, "batch_size": 4, "length_n": 1}


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    return tiny_run.run_dir


@pytest.fixture(scope="module")
def main_out(run_dir, tmp_path_factory):
    """eval.py's main, in-process, on the tiny run with a held-out task."""
    out = tmp_path_factory.mktemp("eval-out")
    code = eval_script.main(["--ckpt", str(run_dir), "--tasks", "babi:2", "--limit", "5", "--latency-n", "2",
                             "--lengths", "16,160", "--length-n", "1", "--max-new-tokens", "2", "--batch-size", "4",
                             "--out", str(out), "--no-progress"])
    assert code == 0
    return out


def test_eval_writes_results_markdown_and_plots(main_out, capsys):
    for name in ("results.json", "results.md", "predictions.jsonl", "accuracy_vs_payload_bytes.png",
                 "ttft_vs_context_length.png"):
        assert (main_out / name).is_file(), name
    for png in main_out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((main_out / "results.json").read_text())
    assert set(results["tasks"]) == {"babi:1", "babi:2"}
    assert results["tasks"]["babi:1"]["seen_in_training"] is True
    assert results["tasks"]["babi:2"]["seen_in_training"] is False
    assert results["settings"]["limit"] == 5
    markdown = (main_out / "results.md").read_text()
    assert "## babi:2 (held out" in markdown and "limit 5" in markdown
    lines = (main_out / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 5 * len(DEFAULT_METHODS)
    assert {"task", "method", "id", "question", "answer", "prediction"} <= set(json.loads(lines[0]))


def test_every_method_row_holds_every_metric(main_out):
    results = json.loads((main_out / "results.json").read_text())
    assert results["skipped"] == {}
    for task, t in results["tasks"].items():
        assert t["n"] == 5 and t["available"] == 1000
        assert set(t["methods"]) == set(DEFAULT_METHODS)  # results.json sorts keys
        for name, m in t["methods"].items():
            assert set(METRICS) <= set(m), (task, name)
            for key in ("exact_match", "contains", "f1"):
                assert 0.0 <= m[key] <= 1.0
            for key in ("exact_match", "contains"):
                low, high = m[f"{key}_ci"]
                assert low <= m[key] <= high, (task, name, key)
            assert m["prefill_positions"] > 0
            assert m["latency"]["n"] == 2
            for key in LATENCY:
                s = m["latency"][key]
                assert s["n"] == 2 and 0.0 <= s["p50"] <= s["p99"], (task, name, key)
    methods = results["tasks"]["babi:1"]["methods"]
    assert methods["no_context"]["wire_bytes"] == methods["prompt_tuned"]["wire_bytes"] == 0
    assert methods["cold_read"]["wire_bytes"] == methods["cold_read_tuned"]["wire_bytes"] > 0
    assert methods["ilcp"]["tensor_bytes"] == 4 * results["run"]["latent_dim"]
    assert methods["ilcp"]["wire_bytes"] > methods["ilcp"]["tensor_bytes"]
    assert methods["cold_read"]["prefill_positions"] > methods["no_context"]["prefill_positions"]
    sweep = results["context_length"]
    assert {r["method"] for r in sweep["rows"]} == {"no_context", "cold_read", "ilcp"}
    tokens = {r["target_tokens"]: r["context_tokens"] for r in sweep["rows"]}
    assert tokens[160] > tokens[16]
    assert results["facts_count"] is None  # the run was trained on bAbI


def test_missing_weights_are_skipped_with_a_note(run_dir, tiny_lm, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(run_dir, partial, ignore=shutil.ignore_patterns("stages", "logs", "cache"))
    config = json.loads((partial / "config.json").read_text())
    del config["files"]["ilcp"], config["files"]["cold_read_tuned"]
    (partial / "config.json").write_text(json.dumps(redigest(config)))
    notes = []
    results = evaluate(partial, limit=2, latency_n=0, lengths=(), lm=tiny_lm, log=notes.append, **FAST)
    assert set(results["skipped"]) == {"ilcp", "cold_read_tuned"}
    assert any("skipping ilcp" in n for n in notes)
    assert list(results["tasks"]["babi:1"]["methods"]) == ["no_context", "prompt_tuned", "cold_read"]
    assert results["context_length"] is None


def test_facts_run_reports_accuracy_against_the_number_of_facts(run_dir, tiny_lm, tmp_path):
    facts_run = tmp_path / "facts"
    shutil.copytree(run_dir, facts_run, ignore=shutil.ignore_patterns("stages", "logs", "cache"))
    config = json.loads((facts_run / "config.json").read_text())
    config["task"] = "facts"  # the modules do not depend on the task; the report does
    (facts_run / "config.json").write_text(json.dumps(redigest(config)))
    results = evaluate(facts_run, limit=2, latency_n=1, lengths=(), facts_counts=(1, 2), facts_count_limit=2,
                       out=tmp_path / "out", lm=tiny_lm, **FAST)
    assert list(results["tasks"]) == ["facts"]
    rows = results["facts_count"]["rows"]
    assert {(r["method"], r["n_facts"]) for r in rows} == {
        (m, n) for m in ("ilcp", "prompt_tuned", "cold_read_tuned") for n in (1, 2)}
    assert all(r["n"] == 2 for r in rows)
    assert (tmp_path / "out" / "accuracy_vs_num_facts.png").is_file()


class Head(HandoffMethod):
    """A registered family for the test: the first N words of the context, as text."""

    def __init__(self, name: str):
        super().__init__(name)
        self.words = int(name.split(":")[1])
        self.text = ColdRead("cold_read")

    def bind(self, ctx):
        super().bind(ctx)
        self.text.bind(ctx)

    def send(self, row):
        data = " ".join(row["context"].split()[: self.words]).encode()
        return Sent(handed_over=data, wire_bytes=len(data))

    def receive(self, sent, row):
        return self.text.receive(sent, row)


def test_a_registered_method_family_runs_in_the_same_loop(run_dir, tiny_lm, monkeypatch):
    monkeypatch.setitem(FAMILIES, "head", None)  # restored after the test
    register_method("head", Head, family=True, replace=True)
    assert make_method("head:3").words == 3
    results = evaluate(run_dir, methods=["no_context", "head:3"], limit=3, latency_n=1, lengths=(), lm=tiny_lm, **FAST)
    head = results["tasks"]["babi:1"]["methods"]["head:3"]
    assert 0 < head["wire_bytes"] < 40 and head["latency"]["n"] == 1


def test_bad_arguments_are_clear_errors(run_dir, tmp_path, monkeypatch, capsys):
    def no_lm(*args, **kwargs):
        raise AssertionError("bad arguments must be refused before the LM loads")

    monkeypatch.setattr(eval_session, "load_export_lm", no_lm)
    with pytest.raises(ExportError, match="not a directory"):
        evaluate(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown method 'telepathy'"):
        evaluate(run_dir, methods=["ilcp", "telepathy"])
    with pytest.raises(ValueError, match="unknown task 'trivia'"):
        evaluate(run_dir, tasks=["trivia"])
    with pytest.raises(ValueError, match="babi:4"):  # no such file in the vendored bAbI tasks
        evaluate(run_dir, tasks=["babi:4"])
    with pytest.raises(ValueError, match="limit"):
        evaluate(run_dir, limit=-3)

    cases = [
        (["--ckpt", str(tmp_path / "missing")], "is not a directory"),
        (["--ckpt", str(run_dir), "--methods", "telepathy"], "unknown method 'telepathy'"),
        (["--ckpt", str(run_dir), "--tasks", "babi:99"], "babi:99"),
        (["--ckpt", str(run_dir), "--lengths", "a,b"], "comma-separated integers"),
        (["--ckpt", str(tmp_path)], "no config.json"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            eval_script.main(argv + ["--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, argv


def test_bootstrap_interval_is_seeded_and_contains_the_mean():
    values = [1.0] * 30 + [0.0] * 70
    low, high = bootstrap_interval(values, resamples=1000, seed=0)
    assert low < 0.3 < high and 0.1 < high - low < 0.25  # about +-9 pp at n = 100
    assert bootstrap_interval(values, resamples=1000, seed=0) == (low, high)
    assert bootstrap_interval([], resamples=10) is None
    assert bootstrap_interval([1.0, 1.0]) == (1.0, 1.0)
    summary = latency_summary([0.1, 0.2, 0.3, 10.0])
    assert summary["n"] == 4 and summary["p50"] == pytest.approx(0.25) and summary["p99"] > 9.0


def test_ilcp_method_sends_the_handoff_payload_and_counts_its_bytes(run_dir, tiny_lm):
    run = read_export(run_dir)
    handoff = ILCPHandoff.from_export(run, tiny_lm)
    method = make_method("ilcp")
    assert isinstance(method, ILCPMethod)
    method.bind(EvalContext(lm=tiny_lm, run=run, handoff=handoff))
    row = {"context": "Mary went to the kitchen. John moved to the garden.", "question": "Where is Mary?"}
    sent = method.send(row)
    assert isinstance(sent.handed_over, bytes)
    assert sent.wire_bytes == len(sent.handed_over) == handoff.wire_bytes
    assert sent.tensor_bytes == handoff.tensor_bytes == 4 * run.config["latent_dim"]
    built = method.build_prefixes([row])
    assert (built.wire_bytes, built.tensor_bytes) == ([sent.wire_bytes], [sent.tensor_bytes])


def test_facts_settings_come_from_config_json(run_dir, tiny_lm, tmp_path, monkeypatch):
    facts_run = tmp_path / "facts"
    shutil.copytree(run_dir, facts_run, ignore=shutil.ignore_patterns("stages", "logs", "cache"))
    (facts_run / "train_config.yaml").unlink()  # eval reads config.json, not the training YAML
    config = json.loads((facts_run / "config.json").read_text())
    config["task"] = "facts"
    config["task_settings"].update(facts_n_facts=2, facts_n_distractors=1, seed=3)
    (facts_run / "config.json").write_text(json.dumps(redigest(config)))
    out = tmp_path / "out"
    results = evaluate(facts_run, methods=["cold_read"], limit=3, latency_n=0, lengths=(), facts_counts=(),
                       out=out, lm=tiny_lm, **FAST)
    assert results["tasks"]["facts"]["source"] == "facts test split (2 facts, 1 distractors, seed 3)"
    expected = make_facts(3, n_facts=2, n_distractors=1, seed=3, split="test").to_list()
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [p["id"] for p in predictions] == [r["id"] for r in expected]
    assert [p["question"] for p in predictions] == [r["question"] for r in expected]

    def no_lm(*args, **kwargs):
        raise AssertionError("a run without task settings must be refused before the LM loads")

    monkeypatch.setattr(eval_session, "load_export_lm", no_lm)
    del config["task_settings"]["facts_n_distractors"]
    (facts_run / "config.json").write_text(json.dumps(redigest(config)))
    with pytest.raises(ExportError, match="task_settings lacks facts_n_distractors"):
        evaluate(facts_run, methods=["cold_read"])
    del config["task_settings"]
    (facts_run / "config.json").write_text(json.dumps(redigest(config)))
    with pytest.raises(ExportError, match="records no task_settings"):
        evaluate(facts_run, methods=["cold_read"])
    config["task"] = "babi:1"  # a bAbI run needs no facts settings unless facts is asked for
    (facts_run / "config.json").write_text(json.dumps(redigest(config)))
    with pytest.raises(ExportError, match="records no task_settings"):
        evaluate(facts_run, methods=["cold_read"], tasks=["facts"])
    monkeypatch.undo()
    results = evaluate(facts_run, methods=["cold_read"], limit=2, latency_n=0, lengths=(), lm=tiny_lm, **FAST)
    assert list(results["tasks"]) == ["babi:1"]


def test_facts_heldout_task_asks_only_values_training_never_used():
    from ilcp.tasks import FACT_VOCABULARIES, fact_values

    from ilcp.tasks import EvalTaskContext

    spec = eval_run.parse_task("facts-heldout")
    assert spec.needs_facts_settings and spec.value_split == "heldout" and not spec.trainable
    settings = {"n_facts": 2, "n_distractors": 0, "seed": 0, "value_split": "train"}
    built = spec.eval_rows(40, EvalTaskContext(facts_settings=settings))
    rows, desc = built.rows, built.source
    heldout = {v for vocab in FACT_VOCABULARIES for v in fact_values(vocab, "heldout")}
    train_answers = {r["answer"] for r in make_facts(400, split="train", n_facts=2, value_split="train").to_list()}
    assert "held-out values" in desc and len(rows) == 40
    assert {r["answer"] for r in rows} <= heldout and not ({r["answer"] for r in rows} & train_answers)


def test_facts_value_split_flows_from_the_config_to_the_export_and_eval(tmp_path):
    from ilcp.config import load_config
    from ilcp.training.data import task_kwargs

    cfg = load_config(None, ["data.task=facts", "data.facts_value_split=train"])
    assert task_kwargs(cfg, "train", 10)["value_split"] == "train"
    assert "value_split" not in task_kwargs(load_config(None, ["data.task=facts"]), "train", 10)
    with pytest.raises(ValueError, match="facts_value_split"):
        load_config(None, ["data.facts_value_split=heldout"])
    config = {"task_settings": {"facts_n_facts": 1, "facts_n_distractors": 0, "seed": 0, "facts_value_split": "train"}}
    assert eval_run.run_facts_settings(config, tmp_path)["value_split"] == "train"


def test_a_run_trained_on_a_babi_mix_is_evaluated_on_each_of_its_tasks():
    specs = eval_session.resolve_tasks("babi:1+2", ["babi:6", "babi:2"])
    assert [s.name for s in specs] == ["babi:1", "babi:2", "babi:6"]
    assert [s.name for s in eval_session.training_tasks("babi:2+1")] == ["babi:1", "babi:2"]


def test_wilson_interval_does_not_collapse_at_zero_or_all_hits():
    from ilcp.stats import wilson_interval

    low, high = wilson_interval([0.0] * 200)
    assert low == 0.0 and 0.015 < high < 0.025
    low, high = wilson_interval([1.0] * 50)
    assert high == 1.0 and 0.9 < low < 0.95
    low, high = wilson_interval([1.0] * 30 + [0.0] * 70)
    assert low < 0.3 < high and abs((high - low) - 0.18) < 0.02
    assert wilson_interval([]) is None
    with pytest.raises(ValueError):
        wilson_interval([0.5])


def test_eval_refuses_a_file_as_out_and_a_bad_device_before_evaluating(run_dir, tmp_path, capsys):
    target = tmp_path / "results.txt"
    target.write_text("x")
    for args in (["--out", str(target)], ["--device", "banana"]):
        with pytest.raises(SystemExit) as info:
            eval_script.main(["--ckpt", str(run_dir), *args])
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "is a file" in err and "not a device" in err
