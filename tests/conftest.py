"""Shared fixtures: the tiny random Qwen3 (hidden 64, 2 layers) and, for the few integration
tests marked slow, the embedded SmolLM2."""

import pytest

from ilcp.lm import DEFAULT_LM, TINY_LM, load_lm


@pytest.fixture(scope="session")
def tiny_lm():
    """The tiny test LM. Shared by every test: treat it as read-only."""
    return load_lm(TINY_LM)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default LM (converted once into the user's cache)."""
    return load_lm(DEFAULT_LM)
