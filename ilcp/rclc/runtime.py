"""Worker threads and the process-wide model lock.

Every attention forward that RCLC runs (selector capture, reasoning rollouts, prefills of
selected rows) holds `MODEL_LOCK`. It is re-entrant so that a synchronous reasoning method,
which already runs under the lock, can call `latent_mass_sync` without deadlocking.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Callable

MODEL_LOCK = threading.RLock()


async def run_in_worker(fn: Callable[..., Any], *args: Any, lock: bool = True, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in a worker thread (holding `MODEL_LOCK` when ``lock``).

    Cancellation of the awaiting task does not abandon the worker: it waits until the worker
    has finished (and restored any model state), then raises `asyncio.CancelledError`.
    """
    loop = asyncio.get_running_loop()

    def work():
        if not lock:
            return fn(*args, **kwargs)
        with MODEL_LOCK:
            return fn(*args, **kwargs)

    future = loop.run_in_executor(None, functools.partial(work))
    return await wait_for_worker(future)


async def wait_for_worker(future: "asyncio.Future[Any]") -> Any:
    """Await ``future`` to completion even if cancelled meanwhile; re-raise the cancellation after."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:
            break
    if cancelled:
        if not future.cancelled():
            future.exception()  # mark retrieved; the cancellation is what the caller sees
        raise asyncio.CancelledError
    return future.result()


def require_no_running_loop(name: str) -> None:
    """Raise RuntimeError when called from a thread that runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"{name} blocks and cannot run inside a running event loop; await the async form instead"
    )
