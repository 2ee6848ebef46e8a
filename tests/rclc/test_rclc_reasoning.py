"""latent_mass, the four reasoning contexts with their budget accounting, custom methods, and
selection records."""

import asyncio
import json
from functools import partial

import pytest
import torch

from ilcp import compat, rclc
from ilcp.rclc import hf
from ilcp.rclc import budget as b

REQUEST = "Who owns Cedar?"


def test_latent_mass_appends_normalised_rows(model, tokenizer, sender):
    rows = sender.input_embeds.clone()
    state = asyncio.run(rclc.latent_mass(sender, steps=5))
    assert state.positions == sender.positions + 5 and state.latent_steps == 5
    assert torch.equal(state.token_ids[-5:], torch.full((5,), -1))
    assert torch.equal(state.input_embeds[: sender.positions], rows) and torch.equal(sender.input_embeds, rows)
    target = model.get_input_embeddings().weight.norm(dim=-1).mean()
    torch.testing.assert_close(state.input_embeds[-5:].norm(dim=-1), target.expand(5), rtol=1e-4, atol=1e-4)
    # The cache is exactly a prefill of all rows.
    fresh = hf.prefill(model, state.input_embeds)
    for a, c in zip(compat.cache_tensors(fresh), compat.cache_tensors(state.past_key_values)):
        torch.testing.assert_close(a[0], c[0], rtol=1e-4, atol=1e-5)
    assert rclc.latent_mass_sync(sender, steps=0) is sender
    assert rclc.latent_mass_sync(sender, steps=9, max_positions=2).latent_steps == 2


def test_latent_mass_with_request_replays_over_the_prefix(model, tokenizer, sender):
    ids = tokenizer(REQUEST, add_special_tokens=False, return_tensors="pt").input_ids
    state = rclc.latent_mass_sync(sender, 3, request=ids)
    assert state.positions == sender.positions + 3  # request tokens are not kept
    plain = rclc.latent_mass_sync(sender, 3)
    assert not torch.equal(state.input_embeds[-3:], plain.input_embeds[-3:])
    fresh = hf.prefill(model, state.input_embeds)
    for a, c in zip(compat.cache_tensors(fresh), compat.cache_tensors(state.past_key_values)):
        torch.testing.assert_close(a[1], c[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("context", ["full", "full_with_request"])
def test_reasoning_before_selection(sender, context):
    inbox = []
    rclc.transfer_sync(sender, inbox.append, REQUEST, budget=12, reasoning=partial(rclc.latent_mass, steps=4),
                       reasoning_context=context, record_selection=True)
    message = inbox[0].messages[0]
    record = message.selection
    assert message.positions == 12
    assert record.source_positions == sender.positions + 4  # the extended state
    assert record.indices[0] == 0 and record.indices[-4:] == list(range(sender.positions, sender.positions + 4))
    assert record.spans[-1]["kind"] == "latent" and record.spans[-1]["kept"]
    assert record.added_latent_positions == []


def test_reasoning_budget_caps_new_rows_before_selection(sender):
    inbox = []
    rclc.transfer_sync(sender, inbox.append, REQUEST, ratio=1, reasoning=partial(rclc.latent_mass, steps=50),
                       reasoning_budget=3)
    assert inbox[0].messages[0].positions == sender.positions + 3


@pytest.mark.parametrize("context", ["selected", "selected_with_request"])
def test_reasoning_after_selection(sender, context):
    inbox = []
    rclc.transfer_sync(sender, inbox.append, REQUEST, budget=14, reasoning=partial(rclc.latent_mass, steps=4),
                       reasoning_context=context, reasoning_budget=6, record_selection=True)
    message = inbox[0].messages[0]
    record = message.selection
    # min(14, T + 6) = 14 message positions, 8 for the selector, 4 appended (unused space not refilled).
    assert len(record.indices) == 8 and record.budget == 14
    assert message.positions == 12
    assert record.added_latent_positions == [8, 9, 10, 11]
    assert record.source_positions == sender.positions


def test_post_selection_budget_relative(sender):
    inbox = []
    rclc.transfer_sync(sender, inbox.append, REQUEST, ratio=4, reasoning=partial(rclc.latent_mass, steps=2),
                       reasoning_context="selected", reasoning_budget=2, record_selection=True)
    total, selected = b.split_post_selection(sender.positions, 0, b.BudgetMode("ratio", 4), 2)
    assert len(inbox[0].messages[0].selection.indices) == selected
    assert inbox[0].messages[0].positions == total


def test_custom_methods_sync_and_async(sender):
    seen = {}

    async def think(state, *, max_positions, request=None):
        seen["async"] = (max_positions, request.shape if request is not None else None)
        await asyncio.sleep(0)
        return await rclc.latent_mass(state, 2, request, max_positions=max_positions)

    def think_sync(state, *, max_positions, request=None):
        seen["sync"] = max_positions
        return rclc.latent_mass_sync(state, 1)

    inbox = []
    rclc.transfer_sync(sender, inbox.append, REQUEST, reasoning=think, reasoning_context="full_with_request",
                       reasoning_budget=5, ratio=1)
    rclc.transfer_sync(sender, inbox.append, REQUEST, reasoning=think_sync, reasoning_budget=5, ratio=1)
    assert seen["async"][0] == 5 and seen["async"][1][0] == 1 and seen["sync"] == 5
    assert [d.messages[0].positions for d in inbox] == [sender.positions + 2, sender.positions + 1]


def test_invalid_custom_results_deliver_nothing(sender):
    def too_many(state, *, max_positions, request=None):
        return rclc.latent_mass_sync(state, max_positions + 1)

    def changes_prefix(state, *, max_positions, request=None):
        state.input_embeds[1] += 1.0
        return state.replace(input_embeds=state.input_embeds)

    def wrong_latent(state, *, max_positions, request=None):
        grown = rclc.latent_mass_sync(state, 2)
        return grown.replace(latent_steps=1)

    def not_a_state(state, *, max_positions, request=None):
        return "done"

    rows = sender.input_embeds.clone()
    inbox = []
    for method, error in ((too_many, ValueError), (changes_prefix, ValueError), (wrong_latent, ValueError),
                          (not_a_state, TypeError)):
        with pytest.raises(error):
            rclc.transfer_sync(sender, inbox.append, REQUEST, reasoning=method, reasoning_budget=3)
    assert inbox == []
    assert torch.equal(sender.input_embeds, rows)  # methods get private copies


def test_selection_record_is_json_and_html(sender):
    inbox = []
    rclc.transfer_sync(sender, inbox.append, [REQUEST, "Where is John?"], ratio=4, record_selection=True)
    delivery = inbox[1]
    report = delivery.inspect_selection()
    text = json.dumps(report)
    assert json.loads(text) == report
    record = report[0]
    assert record["source_positions"] == sender.positions
    assert record["budget"] == len(record["indices"]) == b.position_budget(sender.positions, ratio=4)
    spans = record["spans"]
    assert spans[0]["start"] == 0 and spans[-1]["stop"] == sender.positions
    assert all(s["stop"] == t["start"] for s, t in zip(spans, spans[1:]))
    kept = [p for s in spans if s["kept"] for p in range(s["start"], s["stop"])]
    assert kept == record["indices"]
    decoded = "".join(s["text"] for s in spans)
    assert decoded == sender.tokenizer.decode(sender.token_ids)
    page = delivery.selection_html()
    assert "Where is John?" in page and page.count("background:#b9f6b0") == sum(s["kept"] for s in spans)
    assert "Sandra" in page  # omitted text is shown too
    unrecorded = []
    rclc.transfer_sync(sender, unrecorded.append, REQUEST)
    assert unrecorded[0].messages[0].selection is None
    with pytest.raises(ValueError, match="record_selection"):
        unrecorded[0].selection_html()


def test_selection_record_labels_unknown_rows(model, sender):
    state = rclc.SenderState(model=model, past_key_values=sender.past_key_values, input_embeds=sender.input_embeds)
    inbox = []
    rclc.transfer_sync(state, inbox.append, torch.tensor([[5, 6]]), ratio=2, record_selection=True,
                       representation="token_ids+continuous")
    message = inbox[0].messages[0]
    assert {s["kind"] for s in message.selection.spans} == {"unknown"}
    assert bool((message.token_ids == -1).all()) and message.rows.shape[0] == message.positions
