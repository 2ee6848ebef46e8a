"""Shared fixtures: the tiny random Qwen3 (hidden 64, 2 layers), one tiny training run on it that
every test reads, and, for the few integration tests marked slow, the embedded SmolLM2."""

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest

from ilcp.config import TrainConfig, load_config
from ilcp.lm import DEFAULT_LM, TINY_LM, load_lm

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def raw_weight_digest(model) -> str:
    """sha256 over every tensor of a model's state dict, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="session")
def tiny_lm():
    """The tiny test LM. Shared by every test: treat it as read-only."""
    return load_lm(TINY_LM)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default LM (converted once into the user's cache)."""
    return load_lm(DEFAULT_LM)


@dataclass(frozen=True)
class TinyRun:
    """The tiny config trained once per test session; tests must not write into its folder."""

    cfg: TrainConfig
    result: object  # ilcp.training.TrainResult
    lm_digest_before: str
    lm_digest_after: str

    @property
    def run_dir(self) -> Path:
        return self.result.run_dir


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_lm) -> TinyRun:
    from ilcp.training import train

    out = tmp_path_factory.mktemp("tiny-run")
    cfg = load_config(TINY_CONFIG, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}"])
    before = raw_weight_digest(tiny_lm.model)
    result = train(cfg, lm=tiny_lm)
    return TinyRun(cfg, result, before, raw_weight_digest(tiny_lm.model))


@pytest.fixture
def capture_log():
    """``capture_log(name)``: the list of messages the logger ``name`` emits at INFO and above until
    the test ends (its handler and level restored then)."""
    undo = []

    def capture(name: str) -> list[str]:
        found: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: found.append(record.getMessage())
        logger = logging.getLogger(name)
        undo.append((logger, handler, logger.level))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        return found

    yield capture
    for logger, handler, level in reversed(undo):
        logger.removeHandler(handler)
        logger.setLevel(level)
