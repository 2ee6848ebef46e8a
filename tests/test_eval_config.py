"""EvalConfig: its defaults, its checks (one-line ValueErrors before anything loads), its light
imports, and evaluate() taking it or the same fields as keywords, run part by part."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ilcp import names
from ilcp.eval_config import DEFAULT_VLLM_KV_CACHE_BYTES, EvalConfig

REPO = Path(__file__).resolve().parent.parent
FAST = {"methods": ["no_context", "ilcp"], "limit": 4, "latency_n": 1, "max_new_tokens": 2, "batch_size": 4,
        "lengths": [], "facts_counts": []}


def test_defaults_are_the_command_line_defaults_and_every_field_has_help():
    from ilcp.engines.build import DEFAULT_KV_CACHE_BYTES

    cfg = EvalConfig()
    assert (cfg.limit, cfg.latency_n, cfg.throughput_n) == (names.DEFAULT_LIMIT, names.DEFAULT_LATENCY_N,
                                                           names.DEFAULT_THROUGHPUT_N)
    assert cfg.methods == list(names.DEFAULT_METHODS) and cfg.tasks == [] and cfg.throughput_batches == []
    assert cfg.lengths == list(names.DEFAULT_LENGTHS) and cfg.facts_counts == list(names.DEFAULT_FACTS_COUNTS)
    assert (cfg.engine, cfg.payload_dtype, cfg.precision, cfg.out) == ("hf", "float32", None, None)
    assert DEFAULT_VLLM_KV_CACHE_BYTES == DEFAULT_KV_CACHE_BYTES == cfg.vllm_kv_cache_bytes
    assert all(text.strip() for text in EvalConfig.help().values())
    assert set(EvalConfig.help()) == {f.name for f in dataclasses.fields(EvalConfig)}
    cfg.lengths.append(1)  # lists are per instance
    assert EvalConfig().lengths == list(names.DEFAULT_LENGTHS)


def test_names_and_numbers_are_normalised():
    cfg = EvalConfig(tasks="babi:2, facts", methods="ilcp,cold_read", limit=0, lengths=(16, 32))
    assert cfg.tasks == ["babi:2", "facts"] and cfg.methods == ["ilcp", "cold_read"]
    assert cfg.limit is None and cfg.lengths == [16, 32]
    assert EvalConfig(limit=None).limit is None


@pytest.mark.parametrize("settings, message", [
    ({"limit": -3}, "limit must be an int >= 1, got -3"),
    ({"limit": 2.5}, "limit must be an int >= 1, got 2.5"),
    ({"latency_n": -1}, "latency_n must be an int >= 0, got -1"),
    ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
    ({"max_new_tokens": True}, "max_new_tokens must be an int >= 1, got True"),
    ({"length_n": 0}, "length_n must be an int >= 1"),
    ({"facts_count_limit": 0}, "facts_count_limit must be an int >= 1"),
    ({"seed": -1}, "seed must be an int >= 0"),
    ({"throughput_n": 0}, "throughput_n must be an int >= 1"),
    ({"vllm_kv_cache_bytes": 0}, "vllm_kv_cache_bytes must be an int >= 1"),
    ({"throughput_batches": [1, 0]}, "throughput_batches must be an int >= 1, got 0"),
    ({"lengths": [64, -1]}, "lengths must be an int >= 1, got -1"),
    ({"lengths": "64"}, "lengths must be a list of ints"),
    ({"facts_counts": [0]}, "facts_counts must be an int >= 1, got 0"),
    ({"engine": "trt"}, "engine must be one of hf, vllm, got 'trt'"),
    ({"precision": "half"}, "precision must be one of 32-true, bf16-mixed, auto, got 'half'"),
    ({"payload_dtype": "int4"}, "payload_dtype must be one of float32, float16, bfloat16, int8, got 'int4'"),
    ({"methods": []}, "no methods given"),
    ({"methods": " , "}, "no methods given"),
    ({"methods": ["ilcp", 3]}, "tasks and methods must be names"),
    ({"tasks": 3}, "tasks must be a list of names"),
    ({"progress": "yes"}, "progress must be True or False"),
])
def test_bad_settings_are_one_line_value_errors(settings, message):
    with pytest.raises(ValueError) as info:
        EvalConfig(**settings)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_config_imports_no_heavy_package():
    probe = ("import sys; from ilcp.eval_config import EvalConfig; EvalConfig(limit=3); "
             "print([m for m in ('torch', 'lightning', 'transformers', 'datasets') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_command_line_refuses_a_bad_number_before_loading(tmp_path, capsys):
    from ilcp import cli

    with pytest.raises(SystemExit) as info:
        cli.eval_main(["--ckpt", str(tmp_path), "--batch-size", "0"])
    assert info.value.code == 2
    assert "ilcp-eval: error: batch_size must be an int >= 1, got 0" in capsys.readouterr().err
    args = cli.build_eval_parser().parse_args(["--ckpt", str(tmp_path), "--lengths", "", "--limit", "0",
                                               "--vllm-kv-cache-mb", "2", "--no-progress"])
    cfg = cli.eval_config(args, tmp_path / "out")
    assert (cfg.lengths, cfg.limit, cfg.vllm_kv_cache_bytes, cfg.progress, cfg.out) == (
        [], None, 2 << 20, False, tmp_path / "out")


def _same(a: dict, b: dict) -> bool:
    """Results equal but for timings."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("seconds", "decode_s") and not k.endswith("_s")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip(a) == strip(b)


def test_evaluate_takes_a_config_or_its_fields_and_runs_part_by_part(tiny_run, tiny_lm, tmp_path):
    from ilcp.evaluation import run as eval_run
    from ilcp.evaluation import side_sweeps

    run_dir = tiny_run.run_dir
    cfg = EvalConfig(**FAST, out=tmp_path / "a")
    lines: list[str] = []
    from_config = eval_run.evaluate(run_dir, cfg, lm=tiny_lm, log=lines.append)
    from_keywords = eval_run.evaluate(run_dir, lm=tiny_lm, **FAST)
    assert _same({k: v for k, v in from_config.items() if k != "plots"}, from_keywords)
    assert from_config["settings"]["methods"] == ["no_context", "ilcp"] and from_config["settings"]["limit"] == 4
    written = json.loads((tmp_path / "a" / "results.json").read_text())
    assert written["tasks"]["babi:1"]["n"] == 4
    assert any(line.startswith("task babi:1 (seen in training): 4 of 1000 test questions") for line in lines)
    # keywords given with a config replace its fields
    one = eval_run.evaluate(run_dir, cfg, lm=tiny_lm, methods=["no_context"], out=None)
    assert list(one["tasks"]["babi:1"]["methods"]) == ["no_context"] and cfg.methods == ["no_context", "ilcp"]
    with pytest.raises(TypeError):
        eval_run.evaluate(run_dir, lm=tiny_lm, limt=3)

    # the parts, one at a time, give what evaluate() reports
    session = eval_run.open_session(run_dir, dataclasses.replace(cfg, lengths=[16], out=None), lm=tiny_lm)
    assert [m.name for m in session.methods] == ["no_context", "ilcp"] and session.skipped == {}
    task, (rows, by_method, by_method_vllm) = eval_run.evaluate_task(session, session.tasks[0])
    assert _same(task, from_config["tasks"]["babi:1"]) and len(rows) == 4 and by_method_vllm == {}
    assert set(by_method) == {"no_context", "ilcp"}
    assert side_sweeps.engine_agreement(session, {"babi:1": task}) is None  # engine="hf"
    assert side_sweeps.throughput_table(session) is None  # no batches asked
    assert side_sweeps.facts_count_sweep(session) is None  # a bAbI-trained run
    lengths = side_sweeps.context_length_sweep(session)
    assert lengths["targets"] == [16] and [r["method"] for r in lengths["rows"]] == ["no_context", "ilcp"]
    assert lengths["ilcp_pooled_max_length"] == session.handoff.max_length


def test_a_resumed_evaluation_reuses_saved_results_and_recomputes_changed_ones(tiny_run, tiny_lm, tmp_path,
                                                                              monkeypatch):
    from ilcp.evaluation import run as eval_run
    from ilcp.evaluation.run import evaluate

    out = tmp_path / "eval"
    settings = dict(methods=["no_context", "ilcp"], limit=4, latency_n=0, lengths=[], lm=tiny_lm, out=out)
    first = evaluate(tiny_run.run_dir, **settings)
    assert (out / "parts" / "babi_1" / "ilcp.json").is_file()
    computed = []
    real = eval_run.accuracy

    def counting(method, rows, **kwargs):
        computed.append(method.name)
        return real(method, rows, **kwargs)

    monkeypatch.setattr(eval_run, "accuracy", counting)
    again = evaluate(tiny_run.run_dir, resume=True, **settings)
    assert computed == []
    for name in ("no_context", "ilcp"):
        assert again["tasks"]["babi:1"]["methods"][name]["exact_match"] == \
            first["tasks"]["babi:1"]["methods"][name]["exact_match"]
    evaluate(tiny_run.run_dir, resume=True, **{**settings, "methods": ["no_context", "prompt_tuned"]})
    assert computed == ["prompt_tuned"]  # only what was missing
    evaluate(tiny_run.run_dir, resume=True, **{**settings, "max_new_tokens": 3})
    assert computed == ["prompt_tuned", "no_context", "ilcp"]  # other settings: computed again
    with pytest.raises(ValueError, match="resume reads the results saved under out"):
        EvalConfig(resume=True)
