"""Pooled sender states: masked mean pooling, learned attention pooling, batched extraction, and
an on-disk cache.

The sender's summary of a context is, by default, the mean of its last-layer hidden states over
real tokens (padding masked out, divided by the raw token count clamped to >= 1, no L2
normalisation). `layers` can name several layers; their states are concatenated along the
feature axis. `AttentionPooler` is the trained alternative: a few learned queries, each taking a
softmax-weighted mean of the token states; it starts out equal to the masked mean.

    from ilcp.lm import load_lm
    from ilcp.pooling import pooled_states
    lm = load_lm()
    pooled = pooled_states(lm, ["John went to the garden.", "Mary is in the hall."])  # (2, 576)

Extraction runs through a Lightning predict loop, so the same code uses any Trainer strategy
(pass ``trainer_kwargs={"devices": 4, "strategy": "ddp"}``); each rank writes its shard and the
shards are merged by row index. `cached_pooled_states` keys the result by the LM fingerprint,
the task configuration, the maximum length and the layers, and a second call reads it back
without a forward pass. `token_states` / `cached_token_states` do the same for the unpooled
states of every real token (what an `AttentionPooler` trains on), stored flat as `TokenStates`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from safetensors.torch import load_file, save_file
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler

from .compat import logits_to_keep_kwargs
from .io import atomic_save_safetensors
from .lm import LM, default_cache_dir


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


def layer_states(outputs, layers: Sequence[int] = (-1,)) -> Tensor:
    """The chosen layers' token states of a forward with ``output_hidden_states=True``,
    concatenated along the feature axis: (B, S, H * len(layers))."""
    hidden = getattr(outputs, "hidden_states", None)
    if hidden is None:
        raise ValueError("outputs carry no hidden_states: run the forward with output_hidden_states=True")
    return torch.cat([hidden[i] for i in layers], dim=-1)


class TokenStates:
    """Token states of N contexts of different lengths, stored flat.

    Row i is ``flat[offsets[i]:offsets[i + 1]]``, a (S_i, D) tensor.
    """

    def __init__(self, flat: Tensor, offsets: Tensor):
        if flat.dim() != 2 or offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError("TokenStates needs flat (T, D) states and offsets (N + 1,)")
        if int(offsets[0]) != 0 or int(offsets[-1]) != flat.shape[0] or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(f"offsets must rise from 0 to {flat.shape[0]}")
        self.flat, self.offsets = flat, offsets.long()

    @property
    def dim(self) -> int:
        return self.flat.shape[1]

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, i: int) -> Tensor:
        return self.flat[int(self.offsets[i]): int(self.offsets[i + 1])]

    def lengths(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def mean(self) -> Tensor:
        """The masked mean of every row: (N, D) float32."""
        index = torch.repeat_interleave(torch.arange(len(self)), self.lengths())
        sums = torch.zeros((len(self), self.dim), dtype=torch.float32).index_add_(0, index, self.flat.float())
        return sums / self.lengths().clamp(min=1).unsqueeze(-1).float()


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
# batched extraction through a Lightning predict loop


class _Texts(Dataset):
    def __init__(self, ids: list[list[int]]):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return i, self.ids[i]


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


def _collate(pad_id: int):
    def collate(items):
        index = torch.tensor([i for i, _ in items], dtype=torch.long)
        input_ids, mask = pad_right([ids for _, ids in items], pad_id)
        return {"index": index, "input_ids": input_ids, "attention_mask": mask}

    return collate


class PoolingModule(L.LightningModule):
    """Wraps the frozen LM for `Trainer.predict`; returns pooled states per batch, or with
    ``tokens=True`` the states of every real token (flat) and each row's length."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[int] = (-1,), tokens: bool = False):
        super().__init__()
        self.model = model
        self.layers = tuple(layers)
        self.tokens = tokens

    def predict_step(self, batch, batch_idx):
        mask = batch["attention_mask"]
        states = sender_token_states(self.model, batch["input_ids"], mask, self.layers)
        if self.tokens:  # right padding: the real tokens of each row come first, rows in order
            return {"index": batch["index"].cpu(), "states": states[mask.bool()].float().cpu(),
                    "lengths": mask.sum(-1).cpu()}
        return {"index": batch["index"].cpu(), "pooled": masked_mean_pool(states, mask).float().cpu()}


class _ShardWriter(BasePredictionWriter):
    """Each rank writes its predictions to one file; `merge` puts rows back in order."""

    def __init__(self, directory: Path):
        super().__init__(write_interval="epoch")
        self.directory = directory

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        tensors = {k: torch.cat([p[k] for p in predictions]) for k in predictions[0]}
        save_file(tensors, str(self.directory / f"rank{trainer.global_rank}.safetensors"))

    def merge(self, n: int) -> Tensor:
        shards = [load_file(str(p)) for p in sorted(self.directory.glob("rank*.safetensors"))]
        dim = shards[0]["pooled"].shape[1]
        out = torch.empty((n, dim), dtype=torch.float32)
        seen = torch.zeros(n, dtype=torch.bool)
        for s in shards:  # distributed samplers may repeat rows to even out ranks: same values
            out[s["index"]] = s["pooled"]
            seen[s["index"]] = True
        if not bool(seen.all()):
            raise RuntimeError(f"pooled-state extraction returned {int(seen.sum())} of {n} rows")
        return out

    def merge_tokens(self, n: int) -> list[Tensor]:
        """Per-row token states (S_i, D), in row-index order."""
        rows: list[Tensor | None] = [None] * n
        for p in sorted(self.directory.glob("rank*.safetensors")):
            s = load_file(str(p))
            for i, part in zip(s["index"].tolist(), torch.split(s["states"], s["lengths"].tolist())):
                rows[i] = part
        missing = sum(r is None for r in rows)
        if missing:
            raise RuntimeError(f"token-state extraction missed {missing} of {n} rows")
        return rows


def context_lengths(tokenizer, texts: Sequence[str]) -> list[int]:
    """Each context's token count, as the sender tokenizes it (no special tokens)."""
    return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def tokenize_contexts(tokenizer, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids without special tokens; contexts longer than `max_length` keep their last tokens
    (the most recent part of an agent's context)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [seq[-max_length:] if len(seq) > max_length else seq for seq in ids]


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


class _Batches(Sampler):
    """Fixed batches of row indices, as a batch sampler."""

    def __init__(self, batches: list[list[int]]):
        self.batches = batches
        self.drop_last = False  # every row is predicted

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _extract(lm: LM, texts: Sequence[str], *, tokens: bool, batch_size: int, max_length: int,
             layers: Sequence[int], trainer_kwargs: dict | None, progress: bool, max_batch_tokens: int | None = None):
    """One predict pass over `texts` (sorted by length, put back in order afterwards)."""
    texts = list(texts)
    if any(not isinstance(t, str) for t in texts):
        raise ValueError("texts must be strings")
    ids = tokenize_contexts(lm.tokenizer, texts, max_length)
    if any(len(seq) == 0 for seq in ids):
        raise ValueError("cannot pool an empty context (it has no tokens)")
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    sorted_ids = [ids[i] for i in order]
    batches = _Batches(length_batches([len(seq) for seq in sorted_ids], batch_size, max_batch_tokens))
    loader = DataLoader(_Texts(sorted_ids), batch_sampler=batches, collate_fn=_collate(pad_id_of(lm.tokenizer)))
    kwargs = {"accelerator": "auto", "devices": 1, "logger": False, "enable_checkpointing": False,
              "enable_progress_bar": progress, "enable_model_summary": False}
    kwargs.update(trainer_kwargs or {})
    with tempfile.TemporaryDirectory(prefix="ilcp-pool-") as tmp:
        writer = _ShardWriter(Path(tmp))
        trainer = L.Trainer(callbacks=[writer], **kwargs)
        with warnings.catch_warnings():  # the batches hold every row: nothing is dropped
            warnings.filterwarnings("ignore", message=".*custom batch sampler.*")
            trainer.predict(PoolingModule(lm.model, layers, tokens=tokens), dataloaders=loader,
                            return_predictions=False)
        if tokens:
            rows_sorted = writer.merge_tokens(len(sorted_ids))
            rows: list[Tensor] = [None] * len(texts)  # type: ignore[list-item]
            for pos, i in enumerate(order):
                rows[i] = rows_sorted[pos]
            return rows
        pooled_sorted = writer.merge(len(sorted_ids))
    pooled = torch.empty_like(pooled_sorted)
    pooled[torch.tensor(order)] = pooled_sorted
    return pooled


def pooled_states(
    lm: LM,
    texts: Sequence[str],
    *,
    batch_size: int = 16,
    max_batch_tokens: int | None = None,
    max_length: int = 512,
    layers: Sequence[int] = (-1,),
    trainer_kwargs: dict | None = None,
    progress: bool = True,
) -> Tensor:
    """Pooled states of `texts` with the frozen LM, in the order given.

    Texts are sorted by length into batches (less padding) and put back in order afterwards.

    Returns:
        (N, H * len(layers)) float32 on the CPU.
    """
    if len(texts) == 0:
        return torch.zeros((0, lm.hidden_size * len(layers)), dtype=torch.float32)
    return _extract(lm, texts, tokens=False, batch_size=batch_size, max_length=max_length, layers=layers,
                    trainer_kwargs=trainer_kwargs, progress=progress, max_batch_tokens=max_batch_tokens)


def token_states(
    lm: LM,
    texts: Sequence[str],
    *,
    batch_size: int = 16,
    max_batch_tokens: int | None = None,
    max_length: int = 512,
    layers: Sequence[int] = (-1,),
    trainer_kwargs: dict | None = None,
    progress: bool = True,
) -> TokenStates:
    """The states of every real token of `texts` (the chosen layers concatenated), in the order
    given: row i is (S_i, H * len(layers)) float32, S_i the context's token count (<= max_length)."""
    if len(texts) == 0:
        return TokenStates(torch.zeros((0, lm.hidden_size * len(layers))), torch.zeros(1, dtype=torch.long))
    rows = _extract(lm, texts, tokens=True, batch_size=batch_size, max_length=max_length, layers=layers,
                    max_batch_tokens=max_batch_tokens,
                    trainer_kwargs=trainer_kwargs, progress=progress)
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return TokenStates(torch.cat(rows).contiguous(), offsets)


# --------------------------------------------------------------------------------------------
# on-disk cache


def pooled_cache_key(fingerprint: str, task_key: dict, max_length: int, layers: Sequence[int],
                     kind: str = "mean", precision: str = "32-true") -> dict:
    """Everything that decides the cached states, as a JSON-serialisable dict (the compute
    precision only when it is not float32, so float32 states keep their key)."""
    key = {"lm": fingerprint, "task": task_key, "max_length": int(max_length),
           "layers": [int(i) for i in layers], "pool": kind, "format": 1}
    if precision != "32-true":
        key["precision"] = precision
    return key


def _cache_lookup(key: dict, row_ids: Sequence[str], cache_dir) -> tuple[Path, dict, dict | None]:
    """(cache file, its metadata, its tensors when the file matches `key` and `row_ids`, else None)."""
    key_json = json.dumps(key, sort_keys=True)
    digest = hashlib.sha256(key_json.encode()).hexdigest()[:24]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = root / "pooled" / f"{digest}.safetensors"
    meta = {"key": key_json, "row_ids": json.dumps(list(row_ids))}
    if path.is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                found = f.metadata() or {}
                if found.get("key") == meta["key"] and found.get("row_ids") == meta["row_ids"]:
                    return path, meta, {k: f.get_tensor(k) for k in f.keys()}
        except Exception:  # unreadable or foreign file: recompute and replace it
            pass
    return path, meta, None


def cached_pooled_states(
    lm: LM,
    contexts: Sequence[str],
    row_ids: Sequence[str],
    task_key: dict,
    *,
    cache_dir: str | os.PathLike | None = None,
    max_length: int = 512,
    layers: Sequence[int] = (-1,),
    batch_size: int = 16,
    max_batch_tokens: int | None = None,
    trainer_kwargs: dict | None = None,
    progress: bool = True,
    precision: str = "32-true",
) -> tuple[Tensor, Path, bool]:
    """Pooled states of `contexts`, read from the cache when present, else computed and stored;
    the forward runs at ``precision`` (a resolved `ilcp.precision` name), the states are float32.

    Returns:
        (pooled (N, D) float32, cache file, hit): `hit` is True when no forward pass ran.
    """
    if len(contexts) != len(row_ids):
        raise ValueError(f"{len(contexts)} contexts but {len(row_ids)} row ids")
    key = pooled_cache_key(lm.fingerprint, task_key, max_length, layers, precision=precision)
    trainer_kwargs = {**(trainer_kwargs or {}), "precision": precision}
    path, meta, found = _cache_lookup(key, row_ids, cache_dir)
    if found is not None and "pooled" in found:
        return found["pooled"], path, True
    pooled = pooled_states(lm, contexts, batch_size=batch_size, max_length=max_length, layers=layers,
                           trainer_kwargs=trainer_kwargs, progress=progress, max_batch_tokens=max_batch_tokens)
    atomic_save_safetensors({"pooled": pooled.contiguous()}, path, meta)
    return pooled, path, False


def cached_token_states(
    lm: LM,
    contexts: Sequence[str],
    row_ids: Sequence[str],
    task_key: dict,
    *,
    cache_dir: str | os.PathLike | None = None,
    max_length: int = 512,
    layers: Sequence[int] = (-1,),
    batch_size: int = 16,
    max_batch_tokens: int | None = None,
    trainer_kwargs: dict | None = None,
    progress: bool = True,
    precision: str = "32-true",
) -> tuple[TokenStates, Path, bool]:
    """`token_states` of `contexts` through the same cache as `cached_pooled_states`, the forward
    at ``precision``.

    Returns:
        (token states, cache file, hit).
    """
    if len(contexts) != len(row_ids):
        raise ValueError(f"{len(contexts)} contexts but {len(row_ids)} row ids")
    key = pooled_cache_key(lm.fingerprint, task_key, max_length, layers, kind="tokens", precision=precision)
    trainer_kwargs = {**(trainer_kwargs or {}), "precision": precision}
    path, meta, found = _cache_lookup(key, row_ids, cache_dir)
    if found is not None and {"states", "offsets"} <= set(found):
        return TokenStates(found["states"], found["offsets"]), path, True
    states = token_states(lm, contexts, batch_size=batch_size, max_length=max_length, layers=layers,
                          trainer_kwargs=trainer_kwargs, progress=progress, max_batch_tokens=max_batch_tokens)
    atomic_save_safetensors({"states": states.flat.contiguous(), "offsets": states.offsets.contiguous()}, path, meta)
    return states, path, False
