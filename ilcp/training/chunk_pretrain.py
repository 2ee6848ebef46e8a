"""Pretraining a `ChunkWriter` on text alone: one vector -> its chunk's c tokens, the receiver frozen.

The receiver reads the reconstruction instruction, then one chunk's memory vector, then says the
chunk back, teacher-forced. The instruction is the same for every chunk, so its key/value cache is
computed once and every step pays only for the chunks' own positions (1 + c - 1 = c each, all
chunks of a batch in one forward). The loss is the cross-entropy over the chunk's tokens; only the
writer learns.

Corpus (`chunk_corpus`): SQuAD training paragraphs, the background books' training passages and
the bAbI stories of the trained tasks (held-out tasks left out). Each epoch cuts every text into
chunks from another offset (0, 3, 6, 1, ... for c = 8), so a chunk recurs only every c epochs.
Held-out read-back (`heldout_sets`): chunks of SQuAD validation paragraphs, of the books'
validation passages, and of the held-out bAbI tasks' stories.

Stage b (``window_chunks`` N > 1) reads a window of N x c tokens back from its N vectors, in order;
with ``continuation_tokens`` M the same vectors also go on with the text: the receiver reads the
continuation instruction, then the N vectors, and predicts the M tokens that follow the window
(their cross-entropy, weighted by ``continuation_weight``, added to the loss), so the vectors are
trained to serve text that comes after them as well as to be said back.

The run is a curve, not a rung: held-out token accuracy and exact chunks every ``eval_every``
steps go to ``curve.jsonl`` with the step and the seconds trained; the state (writer, AdamW
moments, step, seconds) is written atomically as safetensors + JSON at each evaluation, so
``--resume`` continues the same curve across sessions (the data order is a function of the step).

    python -m ilcp.training.chunk_pretrain --out checkpoints/chunk-c8 --chunk-tokens 8 --steps 1500
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor

from ..compat import cache_kwargs, cache_tensors, new_dynamic_cache, output_cache
from ..encoder.chunk import ChunkWriter
from ..encoder.chunk_sender import SenderChunkWriter, memory_token_id
from ..io import atomic_save_safetensors, atomic_write_json, atomic_write_text
from ..lm import LM
from ..receiver.prompts import continuation_prompt, reconstruction_prompt
from .chunk_run import adam_moments, parse_flag, restore_adam_moments, run_with_lm

HELDOUT_BABI = ("2", "11", "16")
TRAINED_BABI = ("1", "3", "6", "7", "8", "9", "10", "15", "17", "18", "19", "20")  # the shipped tasks, held-out ones left out


@dataclass
class ChunkPretrainConfig:
    chunk_tokens: int = 8
    batch_chunks: int = 32  # texts a step (each of window_chunks chunks)
    steps: int = 1500
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    eval_every: int = 250
    heldout_chunks: int = 256
    width: int = 256
    inner: int = 1024
    babi_stories: int = 3000  # per the trained tasks together
    seed: int = 0
    direct: bool = False  # the writer's path linear in the token embeddings (`ChunkWriter`)
    window_chunks: int = 1  # N: a text of N x c tokens read back from N vectors (1: stage a, one chunk)
    init_from: str = ""  # a chunk pretraining folder whose writer this run starts from (stage b after a)
    reading_vectors: int = 0  # R tuned vectors the receiver reads before every text's chunk vectors (`ChunkWriter`)
    continuation_tokens: int = 0  # M: the vectors also go on with the M tokens after the window (0: said back only)
    continuation_weight: float = 1.0  # the continuation loss's weight beside the read-back's
    sender_layers: int = 0  # > 0: the LM itself writes (`SenderChunkWriter`), adapters on its top layers
    sender_rank: int = 8  # those adapters' rank

    def __post_init__(self):
        least = {"chunk_tokens": 1, "batch_chunks": 1, "steps": 0, "eval_every": 1, "heldout_chunks": 1, "width": 1,
                 "inner": 1, "window_chunks": 1, "reading_vectors": 0, "continuation_tokens": 0, "warmup_steps": 0,
                 "sender_layers": 0, "sender_rank": 1}
        for name, low in least.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"chunk pretraining: {name} must be an integer >= {low}, got {value!r}")
        for name in ("lr", "continuation_weight", "weight_decay"):
            if not isinstance(getattr(self, name), (int, float)) or not getattr(self, name) >= 0:
                raise ValueError(f"chunk pretraining: {name} must be a number >= 0, got {getattr(self, name)!r}")
        if self.sender_layers and self.direct:
            raise ValueError("chunk pretraining: direct is a setting of the embedding writer; the LM writer "
                             "(sender_layers > 0) has no such path")

    @property
    def window_tokens(self) -> int:
        return self.window_chunks * self.chunk_tokens


# ------------------------------------------------------------------------------------------ data


def _squad_contexts(split: str) -> list[str]:
    from ..datadir import data_root

    seen: dict[str, None] = {}
    with open(Path(data_root()) / "squad" / f"{split}.jsonl", encoding="utf-8") as f:
        for line in f:
            seen.setdefault(json.loads(line)["context"], None)
    return list(seen)


def _book_passages(split: str, sentences_per_passage: int = 6) -> list[str]:
    from ..tasks.background import background_sentences

    rows = background_sentences(split)
    passages, current, source = [], [], None
    for s in rows:
        if s.source != source or len(current) == sentences_per_passage:
            if current:
                passages.append(" ".join(current))
            current, source = [], s.source
        current.append(s.text)
    if current:
        passages.append(" ".join(current))
    return passages


def _babi_texts(tasks, split: str, limit: int) -> list[str]:
    from ..tasks.babi import babi_stories

    return babi_stories(list(tasks), variant="en", split=split)[:limit]


def chunk_corpus(cfg: ChunkPretrainConfig) -> dict[str, list[str]]:
    """The training texts by source."""
    return {"squad": _squad_contexts("train"), "prose": _book_passages("train"),
            "babi": _babi_texts(TRAINED_BABI, "train", cfg.babi_stories)}


def heldout_texts(cfg: ChunkPretrainConfig) -> dict[str, list[str]]:
    """The held-out read-back texts by name (never trained on)."""
    return {"squad": _squad_contexts("validation"), "prose": _book_passages("validation"),
            "babi_heldout_tasks": _babi_texts(HELDOUT_BABI, "test", 200)}


def tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def cut(token_lists: list[list[int]], c: int, offset: int = 0) -> Tensor:
    """Every whole chunk of c tokens of every text, starting `offset` tokens in: (N, c) long."""
    rows = [ids[i:i + c] for ids in token_lists for i in range(offset, len(ids) - c + 1, c)]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, c)


def epoch_offset(epoch: int, c: int) -> int:
    """The chunk grid's offset in an epoch: a step of 3 (coprime with 4 and 8) walks all c offsets."""
    return (3 * epoch) % c


def even_sample(chunks: Tensor, n: int) -> Tensor:
    """At most n chunks spread evenly over the set (the same every time)."""
    if len(chunks) <= n:
        return chunks
    return chunks[torch.linspace(0, len(chunks) - 1, n).round().long()]


class ChunkBatches:
    """The training chunks in a fixed order that is a function of (seed, step): resuming at a step
    gives the batches an uninterrupted run would have seen."""

    def __init__(self, token_lists: list[list[int]], c: int, batch: int, seed: int, length: int | None = None):
        self.tokens, self.c, self.batch, self.seed = token_lists, c, batch, seed
        self.length = length or c  # tokens a row (N chunks of c)
        self._epoch, self._order = None, None

    def _epoch_chunks(self, epoch: int) -> Tensor:
        if self._epoch != epoch:
            chunks = cut(self.tokens, self.length, epoch_offset(epoch, self.c))
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order, self._epoch = chunks[torch.randperm(len(chunks), generator=g)], epoch
        return self._order

    def texts_per_epoch(self) -> int:
        return len(self._epoch_chunks(0))

    def steps_per_epoch(self) -> int:
        return max(1, self.texts_per_epoch() // self.batch)

    def at(self, step: int) -> Tensor:
        """The step's batch, always `batch` rows: an epoch cut at another offset can hold fewer rows
        than the first (whose count sets the steps an epoch), so its last batches wrap to its start."""
        per = self.steps_per_epoch()
        chunks = self._epoch_chunks(step // per)
        i = step % per
        return chunks[(i * self.batch + torch.arange(self.batch)) % len(chunks)]


# -------------------------------------------------------------------------------------- receiver


class ChunkReader:
    """The frozen receiver reading [instruction ; memory vectors ; tokens], teacher-forced.

    The instruction (the reconstruction instruction unless `prompt` says otherwise) is the same for
    every text: its key/value cache is computed once, and `logits` runs all texts of a batch in one
    forward of their own positions.
    """

    def __init__(self, lm: LM, prompt: str | None = None):
        self.lm = lm
        tok = lm.tokenizer
        prompt = reconstruction_prompt(tok) if prompt is None else prompt
        self.prefix_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        self.table = lm.model.get_input_embeddings().weight
        with torch.no_grad():
            out = lm.model(input_ids=torch.tensor([self.prefix_ids], device=lm.device), use_cache=True)
        cache = output_cache(out)
        self.prefix_kv = [(k.detach(), v.detach()) for k, v in cache_tensors(cache)]
        self.prefix_logits = out.logits[0, -1].detach().float()  # what the instruction alone predicts next

    @property
    def prefix_length(self) -> int:
        return len(self.prefix_ids)

    def _cache(self, n: int):
        cache = new_dynamic_cache(self.lm.model)
        for layer, (k, v) in enumerate(self.prefix_kv):
            cache.update(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1), layer)
        return cache

    def logits(self, memory: Tensor | None, tokens: Tensor) -> Tensor:
        """(B, L, V) logits for ``tokens`` (B, L), teacher-forced, read after the instruction and
        ``memory`` (B, N, H) (None: no memory, the instruction alone)."""
        b, length = tokens.shape
        embeds = self.table[tokens.to(self.table.device)]
        n = 0 if memory is None else memory.shape[1]
        inputs = embeds[:, :-1] if memory is None else torch.cat([memory.to(embeds.dtype), embeds[:, :-1]], dim=1)
        if inputs.shape[1] == 0:
            return self.prefix_logits.expand(b, 1, -1)
        p = self.prefix_length
        positions = torch.arange(p, p + inputs.shape[1], device=inputs.device).expand(b, -1)
        mask = torch.ones(b, p + inputs.shape[1], dtype=torch.long, device=inputs.device)
        out = self.lm.model(inputs_embeds=inputs, attention_mask=mask, position_ids=positions,
                            **cache_kwargs(self.lm.model, self._cache(b)), use_cache=True)
        logits = out.logits.float()
        if memory is None:
            return torch.cat([self.prefix_logits.expand(b, 1, -1), logits], dim=1)
        return logits[:, n - 1:]

    def score(self, memory: Tensor | None, tokens: Tensor) -> dict:
        """Loss (nats a token), token accuracy and exact texts (every token right, so greedy
        decoding says the text back) of reading ``tokens`` (B, L) from ``memory`` (B, N, H)."""
        logits = self.logits(memory, tokens)
        labels = tokens.to(logits.device)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        right = logits.argmax(-1) == labels
        return {"loss": loss, "token_accuracy": right.float().mean(), "exact": right.all(-1).float().mean()}


# ------------------------------------------------------------------------------------- training


def make_writer(cfg: ChunkPretrainConfig, lm: LM) -> ChunkWriter | SenderChunkWriter:
    """The run's writer: the embedding MLP (`ChunkWriter`), or with ``sender_layers`` the LM itself
    with adapters on its top layers (`SenderChunkWriter`), its memory token the end-of-text token."""
    if not cfg.sender_layers:
        return ChunkWriter(lm.hidden_size, cfg.chunk_tokens, width=cfg.width, inner=cfg.inner, direct=cfg.direct,
                           reading=cfg.reading_vectors).to(lm.device)
    table = lm.model.get_input_embeddings().weight
    return SenderChunkWriter.for_model(lm.model, cfg.chunk_tokens, table[memory_token_id(lm.tokenizer)],
                                       layers=cfg.sender_layers, rank=cfg.sender_rank,
                                       reading=cfg.reading_vectors).to(lm.device)


def write(writer: ChunkWriter, reader: ChunkReader, windows: Tensor) -> Tensor:
    """Windows of N x c tokens (B, N * c) -> their chunks' vectors (B, N, H), all chunks in one call,
    after the writer's R reading vectors if it has them: (B, R + N, H)."""
    b, length = windows.shape
    c = writer.chunk_tokens
    vectors = writer(reader.table[windows.reshape(b * (length // c), c).to(reader.table.device)])
    return writer.with_reading(vectors.reshape(b, length // c, -1))


@torch.no_grad()
def read_back(writer: ChunkWriter | None, reader: ChunkReader, chunks: Tensor, batch: int = 64,
              memory_tokens: int | None = None) -> dict:
    """Held-out read-back over `chunks` (writer None: no memory). With `memory_tokens` W, the
    vectors of each row's first W tokens predict the rest of the row (the continuation)."""
    totals = {"loss": 0.0, "token_accuracy": 0.0, "exact": 0.0}
    w = chunks.shape[1] if memory_tokens is None else memory_tokens
    for i in range(0, len(chunks), batch):
        part = chunks[i:i + batch]
        memory = None if writer is None else write(writer, reader, part[:, :w])
        s = reader.score(memory, part if memory_tokens is None else part[:, w:])
        for k in totals:
            totals[k] += float(s[k]) * len(part)
    return {k: round(v / len(chunks), 4) for k, v in totals.items()}


def _lr_at(cfg: ChunkPretrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


def _save_state(out: Path, writer: ChunkWriter, opt: torch.optim.AdamW, step: int, seconds: float,
                cfg: ChunkPretrainConfig) -> None:
    state = out / "state"
    state.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors({k: v.detach().cpu().contiguous() for k, v in writer.state_dict().items()},
                            state / "writer.safetensors")
    atomic_save_safetensors(adam_moments(writer, opt), state / "optimizer.safetensors")
    atomic_write_json(state / "state.json", {"step": step, "seconds": seconds, "config": asdict(cfg),
                                             "writer": writer.settings()})


def _load_state(out: Path, writer: ChunkWriter, opt: torch.optim.AdamW) -> tuple[int, float]:
    state = out / "state"
    meta = json.loads((state / "state.json").read_text())
    writer.load_state_dict(load_file(state / "writer.safetensors"))
    restore_adam_moments(writer, opt, load_file(state / "optimizer.safetensors"), meta["step"])
    return int(meta["step"]), float(meta["seconds"])


def _curve_rows(path: Path, upto: int) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] <= upto]


def pretrain(out: Path, lm: LM, cfg: ChunkPretrainConfig, *, resume: bool = False, log=print) -> list[dict]:
    """Train (or go on training) a chunk writer; returns the curve's rows."""
    out = Path(out)
    if (out / "state" / "state.json").exists() and not resume:
        raise FileExistsError(f"{out} holds a chunk pretraining; pass --resume to go on with it or pick another --out")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    writer = make_writer(cfg, lm)
    opt = torch.optim.AdamW(writer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    step, seconds = 0, 0.0
    if resume and (out / "state" / "state.json").exists():
        saved = json.loads((out / "state" / "state.json").read_text())["config"]
        now = asdict(cfg)  # settings added since the run started are not compared
        if {k: v for k, v in saved.items() if k != "steps"} != {k: now[k] for k in saved if k != "steps"}:
            raise ValueError(f"{out} was trained with other settings ({saved}); only --steps may change on --resume")
        step, seconds = _load_state(out, writer, opt)
        log(f"[chunk] resumed at step {step} ({seconds / 3600:.2f} h trained)")
    elif cfg.init_from:
        writer.load_state_dict(load_file(Path(cfg.init_from) / "state" / "writer.safetensors"))
        log(f"[chunk] writer from {cfg.init_from}")
    reader = ChunkReader(lm)
    follower = ChunkReader(lm, continuation_prompt(lm.tokenizer)) if cfg.continuation_tokens else None
    if writer.reading is not None and not resume and not cfg.init_from:
        with torch.no_grad():  # the reading vectors start as copies of the instruction's last tokens
            writer.reading.copy_(reader.table[reader.prefix_ids[-cfg.reading_vectors:]].float())
    tok = lm.tokenizer
    corpus = chunk_corpus(cfg)
    tokens = [ids for texts in corpus.values() for ids in tokenize(tok, texts)]
    w, m = cfg.window_tokens, cfg.continuation_tokens
    batches = ChunkBatches(tokens, cfg.chunk_tokens, cfg.batch_chunks, cfg.seed, w + m)
    held_tokens = {name: tokenize(tok, texts) for name, texts in heldout_texts(cfg).items()}
    heldout = {name: even_sample(cut(ids, w), cfg.heldout_chunks) for name, ids in held_tokens.items()}
    following = {f"{name}_continuation": even_sample(cut(held_tokens[name], w + m), cfg.heldout_chunks)
                 for name in ("squad", "prose") if m}

    def held_out(source: ChunkWriter | None) -> dict:
        return {**{name: read_back(source, reader, chunks) for name, chunks in heldout.items()},
                **{name: read_back(source, follower, rows, memory_tokens=w) for name, rows in following.items()}}

    log(f"[chunk] corpus: {', '.join(f'{k} {len(v)} texts' for k, v in corpus.items())}; "
        f"{batches.texts_per_epoch()} texts of {cfg.window_chunks} x {cfg.chunk_tokens} tokens"
        f"{f' and {m} to continue' if m else ''} an epoch "
        f"({batches.steps_per_epoch()} steps of {cfg.batch_chunks}); held out: "
        f"{', '.join(f'{k} {len(v)}' for k, v in heldout.items())}; writer {sum(p.numel() for p in writer.parameters()):,} "
        f"parameters")
    out.mkdir(parents=True, exist_ok=True)
    from ..provenance import provenance

    sessions_path = out / "sessions.json"
    sessions = json.loads(sessions_path.read_text()) if sessions_path.exists() else []
    atomic_write_json(sessions_path, sessions + [{"from_step": step, **provenance()}])
    curve_path = out / "curve.jsonl"
    rows = _curve_rows(curve_path, step)
    if not rows:
        base = held_out(None)
        atomic_write_json(out / "no_memory.json", base)
        log(f"[chunk] no memory: {json.dumps(base)}")
    losses: list[float] = []
    last = time.perf_counter()

    def evaluate():
        nonlocal last, seconds
        seconds += time.perf_counter() - last
        writer.eval()
        row = {"step": step, "seconds": round(seconds, 1),
               "train_loss": round(sum(losses) / len(losses), 4) if losses else None,
               **held_out(writer)}
        writer.train()
        rows.append(row)
        atomic_write_text(curve_path, "".join(json.dumps(r) + "\n" for r in rows))
        _save_state(out, writer, opt, step, seconds, cfg)
        log(f"[chunk] step {step} | {seconds / 60:.1f} min | " + " | ".join(
            f"{name} acc {row[name]['token_accuracy']:.3f} exact {row[name]['exact']:.3f}" for name in heldout)
            + "".join(f" | {name} acc {row[name]['token_accuracy']:.3f}" for name in following)
            + (f" | train loss {row['train_loss']:.3f}" if losses else ""))
        losses.clear()
        last = time.perf_counter()

    if not rows:
        evaluate()
    while step < cfg.steps:
        chunks = batches.at(step)
        for group in opt.param_groups:
            group["lr"] = _lr_at(cfg, step)
        memory = write(writer, reader, chunks[:, :w])
        loss = reader.score(memory, chunks[:, :w])["loss"]
        if m:
            loss = loss + cfg.continuation_weight * follower.score(memory, chunks[:, w:])["loss"]
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(f"chunk pretraining: the loss is {float(loss)} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(writer.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % 25 == 0:
            elapsed = seconds + time.perf_counter() - last
            chunks_per_s = cfg.batch_chunks * cfg.window_chunks * step / max(elapsed, 1e-9)
            log(f"[chunk] step {step}/{cfg.steps} | loss {sum(losses[-25:]) / len(losses[-25:]):.3f} | "
                f"{elapsed / step if step else 0:.2f} s/step | {chunks_per_s:.1f} chunks/s")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evaluate()
    return rows


def load_settings(path: str | None, overrides: dict) -> tuple[ChunkPretrainConfig, dict]:
    """The run's settings: a YAML file of `ChunkPretrainConfig` fields plus ``lm``, ``dtype`` and
    ``device`` (all optional), then the command line's overrides. ValueError names a wrong key."""
    import yaml

    loaded = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{path} must hold a mapping of settings")
    merged = {**loaded, **{k: v for k, v in overrides.items() if v is not None}}
    runtime = {k: merged.pop(k) for k in ("lm", "dtype", "device") if k in merged}
    known = set(asdict(ChunkPretrainConfig()))
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ValueError(f"unknown chunk pretraining setting(s) {', '.join(unknown)} (known: lm, dtype, device, "
                         f"{', '.join(sorted(known))})")
    return ChunkPretrainConfig(**merged), {"lm": "smollm2-135m-instruct", "dtype": "float32", "device": "cpu", **runtime}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ilcp.training.chunk_pretrain", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the run's folder (curve.jsonl, state/)")
    p.add_argument("--config", help="a YAML file of settings (configs/chunk/pretrain.yaml); flags override it")
    p.add_argument("--lm", help="the frozen LM (default smollm2-135m-instruct)")
    p.add_argument("--dtype", help="the frozen receiver's dtype: float32 (default) or bfloat16")
    p.add_argument("--device", help="cpu (default) or cuda")
    p.add_argument("--resume", action="store_true", help="go on with the run in --out")
    for name, value in asdict(ChunkPretrainConfig()).items():
        kind = parse_flag if isinstance(value, bool) else type(value)
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"default {value!r}")
    args = p.parse_args(argv)
    try:
        cfg, runtime = load_settings(args.config, {k: getattr(args, k) for k in
                                                   [*asdict(ChunkPretrainConfig()), "lm", "dtype", "device"]})
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_with_lm(runtime, lambda lm: pretrain(Path(args.out), lm, cfg, resume=args.resume,
                                                    log=lambda m: print(m, flush=True)))


if __name__ == "__main__":
    sys.exit(main())
