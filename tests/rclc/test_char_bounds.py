"""`ilcp.rclc` bounds a text by the same character rule as ILCP (`ilcp.checks.text_input`: the
model's positions x CHARS_PER_TOKEN) before its tokenizer or chat template runs: chat messages,
sender texts, requests and appended text. A refusal is one ValueError line."""

import asyncio
import time

import pytest

from ilcp import rclc
from ilcp.checks import CHARS_PER_TOKEN

HUGE = "Cedar is owned by Alice. " * 400_000  # 10,000,000 characters


@pytest.fixture
def bound(model):
    limit = model.config.max_position_embeddings
    return limit, limit * CHARS_PER_TOKEN


def _guarded(original, what):
    def call(self, text, *args, **kwargs):
        size = len(text) if isinstance(text, str) else sum(len(str(m.get("content", ""))) for m in text)
        if size > 1_000_000:
            pytest.fail(f"an overlong text reached the {what}")
        return original(self, text, *args, **kwargs)
    return call


@pytest.fixture
def no_tokenizing(tokenizer, monkeypatch):
    """A text of over a million characters reaching the tokenizer or its chat template fails the test."""
    cls = type(tokenizer)
    monkeypatch.setattr(cls, "__call__", _guarded(cls.__call__, "tokenizer"))
    monkeypatch.setattr(cls, "apply_chat_template", _guarded(cls.apply_chat_template, "chat template"))


def refused(call, *words) -> str:
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        call()
    assert time.perf_counter() - start < 2.0
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    for word in words:
        assert word in message, (word, message)
    return message


def test_bind_with_an_overlong_message_is_refused_before_tokenising(model, tokenizer, bound, no_tokenizing):
    limit, chars = bound
    refused(lambda: rclc.bind(model, tokenizer, messages=[{"role": "user", "content": HUGE}]),
            "the text of the chat messages has 10,000,000 characters",
            f"more than {limit} tokens can hold (at most {chars:,}")


def test_the_messages_are_bounded_together(model, tokenizer, bound, no_tokenizing):
    limit, chars = bound
    half = "x" * (chars // 2 + 1)
    refused(lambda: rclc.bind(model, tokenizer, messages=[{"role": "user", "content": half},
                                                          {"role": "assistant", "content": half}]),
            f"the text of the chat messages has {2 * len(half):,} characters")
    rclc.bind(model, tokenizer, messages=[{"role": "user", "content": half[:-2]}])  # within the bound


def test_a_receiver_bound_with_overlong_history_is_refused_at_once(model, tokenizer, no_tokenizing):
    refused(lambda: rclc.HFReceiver(model, tokenizer, messages=[{"role": "system", "content": HUGE}]),
            "10,000,000 characters")


def test_sender_texts_and_appends_are_bounded(model, tokenizer, story_messages, no_tokenizing):
    refused(lambda: rclc.sender_from_hf(model, tokenizer, HUGE), "the sender's text has 10,000,000 characters")
    refused(lambda: rclc.sender_from_hf(model, tokenizer, [{"role": "user", "content": HUGE}]),
            "the text of the chat messages has 10,000,000 characters")


def test_append_is_bounded(model, tokenizer, story_messages):
    agent = rclc.bind(model, tokenizer, messages=story_messages)
    kept = agent.sender_state()
    refused(lambda: asyncio.run(agent.append(HUGE)), "the appended text has 10,000,000 characters")
    assert agent.sender_state() is kept


def test_transfer_with_an_overlong_request_is_refused_before_tokenising(model, tokenizer, story_messages,
                                                                        history_y, monkeypatch):
    x = rclc.bind(model, tokenizer, messages=story_messages)
    y = rclc.bind(model, tokenizer, messages=history_y)
    cls = type(tokenizer)
    monkeypatch.setattr(cls, "__call__", _guarded(cls.__call__, "tokenizer"))
    refused(lambda: rclc.transfer_sync(x, y, HUGE, ratio=4), "the request has 10,000,000 characters")
    assert len(y) == 0


def test_a_lone_surrogate_is_refused_as_ilcp_refuses_it(model, tokenizer, story_messages, history_y):
    x = rclc.bind(model, tokenizer, messages=story_messages)
    y = rclc.bind(model, tokenizer, messages=history_y)
    refused(lambda: rclc.transfer_sync(x, y, "Who owns \ud800 Cedar?", ratio=4),
            "is not valid Unicode text: it holds a lone surrogate")


def test_texts_within_the_bound_still_transfer(model, tokenizer, story_messages, history_y):
    x = rclc.bind(model, tokenizer, messages=story_messages, max_new_tokens=4)
    y = rclc.bind(model, tokenizer, messages=history_y, max_new_tokens=4)
    rclc.transfer_sync(x, y, "Who owns Cedar?", ratio=4)
    assert len(y) == 1
