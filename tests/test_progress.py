"""Progress a log shows: with the output not a terminal, plain ``[ilcp]`` lines during extraction,
every training stage and eval, at most every 30 s (a patched clock here), and a line from the
watchdog when nothing else was said; ``progress=false`` silences them; a terminal keeps the bars."""

import io
import threading
from pathlib import Path

import pytest

from ilcp import progress
from ilcp.config import load_config
from ilcp.evaluation.run import evaluate
from ilcp.training import train
from ilcp.training.extraction import cached_token_states
from ilcp.training.log import ProgressLines, make_trainer

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
TEXTS = [f"John went to room {i}. Mary took the apple {i}." for i in range(12)]


class _Clock:
    """A clock that moves `step` seconds each time it is read."""

    def __init__(self, step: float):
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def heard(monkeypatch, capture_log):
    """The progress lines logged (non-terminal output, a clock 31 s apart at every reading)."""
    monkeypatch.setattr(progress, "monotonic", _Clock(31.0))
    monkeypatch.setattr(progress, "on_terminal", lambda stream=None: False)
    monkeypatch.setattr(progress, "_last_line", [None])
    return capture_log("ilcp.progress")


def test_ticker_prints_at_most_every_interval(monkeypatch, heard):
    clock = _Clock(10.0)  # three readings pass 30 s
    monkeypatch.setattr(progress, "monotonic", clock)
    with progress.Ticker("work", total=100, unit="rows") as tick:
        for _ in range(10):
            tick.update(10, tokens=500)
    assert 2 <= len(heard) <= 5, heard
    assert heard[0].startswith("work: 10 of 100 rows") and "tokens/s" in heard[0] and "left" in heard[0]


def test_nothing_when_disabled_or_on_a_terminal(monkeypatch, heard):
    with progress.Ticker("work", total=3, enabled=progress.lines(False)) as tick:
        tick.update(1)
    monkeypatch.setattr(progress, "on_terminal", lambda stream=None: True)
    assert progress.bars(True) and not progress.lines(True) and not progress.bars(False)
    with progress.Ticker("work", total=3, enabled=progress.lines(True)) as tick:
        tick.update(1)
    assert heard == []


def test_the_watchdog_speaks_when_a_step_is_silent(monkeypatch, heard):
    """One update, then a step that says nothing: the watchdog repeats the step's line."""
    said = threading.Event()
    original = progress.emit

    def emit(message):
        original(message)
        said.set()

    monkeypatch.setattr(progress, "emit", emit)
    with progress.keep_talking("run", poll=0.01):
        with progress.Ticker("slow step", total=4, unit="rows", enabled=False) as tick:
            tick.update(1)
            tick.enabled = True  # the step itself prints nothing more: only the watchdog does
            assert said.wait(5)
    assert any(line.startswith("slow step: 1 of 4 rows") and line.endswith("(still running)") for line in heard)


def test_extraction_prints_rows_rate_and_time_left(tiny_lm, tmp_path, heard):
    cached_token_states(tiny_lm, TEXTS, [str(i) for i in range(len(TEXTS))], {"task": "progress"},
                        cache_dir=tmp_path, batch_size=4, progress=True)
    rows = [line for line in heard if line.startswith("sender states:")]
    assert rows and rows[0].startswith("sender states: 4 of 12 rows"), heard
    assert "tokens/s" in rows[0] and "left" in rows[0]


def test_training_stages_print_step_epoch_and_loss(tiny_lm, tmp_path, heard):
    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "trainer.progress=true",
                             "handoff.variants=[ilcp]"])
    train(cfg, lm=tiny_lm)
    compressor = [line for line in heard if line.startswith("compressor:")]
    assert any("of 6 steps, epoch 1 of 3, loss" in line for line in compressor), heard
    ilcp = [line for line in heard if line.startswith("ilcp:")]
    assert any(" of 4 steps" in line and "loss" in line for line in ilcp), heard
    assert any(line.startswith("ilcp: validation:") and "batches" in line for line in heard), heard
    assert any(line.startswith("sender states:") for line in heard)
    # progress=false: no line at all
    heard.clear()
    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "trainer.progress=false",
                             "handoff.variants=[ilcp]", "run_name=quiet"])
    train(cfg, lm=tiny_lm)
    assert heard == []


def test_eval_prints_task_method_and_questions_done(tiny_run, tiny_lm, heard):
    evaluate(tiny_run.run_dir, methods=["no_context", "ilcp"], limit=3, latency_n=0, lengths=(), lm=tiny_lm,
             progress=True)
    assert any(line.startswith("babi:1 ilcp accuracy: 3 of 3 questions") for line in heard), heard
    assert any(line.startswith("babi:1 no_context accuracy:") for line in heard), heard


def test_stage_trainers_get_lines_off_a_terminal_and_bars_on_one(monkeypatch, tmp_path):
    assert progress.on_terminal(io.StringIO()) is False
    cfg = load_config(TINY, [f"out_dir={tmp_path}", "trainer.progress=true"])
    monkeypatch.setattr(progress, "on_terminal", lambda stream=None: False)
    trainer = make_trainer(cfg, tmp_path, "x", [])
    assert any(isinstance(c, ProgressLines) for c in trainer.callbacks) and trainer.progress_bar_callback is None
    monkeypatch.setattr(progress, "on_terminal", lambda stream=None: True)
    trainer = make_trainer(cfg, tmp_path, "x", [])
    assert not any(isinstance(c, ProgressLines) for c in trainer.callbacks)
    assert trainer.progress_bar_callback is not None
