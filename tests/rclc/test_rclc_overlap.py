"""The overlap selector: sentences ranked by the tokens they share with the request."""

import torch

from ilcp import rclc
from ilcp.config import load_config
from ilcp.evaluation.rclc_methods import RCLC_BUDGETS, parse_rclc_name
from ilcp.rclc import selectors

STORY = ("Mary went to the hallway. John moved to the garden. Mary journeyed to the kitchen. "
         "Daniel went back to the bedroom.")


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def _sentences(sender):
    return selectors.overlap.spans(sender)


def _text(tokenizer, sender, positions):
    return tokenizer.decode([sender.token_ids[p] for p in positions])


def test_the_latest_sentence_naming_the_asked_person_comes_first(model, tokenizer):
    sender = rclc.sender_from_hf(model, tokenizer, " " + STORY)
    spans = _sentences(sender)
    assert len(spans) == 4
    third = spans[2]
    # room for position 0 and one whole sentence: the later of the two sentences naming Mary
    kept = selectors.overlap(sender, _ids(tokenizer, "Where is Mary?"), 1 + third[1] - third[0])
    assert kept.tolist() == [0, *range(*third)]
    assert "kitchen" in _text(tokenizer, sender, kept.tolist())
    # another request, another sentence
    fourth = spans[3]
    kept = selectors.overlap(sender, _ids(tokenizer, "Where is Daniel?"), 1 + fourth[1] - fourth[0])
    assert kept.tolist() == [0, *range(*fourth)]


def test_a_budget_below_a_sentence_keeps_the_shared_tokens(model, tokenizer):
    sender = rclc.sender_from_hf(model, tokenizer, " " + STORY)
    kept = selectors.overlap(sender, _ids(tokenizer, "Where is John?"), 2).tolist()
    assert kept[0] == 0 and "John" in _text(tokenizer, sender, kept[1:])


def test_overlap_keeps_the_contract(model, tokenizer):
    sender = rclc.sender_from_hf(model, tokenizer, " " + STORY)
    total = sender.positions
    request = _ids(tokenizer, "Where is Mary?")
    for budget in (1, 2, 5, 9, total // 2, total - 1):
        kept = selectors.validate_positions(selectors.overlap(sender, request, budget), total, budget)
        assert int(kept[0]) == 0 and kept.numel() <= budget
    assert torch.equal(selectors.overlap(sender, request, total + 3), torch.arange(total))
    # no shared token and no request: the request-attention ranking of whole sentences
    for other in (None, _ids(tokenizer, "Why?")):
        assert torch.equal(selectors.overlap(sender, other, 12), selectors.Overlap()(sender, other, 12))


def test_overlap_is_a_named_selector_everywhere(model, tokenizer):
    assert parse_rclc_name("rclc:overlap:r4:tuned").selector == "overlap"
    assert "rclc:overlap:r16" in RCLC_BUDGETS
    assert load_config(None, ["handoff.selection_selector=overlap"]).handoff.selection_selector == "overlap"
    agent_x = rclc.bind(model, tokenizer, messages=[{"role": "user", "content": STORY}])
    agent_y = rclc.bind(model, tokenizer, messages=[{"role": "system", "content": "Answer briefly."}])
    rclc.transfer_sync(agent_x, agent_y, "Where is Mary?", ratio=4, selector=selectors.overlap)
    assert agent_y.pop()["inputs_embeds"].shape[1] > 0
