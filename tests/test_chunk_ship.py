"""Shipping a chunk writer (`ilcp.training.chunk_ship`) and starting a run from the shipped folder
(`compressor.memory.writer_from`, read by `ilcp.encoder.chunk_files`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ilcp.config import load_config
from ilcp.encoder.chunk_files import read_writer_state
from ilcp.training.chunk_pretrain import ChunkPretrainConfig, pretrain
from ilcp.training.chunk_ship import main, ship

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
SETTINGS = {"hidden_size": 64, "chunk_tokens": 4, "width": 8, "inner": 16}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, tiny_lm):
    out = tmp_path_factory.mktemp("ship")
    pretrain(out / "run", tiny_lm, ChunkPretrainConfig(chunk_tokens=4, batch_chunks=8, steps=4, eval_every=2,
                                                       heldout_chunks=4, width=8, inner=16, babi_stories=10),
             log=lambda _m: None)
    return out / "run", ship(out / "run", out / "writer", tiny_lm, texts_per_set=8, log=lambda _m: None)


def test_the_shipped_writer_holds_the_runs_weights_its_figures_and_a_card(shipped, tiny_lm):
    run, dest = shipped
    assert sorted(p.name for p in dest.iterdir()) == ["README.md", "config.json", "curve.jsonl", "writer.safetensors"]
    assert not any(p.name.startswith(".") for p in dest.parent.iterdir())  # no partial folder left
    for name, tensor in load_file(str(run / "state" / "writer.safetensors")).items():
        torch.testing.assert_close(read_writer_state(dest, SETTINGS, tiny_lm.fingerprint)[name], tensor)
    config = json.loads((dest / "config.json").read_text())
    assert config["lm"]["fingerprint"] == tiny_lm.fingerprint and config["pretraining"]["steps"] == 4
    rows = config["readback"]
    assert {(r["vectors"], r["memory"]) for r in rows} == {(v, m) for v in (1, 4, 16) for m in ("chunk writer", "no memory")}
    for r in rows:
        assert 0 <= r["interval"][0] <= r["token_accuracy"] <= r["interval"][1] <= 1 and r["tokens"] == 4 * r["vectors"]
    card = (dest / "README.md").read_text()
    assert "4 steps of 8 texts of 1 chunk(s)" in card and f"`{tiny_lm.fingerprint}`" in card and "| squad | 16 | 4 | chunk writer |" in card


def test_a_changed_writer_another_lm_or_other_settings_are_refused_in_one_line(shipped, tiny_lm, tmp_path):
    import shutil

    _, dest = shipped
    with pytest.raises(ValueError, match="the run's LM has fingerprint 0000"):
        read_writer_state(dest, SETTINGS, "0000")
    with pytest.raises(ValueError, match="set compressor.memory.chunk_tokens, writer, and width, inner and direct"):
        read_writer_state(dest, {**SETTINGS, "inner": 32}, tiny_lm.fingerprint)
    copy = tmp_path / "copy"
    shutil.copytree(dest, copy)
    data = bytearray((copy / "writer.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "writer.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match the sha256"):
        read_writer_state(copy, SETTINGS, tiny_lm.fingerprint)
    config = json.loads((dest / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "writer": {**SETTINGS, "inner": 32}}))
    with pytest.raises(ValueError, match="changed after it was written"):
        read_writer_state(copy, SETTINGS, tiny_lm.fingerprint)


def test_a_run_starts_from_the_shipped_writer(shipped, tiny_lm, tmp_path):
    from ilcp.training import train

    _, dest = shipped
    cfg = load_config(TINY_CONFIG, [
        f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "compressor.memory.kind=chunk",
        "compressor.memory.chunk_tokens=4", "compressor.memory.width=8", "compressor.memory.inner=16",
        f"compressor.memory.writer_from={dest}", "data.pool_layers=[0]", "compressor.answer_head_weight=0",
        "handoff.memory_placement=in_prompt", "handoff.format_vectors=2", "handoff.variants=[ilcp]",
        "handoff.finetune_encoder=false"])
    run = train(cfg, lm=tiny_lm).run_dir
    weights = load_file(str(run / "model.safetensors"))
    for name, tensor in load_file(str(dest / "writer.safetensors")).items():
        torch.testing.assert_close(weights[f"pooler.writer.{name}"], tensor)


def test_shipping_what_is_no_run_is_one_line_and_leaves_nothing(tmp_path, capsys):
    assert main([str(tmp_path / "nothing"), "--out", str(tmp_path / "dest"), "--lm", "tiny-qwen3"]) == 2
    assert "holds no chunk pretraining" in capsys.readouterr().err
    assert not (tmp_path / "dest").exists()


def test_an_unknown_lm_is_one_line_for_shipping_and_pretraining(shipped, tmp_path, capsys):
    from ilcp.training.chunk_pretrain import main as pretrain_main

    run, _ = shipped
    assert main([str(run), "--out", str(tmp_path / "dest"), "--lm", "nosuchlm"]) == 2
    assert "unknown LM spec 'nosuchlm'" in capsys.readouterr().err and not (tmp_path / "dest").exists()
    assert pretrain_main(["--out", str(tmp_path / "run"), "--lm", "nosuchlm"]) == 2
    assert "unknown LM spec 'nosuchlm'" in capsys.readouterr().err


def test_a_window_stage_writer_counts_the_stage_it_started_from(shipped, tiny_lm, tmp_path):
    run, _ = shipped
    window = tmp_path / "window"
    pretrain(window, tiny_lm, ChunkPretrainConfig(chunk_tokens=4, batch_chunks=4, steps=2, eval_every=2, heldout_chunks=4,
                                                  width=8, inner=16, babi_stories=10, window_chunks=2,
                                                  continuation_tokens=4, init_from=str(run)),
             log=lambda _m: None)
    dest = ship(window, tmp_path / "writer", tiny_lm, texts_per_set=4, log=lambda _m: None)
    p = json.loads((dest / "config.json").read_text())["pretraining"]
    assert [(e["folder"], e["steps"]) for e in p["earlier_stages"]] == [(str(run), 4)]
    card = (dest / "README.md").read_text()
    assert f"Earlier stage (`{run}`, which this run started from): 4 steps of 8 texts of 1 chunk(s)" in card
    assert "2 steps of 4 texts of 2 chunk(s) (AdamW, lr 0.001; 4 tokens of continuation)" in card
    assert "hours in all." in card
