"""Reread: a query-agnostic score, the attention each position draws while the sender reads its
own context a second time (as KVzip scores a cache by reconstructing the context from it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ilcp.checks import positive_int
from ilcp.rclc import hf
from ilcp.rclc.runtime import MODEL_LOCK
from ilcp.rclc.selectors.base import (
    AttentionProfile,
    Selector,
    attention_to_sender_chunks,
    sink_window,
)

REREAD_PROMPT = "\n\nRepeat the text above word for word:\n"


@dataclass
class Reread(Selector):
    """After the sender's whole cache, a short instruction to repeat the text and then the sender's
    own rows again are fed in one eager-attention forward (on a private cache copy). A position's
    score is the largest attention any repeated row pays it, averaged over heads and layers (the
    sink window excluded and each query renormalised, as for the other selectors): how much the
    sender needs that row to say its context back, whatever the request. Selection in spans of
    ``window`` consecutive positions scored by their maximum.

    The request is not read, so the same rows go to every request; the pass costs a second
    prefill of the context. Without a tokenizer the rows are repeated without the instruction.

    Attributes:
        window: span width (the spec's W).
    """

    window: int = 4
    group_reduce = "max"

    def __post_init__(self) -> None:
        positive_int("window", self.window)
        self.group_size = self.window

    def score(self, profile: AttentionProfile) -> torch.Tensor:
        """[T] reread attention (carried in the profile's ``tail`` field)."""
        return profile.tail.clone()

    def profile(self, sender, request_ids: torch.Tensor | None) -> AttentionProfile:
        total = sender.positions
        model = sender.model
        sink = sink_window(total, self.sink_size)
        with MODEL_LOCK:
            rows = sender.input_embeds[:total]
            tokenizer = getattr(sender, "tokenizer", None)
            prompt = 0
            if tokenizer is not None:
                ids = tokenizer(REREAD_PROMPT, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
                prompt = int(ids.numel())
                rows = torch.cat([hf.embed_ids(model, ids).to(rows.dtype), rows], dim=0)
            peaks = None  # [layers, heads, T]: the most attention any repeated row so far paid a position
            for start, layers in attention_to_sender_chunks(sender, rows, total, sink):
                skip = max(0, prompt - start)  # the instruction's rows are not scored
                if skip >= layers[0].shape[1]:
                    continue
                chunk = torch.stack([weights[:, skip:].amax(dim=1) for weights in layers])
                peaks = chunk if peaks is None else torch.maximum(peaks, chunk)
        score = peaks.mean(dim=1).mean(dim=0) if peaks is not None else torch.zeros(total)
        return AttentionProfile(torch.zeros(total), score, sink)
