"""Progress that a log shows: plain ``[ilcp] ...`` lines when the output is not a terminal.

On a terminal the tqdm bars (Lightning's, evaluation's) draw as they always did. Redirected to a
file, a bar writes only its last frame, so a long step says where it is in lines instead: a
`Ticker` prints one at most every `LINE_SECONDS` as its step advances (rows done, tokens/s, time
left; a stage's step, epoch and loss; eval's questions done), and `keep_talking`, around a whole
run, prints what the innermost step last reported when nothing at all was printed for that long
(one batch that takes minutes, the LM loading, an export), so a log is never silent for more than
`LINE_SECONDS` and a few seconds. A setting of ``progress=False`` silences bars and lines alike.

    from ilcp.progress import Ticker
    with Ticker("extraction", total=len(rows), unit="rows", enabled=progress) as tick:
        for batch in batches:
            ...
            tick.update(len(batch), tokens=n_tokens)

Standard library only: the command lines import it before torch. Lines go to the ``ilcp.progress``
logger (the command lines print it as ``[ilcp] ...``), from the first process of a run only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

LINE_SECONDS = 30.0  # the most a long step stays silent in a log
POLL_SECONDS = 5.0  # how often `keep_talking` looks

_log = logging.getLogger("ilcp.progress")
_lock = threading.RLock()
_last_line: list[float | None] = [None]  # when the last line was printed (`monotonic`)
_steps: list["Ticker"] = []  # the steps in progress, innermost last


def monotonic() -> float:
    """The clock every interval here is measured on (tests replace it)."""
    return time.monotonic()


def on_terminal(stream=None) -> bool:
    """Whether ``stream`` (default: ``sys.stderr``, where progress goes) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False


def bars(progress: bool) -> bool:
    """Whether tqdm bars draw: progress asked for and the output a terminal."""
    return bool(progress) and on_terminal()


def lines(progress: bool) -> bool:
    """Whether plain progress lines are printed: progress asked for and the output not a terminal."""
    return bool(progress) and not on_terminal()


def _first_process() -> bool:
    if os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get("RANK", "0") != "0":
        return False
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is None or not dist.is_initialized() or dist.get_rank() == 0
    except Exception:
        return True


def heard() -> None:
    """A line went to the log now (the training's own lines call this too)."""
    _last_line[0] = monotonic()


def emit(message: str) -> None:
    """One progress line, from the first process only."""
    if _first_process():
        _log.info(message)
    heard()


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 90:
        return f"{seconds}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _value(v) -> str:
    if callable(v):
        v = v()
    if hasattr(v, "item"):  # a tensor: read only when a line is printed
        v = v.item()
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


class Ticker:
    """The progress of one long step, as lines at most every ``every`` seconds.

    ``update(advance, done=, tokens=, **fields)`` counts ``advance`` more of ``total`` units done
    (or sets the count to ``done``; and
    ``tokens`` more tokens, for a rate) and sets named fields (a step, a loss: values, tensors or
    callables, read only when a line is printed); a line is printed when ``every`` seconds have
    passed since the last line anywhere. Disabled (``enabled=False``), it prints nothing.
    """

    def __init__(self, name: str, total: int | None = None, unit: str = "rows", *, enabled: bool = True,
                 every: float = LINE_SECONDS):
        self.name, self.total, self.unit = name, total, unit
        self.enabled, self.every = bool(enabled), float(every)
        self.done, self.tokens = 0, 0
        self.fields: dict = {}
        self.start = monotonic()

    def __enter__(self) -> "Ticker":
        self.start = monotonic()
        with _lock:
            _steps.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            if self in _steps:
                _steps.remove(self)

    def line(self) -> str:
        parts = []
        if self.total is not None:
            parts.append(f"{self.done:,} of {self.total:,} {self.unit}")
        elif self.done:
            parts.append(f"{self.done:,} {self.unit}")
        parts += [f"{k} {_value(v)}" for k, v in self.fields.items()]
        elapsed = monotonic() - self.start
        if self.tokens and elapsed > 0:
            parts.append(f"{self.tokens / elapsed:,.0f} tokens/s")
        if self.total and 0 < self.done < self.total and elapsed > 0:
            parts.append(f"about {_duration(elapsed * (self.total - self.done) / self.done)} left")
        parts.append(f"{_duration(elapsed)} in")
        return f"{self.name}: {', '.join(parts)}"

    def update(self, advance: int = 0, *, done: int | None = None, tokens: int = 0, **fields) -> None:
        self.done = int(done) if done is not None else self.done + int(advance)
        self.tokens += int(tokens)
        self.fields.update(fields)
        if not self.enabled:
            return
        with _lock:
            last = _last_line[0]
            if last is None or monotonic() - last >= self.every:
                emit(self.line())


@contextlib.contextmanager
def keep_talking(name: str, enabled: bool = True, every: float = LINE_SECONDS, poll: float = POLL_SECONDS):
    """Around a whole run: a thread that, when nothing was printed for ``every`` seconds, prints
    the innermost step's line (or that ``name`` is still running), so a log is never silent for
    longer than ``every + poll`` seconds."""
    if not enabled:
        yield
        return
    stop = threading.Event()
    start = monotonic()
    heard()
    listener = _Heard()
    logging.getLogger("ilcp").addHandler(listener)  # every line of the package counts

    def watch():
        while not stop.wait(poll):
            with _lock:
                last = _last_line[0]
                if last is not None and monotonic() - last < every:
                    continue
                step = _steps[-1] if _steps else None
                emit(f"{step.line()} (still running)" if step is not None and step.enabled
                     else f"{name}: still running, {_duration(monotonic() - start)} in")

    thread = threading.Thread(target=watch, name="ilcp-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=poll + 1)
        logging.getLogger("ilcp").removeHandler(listener)


class _Heard(logging.Handler):
    def emit(self, record) -> None:
        heard()



def tracked(items, name: str, *, progress: bool, total: int | None = None, unit: str = "questions",
            size=None):
    """``items``, iterated with a tqdm bar on a terminal, with `Ticker` lines elsewhere (counting
    ``size(item)`` units an item, default one), silently with ``progress=False``."""
    if bars(progress):
        from tqdm.auto import tqdm

        yield from tqdm(items, desc=name, disable=False, leave=False)
        return
    units = total if total is not None else (len(items) if size is None else None)
    with Ticker(name, total=units, unit=unit, enabled=lines(progress)) as tick:
        for item in items:
            yield item
            tick.update(1 if size is None else size(item))
