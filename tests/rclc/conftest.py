"""Fixtures for the RCLC tests: the tiny Qwen3 (from tests/conftest.py) and a few contexts."""

import pytest

from ilcp import rclc

STORY = (
    "John travelled to the hallway. Mary journeyed to the bathroom. Daniel went back to the "
    "bathroom. Sandra moved to the kitchen. Cedar is owned by Alice. Birch was launched in 1994."
)


@pytest.fixture
def model(tiny_lm):
    return tiny_lm.model


@pytest.fixture
def tokenizer(tiny_lm):
    return tiny_lm.tokenizer


@pytest.fixture
def story():
    return STORY


@pytest.fixture
def story_messages():
    return [{"role": "user", "content": STORY}]


@pytest.fixture
def sender(model, tokenizer, story_messages):
    return rclc.sender_from_hf(model, tokenizer, story_messages)
