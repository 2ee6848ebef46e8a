"""eval --engine vllm on the tiny run: every method's prefixes decoded by HF and through vLLM,
agreement and both engines' accuracy in the report, the throughput section, and methods vLLM
cannot take reported as unavailable."""

import json
import os
import tempfile
import zlib

import pytest
import torch

from ilcp.cli import eval_main
from ilcp.engines.vllm import VLLMDecoder
from ilcp.evaluation import decoders
from ilcp.evaluation import session as eval_session
from ilcp.evaluation.methods import NoContext
from ilcp.evaluation.registry import register_method
from ilcp.evaluation.run import evaluate
from ilcp.receiver.decoding import assemble_prefix
from ilcp.receiver.prompts import question_prompt

FAST = {"latency_n": 0, "lengths": (), "max_new_tokens": 4, "batch_size": 4}
METHODS = ["default", "rclc:cacheback:r4", "eval_vllm_noisy", "eval_vllm_too_long", "eval_vllm_refused"]


class Noisy(NoContext):
    """The question prompt, then one seeded random row: the random tiny LM then answers different
    tokens per question (a prompt alone gives it newlines), so agreement is tested on real answers."""

    def receive(self, sent, row):
        g = torch.Generator().manual_seed(zlib.crc32(row["id"].encode()))
        lm = self.lm
        scale = float(lm.model.get_input_embeddings().weight.norm(dim=-1).mean()) / lm.hidden_size ** 0.5
        return assemble_prefix(lm.model, lm.tokenizer, [question_prompt(lm.tokenizer, row["question"]),
                                                        torch.randn(1, lm.hidden_size, generator=g) * scale])


class TooLong(NoContext):
    """A prefix longer than the engine's context."""

    def receive(self, sent, row):
        return torch.zeros(2000, self.lm.hidden_size)


class Refused(NoContext):
    vllm_unavailable = "this method's receiver is HF-only (test)"


for _name, _cls in (("eval_vllm_noisy", Noisy), ("eval_vllm_too_long", TooLong), ("eval_vllm_refused", Refused)):
    register_method(_name, lambda name, cls=_cls: cls(name), replace=True)


@pytest.fixture(scope="module")
def results(tiny_vllm_run, tiny_vllm_lm, tiny_engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-vllm")
    decoder = VLLMDecoder(tiny_vllm_lm, tiny_engine)
    res = evaluate(tiny_vllm_run, methods=METHODS, limit=24, lm=tiny_vllm_lm, engine="vllm", vllm=decoder,
                   throughput_batches=(1, 8), throughput_n=8, out=out, **FAST)
    return res, out


def test_every_method_decodes_through_vllm_and_agrees_with_hf(results):
    res, out = results
    assert res["settings"]["engine"] == "vllm" and res["vllm"]["vllm_version"]
    methods = res["tasks"]["babi:1"]["methods"]
    ran = [name for name, m in methods.items() if "exact_match" in m["vllm"]]
    assert set(ran) >= {"no_context", "prompt_tuned", "cold_read", "cold_read_tuned", "ilcp", "rclc:cacheback:r4",
                        "eval_vllm_noisy"}
    for name in ran:
        v = methods[name]["vllm"]
        assert v["n"] == 24 and v["agreement"] >= 0.98, (name, v)
        assert v["agreement"] == (v["n"] - v["disagree"]) / v["n"]
        assert 0.0 <= v["exact_match"] <= 1.0 and v["exact_match_ci"] is not None
    assert res["agreement"]["agreement"] >= 0.98 and res["agreement"]["questions"] == 24 * len(ran)
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    noisy = [line for line in lines if line["method"] == "eval_vllm_noisy"]
    assert len(noisy) == 24 and all(line["prediction_vllm"] == line["prediction"] for line in noisy)
    assert len({line["prediction"] for line in noisy}) > 1, "the noisy prefixes should reach different answers"
    assert all("prediction_vllm" not in line for line in lines if line["method"] == "eval_vllm_too_long")


def test_prefixes_vllm_cannot_take_are_unavailable_not_a_crash(results):
    res, out = results
    methods = res["tasks"]["babi:1"]["methods"]
    too_long = methods["eval_vllm_too_long"]
    assert too_long["vllm"]["unavailable"].startswith("unavailable on vllm: ")
    assert "max_model_len" in too_long["vllm"]["unavailable"]
    assert too_long["exact_match"] is not None, "the HF decoder still answers it"
    assert methods["eval_vllm_refused"]["vllm"] == {"unavailable": "unavailable on vllm: this method's receiver is "
                                                                   "HF-only (test)"}
    assert set(res["agreement"]["unavailable"]) == {"babi:1 eval_vllm_too_long", "babi:1 eval_vllm_refused"}
    md = (out / "results.md").read_text()
    assert "unavailable on vllm: prefix 0 has 2000 positions" in md


def test_report_has_both_engines_and_the_throughput_table(results):
    res, out = results
    md = (out / "results.md").read_text()
    assert "## Receiver decoding: HF against vLLM" in md and "## Receiver throughput (questions per second)" in md
    tp = res["throughput"]
    assert tp["task"] == "babi:1" and tp["batches"] == [1, 8] and tp["questions"] == 8
    assert {(r["method"], r["batch"]) for r in tp["rows"]} == {(m, b) for m in ("ilcp", "cold_read") for b in (1, 8)}
    for r in tp["rows"]:
        assert r["n"] == 8 and r["hf_qps"] > 0 and r["vllm_qps"] > 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["tasks"]["babi:1"]["methods"]["ilcp"]["vllm"]["agreement"] == \
        res["tasks"]["babi:1"]["methods"]["ilcp"]["vllm"]["agreement"]


def test_hf_engine_is_unchanged(tiny_vllm_run, tiny_vllm_lm, results):
    res, _ = results
    hf = evaluate(tiny_vllm_run, methods=["no_context", "ilcp"], limit=24, lm=tiny_vllm_lm, **FAST)
    assert hf["settings"]["engine"] == "hf" and hf["vllm"] is None and hf["agreement"] is None
    for name in ("no_context", "ilcp"):
        m = hf["tasks"]["babi:1"]["methods"][name]
        assert "vllm" not in m
        assert m["exact_match"] == res["tasks"]["babi:1"]["methods"][name]["exact_match"]


def test_cli_starts_its_engine_with_caches_in_the_output(tiny_vllm_run, tmp_path, monkeypatch, capsys):
    for key in ("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "TMPDIR"):
        monkeypatch.setenv(key, os.environ.get(key, ""))
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)
    ours = ("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "TMPDIR", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_NO_USAGE_STATS",
            "DO_NOT_TRACK", "HF_HUB_OFFLINE")  # what starting the engine sets (vLLM sets others itself)
    environment, tempdir = {k: os.environ.get(k) for k in ours}, tempfile.tempdir
    seen = []
    real_create_engine = decoders.create_engine

    def create_engine(*args, **kwargs):  # what the engine sees while it starts
        seen.append((os.environ["VLLM_CACHE_ROOT"], os.environ["TMPDIR"], tempfile.gettempdir()))
        return real_create_engine(*args, **kwargs)

    monkeypatch.setattr(decoders, "create_engine", create_engine)
    started = []

    def start_vllm(*args, **kwargs):  # the engine start leaves threads and random state as they were
        torch.set_num_threads(1)
        state, set_num_threads = torch.random.get_rng_state(), torch.set_num_threads
        decoder = decoders.start_vllm(*args, **kwargs)
        started.append((torch.get_num_threads(), torch.equal(torch.random.get_rng_state(), state),
                        torch.set_num_threads is set_num_threads))
        return decoder

    monkeypatch.setattr(eval_session, "start_vllm", start_vllm)
    out = tmp_path / "out"
    code = eval_main(["--ckpt", str(tiny_vllm_run), "--engine", "vllm", "--methods", "no_context,ilcp", "--limit", "6",
                      "--latency-n", "0", "--lengths", "", "--max-new-tokens", "3", "--vllm-kv-cache-mb", "64",
                      "--out", str(out), "--no-progress"])
    assert code == 0
    assert started == [(1, True, True)], "starting the engine must leave torch's threads and random state alone"
    folder = out / "vllm"
    if seen:  # an engine on the same model and settings started earlier in the session is reused
        assert seen == [(str(folder / "cache"), str(folder / "tmp"), str(folder / "tmp"))]
        assert all((folder / name).is_dir() for name in ("cache", "config", "tmp"))
    # the process's own environment is put back once the engine has started
    assert {k: os.environ.get(k) for k in ours} == environment and tempfile.tempdir == tempdir
    saved = json.loads((out / "results.json").read_text())
    assert saved["settings"]["engine"] == "vllm"
    assert saved["tasks"]["babi:1"]["methods"]["ilcp"]["vllm"]["agreement"] >= 0.98
    assert "HF against vLLM" in capsys.readouterr().out
