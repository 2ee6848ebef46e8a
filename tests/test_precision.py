"""Compute precision as one setting: config, training, state extraction, export, ILCPHandoff and
eval; ``auto`` picks bfloat16 only where the hardware has it; weights stay float32; every run
records its precision and its per-stage wall times."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ilcp import precision as prec
from ilcp.config import load_config
from ilcp.evaluation.run import evaluate
from ilcp.handoff import ILCPHandoff
from ilcp.training import train

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
AMX_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile amx_bf16\n"
PLAIN_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"


def test_cpu_flags_are_read_from_cpuinfo():
    assert {"avx512_bf16", "amx_bf16"} <= prec.cpu_flags(AMX_CPUINFO)
    assert "avx512_bf16" not in prec.cpu_flags(PLAIN_CPUINFO)
    assert prec.cpu_flags("") == set()


@pytest.mark.parametrize("cpuinfo, expected", [(AMX_CPUINFO, "bf16-mixed"), (PLAIN_CPUINFO, "32-true")])
def test_auto_is_bf16_only_where_the_cpu_computes_it_natively(monkeypatch, cpuinfo, expected):
    prec.cpu_has_native_bf16.cache_clear()
    real = prec.cpu_flags
    monkeypatch.setattr(prec, "cpu_flags", lambda text=None: real(cpuinfo))
    try:
        assert prec.resolve("auto", "cpu") == expected
        assert prec.resolve("32-true", "cpu") == "32-true" and prec.resolve("bf16-mixed", "cpu") == "bf16-mixed"
        with prec.autocast("auto", "cpu"):
            assert torch.is_autocast_enabled("cpu") == (expected == "bf16-mixed")
        assert not torch.is_autocast_enabled("cpu")
    finally:
        prec.cpu_has_native_bf16.cache_clear()


def test_bad_precisions_are_refused_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match="trainer.precision must be one of 32-true, bf16-mixed, auto"):
        load_config(TINY, ["trainer.precision=bf16"])
    with pytest.raises(ValueError, match="precision must be one of"):
        prec.resolve("fp8")
    assert load_config(TINY, ["trainer.precision=auto"]).trainer.precision == "auto"
    with pytest.raises(ValueError, match="precision must be one of"):
        evaluate(tmp_path, precision="half")


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, tiny_lm):
    out = tmp_path_factory.mktemp("bf16-run")
    cfg = load_config(TINY, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", "trainer.precision=bf16-mixed"])
    return train(cfg, lm=tiny_lm)


def test_a_bf16_run_trains_and_exports_float32_weights_and_records_its_precision(bf16_run, tiny_run):
    run_dir = bf16_run.run_dir
    for name in json.loads((run_dir / "config.json").read_text())["files"].values():
        assert {t.dtype for t in load_file(str(run_dir / name)).values()} == {torch.float32}, name
    config = json.loads((run_dir / "config.json").read_text())
    assert config["lm"]["precision"] == "bf16-mixed"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["precision"] == "bf16-mixed"
    # its states were extracted at its precision, not read from a float32 cache
    assert json.loads((tiny_run.run_dir / "config.json").read_text())["lm"]["precision"] == "32-true"


def test_every_run_records_each_stage_s_wall_time(tiny_run):
    metrics = json.loads((tiny_run.run_dir / "metrics.json").read_text())
    stages = metrics["stage_seconds"]
    assert set(stages) == {"lm", "data", "compressor", "ilcp", "prompt_tuned", "cold_read_tuned", "export"}
    assert all(isinstance(v, float) and v >= 0 for v in stages.values())
    assert metrics["total_seconds"] >= sum(stages.values()) - 0.5


def test_the_handoff_and_eval_use_the_run_s_precision_unless_told(bf16_run, tiny_lm, tmp_path):
    handoff = ILCPHandoff.from_pretrained(bf16_run.run_dir, lm=tiny_lm)
    assert handoff.precision == "bf16-mixed"
    payload = handoff.send("John went to the garden.")
    assert payload.dtype == "float32" and isinstance(handoff.receive(payload, "Where is John?"), str)
    plain = ILCPHandoff.from_pretrained(bf16_run.run_dir, lm=tiny_lm, precision="32-true")
    assert plain.precision == "32-true"
    res = evaluate(bf16_run.run_dir, methods=["no_context", "ilcp"], limit=4, latency_n=0, lengths=[], lm=tiny_lm,
                   out=tmp_path / "eval")
    assert res["settings"]["precision"] == "bf16-mixed"
    assert "Compute precision bf16-mixed" in (tmp_path / "eval" / "results.md").read_text()
    res32 = evaluate(bf16_run.run_dir, methods=["no_context"], limit=4, latency_n=0, lengths=[], lm=tiny_lm,
                     precision="32-true")
    assert res32["settings"]["precision"] == "32-true"
