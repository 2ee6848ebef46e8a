"""Sender states of a task's contexts for training: batched extraction through a Lightning
predict loop, and an on-disk cache read through a memory map.

    from ilcp.lm import load_lm
    from ilcp.training.extraction import pooled_states
    lm = load_lm()
    pooled = pooled_states(lm, ["John went to the garden.", "Mary is in the hall."])  # (2, 576)

Extraction runs the sender's forward (`ilcp.encoder.pooling.sender_token_states`) through a Lightning
predict loop, so the same code uses any Trainer strategy (pass ``trainer_kwargs={"devices": 4,
"strategy": "ddp"}``). Each rank appends every batch's states to its own shard as the batch ends,
and the shards are merged into one safetensors file by streaming them in row order: no step holds
more than a batch of states, nor every context's token ids as Python lists (they are one int32
array). `cached_pooled_states` keys the file by the LM fingerprint, the task configuration, the
maximum length, the layers and the stored dtype (`cache_dtype`: bfloat16 when the run computes in
bfloat16), and a second call reads it back without a forward pass. `token_states` /
`cached_token_states` do the same for the unpooled states of every real token (what an
`AttentionPooler` trains on), stored flat as `TokenStates`.

The cache file, its key and its reader are `ilcp.training.state_cache`: its tensors are memory
maps (`read_cache`), never loaded whole, so training batches read their rows from the file. A file
is written to a folder of its own next to the cache and renamed into place when complete, so a
kill leaves no file a later run reads; one that does not match what is asked (another key, other
rows, dtype, sizes, truncated, bytes that do not match its digest, a NaN or an infinity in its
states, or no digest at all) is refused with one line saying why, and computed again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from ..lm import LM
from ..encoder.pooling import (TOKENIZE_CHUNK, TokenStates, length_batches, masked_mean_pool, pad_id_of, pad_right,
                       sender_token_states, tokenize_contexts)
from ..progress import Ticker, bars, lines
from .log import say
from .state_cache import (CACHE_DTYPES, CacheMismatch, cache_dtype, cache_path, check_contents, clear_dead_writers,
                          pooled_cache_key, read_cache, states_in_cache, write_safetensors, writer_folder)


def token_ids(tokenizer, texts: Sequence[str], max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Every context's token ids (its last `max_length`), as one flat int32 array and row offsets
    (N + 1,) int64; tokenized a chunk of contexts at a time."""
    parts, lengths = [], [np.zeros(1, dtype=np.int64)]
    for start in range(0, len(texts), TOKENIZE_CHUNK):
        ids = tokenize_contexts(tokenizer, texts[start:start + TOKENIZE_CHUNK], max_length)
        lengths.append(np.array([len(seq) for seq in ids], dtype=np.int64))
        parts.append(np.fromiter((t for seq in ids for t in seq), dtype=np.int32, count=int(lengths[-1].sum())))
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return flat, np.cumsum(np.concatenate(lengths))


class _Contexts(Dataset):
    """(row index, token ids) of the rows in `order`."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, order: np.ndarray):
        self.ids, self.offsets, self.order = ids, offsets, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, pos: int):
        i = int(self.order[pos])
        return i, self.ids[self.offsets[i]:self.offsets[i + 1]].tolist()


def _collate(pad_id: int):
    def collate(items):
        index = torch.tensor([i for i, _ in items], dtype=torch.long)
        input_ids, mask = pad_right([ids for _, ids in items], pad_id)
        return {"index": index, "input_ids": input_ids, "attention_mask": mask}

    return collate


class PoolingModule(L.LightningModule):
    """Wraps the frozen LM for `Trainer.predict`; returns each batch's pooled states, or with
    ``tokens=True`` the states of every real token (flat), with each row's index and length."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[int] = (-1,), tokens: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.model = model
        self.layers = tuple(layers)
        self.tokens = tokens
        self.dtype_stored = dtype

    def predict_step(self, batch, batch_idx):
        mask = batch["attention_mask"]
        states = sender_token_states(self.model, batch["input_ids"], mask, self.layers)
        if self.tokens:  # right padding: the real tokens of each row come first, rows in order
            return {"index": batch["index"].cpu(), "states": states[mask.bool()].to(self.dtype_stored).cpu(),
                    "lengths": mask.sum(-1).cpu()}
        pooled = masked_mean_pool(states.float(), mask).to(self.dtype_stored).cpu()
        return {"index": batch["index"].cpu(), "states": pooled, "lengths": torch.ones(len(pooled), dtype=torch.long)}


def _raw(t: Tensor) -> memoryview:
    """A tensor's bytes, little-endian as stored."""
    return memoryview(t.detach().contiguous().view(torch.uint8).numpy())


class _ShardWriter(BasePredictionWriter):
    """Each rank appends every batch to its shard as the batch ends: ``rankR.states`` (the rows'
    states, row after row) and ``rankR.rows`` ((row index, length) int64 pairs); `merge` writes
    the cache file from the shards in row order."""

    def __init__(self, directory: Path, ticker: Ticker):
        super().__init__(write_interval="batch")
        self.directory, self.ticker = directory, ticker

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        rank = trainer.global_rank
        with open(self.directory / f"rank{rank}.states", "ab") as f:
            f.write(_raw(prediction["states"]))
        pairs = torch.stack([prediction["index"].long(), prediction["lengths"].long()], dim=1)
        with open(self.directory / f"rank{rank}.rows", "ab") as f:
            f.write(_raw(pairs))
        tokens = int(batch["attention_mask"].sum())
        self.ticker.update(len(pairs) * trainer.world_size, tokens=tokens * trainer.world_size)

    def merge(self, out: Path, n: int, dim: int, dtype: torch.dtype, *, tokens: bool,
              metadata: dict[str, str] | None = None) -> None:
        """Write ``out``: ``states`` (T, dim) and ``offsets`` (n + 1,), or with ``tokens=False``
        ``pooled`` (n, dim); one row at a time from the shards' memory maps."""
        row_bytes = dim * torch.empty((), dtype=dtype).element_size()
        shard_of = np.full(n, -1, dtype=np.int64)
        start_of = np.zeros(n, dtype=np.int64)
        lengths = np.zeros(n, dtype=np.int64)
        maps = []
        for s, rows_file in enumerate(sorted(self.directory.glob("rank*.rows"))):
            pairs = np.fromfile(rows_file, dtype=np.int64).reshape(-1, 2)
            starts = np.concatenate([[0], np.cumsum(pairs[:, 1])[:-1]]).astype(np.int64)
            states_file = rows_file.with_suffix(".states")
            if states_file.stat().st_size != int(pairs[:, 1].sum()) * row_bytes:
                raise RuntimeError(f"sender-state shard {states_file.name} does not hold the rows it lists")
            # distributed samplers may repeat rows to even out ranks: the same values, either copy serves
            shard_of[pairs[:, 0]], start_of[pairs[:, 0]], lengths[pairs[:, 0]] = s, starts, pairs[:, 1]
            size = states_file.stat().st_size
            maps.append(np.memmap(states_file, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8))
        missing = int((shard_of < 0).sum())
        if missing:
            raise RuntimeError(f"sender-state extraction missed {missing} of {n} rows")
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        if tokens:
            layout = [("offsets", torch.int64, [n + 1]), ("states", dtype, [int(offsets[-1]), dim])]
        else:
            layout = [("pooled", dtype, [n, dim])]

        def fill(f, name):
            if name == "offsets":
                f.write(memoryview(offsets))
                return
            for i in range(n):
                begin = int(start_of[i]) * row_bytes
                f.write(maps[shard_of[i]][begin:begin + int(lengths[i]) * row_bytes])

        write_safetensors(out, layout, fill, metadata)
        maps.clear()  # the shards can be removed now


class _Batches(Sampler):
    """Fixed batches of row indices, as a batch sampler."""

    def __init__(self, batches: list[list[int]]):
        self.batches = batches
        self.drop_last = False  # every row is predicted

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _extract_to(out: Path, lm: LM, texts: Sequence[str], *, tokens: bool, batch_size: int, max_length: int,
                layers: Sequence[int], trainer_kwargs: dict | None, progress: bool,
                max_batch_tokens: int | None = None, dtype: torch.dtype = torch.float32,
                metadata: dict[str, str] | None = None) -> None:
    """One predict pass over `texts` (sorted by length), written to the safetensors file ``out`` in
    the order given; the shards go to a folder beside it, removed afterwards."""
    if any(not isinstance(t, str) for t in texts):
        raise ValueError("texts must be strings")
    ids, offsets = token_ids(lm.tokenizer, texts, max_length)
    lengths = np.diff(offsets)
    if (lengths == 0).any():
        raise ValueError("cannot pool an empty context (it has no tokens)")
    order = np.argsort(lengths, kind="stable")
    batches = _Batches(length_batches(lengths[order].tolist(), batch_size, max_batch_tokens))
    loader = DataLoader(_Contexts(ids, offsets, order), batch_sampler=batches,
                        collate_fn=_collate(pad_id_of(lm.tokenizer)))
    kwargs = {"accelerator": "auto", "devices": 1, "logger": False, "enable_checkpointing": False,
              "enable_progress_bar": bars(progress), "enable_model_summary": False}
    kwargs.update(trainer_kwargs or {})
    shards = out.parent / f"{out.name}.shards"
    shards.mkdir(parents=True, exist_ok=True)
    trainer = None
    try:
        with Ticker("sender states", total=len(texts), unit="rows", enabled=lines(progress)) as tick:
            writer = _ShardWriter(shards, tick)
            trainer = L.Trainer(callbacks=[writer], **kwargs)
            with warnings.catch_warnings():  # the batches hold every row: nothing is dropped
                warnings.filterwarnings("ignore", message=".*custom batch sampler.*")
                trainer.predict(PoolingModule(lm.model, layers, tokens=tokens, dtype=dtype), dataloaders=loader,
                                return_predictions=False)
        if trainer.global_rank == 0:
            writer.merge(out, len(texts), lm.hidden_size * len(layers), dtype, tokens=tokens, metadata=metadata)
    finally:
        if trainer is None or trainer.global_rank == 0:  # rank 0 merges the other ranks' shards too
            shutil.rmtree(shards, ignore_errors=True)


def _in_memory(lm: LM, texts: Sequence[str], *, tokens: bool, **kwargs):
    """`_extract_to` a temporary file, read back into memory as float32."""
    texts = list(texts)
    with tempfile.TemporaryDirectory(prefix="ilcp-pool-") as tmp:
        out = Path(tmp) / "states.safetensors"
        _extract_to(out, lm, texts, tokens=tokens, **kwargs)
        dim = lm.hidden_size * len(kwargs.get("layers", (-1,)))
        if tokens:
            found = read_cache(out, {"offsets": (torch.int64, [len(texts) + 1]),
                                     "states": (torch.float32, [None, dim])})
            return TokenStates(found["states"].clone(), found["offsets"].clone())
        return read_cache(out, {"pooled": (torch.float32, [len(texts), dim])})["pooled"].clone()


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
    return _in_memory(lm, texts, tokens=False, batch_size=batch_size, max_length=max_length, layers=layers,
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
    return _in_memory(lm, texts, tokens=True, batch_size=batch_size, max_length=max_length, layers=layers,
                      max_batch_tokens=max_batch_tokens, trainer_kwargs=trainer_kwargs, progress=progress)


# --------------------------------------------------------------------------------------------
# through the on-disk cache


def _cached(lm: LM, contexts: Sequence[str], row_ids: Sequence[str], task_key: dict, *, tokens: bool,
            cache_dir, max_length: int, layers: Sequence[int], batch_size: int, max_batch_tokens: int | None,
            trainer_kwargs: dict | None, progress: bool, precision: str, dtype: str):
    if len(contexts) != len(row_ids):
        raise ValueError(f"{len(contexts)} contexts but {len(row_ids)} row ids")
    dtype = cache_dtype(dtype, precision)
    key = pooled_cache_key(lm.fingerprint, task_key, max_length, layers, kind="tokens" if tokens else "mean",
                           precision=precision, dtype=dtype)
    path = cache_path(key, cache_dir)
    metadata = {"key": json.dumps(key, sort_keys=True), "row_ids": json.dumps(list(row_ids)), "dtype": dtype}
    n, dim, stored = len(contexts), lm.hidden_size * len(layers), CACHE_DTYPES[dtype]
    expect = ({"offsets": (torch.int64, [n + 1]), "states": (stored, [None, dim])} if tokens
              else {"pooled": (stored, [n, dim])})
    if path.exists() or path.is_symlink():
        try:
            if not path.is_file():
                raise CacheMismatch("it is not a regular file")
            states = states_in_cache(read_cache(path, expect, metadata), tokens, n)
            check_contents(path)
            return states, path, True
        except (CacheMismatch, OSError) as e:
            say(f"sender-state cache {path} refused ({e}): computing it again")
    make_cache_folder(path)
    clear_dead_writers(path)
    work = writer_folder(path)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        out = work / path.name
        _extract_to(out, lm, list(contexts), tokens=tokens, batch_size=batch_size, max_length=max_length,
                    layers=layers, trainer_kwargs={**(trainer_kwargs or {}), "precision": precision},
                    progress=progress, max_batch_tokens=max_batch_tokens, dtype=stored, metadata=metadata)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(out, path)  # complete, so only now under its name
    finally:
        shutil.rmtree(work, ignore_errors=True)
    states = states_in_cache(read_cache(path, expect, metadata), tokens, n)
    try:
        check_contents(path)
    except CacheMismatch as e:
        path.unlink(missing_ok=True)
        hint = ("the LM gives non-finite states for these contexts: try trainer.precision=32-true" if "NaN" in str(e)
                else "the file changed as it was written: check the disk and run again")
        raise ValueError(f"the sender states just computed into {path} are refused ({e}); {hint}") from None
    return states, path, False


def make_cache_folder(path: Path) -> None:
    """The cache's folder of ``path``, made when missing; ValueError naming it when a file is in
    its way."""
    for folder in (path.parent, *path.parent.parents):
        if folder.exists() or folder.is_symlink():
            if not folder.is_dir():
                raise ValueError(f"the sender-state cache needs the folder {path.parent}, but {folder} is a file: move "
                                 "it away or set lm.cache_dir to another folder")
            break
    path.parent.mkdir(parents=True, exist_ok=True)


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
    dtype: str = "auto",
) -> tuple[Tensor, Path, bool]:
    """Pooled states of `contexts`, read from the cache when present, else computed and stored;
    the forward runs at ``precision`` (a resolved `ilcp.precision` name), the states are stored in
    ``dtype`` (`cache_dtype`).

    Returns:
        (pooled (N, D), a read-only memory map of the cache file; cache file; hit): `hit` is True
        when no forward pass ran.
    """
    return _cached(lm, contexts, row_ids, task_key, tokens=False, cache_dir=cache_dir, max_length=max_length,
                   layers=layers, batch_size=batch_size, max_batch_tokens=max_batch_tokens,
                   trainer_kwargs=trainer_kwargs, progress=progress, precision=precision, dtype=dtype)


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
    dtype: str = "auto",
) -> tuple[TokenStates, Path, bool]:
    """`token_states` of `contexts` through the same cache as `cached_pooled_states`, the forward
    at ``precision``, stored in ``dtype``; the returned rows are read from the file's memory map.

    Returns:
        (token states, cache file, hit).
    """
    return _cached(lm, contexts, row_ids, task_key, tokens=True, cache_dir=cache_dir, max_length=max_length,
                   layers=layers, batch_size=batch_size, max_batch_tokens=max_batch_tokens,
                   trainer_kwargs=trainer_kwargs, progress=progress, precision=precision, dtype=dtype)
