"""Pooled sender states: masked mean pooling, batched extraction, and an on-disk cache.

The sender's summary of a context is the mean of its last-layer hidden states over real tokens
(padding masked out, divided by the raw token count clamped to >= 1, no L2 normalisation).
`layers` can name several layers; their pooled vectors are concatenated.

    from ilcp.lm import load_lm
    from ilcp.pooling import pooled_states
    lm = load_lm()
    pooled = pooled_states(lm, ["John went to the garden.", "Mary is in the hall."])  # (2, 576)

Extraction runs through a Lightning predict loop, so the same code uses any Trainer strategy
(pass ``trainer_kwargs={"devices": 4, "strategy": "ddp"}``); each rank writes its shard and the
shards are merged by row index. `cached_pooled_states` keys the result by the LM fingerprint,
the task configuration, the maximum length and the layers, and a second call reads it back
without a forward pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

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


def pool_from_outputs(outputs, attention_mask: Tensor, layers: Sequence[int] = (-1,)) -> Tensor:
    """Pool from a forward the sender already ran with ``output_hidden_states=True``.

    Returns (B, H * len(layers)): the masked means of the chosen layers, concatenated.
    """
    hidden = getattr(outputs, "hidden_states", None)
    if hidden is None:
        raise ValueError("outputs carry no hidden_states: run the forward with output_hidden_states=True")
    return torch.cat([masked_mean_pool(hidden[i], attention_mask) for i in layers], dim=-1)


# --------------------------------------------------------------------------------------------
# batched extraction through a Lightning predict loop


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
        width = max(len(ids) for _, ids in items)
        input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, (_, ids) in enumerate(items):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        return {"index": index, "input_ids": input_ids, "attention_mask": mask}

    return collate


class PoolingModule(L.LightningModule):
    """Wraps the frozen LM for `Trainer.predict`; returns pooled states per batch."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[int] = (-1,)):
        super().__init__()
        self.model = model
        self.layers = tuple(layers)

    def predict_step(self, batch, batch_idx):
        out = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=True,
            use_cache=False,
            **logits_to_keep_kwargs(self.model, 1),  # the LM head's logits are not needed
        )
        pooled = pool_from_outputs(out, batch["attention_mask"], self.layers)
        return {"index": batch["index"].cpu(), "pooled": pooled.float().cpu()}


class _ShardWriter(BasePredictionWriter):
    """Each rank writes its predictions to one file; `merge` puts rows back in order."""

    def __init__(self, directory: Path):
        super().__init__(write_interval="epoch")
        self.directory = directory

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        index = torch.cat([p["index"] for p in predictions])
        pooled = torch.cat([p["pooled"] for p in predictions])
        save_file({"index": index, "pooled": pooled}, str(self.directory / f"rank{trainer.global_rank}.safetensors"))

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


def tokenize_contexts(tokenizer, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids without special tokens; contexts longer than `max_length` keep their last tokens
    (the most recent part of an agent's context)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [seq[-max_length:] if len(seq) > max_length else seq for seq in ids]


def pooled_states(
    lm: LM,
    texts: Sequence[str],
    *,
    batch_size: int = 16,
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
    texts = list(texts)
    if not texts:
        return torch.zeros((0, lm.hidden_size * len(layers)), dtype=torch.float32)
    if any(not isinstance(t, str) for t in texts):
        raise ValueError("texts must be strings")
    ids = tokenize_contexts(lm.tokenizer, texts, max_length)
    if any(len(seq) == 0 for seq in ids):
        raise ValueError("cannot pool an empty context (it has no tokens)")
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    sorted_ids = [ids[i] for i in order]
    loader = DataLoader(_Texts(sorted_ids), batch_size=batch_size, shuffle=False,
                        collate_fn=_collate(lm.tokenizer.pad_token_id or 0))
    kwargs = {"accelerator": "auto", "devices": 1, "logger": False, "enable_checkpointing": False,
              "enable_progress_bar": progress, "enable_model_summary": False}
    kwargs.update(trainer_kwargs or {})
    with tempfile.TemporaryDirectory(prefix="ilcp-pool-") as tmp:
        writer = _ShardWriter(Path(tmp))
        trainer = L.Trainer(callbacks=[writer], **kwargs)
        trainer.predict(PoolingModule(lm.model, layers), dataloaders=loader, return_predictions=False)
        pooled_sorted = writer.merge(len(sorted_ids))
    pooled = torch.empty_like(pooled_sorted)
    pooled[torch.tensor(order)] = pooled_sorted
    return pooled


# --------------------------------------------------------------------------------------------
# on-disk cache


def pooled_cache_key(fingerprint: str, task_key: dict, max_length: int, layers: Sequence[int]) -> dict:
    """Everything that decides the pooled states, as a JSON-serialisable dict."""
    return {"lm": fingerprint, "task": task_key, "max_length": int(max_length),
            "layers": [int(i) for i in layers], "pool": "masked_mean", "format": 1}


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
    trainer_kwargs: dict | None = None,
    progress: bool = True,
) -> tuple[Tensor, Path, bool]:
    """Pooled states of `contexts`, read from the cache when present, else computed and stored.

    Returns:
        (pooled (N, D) float32, cache file, hit): `hit` is True when no forward pass ran.
    """
    if len(contexts) != len(row_ids):
        raise ValueError(f"{len(contexts)} contexts but {len(row_ids)} row ids")
    key = pooled_cache_key(lm.fingerprint, task_key, max_length, layers)
    key_json = json.dumps(key, sort_keys=True)
    digest = hashlib.sha256(key_json.encode()).hexdigest()[:24]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = root / "pooled" / f"{digest}.safetensors"
    ids_json = json.dumps(list(row_ids))
    if path.is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("key") == key_json and meta.get("row_ids") == ids_json:
                    return f.get_tensor("pooled"), path, True
        except Exception:  # unreadable or foreign file: recompute and replace it
            pass
    pooled = pooled_states(lm, contexts, batch_size=batch_size, max_length=max_length, layers=layers,
                           trainer_kwargs=trainer_kwargs, progress=progress)
    atomic_save_safetensors({"pooled": pooled.contiguous()}, path, {"key": key_json, "row_ids": ids_json})
    return pooled, path, False
