"""Latency: one handoff request run unbatched and timed (`time_request`), and a method's latency
summary on a task's first rows (`latency`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..receiver.decoding import decode_one
from ..progress import tracked
from ..stats import latency_summary
from .registry import HandoffMethod

__all__ = ["TimedRequest", "latency", "time_request"]


@dataclass(frozen=True)
class TimedRequest:
    """Seconds of one handoff request: sender, receiver to first token, receiver to the full answer."""

    sender_s: float
    receiver_ttft_s: float
    receiver_total_s: float
    prefill_positions: int
    wire_bytes: int
    text: str

    @property
    def handoff_s(self) -> float:
        return self.sender_s + self.receiver_ttft_s


def time_request(method: HandoffMethod, row: dict, *, max_new_tokens: int = 8) -> TimedRequest:
    """Run one request unbatched: ``send`` (sender), then ``receive`` and `decode_one` (receiver;
    a method that decodes itself: its `decode_received`)."""
    lm = method.lm
    t0 = time.perf_counter()
    sent = method.send(row)
    t1 = time.perf_counter()
    prefix = method.receive(sent, row)
    t2 = time.perf_counter()
    if method.decodes_itself:
        result = method.decode_received(prefix, row, max_new_tokens=max_new_tokens, stop_at_newline=True)
    else:
        result = decode_one(lm.model, lm.tokenizer, prefix, max_new_tokens=max_new_tokens, stop_at_newline=True)
    return TimedRequest(sender_s=t1 - t0, receiver_ttft_s=(t2 - t1) + result.prefill_s,
                        receiver_total_s=(t2 - t1) + result.total_s, prefill_positions=result.prefill_positions,
                        wire_bytes=sent.wire_bytes, text=result.text)


def latency(method: HandoffMethod, rows: Sequence[dict], max_new_tokens: int, progress: bool, desc: str) -> dict:
    """Latency summaries (sender, receiver to first token and to the answer, handoff) of ``rows``,
    each request timed alone after one untimed warm-up request."""
    if not rows:
        return {"n": 0, **{k: latency_summary([]) for k in ("sender_s", "receiver_ttft_s", "receiver_total_s", "handoff_s")}}
    time_request(method, rows[0], max_new_tokens=max_new_tokens)  # warm-up: allocations, kernels
    timed = [time_request(method, r, max_new_tokens=max_new_tokens)
             for r in tracked(rows, desc, progress=progress)]
    summary = {
        "n": len(timed),
        "sender_s": latency_summary([t.sender_s for t in timed]),
        "receiver_ttft_s": latency_summary([t.receiver_ttft_s for t in timed]),
        "receiver_total_s": latency_summary([t.receiver_total_s for t in timed]),
        "handoff_s": latency_summary([t.handoff_s for t in timed]),
    }
    reused = getattr(method, "reused_sender_seconds", None)
    if reused is not None:  # ilcp: the sender's time when its own forward already ran
        summary["sender_reusing_forward_s"] = latency_summary([reused(r) for r in rows])
    return summary
