"""The selector contract, the shared attention-scoring pass and the shared selection routine.

A selector is any callable ``selector(sender, request_ids, budget) -> positions``:

- ``sender``: the `SenderState` to select from (read-only);
- ``request_ids``: int64 [1, R] request tokens in the sender's vocabulary;
- ``budget``: the most positions it may return;
- ``positions``: sorted, unique int64 positions in ``[0, sender.positions)``, at most ``budget``.

Built-in selectors subclass `Selector`: they keep position 0 and the latent tail by rule (both
count toward the budget), score the rest from one forward on a private cache copy with eager
attention, and pick positions with `select_groups`.

Attention sinks: the first positions of a context draw most of every query's attention in every
layer, whatever the request. Scores therefore drop the first ``sink_size`` key positions and
renormalise each query's attention over the rest before averaging; the sink window is ranked
last (position 0 is kept by rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ilcp import compat
from ilcp.rclc import hf
from ilcp.rclc.runtime import MODEL_LOCK
from ilcp.rclc.budget import protected_count


@dataclass
class AttentionProfile:
    """Attention the sender's positions receive, averaged over layers, heads and queries.

    Attributes:
        request: [T] from the request tokens appended after the sender's rows (zeros without a request).
        tail: [T] from the sender's own last ``tail_queries`` positions (zeros when none).
        sink: the size of the sink window excluded from both.
    """

    request: torch.Tensor
    tail: torch.Tensor
    sink: int


def attention_profile(sender, request_ids: torch.Tensor | None, *, tail_queries: int = 16, sink_size: int = 4) -> AttentionProfile:
    """One eager-attention forward on a private copy of the sender's cache.

    The copy is cropped to ``T - t`` positions (``t = min(tail_queries, T - 1)``) and the last
    ``t`` sender rows plus the request tokens are fed after it, so one pass yields both the
    request's attention to every position and the sender tail's attention to its own past.
    Heads are averaged over query heads (under grouped-query attention each KV group has the
    same number of query heads, so this is also the mean over groups).

    Args:
        sender: SenderState with T positions.
        request_ids: int64 [1, R] or None.
    Returns:
        AttentionProfile with float32 CPU tensors [T].
    """
    total = sender.positions
    t = max(0, min(tail_queries, total - 1))
    model = sender.model
    with MODEL_LOCK:
        rows = sender.input_embeds[total - t:]
        r = 0
        if request_ids is not None and request_ids.numel():
            request_rows = hf.embed_ids(model, request_ids.reshape(-1))
            r = int(request_rows.shape[0])
            rows = torch.cat([rows, request_rows.to(rows.dtype)], dim=0)
        if rows.shape[0] == 0:
            zeros = torch.zeros(total)
            return AttentionProfile(zeros, zeros.clone(), min(sink_size, total))
        sink = sink_window(total, sink_size)
        layers = attention_to_sender(sender, rows, total - t, sink)
    request = torch.zeros(total)
    tail = torch.zeros(total)
    for weights in layers:  # [heads, t + R, T]
        if t:
            tail += weights[:, :t].mean(dim=(0, 1))
        if r:
            request += weights[:, t:].mean(dim=(0, 1))
    return AttentionProfile(request / len(layers), tail / len(layers), sink)


def sink_window(total: int, sink_size: int) -> int:
    """Leading key positions left out of attention scores: ``sink_size``, fewer for short senders."""
    return sink_size if total > sink_size else min(1, total)


def attention_to_sender(sender, rows: torch.Tensor, keep: int, sink: int) -> list[torch.Tensor]:
    """One eager-attention forward of ``rows`` [n, hidden] after a private copy of the sender's
    cache cropped to its first ``keep`` positions. Per layer, the attention the rows pay the
    sender's T positions, float32 CPU [heads, n, T], with the first ``sink`` key positions zeroed
    and each query renormalised over the rest. The caller holds ``MODEL_LOCK``."""
    return next(attention_to_sender_chunks(sender, rows, keep, sink, chunk_rows=max(1, int(rows.shape[0]))))[1]


ATTENTION_CHUNK_ELEMENTS = 1 << 26  # attention weights one chunk of rows may hold, over all layers and heads


def attention_to_sender_chunks(sender, rows: torch.Tensor, keep: int, sink: int, *, chunk_rows: int | None = None):
    """`attention_to_sender` fed ``chunk_rows`` rows at a time: the private cache grows between
    chunks, so every row attends to the same positions as in one forward, and only one chunk's
    attention weights are held at once (a row count that keeps them near
    ``ATTENTION_CHUNK_ELEMENTS`` when ``chunk_rows`` is None). Yields ``(start, layers)``: the
    chunk's first row and its per-layer weights [heads, rows in chunk, T]. The caller holds
    ``MODEL_LOCK`` while it iterates."""
    total = sender.positions
    model = sender.model
    n = int(rows.shape[0])
    if chunk_rows is None:
        config = getattr(model, "config", None)
        layers_heads = getattr(config, "num_hidden_layers", 1) * getattr(config, "num_attention_heads", 1)
        chunk_rows = max(1, ATTENTION_CHUNK_ELEMENTS // max(1, layers_heads * (keep + n)))
    cache = compat.clone_cache(sender.past_key_values)
    compat.crop_cache(cache, keep)
    with hf.eager_attention(model):
        for start in range(0, n, chunk_rows):
            outputs = hf.forward_rows(model, rows[start:start + chunk_rows], cache, output_attentions=True)
            cache = compat.output_cache(outputs)
            attentions = getattr(outputs, "attentions", None)
            if not attentions:
                raise RuntimeError(f"{type(model).__name__} returned no attention weights with eager attention")
            layers = []
            for layer in attentions:
                weights = layer[0, :, :, :total].float().cpu()
                weights[..., :sink] = 0.0
                layers.append(weights / weights.sum(-1, keepdim=True).clamp_min(1e-12))
            del outputs, attentions
            yield start, layers


_REDUCE = {"max": torch.max, "sum": torch.sum, "mean": torch.mean}


def select_groups(
    scores: torch.Tensor,
    budget: int,
    protected: torch.Tensor,
    *,
    group_size: int = 1,
    reduce: str = "max",
    spans: list[tuple[int, int]] | None = None,
    trim_last: bool = True,
) -> torch.Tensor:
    """Keep ``protected``, then whole groups of positions by descending group score.

    Groups are ``spans`` (``[start, stop)`` pairs covering ``[0, T)`` in order) when given, else
    consecutive groups of ``group_size`` aligned at 0; a group's score is the max, sum or mean of
    its positions' scores. With ``trim_last`` the first group that does not fit is trimmed to its
    best-scoring positions and fills the budget; without, a group that does not fit is skipped
    (a later, shorter one may fit) and the budget may be left partly unused. Ties go to the
    earlier position.

    Args:
        scores: [T] per-position scores.
        budget: positions to return at most (at least ``len(protected)``; at most T).
        protected: int64 [P] positions kept unconditionally.
    Returns:
        int64 sorted positions: [min(budget, T)] with ``trim_last``.
    """
    total = int(scores.shape[0])
    keep = torch.zeros(total, dtype=torch.bool)
    keep[protected] = True
    left = min(budget, total) - int(keep.sum())
    if left < 0:
        raise ValueError(f"budget {budget} is smaller than the {int(keep.sum())} protected positions")
    if reduce not in _REDUCE:
        raise ValueError(f"reduce must be one of {sorted(_REDUCE)}, got {reduce!r}")
    scores = scores.float().cpu()
    if spans is None:
        spans = [(s, min(s + group_size, total)) for s in range(0, total, group_size)]
    else:
        _check_spans(spans, total)
    group_scores = torch.stack([_REDUCE[reduce](scores[a:b]) for a, b in spans])
    order = torch.sort(-group_scores, stable=True).indices.tolist()
    for g in order:
        if left <= 0:
            break
        members = torch.arange(*spans[g])
        members = members[~keep[members]]
        if members.numel() == 0:
            continue
        if members.numel() > left:
            if not trim_last:
                continue
            best = torch.sort(-scores[members], stable=True).indices[:left]
            members = members[best]
        keep[members] = True
        left -= int(members.numel())
    return keep.nonzero().flatten()


def _check_spans(spans: list[tuple[int, int]], total: int) -> None:
    """ValueError unless ``spans`` are non-empty ``[start, stop)`` pairs tiling ``[0, total)`` in order."""
    edge = 0
    for start, stop in spans:
        if start != edge or stop <= start:
            break
        edge = stop
    else:
        if edge == total:
            return
    raise ValueError(f"spans must tile [0, {total}) in order, got {list(spans)[:6]}")


def validate_positions(positions, total: int, budget: int) -> torch.Tensor:
    """Check a selector's result; returns it as an int64 CPU vector.

    Raises:
        TypeError / ValueError: not integers, not 1-D, not sorted and unique, out of
        ``[0, total)``, or more than ``budget`` positions.
    """
    if isinstance(positions, torch.Tensor):
        tensor = positions.detach().cpu()
    else:
        try:
            values = list(positions)
        except TypeError:
            raise TypeError(f"a selector must return a sequence of positions, got {type(positions).__name__}") from None
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise TypeError("a selector's positions must be ints")
        tensor = torch.tensor(values, dtype=torch.long)
    if tensor.dtype in (torch.bool,) or tensor.is_floating_point() or tensor.is_complex():
        raise TypeError(f"a selector's positions must be integers, got {tensor.dtype}")
    tensor = tensor.to(torch.long)
    if tensor.dim() != 1:
        raise ValueError(f"a selector must return a 1-D vector of positions, got shape {tuple(tensor.shape)}")
    if tensor.numel() > budget:
        raise ValueError(f"the selector returned {tensor.numel()} positions for a budget of {budget}")
    if tensor.numel():
        if int(tensor.min()) < 0 or int(tensor.max()) >= total:
            raise ValueError(f"selected positions must lie in [0, {total}), got [{int(tensor.min())}, {int(tensor.max())}]")
        if tensor.numel() > 1 and bool((tensor[1:] <= tensor[:-1]).any()):
            raise ValueError("selected positions must be sorted and unique")
    return tensor


@dataclass
class Selector:
    """Base of the built-in selectors: protection, the all-fits shortcut and shared selection.

    Attributes:
        sink_size: leading positions excluded from attention ranking (position 0 is kept anyway).
    """

    sink_size: int = 4

    tail_queries = 0
    group_size = 1
    group_reduce = "max"
    trim_last = True

    def spans(self, sender) -> list[tuple[int, int]] | None:
        """The groups selection keeps whole, as ``[start, stop)`` pairs covering the sender's
        positions; None: consecutive groups of ``group_size``."""
        return None

    def protected_positions(self, sender) -> torch.Tensor:
        """int64 [P]: position 0 and the latent tail."""
        total, latent = sender.positions, sender.latent_steps
        tail = list(range(total - latent, total))
        return torch.tensor(sorted({0, *tail}) if total > latent else tail, dtype=torch.long)

    def protected_count(self, total: int, latent_steps: int) -> int:
        return protected_count(total, latent_steps)

    def score(self, profile: AttentionProfile) -> torch.Tensor:
        """[T] per-position scores from the attention profile."""
        raise NotImplementedError

    def profile(self, sender, request_ids: torch.Tensor | None) -> AttentionProfile:
        """The attention pass the scores come from (the request's and the sender tail's)."""
        return attention_profile(sender, request_ids, tail_queries=self.tail_queries, sink_size=self.sink_size)

    def __call__(self, sender, request_ids: torch.Tensor | None, budget: int) -> torch.Tensor:
        """Positions to keep: int64 [min(budget, T)], sorted.

        Raises:
            ValueError: the budget cannot hold position 0 and the latent tail.
        """
        total = sender.positions
        protected = self.protected_positions(sender)
        if budget < protected.numel():
            raise ValueError(
                f"a budget of {budget} cannot hold position 0 and the {sender.latent_steps}-row latent tail"
            )
        if budget >= total:
            return torch.arange(total)
        if budget == protected.numel():
            return protected
        profile = self.profile(sender, request_ids)
        scores = self.score(profile)
        scores[: profile.sink] = 0.0
        return select_groups(scores, budget, protected, group_size=self.group_size, reduce=self.group_reduce,
                             spans=self.spans(sender), trim_last=self.trim_last)


def is_builtin(selector) -> bool:
    """Built-in selectors reserve their protected positions when budgets are fitted."""
    return isinstance(selector, Selector)
