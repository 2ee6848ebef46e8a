"""Overlap: whole sentences ranked by the tokens they share with the request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ilcp.rclc.selectors.base import AttentionProfile
from ilcp.rclc.selectors.sentences import Sentences

RECENCY = 1e-3  # the later of two sentences sharing as much with the request ranks first
ATTENTION = 1e-5  # the request's attention only orders rows that share nothing


@dataclass
class Overlap(Sentences):
    """Each sender row whose token the request also holds scores ``1 / n``, ``n`` the number of
    the sender's rows holding that token (a word every sentence repeats counts little, a name
    said once counts whole); a sentence scores the sum of its rows. Ties go to the later sentence
    (in a story, the latest mention is the one that holds), then to the request's attention.
    Sentences are kept whole by descending score; the first that does not fit is cut to its best
    rows (its shared tokens first), so a budget below one sentence still sends the rows that name
    what the request asks about.

    The score reads token IDs, not attention: on small models the request's attention barely
    tells look-alike sentences apart (``benchmarks/selection_recall.py``). It matches tokens, not
    meanings: "Who owns X?" shares nothing with "X is owned by Y" but the name, and a function
    word the request shares with one sentence only ("is") counts as much as a name. Rows without
    a token ID share nothing; without a shared token the ranking is the request attention of
    `Sentences` (cut sentences included).
    """

    group_reduce = "sum"
    trim_last = True

    def profile(self, sender, request_ids: torch.Tensor | None) -> AttentionProfile:
        attention = super().profile(sender, request_ids)
        ids = sender.token_ids
        if ids is None or request_ids is None or not request_ids.numel():
            return attention
        ids = ids.reshape(-1).cpu()
        asked = torch.isin(ids, request_ids.reshape(-1).cpu()) & (ids >= 0)
        counts = torch.zeros_like(ids, dtype=torch.float32)
        for token in ids[asked].unique():
            counts[ids == token] = float((ids == token).sum())
        score = torch.where(asked, 1.0 / counts.clamp_min(1.0), torch.zeros_like(counts))
        request = attention.request.clone()
        request[: attention.sink] = 0.0
        score += ATTENTION * request
        spans = self.spans(sender)
        for k, (start, _) in enumerate(spans):
            score[start] += RECENCY * (k + 1) / len(spans)
        # the sink window is already ranked by the shared tokens: nothing to drop
        return AttentionProfile(request=score, tail=attention.tail, sink=0)
