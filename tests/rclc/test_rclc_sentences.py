"""The sentences selector: whole sentences or nothing, within the budget, position 0 and the latent
tail kept; and select_groups with explicit spans."""

import pytest
import torch

from ilcp import compat, rclc
from ilcp.rclc import hf, selectors

STORY = "Mary went to the hallway. John moved to the garden. Sandra journeyed to the kitchen. Daniel is in the bedroom."


@pytest.fixture
def plain_sender(model, tokenizer):
    return rclc.sender_from_hf(model, tokenizer, STORY)


@pytest.fixture
def request_ids(tokenizer):
    return tokenizer("Where is John?", add_special_tokens=False, return_tensors="pt").input_ids


def _sentence_spans(sender):
    spans = selectors.sentences.spans(sender)
    assert spans[0][0] == 0 and spans[-1][1] == sender.positions
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    return spans


def test_spans_end_at_sentence_ends(plain_sender, tokenizer):
    spans = _sentence_spans(plain_sender)
    texts = [tokenizer.decode(plain_sender.token_ids[a:b]).strip() for a, b in spans]
    assert texts == ["Mary went to the hallway.", "John moved to the garden.", "Sandra journeyed to the kitchen.",
                     "Daniel is in the bedroom."]


@pytest.mark.parametrize("budget", [3, 7, 12, 20])
def test_only_whole_sentences_are_kept(plain_sender, request_ids, budget):
    kept = selectors.sentences(plain_sender, request_ids, budget)
    checked = selectors.validate_positions(kept, plain_sender.positions, budget)
    kept = set(checked.tolist())
    assert 0 in kept
    for a, b in _sentence_spans(plain_sender):
        inside = kept & set(range(a, b)) - {0}
        assert not inside or inside == set(range(a, b)) - {0}, (a, b, sorted(kept))
    shortest = min(b - a for a, b in _sentence_spans(plain_sender))
    if budget > shortest:
        assert len(kept) > 1  # a whole sentence fits, so one is kept


def test_continuous_rows_are_grouped_in_windows_and_the_latent_tail_kept(model, plain_sender, request_ids):
    torch.manual_seed(1)
    extra = torch.randn(6, plain_sender.hidden_size) * 0.05
    cache = hf.prefill(model, extra, compat.clone_cache(plain_sender.past_key_values))
    sender = rclc.SenderState(model=model, past_key_values=cache,
                              input_embeds=torch.cat([plain_sender.input_embeds, extra]),
                              tokenizer=plain_sender.tokenizer, latent_steps=2,
                              token_ids=torch.cat([plain_sender.token_ids, torch.full((6,), -1)]))
    spans = _sentence_spans(sender)
    total = plain_sender.positions
    assert spans[-2:] == [(total, total + 4), (total + 4, total + 6)]
    kept = selectors.sentences(sender, request_ids, 12).tolist()
    assert kept[0] == 0 and kept[-2:] == [total + 4, total + 5]
    no_tokenizer = rclc.SenderState(model=model, past_key_values=plain_sender.past_key_values,
                                    input_embeds=plain_sender.input_embeds)
    assert selectors.sentences.spans(no_tokenizer)[:2] == [(0, 4), (4, 8)]


def test_select_groups_with_spans_skips_what_does_not_fit_and_checks_the_spans():
    scores = torch.tensor([0.0, 0.9, 0.9, 0.9, 0.1, 0.5, 0.5])
    spans = [(0, 1), (1, 4), (4, 5), (5, 7)]
    protected = torch.tensor([0])
    # mean scores: 0.0, 0.9, 0.1, 0.5; a budget of 3 holds [0] and one sentence of two rows
    assert selectors.select_groups(scores, 3, protected, spans=spans, reduce="mean", trim_last=False).tolist() == [0, 5, 6]
    assert selectors.select_groups(scores, 3, protected, spans=spans, reduce="mean").tolist() == [0, 1, 2]
    assert selectors.select_groups(scores, 7, protected, spans=spans, reduce="mean", trim_last=False).tolist() == list(range(7))
    for bad in ([(0, 3), (4, 7)], [(0, 4), (4, 6)], [(0, 0), (0, 7)], []):
        with pytest.raises(ValueError, match="spans must tile"):
            selectors.select_groups(scores, 3, protected, spans=bad)
