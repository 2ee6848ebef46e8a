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


@pytest.fixture
def history_x(story):
    """A sender's chat history (the story as a prior user turn)."""
    return [{"role": "user", "content": story}]


@pytest.fixture
def history_y():
    """A receiver's chat history (system instructions only)."""
    return [{"role": "system", "content": "Answer the question with one word."}]


@pytest.fixture(scope="session")
def other_lm():
    """A tiny Qwen3 with other random weights (seed 1) and the same tokenizer and config."""
    from ilcp.lm import build_tiny_qwen3

    model, tokenizer = build_tiny_qwen3(seed=1)
    return model.eval(), tokenizer


@pytest.fixture(params=["tiny-qwen3", pytest.param("smollm2-135m-instruct", marks=pytest.mark.slow)])
def spec_lm(request):
    """The LM the spec's examples run on: the tiny Qwen3, and the embedded SmolLM2 (slow)."""
    return request.getfixturevalue("tiny_lm" if request.param == "tiny-qwen3" else "smollm2")
