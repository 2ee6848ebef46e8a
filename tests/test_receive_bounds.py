"""Bounds checked before anything is tokenised or allocated: the characters of all of one
receive's questions together (`MAX_RECEIVE_CHARACTERS`), and every greedy decode's prompt plus its
new tokens against the LM's positions (no forward runs on a prompt that cannot fit)."""

import time

import pytest
import torch

from ilcp.handoff import ILCPHandoff
from ilcp.receiver.decoding import answer_loss_and_greedy, decode_one, greedy_decode, greedy_decode_ids
from ilcp.receiver.receive import MAX_RECEIVE_CHARACTERS


@pytest.fixture(scope="module")
def handoff(tiny_run, tiny_lm):
    return ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)


@pytest.fixture(scope="module")
def wire(handoff) -> bytes:
    """A one-latent payload, sent before any test stops the tokenizer."""
    return handoff.send("John travelled to the hallway. Mary journeyed to the bathroom.").to_bytes()


@pytest.fixture
def no_tokenizing(tiny_lm, monkeypatch):
    """The tiny LM's tokenizer, made to fail whenever it is called."""
    cls = type(tiny_lm.tokenizer)

    def refuse(self, *args, **kwargs):
        raise AssertionError("the tokenizer was called")

    monkeypatch.setattr(cls, "__call__", refuse)
    monkeypatch.setattr(cls, "encode", refuse)
    return tiny_lm.tokenizer


@pytest.fixture
def no_forward(tiny_lm, monkeypatch):
    """The tiny LM, made to fail whenever its forward runs (``ForwardRan``)."""
    def refuse(*args, **kwargs):
        raise ForwardRan

    monkeypatch.setattr(tiny_lm.model, "forward", refuse)
    return tiny_lm


class ForwardRan(Exception):
    pass


# --------------------------------------------------------------------------- receive's questions

def test_400_questions_of_130k_characters_are_refused_before_any_is_tokenised(handoff, wire, tiny_lm,
                                                                               no_tokenizing):
    question = ("Where is John? " * 9000)[:130_000]
    assert len(question) == 130_000 < tiny_lm.max_positions * 32  # each alone within its own bound
    start = time.monotonic()
    with pytest.raises(ValueError) as caught:
        handoff.receive(wire, [question] * 400)
    assert time.monotonic() - start < 10
    message = str(caught.value)
    assert "\n" not in message
    for words in ("these 400 questions hold 52,000,000 characters together", f"more than {MAX_RECEIVE_CHARACTERS:,}",
                  "MAX_RECEIVE_CHARACTERS", "ask them in several calls"):
        assert words in message, (words, message)


def test_questions_at_the_total_bound_pass_it(handoff, wire, tiny_lm, no_tokenizing):
    """Each question's own bound comes first (one overlong question is told to shorten it); at
    exactly MAX_RECEIVE_CHARACTERS the total is accepted (what refuses these questions then is the
    one-latent payload, still before tokenising); one character more is the total's refusal."""
    each = tiny_lm.max_positions * 32
    assert 8 * each == MAX_RECEIVE_CHARACTERS
    with pytest.raises(ValueError, match="question 1 has 524,288 characters, more than 4096 tokens can hold"):
        handoff.receive(wire, ["w", "w" * (MAX_RECEIVE_CHARACTERS // 2)])
    with pytest.raises(ValueError, match="1 latent"):
        handoff.receive(wire, ["w" * each] * 8)
    with pytest.raises(ValueError, match=r"these 9 questions hold 1,048,577 characters together"):
        handoff.receive(wire, ["w" * each] * 8 + ["w"])


def test_a_receive_within_the_bounds_still_answers(handoff, wire):
    assert isinstance(handoff.receive(wire, "Where is John?", max_new_tokens=2), str)


# ------------------------------------------------------------------------- decode prompt length

def prefix_of(lm, length: int) -> torch.Tensor:
    return torch.zeros(length, lm.model.config.hidden_size)


DECODES = {
    "greedy_decode": lambda lm, prefixes, n: greedy_decode(lm.model, lm.tokenizer, prefixes, max_new_tokens=n),
    "greedy_decode_ids": lambda lm, prefixes, n: greedy_decode_ids(lm.model, lm.tokenizer, prefixes,
                                                                   max_new_tokens=n, batch_size=2),
    "decode_one": lambda lm, prefixes, n: decode_one(lm.model, lm.tokenizer, prefixes[-1], max_new_tokens=n),
    "answer_loss_and_greedy": lambda lm, prefixes, n: answer_loss_and_greedy(
        lm.model, lm.tokenizer, prefixes, [[1]] * len(prefixes), max_new_tokens=n),
}


@pytest.mark.parametrize("decode", list(DECODES))
def test_a_prefix_longer_than_the_lm_s_positions_is_refused_before_any_forward(decode, no_forward):
    lm = no_forward
    limit = lm.model.config.max_position_embeddings
    assert limit == 4096
    for length, new in ((limit + 1, 4), (limit - 3, 4), (10 * limit, 1)):
        prefixes = [prefix_of(lm, 3), prefix_of(lm, length)]
        with pytest.raises(ValueError) as caught:
            DECODES[decode](lm, prefixes, new)
        message = str(caught.value)
        assert "\n" not in message
        for words in (f"a prompt of {length:,} positions plus {new} new tokens", f"context of {limit:,} positions",
                      "shorten the question or the context"):
            assert words in message, (words, message)


@pytest.mark.parametrize("decode", ["greedy_decode", "decode_one"])
def test_a_prefix_that_fits_with_its_new_tokens_reaches_the_forward(decode, no_forward):
    lm = no_forward
    limit = lm.model.config.max_position_embeddings
    with pytest.raises(ForwardRan):
        DECODES[decode](lm, [prefix_of(lm, limit - 4)], 4)


def test_answer_loss_counts_the_longest_target_against_the_positions(no_forward):
    """The teacher-forced targets follow the prefix in the same forward: a prefix that fits with
    max_new_tokens but not with its target is refused."""
    lm = no_forward
    limit = lm.model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"a prompt of {limit - 4:,} positions plus 6 new tokens"):
        answer_loss_and_greedy(lm.model, lm.tokenizer, [prefix_of(lm, limit - 4)], [[1] * 6], max_new_tokens=4)
