"""benchmarks/vllm_prefix_cache.py runs at tiny size: both modes' engines answer every question with
the same first token, and the figures are written."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_prefix_cache_benchmark_runs_both_modes_and_agrees(tiny_vllm_run, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("vllm_prefix_cache", ROOT / "benchmarks" / "vllm_prefix_cache.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cache.json"
    assert bench.main(["--ckpt", str(tiny_vllm_run), "--questions", "3", "--rounds", "1", "--max-model-len", "1024",
                       "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "questions 2..3: caching off" in printed and "the same first token in 3 of 3 requests" in printed
    report = json.loads(out.read_text())
    assert report["same_first_tokens"] == 3 and set(report["modes"]) == {"off", "on"}
    assert len(report["modes"]["on"]["ttft_s"]) == 3 and report["shared_positions"] > 0
