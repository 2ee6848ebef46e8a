"""Training data: task rows with the sender's states, batches, and the data module.

A row is ``{context, question, answer}`` plus the sender's states of its context: the states of
every context token (`TokenStates`, what an attention pooler reads) or, for mean pooling, the
mean computed ahead of time, (N, D). Both come from the frozen LM through
`ilcp.training.extraction` (a Lightning predict loop and its on-disk cache) and are memory maps of
the cache file: a batch reads its rows from it, as float32.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from ..config import TrainConfig
from ..encoder.model import ILCPEncoder, sender_states_of
from ..lm import LM
from ..encoder.pooling import AttentionPooler, TokenStates, context_lengths, pad_token_states, pool_states, pool_units
from ..tasks.babilong_context import story_token_mask
from ..progress import Ticker, lines
from ..tasks import FACT_VOCABULARIES, Task, fact_values, held_out, resolve_task
from .distributed import rank, world_size
from .extraction import cached_pooled_states, cached_token_states
from .state_cache import cache_dtype
from .log import run_precision, say


def training_task(cfg: TrainConfig) -> Task:
    """The task every training stage reads: ``data.task`` without the tasks ``data.heldout_tasks``
    holds out (`ilcp.tasks.held_out`; ValueError in one line for a name that is not one of its
    tasks, or one that holds out all of them)."""
    return held_out(resolve_task(cfg.data.task), cfg.data.heldout_tasks)


def task_kwargs(cfg: TrainConfig, split: str, size: int, tokenizer=None, max_tokens: int | None = None, *,
                text_limit: int | None = None) -> dict:
    """Arguments of the training task's loader for a split of ``size`` rows (the task's own
    `ilcp.tasks.Task.training_kwargs`): ``tokenizer`` (the LM's) for the tasks that count tokens,
    ``max_tokens`` for those that refuse a context longer than the LM's limit, ``text_limit`` (the
    LM's positions) for those that refuse a longer question or answer (a user's files)."""
    return training_task(cfg).training_kwargs(cfg.data, size, tokenizer, max_tokens, text_limit=text_limit)


def load_rows(cfg: TrainConfig, split: str, size: int, tokenizer=None, max_tokens: int | None = None, *,
              text_limit: int | None = None):
    """(rows as a list of dicts, task key for the cache) of the configured task; ``tokenizer``:
    the LM's; ``max_tokens``: the LM's limit where contexts must fit it whole (no configured cut);
    ``text_limit``: the LM's limit, which no question or answer may exceed."""
    task = training_task(cfg)
    task.check_trainable()
    kwargs = task_kwargs(cfg, split, size, tokenizer, max_tokens, text_limit=text_limit)
    ds = task.load(split, **kwargs)
    return ds.to_list(), task.config_key(split, **kwargs)


class HandoffRows(Dataset):
    """Rows {context, question, answer} with their sender states: pooled (N, D), the token
    states of each context (`TokenStates`) for an attention pooler, or None where nothing trained
    reads them (the soft-prompt baselines alone)."""

    def __init__(self, rows: list[dict], states: Tensor | TokenStates | None,
                 story_masks: list[Tensor] | None = None):
        if states is not None and len(rows) != len(states):
            raise ValueError(f"{len(rows)} rows but {len(states)} sender states")
        if story_masks is not None and len(story_masks) != len(rows):
            raise ValueError(f"{len(rows)} rows but {len(story_masks)} story masks")
        self.rows, self.states = rows, states
        self.story_masks = story_masks  # (S_i,) bool per row: which token states are the story's

    @property
    def has_token_states(self) -> bool:
        return isinstance(self.states, TokenStates)

    @property
    def state_dim(self) -> int:
        return self.states.dim if self.has_token_states else self.states.shape[1]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        r = self.rows[i]
        item = {"index": i, "context": r["context"], "question": r["question"], "answer": r["answer"],
                "answers": r.get("answers") or [r["answer"]]}
        if self.states is not None:
            item["states"] = self.states[i]
        if self.story_masks is not None:
            item["story_mask"] = self.story_masks[i]
        return item


def collate_rows(items: list[dict]) -> dict:
    """A batch: "pooled" (B, D), or "tokens" (B, S, D) with "token_mask" (B, S) for token states."""
    batch = {
        "index": torch.tensor([it["index"] for it in items]),
        "context": [it["context"] for it in items],
        "question": [it["question"] for it in items],
        "answer": [it["answer"] for it in items],
        "answers": [it["answers"] for it in items],  # every accepted answer (validation's exact match)
    }
    if "states" not in items[0]:
        return batch
    if items[0]["states"].dim() == 2:  # rows of a memory-mapped cache, maybe bfloat16: float32 batches
        batch["tokens"], batch["token_mask"] = pad_token_states([it["states"] for it in items])
        batch["tokens"] = batch["tokens"].float()
        if "story_mask" in items[0]:
            story = torch.zeros(batch["token_mask"].shape, dtype=torch.bool)
            for i, it in enumerate(items):
                story[i, : len(it["story_mask"])] = it["story_mask"]
            batch["story_mask"] = story
    else:
        batch["pooled"] = torch.stack([it["states"] for it in items]).float()
    return batch


@torch.no_grad()
def pooled_rows(rows: HandoffRows, pooler: AttentionPooler | None, chunk_tokens: int = 0,
                batch_size: int = 64) -> Tensor:
    """Every row's pooled state (N, D) float32 (the masked mean, or `pooler`'s output), or with
    ``chunk_tokens > 0`` that of every chunk of every row (U, D)."""
    if not rows.has_token_states:
        return pool_states(pooler, rows.states)  # a float32 copy of the pooled states
    if pooler is None and chunk_tokens == 0:
        return rows.states.mean()
    lengths = rows.states.lengths()
    units = len(rows) if chunk_tokens == 0 else int(((lengths + chunk_tokens - 1) // chunk_tokens).clamp(min=1).sum())
    # filled in place: results kept between the batches' temporaries would fragment the heap
    out = torch.empty((units, pooler.output_dim if pooler is not None else rows.state_dim), dtype=torch.float32)
    at = 0
    for start in range(0, len(rows), batch_size):
        states, mask = pad_token_states([rows.states[i] for i in range(start, min(start + batch_size, len(rows)))])
        pooled = pool_units(pooler, chunk_tokens, states.float(), mask)
        out[at:at + len(pooled)] = pooled
        at += len(pooled)
    if at != units:
        raise RuntimeError(f"pooled {at} units where the rows' lengths give {units}")
    return out


# An export's latent bound: LATENT_BOUND_FACTOR x the largest |z| over the first LATENT_BOUND_ROWS
# rows of the validation split, then the training split; SENDER_BOUND_ROWS for an encoder that runs
# the sender LM over each row (memory slots: about half a second a row on a 2-core CPU, and a row
# gives a latent per slot, so fewer rows give as many latents)
LATENT_BOUND_FACTOR = 4.0
LATENT_BOUND_ROWS = 512
SENDER_BOUND_ROWS = 128
SENDER_BOUND_BATCH = 4  # contexts per sender forward there: its key/value cache, not the batch, sets the peak


@torch.no_grad()
def latent_bound(encoder: ILCPEncoder, splits: Sequence[HandoffRows], batch_size: int,
                 progress: bool = False) -> float | None:
    """The largest |z| a receiver of this encoder accepts (`ILCPEncoder.latent_bound`):
    `LATENT_BOUND_FACTOR` x the largest |z| the trained encoder gives over the first
    `LATENT_BOUND_ROWS` rows of `splits`, in order (every real chunk or slot of a row;
    `SENDER_BOUND_ROWS` for a memory-slot encoder, which runs the sender LM over each,
    `SENDER_BOUND_BATCH` contexts at a time at most). None when those rows give no latent above 0.
    ``progress``: lines in the log as the rows go."""
    left = SENDER_BOUND_ROWS if encoder.reads_sender_lm else LATENT_BOUND_ROWS
    if encoder.reads_sender_lm:
        batch_size = min(batch_size, SENDER_BOUND_BATCH)
    counts = []  # rows read from each split
    for split in splits:
        counts.append(min(len(split), left))
        left -= counts[-1]
    peak, done = 0.0, 0
    device = next(encoder.parameters()).device
    training = encoder.training
    encoder.eval()
    try:
        with Ticker("latent bound", total=sum(counts), unit="rows", enabled=lines(progress)) as tick:
            for split, n, start in ((s, n, b) for s, n in zip(splits, counts) for b in range(0, n, batch_size)):
                batch = collate_rows([split[i] for i in range(start, min(start + batch_size, n))])
                if encoder.reads_sender_lm:  # memory slots: a forward of the sender LM over the contexts
                    states, mask = encoder.sender_states(batch["context"])
                else:
                    states, mask = sender_states_of(batch)
                mask = None if mask is None else mask.to(device)
                z = encoder.latent(states.to(device), mask)
                if encoder.chunked:
                    z = z[encoder.latent_mask(mask)]
                if z.numel():
                    peak = max(peak, float(z.abs().max()))
                done += len(batch["context"])
                tick.update(done=done)
    finally:
        encoder.train(training)
    return LATENT_BOUND_FACTOR * peak if 0 < peak < float("inf") else None


class GlobalBatchShards(Sampler):
    """One rank's share of every batch one device would take: the batches of
    ``DataLoader(range(n), batch_size, shuffle, generator)`` (its order, epoch after epoch), each
    split among the ranks by stride, so the ranks of a step together see that step's rows. A last
    batch with fewer rows than ranks repeats rows, so every rank takes a batch at every step."""

    def __init__(self, n: int, batch_size: int, shuffle: bool, seed: int, ranks: int, rank: int):
        generator = torch.Generator().manual_seed(seed) if shuffle else None
        self.order = DataLoader(range(n), batch_size=batch_size, shuffle=shuffle, generator=generator)
        self.ranks, self.rank = ranks, rank

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        for batch in self.order:
            rows = batch.tolist()
            if len(rows) < self.ranks:
                rows = (rows * self.ranks)[: self.ranks]
            yield rows[self.rank:: self.ranks]


def row_loader(rows: Dataset, batch_size: int, *, shuffle: bool, seed: int = 0, collate_fn=collate_rows) -> DataLoader:
    """Batches of `batch_size` rows (the global batch), shuffled by `seed`; with several ranks,
    this rank's share of each (`GlobalBatchShards`, so the trainers are built with
    ``use_distributed_sampler=False``)."""
    if world_size() > 1:
        shards = GlobalBatchShards(len(rows), batch_size, shuffle, seed, world_size(), rank())
        return DataLoader(rows, batch_sampler=shards, collate_fn=collate_fn, num_workers=0)
    g = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(rows, batch_size=batch_size, shuffle=shuffle, generator=g, collate_fn=collate_fn, num_workers=0)


class HandoffDataModule(L.LightningDataModule):
    """Train / validation rows with their sender states; shuffling is seeded; `batch_size` is the
    global batch (see `row_loader`)."""

    def __init__(self, train: HandoffRows, val: HandoffRows, batch_size: int, seed: int = 0):
        super().__init__()
        self.train, self.val, self.batch_size, self.seed = train, val, batch_size, seed

    def train_dataloader(self):
        return row_loader(self.train, self.batch_size, shuffle=True, seed=self.seed)

    def val_dataloader(self):
        return row_loader(self.val, self.batch_size, shuffle=False)


def word_tokens(tokenizer, exclude: Sequence[str] = ()) -> list[int]:
    """Ids of the vocabulary's whole-word tokens (a space and 3+ ASCII letters when decoded), less
    every token of the words in `exclude` (as a sentence spells them: with and without a leading
    space, capitalised or not)."""
    banned: set[int] = set()
    for word in exclude:
        for form in {word, word.capitalize(), word.lower()}:
            for text in (form, " " + form):
                banned.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    special = set(tokenizer.all_special_ids)
    words = []
    for i in range(len(tokenizer)):
        if i in special or i in banned:
            continue
        piece = tokenizer.decode([i])
        if re.fullmatch(r" [A-Za-z]{3,}", piece):
            words.append(i)
    return words


def heldout_values() -> list[str]:
    """Every value the facts task holds out of training (`ilcp.tasks.fact_values`)."""
    return [v for name in FACT_VOCABULARIES for v in fact_values(name, "heldout")]


def sender_max_length(cfg: TrainConfig, lm: LM) -> int:
    """The context tokens the sender reads: ``data.max_length``, or with 0 the LM's own limit."""
    return cfg.data.max_length or lm.context_limit


def prepare_data(cfg: TrainConfig, lm: LM) -> tuple[HandoffRows, HandoffRows]:
    """Train and validation rows with their (cached) sender states: token states when ilcp trains
    an attention pooler, mean-pooled states when it trains without one, none when ilcp is not
    trained (the soft-prompt baselines read no sender state)."""
    out = {}
    kind = cfg.compressor.memory
    tokens = kind.reads_token_states
    extract = cached_token_states if tokens else cached_pooled_states
    max_length = sender_max_length(cfg, lm)
    limit = lm.context_limit
    max_tokens = limit if max_length >= limit else None  # no configured cut: a context must fit the LM
    for split, size in (("train", cfg.data.train_size), ("validation", cfg.data.val_size)):
        rows, key = load_rows(cfg, split, size, lm.tokenizer, max_tokens, text_limit=limit)
        if not rows:
            raise ValueError(f"task {cfg.data.task!r} has no {split} rows")
        if "ilcp" not in cfg.handoff.variants or kind.reads_sender_lm:
            why = (f"memory kind {kind.kind!r} runs the sender's LM in training" if kind.reads_sender_lm
                   else "ilcp is not among handoff.variants")
            say(f"{split}: {len(rows)} rows (no sender states: {why})")
            out[split] = HandoffRows(rows, None)
            continue
        t0 = time.perf_counter()
        states, path, hit = extract(
            lm, [r["context"] for r in rows], [r["id"] for r in rows], key,
            cache_dir=cfg.lm.cache_dir, max_length=max_length, layers=cfg.data.pool_layers,
            batch_size=cfg.data.pool_batch_size, max_batch_tokens=cfg.data.pool_batch_tokens,
            progress=cfg.trainer.progress, precision=run_precision(cfg),
            dtype=cache_dtype(cfg.data.cache_dtype, run_precision(cfg), cfg.lm.dtype),
        )
        cut = sum(n > max_length for n in context_lengths(lm.tokenizer, [r["context"] for r in rows]))
        if cut:
            say(f"{split}: {cut} of {len(rows)} contexts are longer than data.max_length={max_length} "
                "tokens: the sender reads their last tokens")
        what = (f"token states ({states.tokens} tokens, {str(states.flat.dtype).removeprefix('torch.')})" if tokens
                else f"pooled states {tuple(states.shape)} {str(states.dtype).removeprefix('torch.')}")
        say(f"{split}: {len(rows)} rows; {what} "
            f"{'read from cache' if hit else 'computed'} in {time.perf_counter() - t0:.1f}s ({path})")
        masks = None
        if cfg.compressor.story_attention_weight > 0:
            masks = story_masks(cfg, split, size, lm.tokenizer, rows, states)
        out[split] = HandoffRows(rows, states, masks)
    return out["train"], out["validation"]


def story_masks(cfg: TrainConfig, split: str, size: int, tokenizer, rows: list[dict],
                states: TokenStates) -> list[Tensor]:
    """Which token states of each BABILong row are its story's (for
    ``compressor.story_attention_weight``), aligned with the states the sender kept (its last
    tokens where a context was cut)."""
    stories = training_task(cfg).stories(split, **task_kwargs(cfg, split, size, tokenizer))
    if len(stories) != len(rows):
        raise ValueError(f"{len(rows)} {split} rows but {len(stories)} bAbI stories behind them")
    masks = []
    for i, (row, story) in enumerate(zip(rows, stories)):
        mask = torch.tensor(story_token_mask(row["context"], story, tokenizer), dtype=torch.bool)
        masks.append(mask[len(mask) - len(states[i]):])
    found = sum(int(m.any()) for m in masks)
    say(f"{split}: story tokens are {float(torch.cat(masks).float().mean()):.1%} of the sender's tokens "
        f"({found} of {len(masks)} contexts hold story tokens)")
    return masks
