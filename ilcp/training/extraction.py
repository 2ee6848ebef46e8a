"""Sender states of a task's contexts for training: batched extraction through a Lightning
predict loop, and an on-disk cache.

    from ilcp.lm import load_lm
    from ilcp.training.extraction import pooled_states
    lm = load_lm()
    pooled = pooled_states(lm, ["John went to the garden.", "Mary is in the hall."])  # (2, 576)

Extraction runs the sender's forward (`ilcp.pooling.sender_token_states`) through a Lightning
predict loop, so the same code uses any Trainer strategy (pass ``trainer_kwargs={"devices": 4,
"strategy": "ddp"}``); each rank writes its shard and the shards are merged by row index.
`cached_pooled_states` keys the result by the LM fingerprint, the task configuration, the maximum
length and the layers, and a second call reads it back without a forward pass. `token_states` /
`cached_token_states` do the same for the unpooled states of every real token (what an
`AttentionPooler` trains on), stored flat as `TokenStates`.
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
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from ..io import atomic_save_safetensors
from ..lm import LM, default_cache_dir
from ..pooling import (TokenStates, length_batches, masked_mean_pool, pad_id_of, pad_right, sender_token_states,
                       tokenize_contexts)


class _Texts(Dataset):
    def __init__(self, ids: list[list[int]]):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return i, self.ids[i]


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
