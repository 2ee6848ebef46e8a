"""Bound agents: binding, lazy history prefill, pop/inputs/update/append transitions and their
failure guarantees (a failed or cancelled call keeps the state, pending inputs and queue)."""

import asyncio

import pytest
import torch

from ilcp import compat, rclc
from ilcp.rclc import backends, hf


@pytest.fixture
def prefills(monkeypatch):
    """Record the number of rows of every prefill RCLC runs."""
    counts = []
    real = hf.prefill

    def counting(model, rows, cache=None):
        counts.append(int(rows.shape[0]))
        return real(model, rows, cache)

    monkeypatch.setattr(hf, "prefill", counting)
    return counts


@pytest.fixture
def slow_worker(monkeypatch):
    """Make a backend method sleep in its worker so a test can cancel while it runs."""

    def install(name: str, seconds: float = 0.3):
        real = getattr(backends.HFBackend, name)

        def slow(self, *args, **kwargs):
            import time

            time.sleep(seconds)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(backends.HFBackend, name, slow)

    return install


def _cancel_after(coro, delay: float = 0.05):
    async def main():
        task = asyncio.ensure_future(coro)
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def _snapshot(agent):
    """What the failure guarantees promise to keep."""
    return (agent._explicit, agent._history, agent._pending, [d for d, _ in agent._receiver.queued()])


def _received(agent, sender, request="Who owns Cedar?", **kwargs):
    rclc.transfer_sync(sender, agent, request, **kwargs)


# ------------------------------------------------------------------------------------ bind


def test_bind_validates_sources_and_backend(model, tokenizer, history_x):
    with pytest.raises(rclc.BackendUnavailableError, match="backend='vllm' is not available.*backend='hf'"):
        rclc.bind(model, tokenizer, messages=history_x, backend="vllm")
    with pytest.raises(ValueError, match="backend must be one of"):
        rclc.bind(model, tokenizer, backend="tgi")
    with pytest.raises(ValueError, match="not both"):
        rclc.bind(model, tokenizer, prompt="a", generation=object())
    with pytest.raises(ValueError, match="past_key_values needs"):
        rclc.bind(model, tokenizer, past_key_values=object())
    with pytest.raises(ValueError, match="max_new_tokens"):
        rclc.bind(model, tokenizer, max_new_tokens=0)
    with pytest.raises(ValueError, match="exceeds the model"):
        rclc.bind(model, tokenizer, context_limit=10**6)
    with pytest.raises(ValueError, match="context limit"):
        rclc.bind(model, tokenizer, prompt="Cedar is owned by Alice. " * 20, context_limit=16)
    agent = rclc.bind(model, tokenizer)
    assert agent.backend == "hf" and agent.engine is None and agent.model is model and len(agent) == 0
    with pytest.raises(ValueError, match="no sender state"):
        agent.sender_state()


def test_bind_without_tokenizer_needs_ids(model):
    agent = rclc.bind(model, prompt=torch.tensor([[5, 6, 7]]))
    assert agent.sender_state().positions == 3
    with pytest.raises(ValueError, match="tokenizer"):
        asyncio.run(agent.append("text"))
    asyncio.run(agent.append(torch.tensor([[8]])))
    assert agent.sender_state().positions == 4


def test_explicit_prompt_generation_and_cache(model, tokenizer, history_y):
    ids = tokenizer("Cedar is owned by Alice.", return_tensors="pt").input_ids
    output = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = compat.output_cache(output)
    before = compat.cache_length(cache)
    a = rclc.bind(model, tokenizer, messages=history_y, generation=output)
    b = rclc.bind(model, tokenizer, messages=history_y, prompt=output.sequences, past_key_values=cache)
    assert a.sender_state().positions == b.sender_state().positions == output.sequences.shape[1]
    assert compat.cache_length(cache) == before
    assert torch.equal(a.sender_state().token_ids, output.sequences[0])


# ------------------------------------------------------------------------------ history


def test_history_prefill_is_lazy_and_reuses_the_cache(model, tokenizer, story, prefills):
    history = [{"role": "user", "content": story}]
    agent = rclc.bind(model, tokenizer, messages=history)
    assert prefills == []  # lazy: nothing at bind
    first = agent.sender_state()
    assert prefills == [first.positions]
    assert agent.sender_state() is first and prefills == [first.positions]  # unchanged history: reused

    history.append({"role": "assistant", "content": "Alice."})
    second = agent.sender_state()
    assert prefills == [first.positions, second.positions - first.positions]  # only the suffix
    assert torch.equal(second.input_embeds[: first.positions], first.input_embeds)
    assert compat.cache_length(first.past_key_values) == first.positions  # handed-out state untouched
    fresh = rclc.sender_from_hf(model, tokenizer, history)
    for (k1, v1), (k2, v2) in zip(compat.cache_tensors(second.past_key_values), compat.cache_tensors(fresh.past_key_values)):
        assert torch.allclose(k1, k2, atol=1e-5) and torch.allclose(v1, v2, atol=1e-5)

    history[0] = {"role": "user", "content": story.replace("Alice", "Bruno")}  # an earlier edit
    third = agent.sender_state()
    assert prefills[-1] == third.positions  # a fresh prefill


def test_transfer_prefills_history_in_a_worker(model, tokenizer, history_x, history_y, prefills):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y)
    rclc.transfer_sync(x, y, "Who owns Cedar?")
    rclc.transfer_sync(x, y, "Where is John?")
    assert prefills == [x.sender_state().positions]  # once for both sends
    assert len(y) == 2


def test_explicit_state_stays_current_until_append_or_update(model, tokenizer, history_x):
    history = [dict(m) for m in history_x]
    agent = rclc.bind(model, tokenizer, messages=history, prompt="Cedar is owned by Alice.")
    explicit = agent.sender_state()
    history.append({"role": "assistant", "content": "ok"})
    assert agent.sender_state() is explicit  # history changes do not touch explicit state
    agent.update()  # back to the history
    from_history = rclc.sender_from_hf(model, tokenizer, history).positions
    assert agent.sender_state().positions == from_history
    asyncio.run(agent.append(" Tool: ok"))  # appending to the history makes explicit state
    appended = agent.sender_state()
    assert appended.positions > from_history and agent._explicit is appended
    history.append({"role": "user", "content": "more"})
    assert agent.sender_state() is appended


def test_lists_mix_agents_and_sender_states(model, tokenizer, history_x, history_y, sender):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y)
    inbox = []
    rclc.transfer_sync([x, sender], [y, inbox.append], ["Who owns Cedar?", "Where is John?"])
    assert len(y) == 2 and len(inbox) == 2 and len(inbox[0].messages) == 2
    rclc.transfer_sync(sender, [x, y], "Who owns Cedar?")  # agents as receivers of a SenderState
    assert len(x) == 1 and len(y) == 3


# ------------------------------------------------------------------------- pop and update


def test_pop_update_records_the_continuation(model, tokenizer, history_x, history_y):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=6)
    _received(y, x, representation="token_ids+continuous")
    inputs = y.pop()
    assert inputs["max_new_tokens"] == 6 and len(y) == 0
    with pytest.raises(RuntimeError, match="pending"):
        y.pop()  # a second pop raises until update records the continuation
    with pytest.raises(RuntimeError, match="pending"):
        rclc.transfer_sync(y, x, "Where is John?")  # no stale state is sent
    output = model.generate(**inputs, do_sample=False, return_dict_in_generate=True)
    y.update(inputs=inputs, generation=output)
    state = y.sender_state()
    p, n = inputs["inputs_embeds"].shape[1], output.sequences.shape[1]
    assert state.positions == p + n
    assert torch.equal(state.input_embeds[:p], inputs["inputs_embeds"][0])
    assert torch.equal(state.token_ids[p:], output.sequences[0])
    # mixed payloads: received rows keep their known IDs, only continuous rows would be -1
    delivery_ids = state.token_ids[: state.inherited_positions]
    assert bool((delivery_ids >= 0).all())
    # the continued cache equals a fresh prefill of the same rows
    fresh = hf.prefill(model, state.input_embeds)
    for (k1, v1), (k2, v2) in zip(compat.cache_tensors(state.past_key_values), compat.cache_tensors(fresh)):
        assert torch.allclose(k1, k2, atol=1e-5) and torch.allclose(v1, v2, atol=1e-5)
    rclc.transfer_sync(y, x, "Where is John?")  # the continuation is sent back
    assert len(x) == 1


def test_received_continuous_rows_are_inherited_and_unknown(model, tokenizer, history_x, history_y):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    _received(y, x)
    delivery = y._receiver.peek()
    inputs = y.pop()
    y.update(inputs=inputs, generation=model.generate(**inputs, do_sample=False, return_dict_in_generate=True))
    state = y.sender_state()
    assert state.inherited_positions == delivery.positions
    assert bool((state.token_ids[: delivery.positions] == -1).all())
    assert bool((state.token_ids[delivery.positions:] >= 0).all())


def test_in_prompt_placement_counts_through_the_last_received_row(model, tokenizer, history_x):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, max_new_tokens=4, placement="in_prompt")
    _received(y, x)
    delivery = y._receiver.peek()
    before = y._receiver.render("Who owns Cedar?").before.shape[1]
    inputs = y.pop()
    y.update(inputs=inputs, generation=model.generate(**inputs, do_sample=False, return_dict_in_generate=True))
    state = y.sender_state()
    assert state.inherited_positions == before + delivery.positions
    assert bool((state.token_ids[before: before + delivery.positions] == -1).all())


def test_pop_discard_pending_replaces_the_pending_inputs(model, tokenizer, history_x, history_y):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    _received(y, x, request=["Who owns Cedar?", "Where is John?"])
    first = y.pop()
    second = y.pop(discard_pending=True)
    with pytest.raises(ValueError, match="exact dictionary"):
        y.update(inputs=first, generation=model.generate(**first, return_dict_in_generate=True))
    y.update(inputs=second, generation=model.generate(**second, do_sample=False, return_dict_in_generate=True))
    assert y._pending is None and len(y) == 0


def test_failed_pop_keeps_queue_and_pending(model, tokenizer, history_x, history_y):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    with pytest.raises(IndexError):
        y.pop()
    _received(y, x)
    kept = _snapshot(y)
    with pytest.raises(ValueError, match="context limit"):
        y.pop(max_new_tokens=10**5)
    with pytest.raises(ValueError):
        y.pop(max_new_tokens=0)
    with pytest.raises(TypeError):
        y.pop(prompt=3.5)
    assert _snapshot(y) == kept and len(y) == 1
    y.pop()
    kept = _snapshot(y)
    with pytest.raises(RuntimeError):
        y.pop()
    assert _snapshot(y) == kept


def test_failed_updates_keep_state_pending_and_queue(model, tokenizer, history_x, history_y, monkeypatch):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="no pending"):
        y.update(inputs={}, generation=torch.tensor([[1]]))
    _received(y, x, request=["Who owns Cedar?", "Where is John?"])
    inputs = y.pop()
    output = model.generate(**inputs, do_sample=False, return_dict_in_generate=True)
    kept = _snapshot(y)

    with pytest.raises(ValueError, match="needs generation"):
        y.update(inputs=inputs)
    with pytest.raises(ValueError, match="exact dictionary"):
        y.update(inputs=dict(inputs), generation=output)
    with pytest.raises(ValueError, match="input_ids"):
        inputs["input_ids"] = torch.tensor([[1]])
        try:
            y.update(inputs=inputs, generation=output)
        finally:
            del inputs["input_ids"]
    with pytest.raises(ValueError, match="vocabulary|must lie"):
        y.update(inputs=inputs, generation=torch.tensor([[10**6]]))
    too_long = torch.zeros(1, inputs["inputs_embeds"].shape[1] + 20, dtype=torch.long)
    output_cache = compat.output_cache(output)
    with pytest.raises(ValueError, match="not generated from these inputs"):
        y.update(inputs=inputs, generation=type(output)(sequences=output.sequences[:, :1], cache=output_cache))
    with pytest.raises(ValueError, match="context limit"):
        small = rclc.bind(model, tokenizer, messages=history_y, context_limit=inputs["inputs_embeds"].shape[1] + 4,
                          max_new_tokens=4)
        small._pending, small._receiver._queue = y._pending, y._receiver._queue
        small.update(inputs=inputs, generation=too_long)
    with pytest.raises(ValueError, match="inputs_embeds generation"):
        y.update(generation=output)  # an inputs_embeds generation is not a token generation
    with pytest.raises(ValueError, match="past_key_values needs"):
        y.update(past_key_values=output_cache)

    def failing(*args, **kwargs):
        raise RuntimeError("forward failed")

    monkeypatch.setattr(hf, "prefill", failing)
    with pytest.raises(RuntimeError, match="forward failed"):
        y.update(inputs=inputs, generation=output)
    monkeypatch.undo()
    assert _snapshot(y) == kept and len(y) == 1
    y.update(inputs=inputs, generation=output)  # still possible after the failures
    assert y._pending is None and len(y) == 1


def test_update_forms(model, tokenizer, history_y):
    agent = rclc.bind(model, tokenizer, messages=history_y)
    ids = tokenizer("Cedar is owned by Alice.", return_tensors="pt").input_ids
    output = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    agent.update(generation=output)
    assert torch.equal(agent.sender_state().token_ids, output.sequences[0])
    agent.update(output.sequences, past_key_values=compat.output_cache(output))
    assert agent.sender_state().positions == output.sequences.shape[1]
    agent.update("Birch was launched in 1994.")
    assert agent.sender_state().positions == len(tokenizer("Birch was launched in 1994.")["input_ids"])
    agent.update()
    assert agent._explicit is None
    assert agent.sender_state().positions == rclc.sender_from_hf(model, tokenizer, history_y).positions


# --------------------------------------------------------------------------------- inputs


def test_inputs_records_pending_without_consuming(model, tokenizer, history_x, history_y):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    _received(y, x)
    inputs = asyncio.run(y.inputs(max_new_tokens=3))
    history_positions = rclc.sender_from_hf(model, tokenizer, history_y).positions
    assert inputs["inputs_embeds"].shape[1] == history_positions and inputs["max_new_tokens"] == 3
    assert len(y) == 1  # nothing consumed
    with pytest.raises(RuntimeError, match="pending"):
        asyncio.run(y.inputs())
    with pytest.raises(RuntimeError, match="pending"):
        y.pop()
    output = model.generate(**inputs, do_sample=False, return_dict_in_generate=True)
    y.update(inputs=inputs, generation=output)
    assert y.sender_state().positions == history_positions + output.sequences.shape[1]
    assert y.sender_state().inherited_positions == 0


def test_inputs_hands_over_the_held_cache_so_generation_prefills_one_row(model, tokenizer, history_y):
    agent = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    fresh = asyncio.run(agent.inputs())  # nothing prefilled yet: no cache to reuse
    assert compat.cache_argument_name(type(model)) not in fresh
    agent.update()  # drops the pending inputs
    asyncio.run(agent.append("Tell me where Birch is."))  # the agent now holds an explicit state and its cache
    state = agent.sender_state()
    held_before = compat.cache_length(state.past_key_values)
    inputs = asyncio.run(agent.inputs())
    name = compat.cache_argument_name(type(model))
    assert compat.cache_length(inputs[name]) == state.positions - 1
    plain = {k: v for k, v in inputs.items() if k != name}
    reused = model.generate(**inputs, do_sample=False, return_dict_in_generate=True, output_scores=True)
    again = model.generate(**plain, do_sample=False, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(reused.sequences, again.sequences)
    for a, b in zip(reused.scores, again.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert compat.cache_length(state.past_key_values) == held_before  # the agent's own cache is untouched
    agent.update(inputs=inputs, generation=reused)
    assert agent.sender_state().positions == state.positions + reused.sequences.shape[1]


def test_inputs_failures_and_cancellation(model, tokenizer, history_y, slow_worker):
    agent = rclc.bind(model, tokenizer, messages=history_y, context_limit=64)
    with pytest.raises(ValueError, match="output positions exceed"):
        asyncio.run(agent.inputs(max_new_tokens=60))
    with pytest.raises(ValueError, match="max_new_tokens"):
        asyncio.run(agent.inputs(max_new_tokens=-1))
    assert agent._pending is None
    slow_worker("embed")
    _cancel_after(agent.inputs(max_new_tokens=4))
    assert agent._pending is None and agent._busy is None
    assert asyncio.run(agent.inputs(max_new_tokens=4))["max_new_tokens"] == 4


# --------------------------------------------------------------------------------- append


def test_append_extends_only_the_new_tokens(model, tokenizer, history_x, history_y, prefills):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    _received(y, x)
    inputs = y.pop()
    y.update(inputs=inputs, generation=model.generate(**inputs, do_sample=False, return_dict_in_generate=True))
    before = y.sender_state()
    prefills.clear()
    messages_before = [dict(m) for m in history_y]
    asyncio.run(y.append("<|im_start|>user\nTool result: 42<|im_end|>\n"))
    asyncio.run(y.append(torch.tensor([[5, 6]])))
    after = y.sender_state()
    tool = len(tokenizer("<|im_start|>user\nTool result: 42<|im_end|>\n", add_special_tokens=False)["input_ids"])
    assert prefills == [tool, 2]  # only the appended tokens are prefilled
    assert after.positions == before.positions + tool + 2
    assert after.inherited_positions == before.inherited_positions
    assert torch.equal(after.input_embeds[: before.positions], before.input_embeds)
    assert torch.equal(after.token_ids[-2:], torch.tensor([5, 6]))
    assert compat.cache_length(before.past_key_values) == before.positions  # private copy
    assert history_y == messages_before  # messages are left alone


def test_append_failures_and_cancellation(model, tokenizer, history_x, history_y, slow_worker):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4, context_limit=200)
    _received(y, x)
    asyncio.run(y.append("Tool: ok"))
    kept = _snapshot(y)
    with pytest.raises(ValueError):
        asyncio.run(y.append(""))
    with pytest.raises(TypeError):
        asyncio.run(y.append(["not", "ids"]))
    with pytest.raises(ValueError, match="int64"):
        asyncio.run(y.append(torch.tensor([[1.0]])))
    with pytest.raises(ValueError, match="context limit"):
        asyncio.run(y.append(torch.ones(1, 300, dtype=torch.long)))
    slow_worker("extend")
    _cancel_after(y.append("Tool: cancelled"))
    assert _snapshot(y) == kept and y._busy is None
    y.pop()
    with pytest.raises(RuntimeError, match="pending"):
        asyncio.run(y.append("Tool: late"))  # record pending generation first


# ------------------------------------------------------------------------ busy and cancel


def test_operations_refused_while_another_runs(model, tokenizer, history_y, slow_worker):
    agent = rclc.bind(model, tokenizer, messages=history_y)
    slow_worker("extend", 0.4)

    async def main():
        task = asyncio.ensure_future(agent.append("Tool: ok"))
        await asyncio.sleep(0.1)
        with pytest.raises(RuntimeError, match="in progress"):
            agent.update()
        with pytest.raises(RuntimeError, match="in progress"):
            agent.sender_state()
        await task

    asyncio.run(main())
    assert agent._explicit is not None


def test_cancelled_transfer_keeps_the_history_cache(model, tokenizer, history_x, history_y, slow_worker):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y)
    slow_worker("history_state")
    _cancel_after(rclc.transfer(x, y, "Who owns Cedar?"))
    assert x._history is None and x._busy is None and len(y) == 0
    rclc.transfer_sync(x, y, "Who owns Cedar?")  # reusable once cancellation completes
    assert len(y) == 1


def test_public_views_follow_the_state_machine(model, tokenizer, history_x, history_y):
    x = rclc.bind(model, tokenizer, messages=history_x)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    assert rclc.bind(model, tokenizer).state_source == "none"
    assert x.state_source == "history" and x.prepared_state is None  # the prefill is lazy
    assert x.describe()["architecture"] == type(model).__name__
    state = x.sender_state()
    assert x.prepared_state is state
    rclc.transfer_sync(x, y, "Who owns Cedar?")
    (delivery, prompt), = y.queued()
    assert delivery is y._receiver.peek() and prompt.positions == y._receiver.render("Who owns Cedar?").positions
    assert y.pending is None
    inputs = y.pop()
    pending = y.pending
    assert pending.inputs is inputs and pending.source == "pop" and y.queued() == []
    assert pending.positions == inputs["inputs_embeds"].shape[1] and pending.inherited_positions == delivery.positions
    y.update(inputs=inputs, generation=model.generate(**inputs, do_sample=False, return_dict_in_generate=True))
    assert y.pending is None and y.state_source == "explicit" and y.prepared_state is y._explicit
    assert y.prepared_state.inherited_positions == delivery.positions
    with pytest.raises(AttributeError):
        y.pending = None  # read-only
