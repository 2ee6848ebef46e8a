"""The kv_relay:... comparison rows on the tiny LM: names, the KV bytes, the r1 equivalence with
decoding after the sender's whole context cache, pruning as masking, budgets, and eval end to end."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from ilcp import compat, rclc
from ilcp.receiver.decoding import assemble_prefix, greedy_decode_ids
from ilcp.evaluation.kv_relay import KVHandoff, RelayInputs, parse_kv_relay_name, relay_decode
from ilcp.evaluation.registry import EvalContext, make_method
from ilcp.evaluation.run import evaluate
from ilcp.export import read_export
from ilcp.receiver.prompts import question_prompt
from ilcp.tasks import load_babi

REPO = Path(__file__).resolve().parent.parent
MAX_NEW = 4


@pytest.fixture(scope="module")
def ctx(tiny_run, tiny_lm):
    return EvalContext(lm=tiny_lm, run=read_export(tiny_run.run_dir))


@pytest.fixture(scope="module")
def rows():
    return load_babi(1, "test", variant="en").to_list()[:5]


def bound(name, ctx):
    method = make_method(name)
    method.bind(ctx)
    return method


def sender(method, ctx, row):
    return rclc.sender_from_hf(ctx.lm.model, ctx.lm.tokenizer, method.sender_text(row["context"]))


def prompt_ids(ctx, row):
    tok = ctx.lm.tokenizer
    return torch.tensor(tok(question_prompt(tok, row["question"]), add_special_tokens=False)["input_ids"])


def test_names_parse_and_bad_names_are_clear_errors():
    assert parse_kv_relay_name("kv_relay:cacheback:r4:prefix").placement == "prefix"
    spec = parse_kv_relay_name("kv_relay:cacheback:r4")
    assert spec.placement == "in_prompt"
    assert (spec.selector, spec.ratio, spec.budget) == ("cacheback", 4, None)
    method = make_method(" kv_relay:chunkkv:b16 ")
    assert method.name == "kv_relay:chunkkv:b16" and (method.spec.ratio, method.spec.budget) == (None, 16)
    assert method.decodes_itself and method.vllm_unavailable and method.requires == ()
    assert not make_method("rclc:cacheback:r4").decodes_itself and not make_method("cold_read").decodes_itself
    for bad, message in [
        ("kv_relay:telepathy:r4", "unknown selector 'telepathy'"),
        ("kv_relay:cacheback:r0", "N >= 1"),
        ("kv_relay:cacheback", "missing budget"),
        ("kv_relay:", "missing selector"),
        ("kv_relay:qsnap:16", "neither r<N>"),
        ("kv_relay:cacheback:r4:tuned", "take only the option 'prefix'"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_method(bad)


def test_bytes_are_the_kept_kv(ctx, rows):
    config = ctx.lm.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * (
        torch.finfo(ctx.lm.dtype).bits // 8)
    tok = ctx.lm.tokenizer
    for name, size in [("kv_relay:cacheback:r4:prefix", lambda t: math.ceil(t / 4)), ("kv_relay:qsnap:b8:prefix", lambda t: min(8, t)),
                       ("kv_relay:chunkkv:r1:prefix", lambda t: t)]:
        method = bound(name, ctx)
        for row in rows[:3]:
            sent = method.send(row)
            kv = sent.handed_over
            tokens = len(tok(method.sender_text(row["context"]), add_special_tokens=False)["input_ids"])
            assert isinstance(kv, KVHandoff) and kv.total == tokens and kv.kept == size(tokens), (name, tokens)
            assert len(kv.keys) == len(kv.values) == config.num_hidden_layers
            assert sent.wire_bytes == sent.tensor_bytes == kv.nbytes == kv.kept * per_position


def test_r1_is_decoding_after_the_full_context_cache(ctx, rows):
    """Every position kept: the same first-token logits and answers as the sender's own cache
    followed by the question, and as one prefill of context + question from scratch."""
    model, tok = ctx.lm.model, ctx.lm.tokenizer
    method = bound("kv_relay:cacheback:r1:prefix", ctx)
    embedding = model.get_input_embeddings()
    decoded = method.decode_rows(rows, max_new_tokens=MAX_NEW)
    for row, answer in zip(rows, decoded.answers):
        sent = method.send(row)
        result, ids, logits = relay_decode(model, tok, method.receive(sent, row), max_new_tokens=MAX_NEW, details=True)
        assert result.text == answer and ids, row["question"]  # the accuracy path answers as the timed one
        state = sender(method, ctx, row)
        question = prompt_ids(ctx, row)
        full = RelayInputs(cache=compat.clone_cache(state.past_key_values), kept=state.positions, total=state.positions,
                           prompt_ids=question)
        _, ref_ids, ref_logits = relay_decode(model, tok, full, max_new_tokens=MAX_NEW, details=True)
        assert ids == ref_ids and torch.equal(logits, ref_logits)
        # One prefill of the context's rows and the question from position 0 (no relayed cache).
        with torch.inference_mode():
            scratch = model(input_ids=torch.cat([state.token_ids, question]).unsqueeze(0)).logits[0, -1].float()
        torch.testing.assert_close(logits, scratch, rtol=1e-4, atol=1e-5)
        prefix = assemble_prefix(model, tok, [embedding(state.token_ids), question_prompt(tok, row["question"])])
        assert greedy_decode_ids(model, tok, [prefix], max_new_tokens=MAX_NEW, stop_at_newline=True)[0] == ids


def test_pruned_cache_is_the_full_cache_with_dropped_positions_masked(ctx, rows):
    """The kept keys keep their rotary positions and the question continues at T: the same as the
    sender's whole cache with the dropped positions masked out."""
    model, tok = ctx.lm.model, ctx.lm.tokenizer
    method = bound("kv_relay:cacheback:r4:prefix", ctx)
    for row in rows[:3]:
        sent = method.send(row)
        kv = sent.handed_over
        assert 0 < kv.kept < kv.total
        _, _, logits = relay_decode(model, tok, method.receive(sent, row), max_new_tokens=1, details=True)
        state = sender(method, ctx, row)
        pairs = compat.cache_tensors(state.past_key_values)
        for (k, v), kept_k, kept_v in zip(pairs, kv.keys, kv.values):  # the sender's own entries, copied
            assert torch.equal(k[0][:, kv.positions], kept_k) and torch.equal(v[0][:, kv.positions], kept_v)
        question = prompt_ids(ctx, row)
        mask = torch.zeros(1, kv.total + question.numel(), dtype=torch.long)
        mask[0, kv.positions] = 1
        mask[0, kv.total:] = 1
        with torch.inference_mode():
            out = model(input_ids=question.unsqueeze(0), attention_mask=mask,
                        position_ids=torch.arange(kv.total, kv.total + question.numel()).unsqueeze(0),
                        **compat.cache_kwargs(model, compat.clone_cache(state.past_key_values)), use_cache=True)
        torch.testing.assert_close(logits, out.logits[0, -1].float(), rtol=1e-4, atol=1e-5)


def test_smaller_budgets_keep_fewer_positions_the_rclc_rows_positions(ctx, rows):
    kept = {name: [bound(name, ctx).send(r).handed_over for r in rows]
            for name in ("kv_relay:cacheback:r1:prefix", "kv_relay:cacheback:r4:prefix", "kv_relay:cacheback:r16:prefix",
                         "kv_relay:chunkkv:b4:prefix")}
    for i, row in enumerate(rows):
        r1, r4, r16, b4 = (kept[n][i] for n in kept)
        assert r16.kept <= r4.kept < r1.kept == r1.total and b4.kept == 4
        assert r4.nbytes < r1.nbytes
        # The positions the rclc row of the same selector and budget hands over as rows.
        rclc_row = bound("rclc:cacheback:r4", ctx)
        deliveries = []
        rclc.transfer_sync(sender(rclc_row, ctx, row), deliveries.append, row["question"].strip(), ratio=4,
                           selector=rclc_row.selector, record_selection=True)
        assert r4.positions.tolist() == deliveries[0].messages[0].selection.indices
    decoded = {n: bound(n, ctx).decode_rows(rows, max_new_tokens=1) for n in ("kv_relay:cacheback:r1:prefix", "kv_relay:cacheback:r4:prefix")}
    assert all(a > b for a, b in zip(decoded["kv_relay:cacheback:r1:prefix"].prefill_positions,
                                     decoded["kv_relay:cacheback:r4:prefix"].prefill_positions))


def test_a_wrong_handoff_is_refused(ctx, rows):
    method = bound("kv_relay:cacheback:r4:prefix", ctx)
    sent = bound("rclc:cacheback:r4", ctx).send(rows[0])
    with pytest.raises(ValueError, match="expected a KVHandoff"):
        method.receive(sent, rows[0])


def test_eval_end_to_end_writes_the_kv_relay_row(tiny_run, tiny_lm, tmp_path):
    out = tmp_path / "out"
    names = ["rclc:cacheback:r1:prefix", "kv_relay:cacheback:r1:prefix", "kv_relay:cacheback:r4:prefix"]
    results = evaluate(tiny_run.run_dir, methods=names, limit=4, latency_n=2, out=out, lm=tiny_lm,
                       max_new_tokens=3, batch_size=4, lengths=())
    assert results["skipped"] == {}
    methods = results["tasks"]["babi:1"]["methods"]
    for name in names[1:]:
        m = methods[name]
        assert m["n"] == 4 and m["wire_bytes"] == m["tensor_bytes"] > 0 and m["prefill_positions"] > 0
        assert m["latency"]["n"] == 2 and m["latency"]["receiver_ttft_s"]["p50"] > 0
    assert methods["kv_relay:cacheback:r4:prefix"]["wire_bytes"] < methods["kv_relay:cacheback:r1:prefix"]["wire_bytes"]
    # r1's receiver attends to what the :prefix rclc row prefills (the context's rows, the question).
    assert methods["kv_relay:cacheback:r1:prefix"]["prefill_positions"] == methods["rclc:cacheback:r1:prefix"]["prefill_positions"]
    predictions = {}
    for line in (out / "predictions.jsonl").read_text().splitlines():
        p = json.loads(line)
        predictions.setdefault(p["method"], []).append(p["prediction"])
    assert predictions["kv_relay:cacheback:r1:prefix"] == predictions["rclc:cacheback:r1:prefix"]
    assert "| kv_relay:cacheback:r4:prefix |" in (out / "results.md").read_text()


def test_eval_script_runs_the_kv_relay_row(tiny_run, tmp_path):
    spec = importlib.util.spec_from_file_location("eval_script_kv_relay", REPO / "eval.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "cli"
    code = script.main(["--ckpt", str(tiny_run.run_dir), "--methods", "kv_relay:cacheback:r4", "--limit", "2",
                        "--latency-n", "1", "--lengths", "", "--max-new-tokens", "2", "--out", str(out), "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["tasks"]["babi:1"]["methods"]) == ["kv_relay:cacheback:r4"]


def test_in_prompt_relay_is_the_cold_read_at_r1_and_counts_only_the_context_entries(tiny_run, tiny_lm, tmp_path, ctx,
                                                                                     rows):
    config = ctx.lm.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * (
        torch.finfo(ctx.lm.dtype).bits // 8)
    method = bound("kv_relay:cacheback:r4", ctx)
    prefix = bound("kv_relay:cacheback:r4:prefix", ctx)
    for row in rows[:3]:
        kv, plain = method.send(row).handed_over, prefix.send(row).handed_over
        head = kv.own
        assert head > 0 and kv.total == head + plain.total  # the prompt's head, then the context
        assert kv.positions[:head].tolist() == list(range(head))
        assert (kv.positions[head:] - head).tolist() == plain.positions.tolist()  # the same selection
        assert kv.nbytes == plain.nbytes == plain.kept * per_position  # the head is the receiver's own
    out = tmp_path / "out"
    names = ["cold_read", "rclc:cacheback:r1", "kv_relay:cacheback:r1", "kv_relay:cacheback:r4"]
    results = evaluate(tiny_run.run_dir, methods=names, limit=4, latency_n=0, out=out, lm=tiny_lm,
                       max_new_tokens=3, batch_size=4, lengths=())
    predictions = {}
    for line in (out / "predictions.jsonl").read_text().splitlines():
        p = json.loads(line)
        predictions.setdefault(p["method"], []).append(p["prediction"])
    assert predictions["kv_relay:cacheback:r1"] == predictions["cold_read"] == predictions["rclc:cacheback:r1"]
    methods = results["tasks"]["babi:1"]["methods"]
    assert methods["kv_relay:cacheback:r1"]["prefill_positions"] == methods["cold_read"]["prefill_positions"]
