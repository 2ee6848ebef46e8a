"""The selection_tuned variant on the tiny config: its training prompts are the rclc row's prefix,
it trains, exports and reloads, its eval row runs, and the default run is left as it was."""

import json
from pathlib import Path

import pytest
import torch

from ilcp.config import load_config
from ilcp.config_sections import DEFAULT_VARIANTS
from ilcp.encoder.model import ConstantMemory
from ilcp.evaluation import rclc_methods
from ilcp.evaluation.rclc_methods import parse_rclc_name, selection_prompt_ids
from ilcp.evaluation.registry import EvalContext, make_method
from ilcp.evaluation.run import evaluate
from ilcp.export import read_export
from ilcp.tasks import load_babi
from ilcp.training import HandoffModule, train
from ilcp.training.data import collate_rows

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"

FAST = {"max_new_tokens": 3, "batch_size": 4, "lengths": ()}


@pytest.fixture(scope="module")
def rows():
    return load_babi(1, "test", variant="en").to_list()[:6]


@pytest.fixture(scope="module")
def selection_run(tmp_path_factory, tiny_lm):
    out = tmp_path_factory.mktemp("selection-run")
    cfg = load_config(TINY_CONFIG, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}",
                                    "handoff.variants=[cold_read_tuned,selection_tuned]", "handoff.max_steps=6",
                                    "handoff.val_every_steps=3"])
    return cfg, train(cfg, lm=tiny_lm)


def test_config_defaults_and_bad_settings():
    cfg = load_config(TINY_CONFIG)
    assert list(cfg.handoff.variants) == list(DEFAULT_VARIANTS) == ["ilcp", "prompt_tuned", "cold_read_tuned"]
    assert (cfg.handoff.selection_selector, cfg.handoff.selection_ratio) == ("cacheback", 4)
    for override, message in [("handoff.selection_selector=snapkv", "handoff.selection_selector"),
                              ("handoff.selection_ratio=0", "handoff.selection_ratio")]:
        with pytest.raises(ValueError, match=message):
            load_config(TINY_CONFIG, [override])


def test_names_parse():
    spec = parse_rclc_name("rclc:cacheback:r4:selection_tuned")
    assert spec.selection_tuned and not spec.tuned and spec.soft_prompt == "selection_tuned"
    assert spec.placement == "in_prompt"
    assert parse_rclc_name("rclc:cacheback:r4:tuned").soft_prompt == "cold_read_tuned"
    assert parse_rclc_name("rclc:cacheback:r4").soft_prompt is None
    assert make_method("rclc:qsnap:r4:selection_tuned").requires == ("selection_tuned",)
    for bad, message in [("rclc:cacheback:r4:selection_tuned:prefix", "does not combine"),
                         ("rclc:cacheback:r4:tuned:selection_tuned", "choose one")]:
        with pytest.raises(ValueError, match=message):
            make_method(bad)


def test_training_prompts_are_the_rclc_rows_prefix(tiny_run, tiny_lm, rows, monkeypatch):
    """The token IDs selection_tuned trains on embed to exactly the rclc:cacheback:r4 row's
    prefix, and each distinct context is prefilled once."""
    built = []
    real = rclc_methods.rclc.sender_from_hf
    monkeypatch.setattr(rclc_methods.rclc, "sender_from_hf", lambda *a, **k: built.append(a[2]) or real(*a, **k))
    asked = rows + [dict(rows[0], question="Where is Mary? ")]  # a second question of one context
    selected = selection_prompt_ids(tiny_lm, asked, selector="cacheback", ratio=4)
    assert len(built) == len({r["context"] for r in asked}) and len(selected) == len(asked)
    monkeypatch.undo()
    method = make_method("rclc:cacheback:r4")
    method.bind(EvalContext(lm=tiny_lm, run=read_export(tiny_run.run_dir)))
    embed = tiny_lm.model.get_input_embeddings()
    for row, prefix in zip(asked, method.build_prefixes(asked).prefixes):
        with torch.no_grad():
            assert torch.equal(embed(torch.tensor(selected[(row["context"], row["question"])])), prefix)
    # Another selector or budget keeps other rows.
    r1 = selection_prompt_ids(tiny_lm, rows[:2], selector="chunkkv", ratio=1)
    assert all(len(r1[k]) > len(selected[k]) for k in r1)


def test_the_module_trains_on_the_selected_prompts(tiny_lm, rows):
    cfg = load_config(TINY_CONFIG).handoff
    selected = selection_prompt_ids(tiny_lm, rows, selector="cacheback", ratio=4)
    source = ConstantMemory.from_embedding_rows(tiny_lm.model, cfg.num_memory_tokens, reads_context_text=True)
    module = HandoffModule(source, tiny_lm, cfg, selected=selected)
    batch = collate_rows([{"index": i, "states": torch.zeros(1), **r} for i, r in enumerate(rows)])
    memory, _ = module.memory(batch)
    sequences, labels = module._answer_sequences(memory, batch, True)
    embed = tiny_lm.model.get_input_embeddings()
    for i, (row, seq, lab) in enumerate(zip(rows, sequences, labels)):
        ids = selected[(row["context"], row["question"])]
        k = memory.shape[1]
        assert torch.equal(seq[:k], memory[i]) and torch.equal(seq[k:k + len(ids)], embed(torch.tensor(ids)))
        assert (lab[:k + len(ids)] == -100).all() and (lab[k + len(ids):] != -100).all()
    # A few optimizer steps on these rows lower their loss.
    opt = torch.optim.AdamW([source.soft_prompt], lr=3e-2)
    first = None
    for _ in range(8):
        loss, _ = module._teacher_forced(batch)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(module._teacher_forced(batch)[0].detach()) < first
    assert len(module.answer(batch)) == len(rows)


def test_the_variant_trains_exports_and_reloads(selection_run, tiny_lm):
    cfg, result = selection_run
    files = json.loads((result.run_dir / "config.json").read_text())["files"]
    assert files == {"cold_read_tuned": "cold_read_tuned.safetensors", "selection_tuned": "selection_tuned.safetensors"}
    metrics = result.metrics["variants"]["selection_tuned"]
    assert metrics["steps"] == 6 and metrics["curve"]
    start = ConstantMemory.from_embedding_rows(tiny_lm.model, cfg.handoff.num_memory_tokens, reads_context_text=True)
    trained = result.sources["selection_tuned"].soft_prompt.detach()
    assert not torch.allclose(trained, start.soft_prompt)  # the vectors moved
    # Trained on other prompts than cold_read_tuned with the same start and steps.
    assert not torch.allclose(trained, result.sources["cold_read_tuned"].soft_prompt.detach())
    run = read_export(result.run_dir)
    assert torch.equal(run.soft_prompts["selection_tuned"], trained.float().cpu())
    assert "selection_tuned (selection_tuned.safetensors)" in (result.run_dir / "README.md").read_text()


def test_its_eval_row_runs(selection_run, tiny_lm, rows, tmp_path):
    _, result = selection_run
    ctx = EvalContext(lm=tiny_lm, run=read_export(result.run_dir))
    tuned, plain = make_method("rclc:cacheback:r4:selection_tuned"), make_method("rclc:cacheback:r4")
    tuned.bind(ctx)
    plain.bind(ctx)
    soft = ctx.run.soft_prompts["selection_tuned"]
    for a, b in zip(tuned.build_prefixes(rows).prefixes, plain.build_prefixes(rows).prefixes):
        assert torch.equal(a[: soft.shape[0]], soft) and torch.equal(a[soft.shape[0]:], b)
    names = ["rclc:cacheback:r4:selection_tuned", "rclc:cacheback:r4:tuned"]
    results = evaluate(result.run_dir, methods=names, limit=3, latency_n=1, out=tmp_path / "out", lm=tiny_lm, **FAST)
    assert results["skipped"] == {}
    m = results["tasks"]["babi:1"]["methods"]["rclc:cacheback:r4:selection_tuned"]
    assert m["n"] == 3 and m["wire_bytes"] > 0 and m["latency"]["n"] == 1


def test_the_default_run_is_unchanged(tiny_run, tiny_lm):
    assert list(tiny_run.cfg.handoff.variants) == list(DEFAULT_VARIANTS)
    files = json.loads((tiny_run.run_dir / "config.json").read_text())["files"]
    assert set(files) == {"ilcp", "prompt_tuned", "cold_read_tuned"}
    assert set(tiny_run.result.metrics["variants"]) == set(DEFAULT_VARIANTS)
    results = evaluate(tiny_run.run_dir, methods=["rclc:cacheback:r4:selection_tuned", "rclc:cacheback:r4"], limit=2,
                       latency_n=0, lm=tiny_lm, **FAST)
    assert "selection_tuned" in results["skipped"]["rclc:cacheback:r4:selection_tuned"]
    assert list(results["tasks"]["babi:1"]["methods"]) == ["rclc:cacheback:r4"]
