"""transfer: r1 equivalence, representations, lists and fitting, atomicity, cancellation,
receiver checks and the inbox."""

import asyncio
import threading
import time

import pytest
import torch

from ilcp import rclc
from ilcp.lm import build_tiny_qwen3, build_tiny_tokenizer
from ilcp import compat
from ilcp.rclc import hf
from ilcp.rclc import budget as b
from ilcp.rclc.receiver import ReceiverPlan, RenderedPrompt, RowReceiver

REQUEST = "Who owns Cedar?"
HISTORY = [{"role": "system", "content": "Answer the question with one word."}]


def _logits(model, embeds):
    with torch.no_grad():
        return model(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long)).logits


def test_r1_reproduces_a_plain_prefill(model, tokenizer, sender):
    receiver = rclc.HFReceiver(model, tokenizer, messages=HISTORY, max_new_tokens=3)
    rclc.transfer_sync(sender, receiver, REQUEST, ratio=1)
    inputs = receiver.pop()
    assert inputs["max_new_tokens"] == 3
    prompt = hf.render_chat(tokenizer, HISTORY + [{"role": "user", "content": REQUEST}], add_generation_prompt=True)
    assert prompt.endswith("<think>\n\n</think>\n\n")  # thinking disabled
    prompt_ids = hf.encode_text(tokenizer, prompt)[0]
    plain = torch.cat([sender.input_embeds, hf.embed_ids(model, prompt_ids)]).unsqueeze(0)
    assert torch.equal(inputs["inputs_embeds"], plain)
    assert torch.equal(_logits(model, inputs["inputs_embeds"]), _logits(model, plain))
    out = model.generate(**inputs, do_sample=False)
    assert out.shape == (1, 3)


def test_in_prompt_placement_puts_rows_at_the_slot(model, tokenizer, sender):
    receiver = rclc.HFReceiver(model, tokenizer, messages=HISTORY, placement="in_prompt",
                               slot_template="Read this: {context}\nNow answer: {request}")
    rclc.transfer_sync(sender, receiver, REQUEST, ratio=1)
    inputs = receiver.pop()
    rendered = receiver.render(REQUEST)
    assert tokenizer.decode(rendered.before[0]).endswith("<|im_start|>user\nRead this: ")
    assert tokenizer.decode(rendered.after[0]).startswith("\nNow answer: Who owns Cedar?<|im_end|>")
    expected = torch.cat([hf.embed_ids(model, rendered.before[0]), sender.input_embeds,
                          hf.embed_ids(model, rendered.after[0])]).unsqueeze(0)
    assert torch.equal(inputs["inputs_embeds"], expected)
    assert inputs["max_new_tokens"] == 1  # one output position when max_new_tokens is unset
    with pytest.raises(ValueError, match="slot_template"):
        rclc.HFReceiver(model, tokenizer, placement="in_prompt", slot_template="no marker")
    with pytest.raises(ValueError, match="placement"):
        rclc.HFReceiver(model, tokenizer, placement="suffix")
    ids = tokenizer(REQUEST, add_special_tokens=False, return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="string request"):
        rclc.transfer_sync(sender, rclc.HFReceiver(model, tokenizer, placement="in_prompt"), ids)


def test_token_ids_and_continuous_round_trip(model, tokenizer, sender):
    state = rclc.latent_mass_sync(sender, steps=3)
    inbox = []
    rclc.transfer_sync(state, inbox.append, REQUEST, ratio=2, representation="token_ids+continuous")
    rclc.transfer_sync(state, inbox.append, REQUEST, ratio=2)
    mixed, dense = inbox[0].messages[0], inbox[1].messages[0]
    weight = model.get_input_embeddings().weight
    assert mixed.positions == dense.positions == b.position_budget(state.positions, ratio=2)
    assert int((mixed.token_ids == -1).sum()) == mixed.rows.shape[0] == 3  # the latent tail
    assert torch.equal(mixed.materialize(weight), dense.materialize(weight))
    assert mixed.nbytes < dense.nbytes
    assert mixed.nbytes == mixed.rows.numel() * 4 + mixed.token_ids.numel() * 8
    with pytest.raises(ValueError, match="vocabulary"):
        mixed.materialize(weight[:10])


def test_lists_fit_the_tightest_receiver_and_keep_order(model, tokenizer, story_messages):
    long_sender = rclc.sender_from_hf(model, tokenizer, story_messages)
    short_sender = rclc.sender_from_hf(model, tokenizer, "Cedar is owned by Alice.")
    roomy = rclc.HFReceiver(model, tokenizer, messages=HISTORY, max_new_tokens=4)
    prompt = roomy.render(REQUEST).positions
    tight = rclc.HFReceiver(model, tokenizer, messages=HISTORY, max_new_tokens=4, context_limit=prompt + 4 + 20)
    calls = []

    def plain(delivery):
        calls.append(("plain", delivery))

    async def later(delivery):
        await asyncio.sleep(0)
        calls.append(("async", delivery))

    requests = [REQUEST, "Where is John?"]
    rclc.transfer_sync([long_sender, short_sender], [roomy, plain, tight, later], requests, ratio=1)
    assert [c[0] for c in calls] == ["plain", "async", "plain", "async"]
    assert [c[1].request for c in calls] == [REQUEST, REQUEST, "Where is John?", "Where is John?"]
    first = calls[0][1]
    assert calls[1][1] is first and roomy.peek() is first and tight.peek() is first
    # Space 20 for the first request; r1 maxima (T_long, T_short); floors 1 each; 18 shared
    # equally but the short sender needs fewer than 9.
    t_long, t_short = long_sender.positions, short_sender.positions
    expected = b.fit_budgets([b.Demand(t_long, 1), b.Demand(t_short, 1)], 20)
    assert [m.positions for m in first.messages] == expected
    assert expected == [20 - t_short, t_short]
    assert len(roomy) == len(tight) == 2


def test_impossible_budget_delivers_nothing(model, tokenizer, sender):
    prompt = rclc.HFReceiver(model, tokenizer).render(REQUEST).positions
    tight = rclc.HFReceiver(model, tokenizer, context_limit=prompt + 1)  # room for 0 rows
    inbox = []
    with pytest.raises(ValueError, match="room for 0"):
        rclc.transfer_sync(sender, [inbox.append, tight], REQUEST)
    assert inbox == [] and len(tight) == 0


def test_selector_failures_deliver_nothing(model, tokenizer, sender):
    receiver = rclc.HFReceiver(model, tokenizer)
    inbox = []

    def broken(state, request_ids, budget):
        raise RuntimeError("selector failed")

    with pytest.raises(RuntimeError, match="selector failed"):
        rclc.transfer_sync(sender, [inbox.append, receiver], [REQUEST, "Where is John?"], selector=broken)
    for bad in ([3, 1], list(range(sender.positions + 1)), [0, sender.positions]):
        with pytest.raises(ValueError):
            rclc.transfer_sync(sender, [inbox.append, receiver], REQUEST, ratio=1, selector=lambda s, r, n, bad=bad: bad)
    assert inbox == [] and len(receiver) == 0


def test_custom_selector_gets_the_budget(sender):
    seen = []

    def first_rows(state, request_ids, budget):
        seen.append((request_ids.shape, budget))
        return list(range(budget))

    inbox = []
    rclc.transfer_sync(sender, inbox.append, REQUEST, budget=5, selector=first_rows)
    assert seen == [((1, len(sender.tokenizer(REQUEST, add_special_tokens=False).input_ids)), 5)]
    assert torch.equal(inbox[0].messages[0].rows, sender.input_embeds[:5])


def test_callback_exception_propagates_after_earlier_deliveries(sender):
    inbox = []

    def fails(delivery):
        raise KeyError("receiver down")

    with pytest.raises(KeyError, match="receiver down"):
        rclc.transfer_sync(sender, [inbox.append, fails, inbox.append], [REQUEST, "Where is John?"])
    assert len(inbox) == 1 and inbox[0].request == REQUEST


def test_cancellation_waits_for_the_worker_and_delivers_nothing(sender):
    started, finished = threading.Event(), threading.Event()

    def slow(state, request_ids, budget):
        started.set()
        time.sleep(0.3)
        finished.set()
        return [0]

    inbox = []

    async def main():
        task = asyncio.create_task(rclc.transfer(sender, inbox.append, REQUEST, selector=slow))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return finished.is_set()

    assert asyncio.run(main()) is True
    assert inbox == []
    rclc.transfer_sync(sender, inbox.append, REQUEST)  # reusable afterwards
    assert len(inbox) == 1


def test_caller_cache_and_sender_rows_unchanged(model, tokenizer):
    ids = tokenizer("Cedar is owned by Alice. Birch was launched in 1994.", return_tensors="pt").input_ids
    with torch.no_grad():
        cache = compat.output_cache(model(input_ids=ids, use_cache=True))
    keys = [layer.keys.clone() for layer in cache.layers]
    sender = rclc.sender_from_hf(model, tokenizer, ids, past_key_values=cache)
    rows = sender.input_embeds.clone()
    inbox = []
    rclc.transfer_sync(sender, inbox.append, [REQUEST, "When was Birch launched?"], ratio=2)
    rclc.transfer_sync(sender, inbox.append, REQUEST, budget=6, reasoning=_two_latent_steps,
                       reasoning_context="full_with_request", reasoning_budget=2)
    assert compat.cache_length(cache) == ids.shape[1]
    assert all(torch.equal(a, layer.keys) for a, layer in zip(keys, cache.layers))
    assert torch.equal(rows, sender.input_embeds) and sender.latent_steps == 0
    assert inbox[-1].messages[0].rows.data_ptr() != sender.input_embeds.data_ptr()


def _two_latent_steps(state, *, max_positions, request=None):
    return rclc.latent_mass_sync(state, 2, request, max_positions=max_positions)


def test_receiver_rejects_other_checkpoints_before_selection(model, tokenizer, sender):
    calls = []

    def spy(state, request_ids, budget):
        calls.append(budget)
        return [0]

    other, _ = build_tiny_qwen3(seed=1)
    other.config._name_or_path = "another-checkpoint"
    with pytest.raises(ValueError, match="checkpoint name"):
        rclc.transfer_sync(sender, rclc.HFReceiver(other.eval(), tokenizer), REQUEST, selector=spy)
    other_tokenizer = build_tiny_tokenizer()
    other_tokenizer.add_tokens(["zzqx"])
    with pytest.raises(ValueError, match="vocabularies"):
        rclc.transfer_sync(sender, rclc.HFReceiver(model, other_tokenizer), REQUEST, selector=spy)
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="architecture"):
        rclc.transfer_sync(sender, rclc.HFReceiver(llama.eval(), tokenizer), REQUEST, selector=spy)
    assert calls == []


def test_tensor_requests(model, tokenizer, sender):
    ids = tokenizer(REQUEST, add_special_tokens=False, return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="framing"):
        rclc.transfer_sync(sender, rclc.HFReceiver(model, tokenizer, messages=HISTORY), ids)
    bare = rclc.HFReceiver(model, tokenizer, max_new_tokens=2)
    rclc.transfer_sync(sender, bare, ids, ratio=1)
    inputs = bare.pop()
    assert torch.equal(inputs["inputs_embeds"][0, sender.positions:], hf.embed_ids(model, ids[0]))
    for bad in (ids.int(), ids[0], ids[:, :0], torch.full((1, 2), 10_000)):
        with pytest.raises(ValueError):
            rclc.transfer_sync(sender, bare, bad)


def test_inbox_pop(model, tokenizer, sender):
    receiver = rclc.HFReceiver(model, tokenizer, messages=HISTORY, max_new_tokens=8, context_limit=200)
    with pytest.raises(IndexError):
        receiver.pop()
    rclc.transfer_sync(sender, receiver, [REQUEST, "Where is John?"], ratio=4)
    assert len(receiver) == 2
    with pytest.raises(ValueError, match="context limit"):
        receiver.pop(max_new_tokens=190)
    assert len(receiver) == 2
    overridden = receiver.pop(prompt="Who owns Birch?", max_new_tokens=2)
    assert overridden["max_new_tokens"] == 2 and len(receiver) == 1
    rows = b.position_budget(sender.positions, ratio=4)
    assert overridden["inputs_embeds"].shape[1] == rows + receiver.render("Who owns Birch?").positions
    history = list(HISTORY)
    receiver.messages = history
    history.append({"role": "user", "content": "later turn"})  # affects only future transfers
    queued = receiver.pop()
    snapshot = rclc.HFReceiver(model, tokenizer, messages=HISTORY).render("Where is John?").positions
    assert snapshot < receiver.render("Where is John?").positions
    assert queued["inputs_embeds"].shape[1] == rows + snapshot
    assert len(receiver) == 0
    with pytest.raises(ValueError, match="exceeds"):
        rclc.HFReceiver(model, tokenizer, context_limit=10**6)


def test_option_errors(sender):
    inbox = []
    cases = [
        (dict(ratio=4, budget=8), ValueError),
        (dict(ratio=0), ValueError),
        (dict(representation="text"), ValueError),
        (dict(reasoning_context="full"), ValueError),
        (dict(reasoning_budget=4), ValueError),
        (dict(reasoning=_two_latent_steps, reasoning_budget=0), ValueError),
        (dict(reasoning=_two_latent_steps, reasoning_context="selected"), ValueError),
        (dict(reasoning=_two_latent_steps, reasoning_context="later", reasoning_budget=2), ValueError),
        (dict(selector="cacheback"), TypeError),
    ]
    for kwargs, error in cases:
        with pytest.raises(error):
            rclc.transfer_sync(sender, inbox.append, REQUEST, **kwargs)
    for args in (([], inbox.append, REQUEST), (sender, [], REQUEST), (sender, inbox.append, [])):
        with pytest.raises(ValueError, match="empty"):
            rclc.transfer_sync(*args)
    with pytest.raises(TypeError):
        rclc.transfer_sync("not a sender", inbox.append, REQUEST)
    assert inbox == []


def test_transfer_sync_refuses_a_running_loop(sender):
    async def main():
        with pytest.raises(RuntimeError, match="event loop"):
            rclc.transfer_sync(sender, [].append, REQUEST)

    asyncio.run(main())


class _PlannedInbox:
    """A minimal RowReceiver: a fixed space for rows, recording every hook call."""

    def __init__(self, space):
        self.space = space
        self.calls = []

    def _rclc_plan(self, request):
        empty = torch.zeros(1, 0, dtype=torch.long)
        plan = ReceiverPlan(prompt=RenderedPrompt(empty, empty), space=self.space)
        self.calls.append(("plan", request, plan))
        return plan

    def _rclc_accept(self, delivery, plan):
        self.calls.append(("accept", delivery, plan))


def test_row_receivers_take_part_in_budget_fitting(model, tokenizer, sender):
    assert isinstance(rclc.HFReceiver(model, tokenizer), RowReceiver)
    assert isinstance(rclc.bind(model, tokenizer), RowReceiver)
    inbox = []
    assert not isinstance(inbox.append, RowReceiver) and not isinstance(print, RowReceiver)

    planned = _PlannedInbox(space=5)
    requests = [REQUEST, "Where is John?"]
    rclc.transfer_sync(sender, [inbox.append, planned], requests, ratio=1)
    # Both requests are planned before anything is accepted, then accepted in request order with their own plan.
    assert [c[0] for c in planned.calls] == ["plan", "plan", "accept", "accept"]
    plans = [c[2] for c in planned.calls[:2]]
    assert [c[1] for c in planned.calls[:2]] == requests
    assert [c[2] for c in planned.calls[2:]] == plans
    assert [c[1] for c in planned.calls[2:]] == inbox  # the plain callback gets the same deliveries
    assert all(d.positions == 5 for d in inbox)  # the planned space binds every receiver of the request

    class Vetoing(_PlannedInbox):
        def _rclc_check_sender(self, state):
            self.calls.append(("check", state))
            raise ValueError("not this sender")

    vetoing, inbox = Vetoing(space=None), []
    with pytest.raises(ValueError, match="not this sender"):
        rclc.transfer_sync(sender, [inbox.append, vetoing], REQUEST)
    assert vetoing.calls == [("check", sender)] and inbox == []

    with pytest.raises(ValueError, match="room for -1"):
        rclc.transfer_sync(sender, [inbox.append, _PlannedInbox(space=-1)], REQUEST)
    assert inbox == []


def test_mixed_messages_are_checked_against_the_receivers_table_lookup(sender, monkeypatch):
    inbox = []
    rclc.transfer_sync(sender, inbox.append, REQUEST, representation="token_ids+continuous")
    real = hf.embedding_weight
    # An embedding module that scales its table: the module's rows are not `weight[ids]`, which is
    # what Message.materialize would rebuild on the receiver.
    monkeypatch.setattr(hf, "embedding_weight", lambda model: real(model) * 2.0)
    with pytest.raises(ValueError, match="do not reproduce the sender's input rows"):
        rclc.transfer_sync(sender, inbox.append, REQUEST, representation="token_ids+continuous")
    rclc.transfer_sync(sender, inbox.append, REQUEST)  # embeddings carry the rows themselves
    assert len(inbox) == 2


def test_transfer_refuses_a_sender_whose_weights_differ():
    import torch

    from ilcp.lm import build_tiny_qwen3
    from ilcp.rclc import hf

    torch.manual_seed(0)
    a, tok = build_tiny_qwen3()
    b, _ = build_tiny_qwen3()
    with torch.no_grad():
        b.get_input_embeddings().weight[0, 0] += 1.0
    hf.check_same_checkpoint(a, tok, a, tok)
    with pytest.raises(ValueError, match="different weights"):
        hf.check_same_checkpoint(a, tok, b, tok)
