"""eval --engine: without vLLM, --engine vllm is one clear line (exit 2) naming .venv-vllm; the HF
engine's receiver-throughput section. (eval --engine vllm itself runs in tests/vllm.)"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ilcp.cli import eval_main
from ilcp.evaluation.decoders import require_engine
from ilcp.evaluation.run import evaluate

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)


def test_engine_vllm_without_vllm_is_one_line_naming_the_vllm_environment(no_vllm, tiny_run, tmp_path, capsys):
    code = eval_main(["--ckpt", str(tiny_run.run_dir), "--engine", "vllm", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: --engine vllm needs vLLM") and err.count("\n") == 1
    assert ".venv-vllm/bin/python" in err and "scripts/install.sh" in err
    assert not (tmp_path / "out").exists(), "nothing runs before the engine is checked"


def test_evaluate_with_engine_vllm_without_vllm_raises_import_error(no_vllm, tiny_run):
    with pytest.raises(ImportError, match=r"\.venv-vllm/bin/python"):
        evaluate(tiny_run.run_dir, engine="vllm", limit=2, latency_n=0, lengths=())
    with pytest.raises(ValueError, match="engine must be one of hf, vllm"):
        require_engine("tgi")


_SPEC = importlib.util.find_spec("vllm")


@pytest.mark.skipif(_SPEC is not None and _SPEC.origin is not None, reason="this environment has vLLM")
def test_eval_script_engine_vllm_in_this_environment_is_not_a_traceback(tmp_path):
    run = subprocess.run([sys.executable, "eval.py", "--ckpt", str(tmp_path), "--engine", "vllm"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and ".venv-vllm/bin/python" in lines[0], run.stderr


def test_hf_throughput_section(tiny_run, tiny_lm, tmp_path):
    out = tmp_path / "out"
    res = evaluate(tiny_run.run_dir, lm=tiny_lm, methods=["no_context", "cold_read", "ilcp"], limit=4,
                   latency_n=0, lengths=(), max_new_tokens=2, throughput_batches=(1, 4), throughput_n=4, out=out)
    assert res["settings"]["engine"] == "hf" and res["vllm"] is None
    assert all("vllm" not in m for m in res["tasks"]["babi:1"]["methods"].values())
    tp = res["throughput"]
    assert {(r["method"], r["batch"]) for r in tp["rows"]} == {(m, b) for m in ("ilcp", "cold_read") for b in (1, 4)}
    assert all(r["hf_qps"] > 0 and r["n"] == 4 and "vllm_qps" not in r for r in tp["rows"])
    md = (out / "results.md").read_text()
    assert "## Receiver throughput (questions per second)" in md and "HF against vLLM" not in md
    assert json.loads((out / "results.json").read_text())["throughput"]["questions"] == 4
