"""The rclc:... rows of eval.py on a tiny trained run: names, payload bytes, placement, budgets,
the cold-read equivalence at r1, the end-to-end report and the skipped :tuned row."""

import copy
import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from ilcp import rclc
from ilcp.receiver.decoding import assemble_prefix, greedy_decode
from ilcp.evaluation import session as eval_session
from ilcp.tasks import BabiTask, EvalRows
from ilcp.evaluation.registry import EvalContext, expand_method_names, make_method, method_groups
from ilcp.evaluation.rclc_methods import RCLC_METHODS, RCLC_QUICK, parse_rclc_name, receiver_framing
from ilcp.evaluation.run import evaluate
from ilcp.export import read_export
from ilcp.lm import LM
from ilcp.receiver.prompts import cold_read_prompt, context_slot_prompt, question_prompt
from ilcp.rclc.hf import context_limit
from ilcp.tasks import load_babi
from ilcp.export_integrity import redigest

REPO = Path(__file__).resolve().parent.parent
FAST = {"max_new_tokens": 3, "batch_size": 4, "lengths": ()}
METRICS = ("n", "exact_match", "exact_match_ci", "contains", "contains_ci", "f1", "wire_bytes", "tensor_bytes",
           "prefill_positions", "latency")


def _load_eval_script():
    spec = importlib.util.spec_from_file_location("eval_script_rclc", REPO / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    return tiny_run.run_dir


@pytest.fixture(scope="module")
def ctx(run_dir, tiny_lm):
    return EvalContext(lm=tiny_lm, run=read_export(run_dir))


@pytest.fixture(scope="module")
def rows():
    return load_babi(1, "test", variant="en").to_list()[:6]


def bound(name, ctx):
    method = make_method(name)
    method.bind(ctx)
    return method


def test_names_parse_and_bad_names_are_clear_errors():
    spec = parse_rclc_name("rclc:cacheback:r4")
    assert (spec.selector, spec.ratio, spec.budget, spec.placement, spec.tuned) == ("cacheback", 4, None, "in_prompt", False)
    spec = parse_rclc_name("rclc:chunkkv:b32:prefix")
    assert (spec.selector, spec.ratio, spec.budget, spec.placement) == ("chunkkv", None, 32, "prefix")
    method = make_method(" rclc:qsnap:r16:tuned ")
    assert method.name == "rclc:qsnap:r16:tuned" and method.spec.tuned and method.requires == ("cold_read_tuned",)
    assert make_method("rclc:cacheback:r4").requires == ()
    for bad, message in [
        ("rclc:telepathy:r4", "unknown selector 'telepathy'"),
        ("rclc:cacheback:r0", "N >= 1"),
        ("rclc:qsnap:b0", "N >= 1"),
        ("rclc:cacheback", "missing budget"),
        ("rclc:", "missing selector"),
        ("rclc:cacheback:4", "neither r<N>"),
        ("rclc:cacheback:r4:sideways", "unknown option 'sideways'"),
        ("rclc:cacheback:r4:prefix:tuned", "does not combine"),
        ("rclc:cacheback:r4:tuned:tuned", "repeated"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_method(bad)


def test_groups_expand_in_order_without_duplicates():
    groups = method_groups()
    assert groups["rclc"] == RCLC_METHODS and groups["rclc-quick"] == RCLC_QUICK
    names = expand_method_names(["default", "rclc", "rclc:cacheback:r4", "cold_read"])
    assert names[:5] == list(groups["default"]) and names[5:] == list(RCLC_METHODS)
    for name in RCLC_METHODS:
        make_method(name)  # every member parses
    assert {"rclc:cacheback:r4:prefix", "rclc:cacheback:r4:tuned"} <= set(RCLC_METHODS)


def test_payload_bytes_are_rows_times_hidden_times_element_size(ctx, rows):
    tok, hidden = ctx.lm.tokenizer, ctx.lm.hidden_size
    for name, size in [("rclc:cacheback:r4", lambda t: math.ceil(t / 4)), ("rclc:qsnap:b8", lambda t: min(8, t))]:
        method = bound(name, ctx)
        for row in rows[:3]:
            sent = method.send(row)
            tokens = len(tok(method.sender_text(row["context"]), add_special_tokens=False)["input_ids"])
            n = sent.handed_over.positions
            assert n == size(tokens), (name, tokens)
            element = sent.handed_over.messages[0].rows.element_size()
            assert element == torch.finfo(ctx.lm.dtype).bits // 8
            assert sent.wire_bytes == sent.tensor_bytes == n * hidden * element


def test_r1_in_prompt_is_the_cold_read(ctx, rows):
    """Every row selected, in the context slot: the cold read's prefix, token for token, so the
    same answers (only the row bytes on the wire differ)."""
    cold, full = bound("cold_read", ctx), bound("rclc:cacheback:r1", ctx)
    embedding = ctx.lm.model.get_input_embeddings()
    cold_prefixes = cold.build_prefixes(rows).prefixes
    r1 = full.build_prefixes(rows)
    for row, a, b in zip(rows, cold_prefixes, r1.prefixes):
        assert torch.equal(a, b)
        ids = ctx.lm.tokenizer(full.sender_text(row["context"]), add_special_tokens=False)["input_ids"]
        sent = full.send(row)
        assert torch.equal(sent.handed_over.rows(embedding.weight), embedding(torch.tensor(ids)))
    model, tok = ctx.lm.model, ctx.lm.tokenizer
    assert greedy_decode(model, tok, cold_prefixes, max_new_tokens=4) == greedy_decode(model, tok, r1.prefixes, max_new_tokens=4)
    for other in ("rclc:qsnap:r1", "rclc:chunkkv:r1"):  # r1 keeps everything whatever the selector
        assert all(torch.equal(a, b) for a, b in zip(cold_prefixes, bound(other, ctx).build_prefixes(rows).prefixes))


def test_smaller_budgets_prefill_fewer_positions(ctx, rows):
    tok = ctx.lm.tokenizer
    lengths = {name: [int(p.shape[0]) for p in bound(name, ctx).build_prefixes(rows).prefixes]
               for name in ("rclc:cacheback:r1", "rclc:cacheback:r4", "rclc:cacheback:r16", "rclc:chunkkv:b4")}
    for i, row in enumerate(rows):
        r1, r4, r16, b4 = (lengths[n][i] for n in lengths)
        assert r16 <= r4 < r1, row["context"]
        before, after = context_slot_prompt(tok, row["question"])
        prompt = len(tok(before.rstrip(" "), add_special_tokens=False)["input_ids"]) + len(
            tok(after, add_special_tokens=False)["input_ids"])
        assert b4 == prompt + 4


def test_prefix_placement_and_tuned_vectors(ctx, rows):
    row = rows[0]
    prefix_method = bound("rclc:cacheback:r4:prefix", ctx)
    sent = prefix_method.send(row)
    rows_in = sent.handed_over.rows(ctx.lm.model.get_input_embeddings().weight)
    expected = assemble_prefix(ctx.lm.model, ctx.lm.tokenizer, [rows_in, question_prompt(ctx.lm.tokenizer, row["question"])])
    assert torch.equal(prefix_method.receive(sent, row), expected)
    soft = ctx.run.soft_prompts["cold_read_tuned"]
    tuned, plain = bound("rclc:cacheback:r4:tuned", ctx), bound("rclc:cacheback:r4", ctx)
    sent = plain.send(row)
    with_soft, without = tuned.receive(sent, row), plain.receive(sent, row)
    assert torch.equal(with_soft[: soft.shape[0]], soft) and torch.equal(with_soft[soft.shape[0]:], without)
    # The receiver's length check counts the K vectors it does not place itself.
    assert tuned.receiver.context_limit == context_limit(ctx.lm.model) - soft.shape[0]
    assert plain.receiver.context_limit == context_limit(ctx.lm.model)


@pytest.mark.parametrize("name,placement", [("rclc:cacheback:r4", "in_prompt"), ("rclc:qsnap:b8:prefix", "prefix")])
def test_receive_is_the_shipped_receiver_path(ctx, rows, name, placement):
    """eval's prefix is what a user gets from rclc.HFReceiver: transfer into the receiver, then pop()."""
    method = bound(name, ctx)
    assert isinstance(method.receiver, rclc.HFReceiver) and method.receiver.placement == placement
    model, tok = ctx.lm.model, ctx.lm.tokenizer
    framing = receiver_framing(tok)
    for row in rows[:3]:
        receiver = rclc.HFReceiver(model, tok, messages=framing.messages, placement=placement,
                                   slot_template=framing.slot_template)
        sender = rclc.sender_from_hf(model, tok, method.sender_text(row["context"]))
        rclc.transfer_sync(sender, receiver, row["question"].strip(), ratio=method.spec.ratio,
                           budget=method.spec.budget, selector=method.selector)
        prompt = framing.question_turn(row["question"]) if placement == "prefix" else None
        expected = receiver.pop(prompt=prompt)["inputs_embeds"][0]
        assert torch.equal(method.receive(method.send(row), row), expected)
        assert len(method.receiver) == 0  # every receive consumes what it queued


def test_without_a_chat_template_r1_is_still_the_cold_read(ctx, rows):
    """The plain-text prompts of ilcp.receiver.prompts (no chat template) map onto HFReceiver too."""
    tok = copy.deepcopy(ctx.lm.tokenizer)
    tok.chat_template = None
    plain_ctx = EvalContext(lm=LM(model=ctx.lm.model, tokenizer=tok, spec=ctx.lm.spec), run=ctx.run)
    framing = receiver_framing(tok)
    assert framing.messages is None and framing.slot_template.startswith("You are agent B.")
    full, prefix = bound("rclc:cacheback:r1", plain_ctx), bound("rclc:cacheback:r1:prefix", plain_ctx)
    model = ctx.lm.model
    for row in rows[:3]:
        cold = assemble_prefix(model, tok, [cold_read_prompt(tok, row["context"], row["question"])])
        assert torch.equal(full.receive(full.send(row), row), cold)
        sent = prefix.send(row)
        received = sent.handed_over.rows(model.get_input_embeddings().weight)
        assert torch.equal(prefix.receive(sent, row),
                           assemble_prefix(model, tok, [received, question_prompt(tok, row["question"])]))


def test_a_failed_receive_leaves_the_receiver_empty(ctx, rows):
    method = bound("rclc:cacheback:r1", ctx)
    fits = method.receiver
    method.receiver = rclc.HFReceiver(ctx.lm.model, ctx.lm.tokenizer, messages=fits.messages, placement="in_prompt",
                                      slot_template=fits.slot_template, context_limit=8)
    with pytest.raises(ValueError, match="exceed the context limit"):
        method.receive(method.send(rows[0]), rows[0])
    assert len(method.receiver) == 0
    method.receiver = fits
    assert method.receive(method.send(rows[0]), rows[0]).shape[0] > 8


def test_eval_end_to_end_writes_rclc_rows_with_every_metric(run_dir, tiny_lm, tmp_path):
    out = tmp_path / "out"
    results = evaluate(run_dir, methods=["cold_read", "rclc:cacheback:r1", "rclc:qsnap:r4:tuned"], limit=4,
                       latency_n=2, out=out, lm=tiny_lm, **FAST)
    assert results["skipped"] == {}
    methods = results["tasks"]["babi:1"]["methods"]
    for name in ("rclc:cacheback:r1", "rclc:qsnap:r4:tuned"):
        m = methods[name]
        assert set(METRICS) <= set(m), name
        assert m["n"] == 4 and m["wire_bytes"] == m["tensor_bytes"] > 0 and m["prefill_positions"] > 0
        assert m["latency"]["n"] == 2 and 0.0 <= m["latency"]["sender_s"]["p50"] <= m["latency"]["sender_s"]["p99"]
    assert methods["rclc:cacheback:r1"]["prefill_positions"] == methods["cold_read"]["prefill_positions"]
    assert methods["rclc:qsnap:r4:tuned"]["wire_bytes"] < methods["rclc:cacheback:r1"]["wire_bytes"]
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    by_method = {}
    for p in predictions:
        by_method.setdefault(p["method"], []).append(p["prediction"])
    assert by_method["rclc:cacheback:r1"] == by_method["cold_read"]
    assert "| rclc:qsnap:r4:tuned |" in (out / "results.md").read_text()


def test_tuned_without_cold_read_tuned_is_skipped(run_dir, tiny_lm, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(run_dir, partial, ignore=shutil.ignore_patterns("stages", "logs", "cache"))
    config = json.loads((partial / "config.json").read_text())
    del config["files"]["cold_read_tuned"]
    (partial / "config.json").write_text(json.dumps(redigest(config)))
    notes = []
    results = evaluate(partial, methods=["rclc:cacheback:r4:tuned", "rclc:cacheback:r4"], limit=2, latency_n=0,
                       lm=tiny_lm, log=notes.append, **FAST)
    assert list(results["skipped"]) == ["rclc:cacheback:r4:tuned"]
    assert "cold_read_tuned" in results["skipped"]["rclc:cacheback:r4:tuned"]
    assert any("skipping rclc:cacheback:r4:tuned" in n for n in notes)
    assert list(results["tasks"]["babi:1"]["methods"]) == ["rclc:cacheback:r4"]


def test_bad_rclc_names_are_refused_before_the_lm_loads(run_dir, tmp_path, monkeypatch, capsys):
    def no_lm(*args, **kwargs):
        raise AssertionError("bad names must be refused before the LM loads")

    monkeypatch.setattr(eval_session, "load_export_lm", no_lm)
    with pytest.raises(ValueError, match="unknown selector 'snapkv'"):
        evaluate(run_dir, methods=["rclc:snapkv:r4"])
    eval_script = _load_eval_script()
    with pytest.raises(SystemExit) as exit_info:
        eval_script.main(["--ckpt", str(run_dir), "--methods", "default,rclc:cacheback", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "missing budget" in err and "Traceback" not in err


def test_the_accuracy_path_builds_each_sender_state_once_for_every_rclc_row(run_dir, tiny_lm, rows, monkeypatch):
    from ilcp.evaluation import rclc_methods

    ctx = EvalContext(lm=tiny_lm, run=read_export(run_dir))  # its own state cache
    names = ["rclc:cacheback:r4", "rclc:qsnap:b8", "rclc:chunkkv:r16:prefix"]
    methods = [bound(n, ctx) for n in names]
    calls = []
    real = rclc_methods.rclc.sender_from_hf
    monkeypatch.setattr(rclc_methods.rclc, "sender_from_hf", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    built = [m.build_prefixes(rows) for m in methods]
    assert len(calls) == len({r["context"] for r in rows}) == ctx.extras[rclc_methods.SENDER_STATES].built
    for m, b in zip(methods, built):  # the same prefixes and bytes as a fresh state per row
        for r, prefix, nbytes in zip(rows, b.prefixes, b.wire_bytes):
            sent = m.send(r)
            assert sent.wire_bytes == nbytes
            torch.testing.assert_close(m.receive(sent, r), prefix, rtol=0, atol=0)


def test_sender_states_stay_within_their_position_bound(tiny_lm):
    from ilcp.evaluation.rclc_methods import SenderStates

    texts = ["Mary went to the kitchen.", "John moved to the garden. Sandra went back to the office.",
             "Daniel journeyed to the hallway."]
    sizes = [len(tiny_lm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    states = SenderStates(tiny_lm, max_positions=sizes[1] + sizes[2])
    for t in texts:
        states.get(t)
    assert states.built == 3 and states._positions <= sizes[1] + sizes[2]
    states.get(texts[2])  # still held
    assert states.built == 3
    states.get(texts[0])  # dropped for the bound: built again
    assert states.built == 4 and states._positions <= states.max_positions
    one = SenderStates(tiny_lm, max_positions=1)  # a state over the bound is still kept until the next
    assert one.get(texts[1]) is one.get(texts[1]) and one.built == 1


def test_rows_sharing_sender_states_build_each_once_under_a_tight_position_bound(run_dir, tiny_lm, tmp_path,
                                                                                   monkeypatch):
    """Several RCLC and kv_relay rows over contexts whose states overflow the bound: the evaluation
    runs them chunk by chunk, so each context's state is built once, and every row's answers
    and metrics are those of the row evaluated alone."""
    from ilcp.evaluation import rclc_methods

    names = ["rclc:cacheback:r4", "rclc:cacheback:r4:tuned", "rclc:cacheback:r8", "rclc:qsnap:r8",
             "kv_relay:cacheback:r8"]
    lengths = []

    class Tight(rclc_methods.SenderStates):  # room for about two contexts at a time
        def __init__(self, lm):
            super().__init__(lm, max_positions=2 * max(lengths))

    rows = load_babi(1, "test", variant="en").to_list()[:5]
    framing = receiver_framing(tiny_lm.tokenizer)
    lengths += [len(tiny_lm.tokenizer(framing.lead + r["context"].strip())["input_ids"]) for r in rows]
    monkeypatch.setattr(rclc_methods, "SenderStates", Tight)
    monkeypatch.setattr(BabiTask, "eval_rows", lambda self, limit, context: EvalRows(rows, 5, "test"))
    notes = []
    together = evaluate(run_dir, methods=names, limit=5, latency_n=0, lm=tiny_lm, log=notes.append, **FAST)
    assert any("5 methods share each context's sender state" in n for n in notes)
    built = []
    real_get = rclc_methods.SenderStates.get
    monkeypatch.setattr(rclc_methods.SenderStates, "get",
                        lambda self, text: (built.append(text) if text not in self._states else None)
                        or real_get(self, text))
    again = evaluate(run_dir, methods=names, limit=5, latency_n=0, lm=tiny_lm, out=tmp_path / "o", **FAST)
    assert len(built) == len(rows)  # once per context, for all five rows
    counted = []
    real_init = rclc_methods.SenderStates.__init__
    monkeypatch.setattr(rclc_methods.SenderStates, "__init__",
                        lambda self, *a, **k: counted.append(self) or real_init(self, *a, **k))
    evaluate(run_dir, methods=names, limit=5, latency_n=0, lm=tiny_lm, **FAST)
    assert counted[-1].selected == 3 * len(rows)  # r4 and r4:tuned share one selection per question
    assert counted[-1].profiled == 2 * len(rows)  # one attention pass per selector and question
    for name in names:
        alone = evaluate(run_dir, methods=[name], limit=5, latency_n=0, lm=tiny_lm, **FAST)
        a, b, c = (r["tasks"]["babi:1"]["methods"][name] for r in (alone, together, again))
        for key in ("n", "exact_match", "contains", "wire_bytes", "prefill_positions"):
            assert a[key] == b[key] == c[key], (name, key)
    preds = [json.loads(line) for line in (tmp_path / "o" / "predictions.jsonl").read_text().splitlines()]
    assert {p["method"] for p in preds} == set(names)


def test_only_tasks_skips_the_training_task(run_dir, tiny_lm, tmp_path, capsys):
    results = evaluate(run_dir, methods=["no_context"], tasks=["babi:2"], only_tasks=True, limit=2, latency_n=0,
                       lm=tiny_lm, **FAST)
    assert list(results["tasks"]) == ["babi:2"] and results["run"]["train_task"] == "babi:1"
    assert results["tasks"]["babi:2"]["seen_in_training"] is False
    with pytest.raises(ValueError, match="only_tasks needs tasks"):
        evaluate(run_dir, methods=["no_context"], only_tasks=True, lm=tiny_lm, **FAST)
    eval_script = _load_eval_script()
    with pytest.raises(SystemExit) as exit_info:
        eval_script.main(["--ckpt", str(run_dir), "--only-tasks", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "only_tasks needs tasks" in err and "Traceback" not in err
