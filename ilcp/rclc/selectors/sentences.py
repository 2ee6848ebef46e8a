"""Sentences: whole sentences of the sender's context, ranked by the request's attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ilcp.rclc.selectors.base import AttentionProfile, Selector

SENTENCE_ENDS = (".", "!", "?", "\n")


@dataclass
class Sentences(Selector):
    """The request's attention (as QSnap's, unsmoothed) averaged over each sentence; whole
    sentences are kept by descending score, in their own order, and a sentence that does not fit
    the budget is skipped rather than cut, so the receiver never reads a fragment of one.

    A sentence ends after a token whose text ends with ``.``, ``!`` or ``?`` or holds a newline.
    Rows without a token ID (received continuous rows, a latent tail) are grouped in spans of
    ``window`` instead. Budget left over when no remaining sentence fits is returned unused.

    Attributes:
        window: span width for rows without token IDs (and for a sender without a tokenizer).
    """

    window: int = 4
    group_reduce = "mean"
    trim_last = False

    def score(self, profile: AttentionProfile) -> torch.Tensor:
        """[T] request attention."""
        return profile.request.clone()

    def spans(self, sender) -> list[tuple[int, int]]:
        """[start, stop) of every sentence, and of the windows over rows without token IDs."""
        total = sender.positions
        ids = sender.token_ids
        tokenizer = sender.tokenizer
        if ids is None or tokenizer is None:
            return [(s, min(s + self.window, total)) for s in range(0, total, self.window)]
        texts = tokenizer.convert_ids_to_tokens([max(int(i), 0) for i in ids.tolist()])
        known = (ids >= 0).tolist()
        spans, start = [], 0
        for pos in range(total):
            if not known[pos]:
                if start < pos and known[start]:  # close the sentence the continuous rows interrupt
                    spans.append((start, pos))
                    start = pos
                if pos + 1 - start == self.window or pos + 1 == total or known[pos + 1]:
                    spans.append((start, pos + 1))
                    start = pos + 1
                continue
            text = tokenizer.convert_tokens_to_string([texts[pos]])
            if text.rstrip(" ").endswith(SENTENCE_ENDS[:3]) or "\n" in text or pos + 1 == total:
                spans.append((start, pos + 1))
                start = pos + 1
        return spans
