"""The sender's runtime pooling: the frozen LM's token states -> what an `ILCPEncoder` reads.

The sender's summary of a context is, by default, the mean of its last-layer hidden states over
real tokens (padding masked out, divided by the raw token count clamped to >= 1, no L2
normalisation). `layers` can name several layers; their states are concatenated along the
feature axis. `AttentionPooler` is the trained alternative: a few learned queries, each taking a
softmax-weighted mean of the token states; it starts out equal to the masked mean.
`ConcatPooler` hands a chunk's token states to the VAE side by side. `split_chunks` and
`pool_units` cut right-padded contexts into chunks of C tokens (one latent per chunk).

`sender_token_states` is the one forward both training extraction and `ILCPHandoff` run;
`tokenize_contexts`, `pad_right` and `length_batches` prepare its inputs; `length_groups` splits
one training batch into forwards of similar lengths (`forward_groups`: or keeps it whole).
Nothing here imports Lightning, so the runtime handoff does not load it: the batched extraction
through a Lightning predict loop and its on-disk cache are `ilcp.training.extraction`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compat import logits_to_keep_kwargs


def masked_mean_pool(hidden_states: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of hidden states over the positions where the mask is 1.

    Args:
        hidden_states: (B, S, H).
        attention_mask: (B, S), 1 for real tokens and 0 for padding.
    Returns:
        (B, H) in the dtype of `hidden_states`; a row with no real token is all zeros.
    """
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be (batch, seq, dim), got shape {tuple(hidden_states.shape)}")
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (batch, seq), got shape {tuple(attention_mask.shape)}")
    if attention_mask.shape != hidden_states.shape[:2]:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} does not match hidden_states "
            f"{tuple(hidden_states.shape)} in (batch, seq)"
        )
    mask = attention_mask.to(hidden_states.dtype).unsqueeze(-1)
    summed = (hidden_states * mask).sum(dim=1)
    count = mask.sum(dim=1).clamp(min=1.0)
    return summed / count


class AttentionPooler(nn.Module):
    """Learned-query attention pooling of a context's token states.

    Each of ``num_queries`` queries scores every real token from its layer-normalised state and
    takes the softmax-weighted mean of the raw states; the query outputs are concatenated. The
    scoring weights start at zero, so an untrained pooler returns ``num_queries`` copies of the
    masked mean (the spec's summary); answer losses (stage 1's answer head, stage 2's LM loss)
    teach the queries which tokens to read. It computes in float32 whatever the parameters' or
    the states' dtype, and under autocast too, so training and inference pool alike.

    Args:
        dim: D, the width of a token state (hidden size x number of layers).
        num_queries: Q; the output is (B, Q * D).
    """

    kind = "attention"

    def __init__(self, dim: int, num_queries: int = 4):
        super().__init__()
        if int(dim) < 1 or int(num_queries) < 1:
            raise ValueError(f"dim and num_queries must be >= 1, got {dim} and {num_queries}")
        self.dim, self.num_queries = int(dim), int(num_queries)
        self.score = nn.Linear(self.dim, self.num_queries, bias=False)  # a bias cancels in the softmax
        nn.init.zeros_(self.score.weight)

    @property
    def output_dim(self) -> int:
        return self.dim * self.num_queries

    def weights(self, states: Tensor, attention_mask: Tensor) -> Tensor:
        """Attention of each query over positions: (B, S, D), (B, S) -> (B, S, Q), float32.

        Padding gets weight 0; a row with no real token gets weight 0 everywhere.
        """
        if states.dim() != 3 or states.shape[-1] != self.dim:
            raise ValueError(f"token states must be (batch, seq, {self.dim}), got {tuple(states.shape)}")
        if attention_mask.shape != states.shape[:2]:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} does not match token states {tuple(states.shape)}"
            )
        real = attention_mask.bool().unsqueeze(-1)
        with torch.autocast(states.device.type, enabled=False):
            normed = F.layer_norm(states.float(), (self.dim,))
            logits = F.linear(normed, self.score.weight.float()).masked_fill(~real, float("-inf"))
            return torch.nan_to_num(logits.softmax(dim=1), nan=0.0)

    def forward(self, states: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, S, D) token states and (B, S) mask -> (B, Q * D) float32."""
        w = self.weights(states, attention_mask)
        with torch.autocast(states.device.type, enabled=False):
            pooled = torch.einsum("bsq,bsd->bqd", w, states.float())
        return pooled.reshape(states.shape[0], self.output_dim)


class ConcatPooler(nn.Module):
    """A chunk's token states side by side: (B, C', D) with mask (B, C'), C' <= C -> (B, C * D).

    Parameter-free and order-keeping: where a learned pooler sums a chunk's tokens into one
    state, this one hands the VAE every token state of the chunk in place (padding and missing
    positions are zeros), so a latent can carry which token stood where. It reads chunks only
    (`ILCPEncoder` with ``chunk_tokens = C``); the VAE then reads C * D floats.

    Args:
        dim: D, the width of a token state (hidden size x number of layers).
        chunk_tokens: C, the tokens of one chunk.
    """

    kind = "concat"

    def __init__(self, dim: int, chunk_tokens: int):
        super().__init__()
        if int(dim) < 1 or int(chunk_tokens) < 1:
            raise ValueError(f"dim and chunk_tokens must be >= 1, got {dim} and {chunk_tokens}")
        self.dim, self.chunk_tokens = int(dim), int(chunk_tokens)

    @property
    def output_dim(self) -> int:
        return self.dim * self.chunk_tokens

    def forward(self, states: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, C', D) token states and (B, C') mask -> (B, C * D) float32."""
        if states.dim() != 3 or states.shape[-1] != self.dim or states.shape[1] > self.chunk_tokens:
            raise ValueError(f"chunk states must be (batch, <= {self.chunk_tokens}, {self.dim}), "
                             f"got {tuple(states.shape)}")
        if attention_mask.shape != states.shape[:2]:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} does not match token states {tuple(states.shape)}"
            )
        with torch.autocast(states.device.type, enabled=False):
            kept = states.float() * attention_mask.to(torch.float32).unsqueeze(-1)
            kept = F.pad(kept, (0, 0, 0, self.chunk_tokens - states.shape[1]))
        return kept.reshape(states.shape[0], self.output_dim)


Pooler = AttentionPooler | ConcatPooler


def pool_states(pooler: Pooler | None, states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Token states (B, S, D) with their mask (B, S) -> pooled (B, D') float32: the masked mean
    (pooler None) or the attention pooler's output.

    Mean-pooled states computed ahead of time, (B, D) with no mask, pass through; an attention
    pooler needs the token states.
    """
    if attention_mask is None:
        if states.dim() != 2:
            raise ValueError(f"token states (batch, seq, dim) need their attention mask, got {tuple(states.shape)}")
        if pooler is not None:
            raise ValueError(f"this encoder pools with {pooler.kind}: give it token states and their mask, not pooled states")
        return states.float()
    if pooler is not None:
        return pooler(states, attention_mask)
    return masked_mean_pool(states, attention_mask).float()


def split_chunks(states: Tensor, attention_mask: Tensor, chunk_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded token states cut into consecutive chunks of `chunk_tokens`.

    Args:
        states: (B, S, D); attention_mask: (B, S), real tokens first in each row.
    Returns:
        (chunk states (B * N, C, D), chunk mask (B * N, C), real (B, N) bool), N = ceil(S / C).
    """
    if attention_mask is None:
        raise ValueError("one latent per chunk needs the token states and their mask, not pooled states")
    b, s, d = states.shape
    n = max(1, -(-s // chunk_tokens))
    pad = n * chunk_tokens - s
    if pad:
        states = torch.cat([states, states.new_zeros((b, pad, d))], dim=1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_zeros((b, pad))], dim=1)
    chunk_mask = attention_mask.reshape(b * n, chunk_tokens)
    return states.reshape(b * n, chunk_tokens, d), chunk_mask, chunk_mask.reshape(b, n, chunk_tokens).bool().any(-1)


def pool_units(pooler: Pooler | None, chunk_tokens: int, states: Tensor,
               attention_mask: Tensor | None = None) -> Tensor:
    """Pooled states of every latent unit: contexts (B, D'), or with ``chunk_tokens > 0`` the
    chunks that hold a token (U, D'), row-major."""
    if chunk_tokens <= 0:
        return pool_states(pooler, states, attention_mask)
    chunk_states, chunk_mask, real = split_chunks(states, attention_mask, chunk_tokens)
    return pool_states(pooler, chunk_states, chunk_mask)[real.reshape(-1)]


def layer_states(outputs, layers: Sequence[int] = (-1,)) -> Tensor:
    """The chosen layers' token states of a forward with ``output_hidden_states=True``,
    concatenated along the feature axis: (B, S, H * len(layers))."""
    hidden = getattr(outputs, "hidden_states", None)
    if hidden is None:
        raise ValueError("outputs carry no hidden_states: run the forward with output_hidden_states=True")
    return torch.cat([hidden[i] for i in layers], dim=-1)


class TokenStates:
    """Token states of N contexts of different lengths, stored flat.

    Row i is ``flat[offsets[i]:offsets[i + 1]]``, a (S_i, D) tensor. ``flat`` may be a memory map
    of the cache file (`ilcp.training.extraction`): a row is read from it when asked for, never
    the whole. ``rows`` picks and orders a subset of the stored rows (`take`) without copying.
    """

    def __init__(self, flat: Tensor, offsets: Tensor, rows: Tensor | None = None):
        if flat.dim() != 2 or offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError("TokenStates needs flat (T, D) states and offsets (N + 1,)")
        if int(offsets[0]) != 0 or int(offsets[-1]) != flat.shape[0] or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(f"offsets must rise from 0 to {flat.shape[0]}")
        if rows is not None and rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < offsets.numel() - 1):
            raise ValueError(f"rows must index the {offsets.numel() - 1} stored rows")
        self.flat, self.offsets = flat, offsets.long()
        self.rows = None if rows is None else rows.long()

    @property
    def dim(self) -> int:
        return self.flat.shape[1]

    def __len__(self) -> int:
        return self.offsets.numel() - 1 if self.rows is None else self.rows.numel()

    def __getitem__(self, i: int) -> Tensor:
        if not -len(self) <= int(i) < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        j = int(i) % len(self) if self.rows is None else int(self.rows[i])
        return self.flat[int(self.offsets[j]): int(self.offsets[j + 1])]

    def lengths(self) -> Tensor:
        stored = self.offsets[1:] - self.offsets[:-1]
        return stored if self.rows is None else stored[self.rows]

    @property
    def tokens(self) -> int:
        """The token states of the rows held (T for the whole store)."""
        return int(self.lengths().sum())

    def take(self, index: Sequence[int]) -> "TokenStates":
        """These rows, in this order, over the same storage (nothing copied)."""
        index = torch.as_tensor(list(index), dtype=torch.long)
        return TokenStates(self.flat, self.offsets, index if self.rows is None else self.rows[index])

    def mean(self, chunk: int = 256) -> Tensor:
        """The masked mean of every row: (N, D) float32, read `chunk` rows at a time."""
        out = torch.zeros((len(self), self.dim), dtype=torch.float32)
        for start in range(0, len(self), chunk):
            rows = [self[i] for i in range(start, min(start + chunk, len(self)))]
            lengths = torch.tensor([r.shape[0] for r in rows])
            index = torch.repeat_interleave(torch.arange(len(rows)), lengths)
            sums = out[start:start + len(rows)].index_add_(0, index, torch.cat(rows).float())
            sums /= lengths.clamp(min=1).unsqueeze(-1).float()
        return out


def pad_token_states(rows: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Right-pad (S_i, D) rows: ((B, S, D) states, (B, S) long mask)."""
    width = max(max(int(r.shape[0]) for r in rows), 1)
    states = rows[0].new_zeros((len(rows), width, rows[0].shape[1]))
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        states[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = 1
    return states, mask


# --------------------------------------------------------------------------------------------
# the sender's forward and its inputs


def pad_right(ids: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad token id lists: ((B, S) input ids, (B, S) long attention mask)."""
    width = max(len(seq) for seq in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return input_ids, mask


def pad_id_of(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


@torch.no_grad()
def first_state_is_embedding(model: nn.Module) -> bool:
    """Whether ``hidden_states[0]`` of `model` equals its input-embedding lookup (Llama and Qwen
    models; not those that scale or mix embeddings first). Checked on a few tokens, cached on
    the model."""
    known = getattr(model, "_ilcp_first_state_is_embedding", None)
    if known is None:
        embed = model.get_input_embeddings()
        ids = torch.arange(1, 6, device=embed.weight.device).clamp(max=embed.weight.shape[0] - 1).unsqueeze(0)
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False, **logits_to_keep_kwargs(model, 1))
        known = bool(torch.equal(out.hidden_states[0], embed(ids)))
        model._ilcp_first_state_is_embedding = known
    return known


def sender_token_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                        layers: Sequence[int] = (-1,)) -> Tensor:
    """The sender's forward over right-padded contexts: the chosen layers' token states,
    concatenated, (B, S, H * len(layers)) in the model's dtype.

    The one forward both training extraction and `ILCPHandoff` run; it asks for the logits of
    one position only, since only hidden states are used. When layer 0 alone is asked and the
    model's first hidden state is its embedding lookup (checked once per model), the lookup is the
    whole of it: no forward."""
    if all(i == 0 for i in layers) and first_state_is_embedding(model):
        rows = model.get_input_embeddings()(input_ids)
        return torch.cat([rows] * len(layers), dim=-1)
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False,
                **logits_to_keep_kwargs(model, 1))
    return layer_states(out, layers)


TOKENIZE_CHUNK = 256  # contexts tokenized at once where only counts are kept (bounds memory)


def context_lengths(tokenizer, texts: Sequence[str]) -> list[int]:
    """Each context's token count, as the sender tokenizes it (no special tokens)."""
    texts = list(texts)
    return [len(ids) for start in range(0, len(texts), TOKENIZE_CHUNK)
            for ids in tokenizer(texts[start:start + TOKENIZE_CHUNK], add_special_tokens=False)["input_ids"]]


def tokenize_contexts(tokenizer, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids without special tokens; contexts longer than `max_length` keep their last tokens
    (the most recent part of an agent's context)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [seq[-max_length:] if len(seq) > max_length else seq for seq in ids]


# A forward's fixed cost, counted in padded positions: what `length_groups` weighs against padding.
FORWARD_OVERHEAD_POSITIONS = 64


def length_groups(lengths: Sequence[int], overhead: int = FORWARD_OVERHEAD_POSITIONS) -> list[list[int]]:
    """Split rows of these ``lengths`` into groups run as separate padded forwards, at the least
    cost: each group costs its rows x its longest length (the padded positions) plus ``overhead``.

    A batch mixing short and long rows (bAbI stories beside SQuAD paragraphs) pads every short row
    to the longest; grouping cuts that padding, and a forward's result does not depend on which
    rows share it, so the batch's loss and gradients are those of one padded forward. The optimum
    is over the rows sorted by length (some optimal grouping takes consecutive runs of them),
    found by dynamic programming. Returns the row indices of each group, shortest rows first.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sizes = [int(lengths[i]) for i in order]
    n = len(sizes)
    best = [0] + [None] * n  # best[j]: least cost of the j shortest rows; start[j]: where its last group starts
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * sizes[j - 1] + overhead
            if best[j] is None or cost < best[j]:
                best[j], start[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[start[j]:j])
        j = start[j]
    return groups[::-1]


def forward_groups(lengths: Sequence[int], grouped: bool = True) -> list[list[int]]:
    """The forwards a training batch of rows of these ``lengths`` runs as: its `length_groups`, or
    with ``grouped`` False (``trainer.length_groups: false``) every row in one padded forward."""
    if grouped:
        return length_groups(lengths)
    return [list(range(len(lengths)))] if len(lengths) else []


def length_batches(lengths: Sequence[int], batch_size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Consecutive batches of rows whose ``lengths`` rise (sorted): at most ``batch_size`` rows,
    and at most ``max_tokens`` padded positions (rows x the widest), a row longer than that
    alone; so long contexts go a few, or one, at a time."""
    batches: list[list[int]] = []
    for i, n in enumerate(lengths):
        last = batches[-1] if batches else None
        if last is not None and len(last) < batch_size and (max_tokens is None or (len(last) + 1) * n <= max_tokens):
            last.append(i)
        else:
            batches.append([i])
    return batches
