"""The reread selector: a query-agnostic score from the sender reading its own context again."""

import importlib

import pytest
import torch

from ilcp import compat, rclc
from ilcp.config import load_config
from ilcp.evaluation.rclc_methods import parse_rclc_name
from ilcp.rclc import hf, selectors
from ilcp.rclc.selectors import base
from ilcp.rclc.selectors.reread import REREAD_PROMPT

reread_module = importlib.import_module("ilcp.rclc.selectors.reread")  # the package's `reread` is the instance

STORY = "Mary went to the hallway. John moved to the garden. Sandra journeyed to the kitchen. Daniel is in the bedroom."


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


@pytest.mark.parametrize("chunk_elements", [None, 1])
def test_the_score_is_the_attention_of_a_second_reading_from_scratch(model, tokenizer, monkeypatch, chunk_elements):
    """In one pass, and fed one row at a time (the bound on attention weights held at once: the
    cache grows between chunks, the first chunks are the instruction's rows)."""
    sizes = []  # rows per chunk

    def counted(*args, **kwargs):
        for start, layers in base.attention_to_sender_chunks(*args, **kwargs):
            sizes.append(layers[0].shape[1])
            yield start, layers

    monkeypatch.setattr(reread_module, "attention_to_sender_chunks", counted)
    if chunk_elements is not None:
        monkeypatch.setattr(base, "ATTENTION_CHUNK_ELEMENTS", chunk_elements)
    sender = rclc.sender_from_hf(model, tokenizer, STORY)
    total = sender.positions
    profile = selectors.reread.profile(sender, None)
    # the same three parts in one uncached forward
    prompt = _ids(tokenizer, REREAD_PROMPT)[0]
    rows = torch.cat([sender.input_embeds, hf.embed_ids(model, prompt).to(sender.input_embeds.dtype),
                      sender.input_embeds])
    with torch.no_grad(), hf.eager_attention(model):
        attentions = model(inputs_embeds=rows[None], output_attentions=True).attentions
    sink = selectors.reread.sink_size
    expected = torch.zeros(total)
    for layer in attentions:
        w = layer[0, :, total + prompt.numel():, :total].float()
        w[..., :sink] = 0.0
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-12)
        expected += w.amax(dim=1).mean(dim=0)
    torch.testing.assert_close(profile.tail, expected / len(attentions), atol=1e-5, rtol=1e-4)
    rows = prompt.numel() + total
    assert sizes == ([rows] if chunk_elements is None else [1] * rows)
    assert compat.cache_length(sender.past_key_values) == total  # the sender's cache is untouched


def test_reread_keeps_the_contract_and_ignores_the_request(model, tokenizer):
    sender = rclc.sender_from_hf(model, tokenizer, STORY)
    total = sender.positions
    for budget in (2, 5, 9, total // 2):
        kept = selectors.reread(sender, _ids(tokenizer, "Where is John?"), budget)
        checked = selectors.validate_positions(kept, total, budget)
        assert checked.numel() == budget and int(checked[0]) == 0
        for request in (_ids(tokenizer, "Who is in the bedroom?"), None):
            assert torch.equal(selectors.reread(sender, request, budget), kept)  # query-agnostic
    assert torch.equal(selectors.reread(sender, None, total + 3), torch.arange(total))
    scores = selectors.reread.profile(sender, None).tail
    windowed = selectors.Reread(window=1)(sender, None, 6)
    # with windows of one position, the kept rows are position 0 and the five best-scored others
    others = scores.clone()
    others[: selectors.reread.sink_size] = 0.0
    others[0] = -1.0
    assert set(windowed.tolist()) == {0, *torch.topk(others, 5).indices.tolist()}


def test_reread_is_a_named_selector_everywhere(model, tokenizer):
    assert parse_rclc_name("rclc:reread:r4").selector == "reread"
    assert load_config(None, ["handoff.selection_selector=reread"]).handoff.selection_selector == "reread"
    agent_x = rclc.bind(model, tokenizer, messages=[{"role": "user", "content": STORY}])
    agent_y = rclc.bind(model, tokenizer, messages=[{"role": "system", "content": "Answer briefly."}])
    rclc.transfer_sync(agent_x, agent_y, "Where is John?", ratio=4, selector=selectors.reread)
    assert agent_y.pop()["inputs_embeds"].shape[1] > 0
