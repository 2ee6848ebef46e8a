"""Training the ILCP modules and the two tuned baselines with PyTorch Lightning.

    python train.py                                   # embedded SmolLM2, bAbI task 1
    python train.py --config configs/tiny.yaml        # seconds, tiny random LM (tests)

`train(cfg)` runs, for one frozen LM loaded once:
1. data: task rows (train / validation), pooled states of every context, or with
   ``compressor.pooling=attention`` the states of every context token (cached on disk);
2. stage 1, `CompressorModule`: the beta-VAE on standardised pooled states
   (reconstruction + beta * KL with a linear warm-up); an untrained attention pooler returns
   copies of the mean, so without the answer head stage 1 sees what the spec's mean pool gives;
   with ``compressor.probe_weight > 0`` a small answer head reads [mu ; question features] and
   its cross-entropy joins the loss, so the latent (and the attention pooler) learn what the
   answers need without an LM forward;
3. stage 2, `HandoffModule`, once per variant with the same recipe and step budget:
   - ``ilcp``: z = mu of the encoder -> projector -> K memory vectors + question prompt
     (the attention pooler, when configured, learns here with the encoder);
   - ``prompt_tuned``: K learned constant vectors + question prompt (no context);
   - ``cold_read_tuned``: K learned constant vectors + context text + question prompt;
   each trained with the answer tokens' cross-entropy through the frozen LM (labels are -100
   everywhere but the answer and its end token), validated every ``val_every_steps`` steps on
   the teacher-forced loss and greedy exact match;
4. export to ``checkpoints/RUN`` (see `ilcp.export`).

The frozen LM never receives gradients and is never written to a checkpoint. Each stage keeps a
``last.ckpt``; ``train(cfg, resume=True)`` skips finished stages and continues the unfinished one.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from safetensors.torch import load_file
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from . import prompts
from .compat import logits_to_keep_kwargs
from .compressor import BetaVAE, active_units
from .config import CompressorConfig, HandoffConfig, TrainConfig, save_config
from .decoding import assemble_prefix, greedy_decode, left_pad
from .metrics import exact_match
from .io import atomic_save_safetensors, atomic_write_json
from .lm import LM, load_lm
from .pooling import (AttentionPooler, TokenStates, cached_pooled_states, cached_token_states, masked_mean_pool,
                      pad_token_states)
from .projector import GatedLatentToMemoryProjector, mean_token_embedding_norm
from .tasks import load_task, task_config_key

LM_PREFIX = "lm."


# --------------------------------------------------------------------------------------------
# data


def task_kwargs(cfg: TrainConfig, split: str, size: int) -> dict:
    """Arguments of `load_task` for the configured training task and a split."""
    d = cfg.data
    if d.task == "facts":
        return {"n_examples": size, "n_facts": d.facts_n_facts, "n_distractors": d.facts_n_distractors, "seed": d.seed}
    return {"variant": d.babi_variant, "limit": size, "seed": d.seed}


def load_rows(cfg: TrainConfig, split: str, size: int):
    """(rows as a list of dicts, task key for the cache) of the configured task."""
    kwargs = task_kwargs(cfg, split, size)
    ds = load_task(cfg.data.task, split, **kwargs)
    return ds.to_list(), task_config_key(cfg.data.task, split, **kwargs)


class HandoffRows(Dataset):
    """Rows {context, question, answer} with their sender states: pooled (N, D), or the token
    states of each context (`TokenStates`) for an attention pooler."""

    def __init__(self, rows: list[dict], states: Tensor | TokenStates):
        if len(rows) != len(states):
            raise ValueError(f"{len(rows)} rows but {len(states)} sender states")
        self.rows, self.states = rows, states

    @property
    def tokens(self) -> bool:
        return isinstance(self.states, TokenStates)

    @property
    def state_dim(self) -> int:
        return self.states.dim if self.tokens else self.states.shape[1]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        r = self.rows[i]
        return {"index": i, "states": self.states[i], "context": r["context"], "question": r["question"], "answer": r["answer"]}


def collate_rows(items: list[dict]) -> dict:
    """A batch: "pooled" (B, D), or "tokens" (B, S, D) with "token_mask" (B, S) for token states."""
    batch = {
        "index": torch.tensor([it["index"] for it in items]),
        "context": [it["context"] for it in items],
        "question": [it["question"] for it in items],
        "answer": [it["answer"] for it in items],
    }
    if items[0]["states"].dim() == 2:
        batch["tokens"], batch["token_mask"] = pad_token_states([it["states"] for it in items])
    else:
        batch["pooled"] = torch.stack([it["states"] for it in items])
    return batch


@torch.no_grad()
def pooled_inputs(rows: HandoffRows, pooler: AttentionPooler | None, batch_size: int = 64) -> Tensor:
    """Every row's pooled state (N, D): the stored one, or the pooler over the token states."""
    if not rows.tokens:
        return rows.states
    if pooler is None:
        return rows.states.mean()
    out = []
    for start in range(0, len(rows), batch_size):
        states, mask = pad_token_states([rows.states[i] for i in range(start, min(start + batch_size, len(rows)))])
        out.append(pooler(states, mask))
    return torch.cat(out)


class HandoffDataModule(L.LightningDataModule):
    """Train / validation rows with pooled states; shuffling is seeded."""

    def __init__(self, train: HandoffRows, val: HandoffRows, batch_size: int, seed: int = 0):
        super().__init__()
        self.train, self.val, self.batch_size, self.seed = train, val, batch_size, seed

    def train_dataloader(self):
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, generator=g,
                          collate_fn=collate_rows, num_workers=0)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size, shuffle=False, collate_fn=collate_rows, num_workers=0)


# --------------------------------------------------------------------------------------------
# stage 1


def question_features(lm: LM, questions: list[str]) -> Tensor:
    """Mean input embedding of each question's tokens: (N, H) float32, no LM forward."""
    table = lm.model.get_input_embeddings().weight.detach().float().cpu()
    ids = lm.tokenizer(list(questions), add_special_tokens=False)["input_ids"]
    return torch.stack([table[torch.tensor(seq or [0])].mean(0) for seq in ids])


class StageOneRows(Dataset):
    """HandoffRows plus standardised question features (N, H) and answer classes (N,), -100 for
    an answer the training split never gives."""

    def __init__(self, rows: HandoffRows, features: Tensor, labels: Tensor):
        self.rows, self.features, self.labels = rows, features, labels

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {**self.rows[i], "features": self.features[i], "label": self.labels[i]}


def collate_stage_one(items: list[dict]) -> dict:
    batch = collate_rows(items)
    batch["features"] = torch.stack([it["features"] for it in items])
    batch["label"] = torch.stack([it["label"] for it in items])
    return batch


class CompressorModule(L.LightningModule):
    """The beta-VAE: MSE of standardised pooled states + beta * KL (warm-up from 0).

    With ``cfg.probe_weight > 0`` an answer head reads [mu ; question features] and its
    cross-entropy, times the weight, joins the loss; the head is dropped after stage 1. The
    attention pooler (if any) learns in stage 1 only then; the reconstruction target is its
    output detached, so the pooler is not pulled towards outputs that are easy to reconstruct.
    """

    def __init__(self, vae: BetaVAE, cfg: CompressorConfig, pooler: AttentionPooler | None = None,
                 question_dim: int = 0, num_answers: int = 0):
        super().__init__()
        self.vae, self.cfg, self.pooler = vae, cfg, pooler
        self.head = None
        if cfg.probe_weight > 0:
            self.head = nn.Sequential(nn.Linear(vae.latent_dim + question_dim, cfg.hidden_dim), nn.SiLU(),
                                      nn.Linear(cfg.hidden_dim, num_answers))
        elif pooler is not None:
            pooler.requires_grad_(False)  # nothing would teach it: it stays the mean
        self._val_mu: list[Tensor] = []

    def kl_weight(self) -> float:
        if self.cfg.kl_warmup_steps == 0:
            return self.vae.beta
        return self.vae.beta * min(1.0, self.global_step / self.cfg.kl_warmup_steps)

    def _losses(self, batch) -> dict[str, Tensor]:
        if "tokens" in batch:
            pooled = (self.pooler(batch["tokens"], batch["token_mask"]) if self.pooler is not None
                      else masked_mean_pool(batch["tokens"], batch["token_mask"]))
        else:
            pooled = batch["pooled"]
        out = self.vae(pooled.detach() if self.head is None else pooled)
        recon = torch.mean((out.reconstruction - out.target.detach()) ** 2)
        losses = {"recon": recon, "kl": out.kl, "mu": out.mu}
        if self.head is not None:
            logits = self.head(torch.cat([out.mu, batch["features"]], dim=-1))
            labels = batch["label"]
            known = labels != -100
            if known.any():
                losses["probe_ce"] = F.cross_entropy(logits[known], labels[known])
                losses["probe_accuracy"] = (logits.argmax(-1)[known] == labels[known]).float().mean()
            else:  # no answer the head knows (a tiny validation split): nothing to score
                losses["probe_ce"] = losses["probe_accuracy"] = logits.sum() * 0.0
        return losses

    def training_step(self, batch, batch_idx):
        out = self._losses(batch)
        loss = out["recon"] + self.kl_weight() * out["kl"]
        logged = {"train/loss": loss, "train/recon": out["recon"], "train/kl": out["kl"]}
        if self.head is not None:
            loss = loss + self.cfg.probe_weight * out["probe_ce"]
            logged.update({"train/probe_ce": out["probe_ce"], "train/probe_accuracy": out["probe_accuracy"]})
        self.log_dict(logged, prog_bar=True, batch_size=len(batch["answer"]))
        return loss

    def validation_step(self, batch, batch_idx):
        out = self._losses(batch)
        self._val_mu.append(out["mu"].detach())
        logged = {"val/recon": out["recon"], "val/kl": out["kl"], "val/loss": out["recon"] + self.vae.beta * out["kl"]}
        if self.head is not None:
            logged.update({"val/probe_ce": out["probe_ce"], "val/probe_accuracy": out["probe_accuracy"]})
        self.log_dict(logged, batch_size=len(batch["answer"]))

    def on_validation_epoch_end(self):
        if self._val_mu:
            self.log("val/active_units", float(active_units(torch.cat(self._val_mu))))
        self._val_mu.clear()

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.cfg.lr)


# --------------------------------------------------------------------------------------------
# stage 2


class HandoffModule(L.LightningModule):
    """One stage-2 variant: memory vectors (from z, or constant) + receiver prompt -> answer.

    Args:
        variant: "ilcp", "prompt_tuned" or "cold_read_tuned".
        lm: the frozen LM (kept in eval mode, excluded from checkpoints).
        cfg: stage-2 settings.
        vae: the stage-1 compressor (ilcp only).
        pooler: the attention pooler in front of the compressor (ilcp only; None = the batches
            carry pooled states).
        val_decode_size: validation rows (the first ones) decoded for exact match.
    """

    def __init__(self, variant: str, lm: LM, cfg: HandoffConfig, vae: BetaVAE | None = None,
                 val_decode_size: int = 64, pooler: AttentionPooler | None = None):
        super().__init__()
        if variant == "ilcp" and vae is None:
            raise ValueError("the ilcp variant needs the stage-1 compressor")
        if pooler is not None and variant != "ilcp":
            raise ValueError("only the ilcp variant reads the sender's states through a pooler")
        self.variant, self.cfg, self.tokenizer, self.val_decode_size = variant, cfg, lm.tokenizer, val_decode_size
        self.lm = lm.model
        self.strict_loading = False  # checkpoints hold the trained modules only
        hidden = lm.hidden_size
        target_norm = mean_token_embedding_norm(lm.model)
        if variant == "ilcp":
            self.vae = vae
            self.vae.requires_grad_(cfg.finetune_encoder)
            self.pooler = pooler
            if pooler is not None:
                pooler.requires_grad_(cfg.finetune_encoder)
            self.projector = GatedLatentToMemoryProjector(vae.latent_dim, cfg.num_memory_tokens, hidden, cfg.projector_hidden)
            self.projector.calibrate_output_norm(target_norm)
        else:
            # Initialised from random rows of the embedding table: the scale of real tokens.
            g = torch.Generator().manual_seed(0)
            weight = lm.model.get_input_embeddings().weight.detach().float().cpu()
            rows = torch.randint(0, weight.shape[0], (cfg.num_memory_tokens,), generator=g)
            self.soft_prompt = nn.Parameter(weight[rows].clone())
        self._val_hits: list[bool] = []

    # the frozen LM stays in eval mode whatever Lightning asks of the module
    def train(self, mode: bool = True):
        super().train(mode)
        self.lm.eval()
        if self.variant == "ilcp" and not self.cfg.finetune_encoder:
            self.vae.eval()
        return self

    def pooled(self, batch: dict) -> Tensor:
        """The batch's pooled sender states (B, D): stored, or through the attention pooler."""
        if "tokens" in batch:
            if getattr(self, "pooler", None) is None:
                return masked_mean_pool(batch["tokens"], batch["token_mask"])
            return self.pooler(batch["tokens"], batch["token_mask"])
        return batch["pooled"]

    def memory(self, pooled: Tensor) -> tuple[Tensor, Tensor]:
        """(B, D) pooled states -> (memory (B, K, H) in the LM's dtype, mean KL or 0)."""
        dtype = self.lm.get_input_embeddings().weight.dtype
        if self.variant == "ilcp":
            mu, logvar = self.vae.encode(pooled)
            kl = -0.5 * torch.mean(torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=-1))
            return self.projector(mu, dtype=dtype), kl
        b = pooled.shape[0]
        return self.soft_prompt.to(dtype).unsqueeze(0).expand(b, -1, -1), pooled.new_zeros(())

    def prompt_text(self, context: str, question: str) -> str:
        if self.variant == "cold_read_tuned":
            return prompts.cold_read_prompt(self.tokenizer, context, question)
        return prompts.question_prompt(self.tokenizer, question)

    def _teacher_forced(self, batch) -> tuple[Tensor, Tensor]:
        memory, kl = self.memory(self.pooled(batch))
        embed = self.lm.get_input_embeddings()
        device = embed.weight.device
        sequences, labels = [], []
        for i, (context, question, answer) in enumerate(zip(batch["context"], batch["question"], batch["answer"])):
            prompt_ids = self.tokenizer(self.prompt_text(context, question), add_special_tokens=False)["input_ids"]
            answer_ids = self.tokenizer(prompts.answer_text(answer, self.tokenizer), add_special_tokens=False)["input_ids"]
            ids = torch.tensor(prompt_ids + answer_ids, device=device)
            sequences.append(torch.cat([memory[i], embed(ids)], dim=0))
            n_ignored = memory.shape[1] + len(prompt_ids)
            labels.append(torch.tensor([-100] * n_ignored + answer_ids, device=device))
        inputs_embeds, attention_mask, position_ids = left_pad(sequences)
        # Left padding puts every answer at the right edge, so only the logits of the last
        # positions are needed: position t predicts token t + 1.
        n_keep = max(len(lab) - int((lab == -100).sum()) for lab in labels) + 1
        targets = torch.full((len(labels), n_keep - 1), -100, dtype=torch.long, device=device)
        for i, lab in enumerate(labels):
            tail = lab[-(n_keep - 1):]
            targets[i, n_keep - 1 - len(tail):] = tail
        out = self.lm(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False, **logits_to_keep_kwargs(self.lm, n_keep))
        logits = out.logits[:, -n_keep:-1].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        return loss, kl

    def training_step(self, batch, batch_idx):
        loss, kl = self._teacher_forced(batch)
        total = loss
        if self.variant == "ilcp" and self.cfg.finetune_encoder and self.cfg.joint_kl_weight > 0:
            total = loss + self.cfg.joint_kl_weight * kl
        self.log_dict({"train/loss": loss, "train/kl": kl}, prog_bar=True, batch_size=len(batch["answer"]))
        return total

    def validation_step(self, batch, batch_idx):
        loss, _ = self._teacher_forced(batch)
        self.log("val/loss", loss, prog_bar=True, batch_size=len(batch["answer"]))
        keep = [i for i, idx in enumerate(batch["index"].tolist()) if idx < self.val_decode_size]
        if keep:
            pooled = self.pooled(batch)
            predictions = self.answer(pooled[keep], [batch["context"][i] for i in keep],
                                      [batch["question"][i] for i in keep])
            self._val_hits.extend(exact_match(p, batch["answer"][i]) for p, i in zip(predictions, keep))

    def on_validation_epoch_end(self):
        if self._val_hits:
            self.log("val/exact_match", sum(self._val_hits) / len(self._val_hits), prog_bar=True)
        self.log("val/step", float(self.global_step))
        self._val_hits.clear()

    @torch.no_grad()
    def answer(self, pooled: Tensor, contexts: list[str], questions: list[str]) -> list[str]:
        """Greedy answers of this variant for a few rows (validation); pooled is (B, D)."""
        memory, _ = self.memory(pooled)
        prefixes = [assemble_prefix(self.lm, self.tokenizer, [memory[i], self.prompt_text(c, q)])
                    for i, (c, q) in enumerate(zip(contexts, questions))]
        return greedy_decode(self.lm, self.tokenizer, prefixes, max_new_tokens=self.cfg.max_new_tokens,
                             batch_size=self.cfg.batch_size)

    def configure_optimizers(self):
        if self.variant == "ilcp":
            groups = [{"params": list(self.projector.parameters()), "lr": self.cfg.lr}]
            if self.cfg.finetune_encoder:
                encoder = list(self.vae.parameters()) + (list(self.pooler.parameters()) if self.pooler is not None else [])
                groups.append({"params": encoder, "lr": self.cfg.encoder_lr})
        else:
            groups = [{"params": [self.soft_prompt], "lr": self.cfg.lr}]
        opt = torch.optim.AdamW(groups, weight_decay=self.cfg.weight_decay)
        warmup, total = self.cfg.warmup_steps, self.cfg.max_steps

        def schedule(step: int) -> float:  # linear warm-up, then cosine to 10%
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(LM_PREFIX)}

    def trained_state(self) -> dict[str, Tensor]:
        """The trained tensors only, with export names."""
        if self.variant == "ilcp":
            state = {f"compressor.{k}": v for k, v in self.vae.state_dict().items()}
            state.update({f"projector.{k}": v for k, v in self.projector.state_dict().items()})
            if self.pooler is not None:
                state.update({f"pooler.{k}": v for k, v in self.pooler.state_dict().items()})
            return state
        return {"soft_prompt": self.soft_prompt.detach()}

    def load_trained_state(self, state: dict[str, Tensor]) -> None:
        if self.variant == "ilcp":
            self.vae.load_state_dict({k[len("compressor."):]: v for k, v in state.items() if k.startswith("compressor.")})
            self.projector.load_state_dict({k[len("projector."):]: v for k, v in state.items() if k.startswith("projector.")})
            if self.pooler is not None:
                self.pooler.load_state_dict({k[len("pooler."):]: v for k, v in state.items() if k.startswith("pooler.")})
        else:
            self.soft_prompt.data.copy_(state["soft_prompt"])


def parameter_counts(module: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts."""
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return trainable, frozen


# --------------------------------------------------------------------------------------------
# the pipeline


def _trainer(cfg: TrainConfig, stage_dir: Path, name: str, callbacks: list, **kwargs) -> L.Trainer:
    t = cfg.trainer
    return L.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=t.strategy,
        precision=t.precision, logger=CSVLogger(str(cfg.run_dir / "logs"), name=name, version=""),
        callbacks=callbacks, enable_progress_bar=t.progress, enable_model_summary=False,
        default_root_dir=str(stage_dir), num_sanity_val_steps=0, log_every_n_steps=5, **kwargs,
    )


def _read_curve(cfg: TrainConfig, name: str) -> list[dict]:
    """Validation rows of a stage's CSV log: [{step, val/loss, val/exact_match, ...}]."""
    path = cfg.run_dir / "logs" / name / "metrics.csv"
    if not path.is_file():
        return []
    import csv

    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            vals = {k: float(v) for k, v in r.items() if k.startswith("val/") and v not in ("", None)}
            if vals:
                step = vals.pop("val/step", float(r["step"]))  # the optimizer step validated
                rows.append({"step": int(step), **vals})
    merged: dict[int, dict] = {}
    for r in rows:
        merged.setdefault(r["step"], {}).update(r)
    return [merged[s] for s in sorted(merged)]


def _last_ckpt(stage_dir: Path) -> Path | None:
    p = stage_dir / "checkpoints" / "last.ckpt"
    return p if p.is_file() else None


def _load_ckpt_state(path: Path) -> dict[str, Tensor]:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return ckpt["state_dict"]


def _say(msg: str) -> None:
    print(f"[ilcp] {msg}", flush=True)


def prepare_data(cfg: TrainConfig, lm: LM):
    """Train and validation rows with their (cached) pooled states."""
    out = {}
    for split, size in (("train", cfg.data.train_size), ("validation", cfg.data.val_size)):
        rows, key = load_rows(cfg, split, size)
        if not rows:
            raise ValueError(f"task {cfg.data.task!r} has no {split} rows")
        t0 = time.perf_counter()
        tokens = cfg.compressor.pooling == "attention" and "ilcp" in cfg.handoff.variants
        extract = cached_token_states if tokens else cached_pooled_states
        states, path, hit = extract(
            lm, [r["context"] for r in rows], [r["id"] for r in rows], key,
            cache_dir=cfg.lm.cache_dir, max_length=cfg.data.max_length, layers=cfg.data.pool_layers,
            batch_size=cfg.data.pool_batch_size, progress=cfg.trainer.progress,
        )
        what = f"token states ({states.flat.shape[0]} tokens)" if tokens else f"pooled states {tuple(states.shape)}"
        _say(f"{split}: {len(rows)} rows; {what} "
             f"{'read from cache' if hit else 'computed'} in {time.perf_counter() - t0:.1f}s ({path})")
        out[split] = HandoffRows(rows, states)
    return out["train"], out["validation"]


def make_pooler(cfg: TrainConfig, state_dim: int) -> AttentionPooler | None:
    """The untrained attention pooler of the config (None for the mean pool)."""
    if cfg.compressor.pooling != "attention":
        return None
    return AttentionPooler(state_dim, cfg.compressor.pool_queries)


def stage_one_rows(lm: LM, train: HandoffRows, val: HandoffRows) -> tuple[StageOneRows, StageOneRows, int]:
    """Stage-1 rows with question features (standardised with train statistics) and answer
    classes; returns (train, validation, number of answer classes)."""
    answers = sorted({r["answer"].strip() for r in train.rows})
    index = {a: i for i, a in enumerate(answers)}
    feats = [question_features(lm, [r["question"] for r in rows.rows]) for rows in (train, val)]
    # Questions share most of their tokens: standardising brings out the words that differ,
    # such as the name asked about.
    mean, std = feats[0].mean(0), feats[0].std(0).clamp(min=1e-6) if len(train) > 1 else torch.ones(feats[0].shape[1])
    out = []
    for rows, f in zip((train, val), feats):
        labels = torch.tensor([index.get(r["answer"].strip(), -100) for r in rows.rows], dtype=torch.long)
        out.append(StageOneRows(rows, (f - mean) / std, labels))
    return out[0], out[1], len(answers)


def train_compressor(cfg: TrainConfig, lm: LM, train: HandoffRows, val: HandoffRows, resume: bool,
                     pooler: AttentionPooler | None = None) -> tuple[BetaVAE, dict]:
    """Stage 1; trains `pooler` in place when the answer head is on.

    The VAE's standardisation statistics come from the untrained pooler (the mean repeated Q
    times); a pooler trained afterwards moves away from them, and the encoder, trained with it,
    absorbs the difference."""
    stage_dir = cfg.run_dir / "stages" / "compressor"
    done = stage_dir / "compressor.safetensors"
    c = cfg.compressor
    train_pooled = pooled_inputs(train, pooler)
    # Seeded before the VAE is built: its initialisation must not depend on what ran earlier in
    # the process (loading or converting the LM draws random numbers too).
    L.seed_everything(cfg.trainer.seed, verbose=False)
    vae = BetaVAE(train_pooled.shape[1], c.latent_dim, c.hidden_dim, c.beta)
    if resume and done.is_file():
        state = load_file(str(done))
        if not any(k.startswith("compressor.") for k in state):
            raise ValueError(f"{done} was written by an older version of this package: train the run again "
                             "with --overwrite")
        vae.load_state_dict({k[len("compressor."):]: v for k, v in state.items() if k.startswith("compressor.")})
        if pooler is not None:
            pooler.load_state_dict({k[len("pooler."):]: v for k, v in state.items() if k.startswith("pooler.")})
        _say("stage 1 (compressor): finished earlier, loaded")
        return vae, json.loads((stage_dir / "metrics.json").read_text())
    vae.set_standardisation(train_pooled)
    train_1, val_1, n_answers = stage_one_rows(lm, train, val)
    module = CompressorModule(vae, c, pooler, question_dim=train_1.features.shape[1], num_answers=n_answers)
    tr, fr = parameter_counts(module)
    head = f"; answer head over {n_answers} answers, weight {c.probe_weight}" if module.head is not None else ""
    _say(f"stage 1 (compressor): {tr:,} trainable parameters, {fr:,} frozen; {c.epochs} epochs{head}")
    g = torch.Generator().manual_seed(cfg.trainer.seed)
    loader = DataLoader(train_1, batch_size=c.batch_size, shuffle=True, generator=g, collate_fn=collate_stage_one)
    val_loader = DataLoader(val_1, batch_size=c.batch_size, collate_fn=collate_stage_one)
    ckpt = ModelCheckpoint(dirpath=str(stage_dir / "checkpoints"), save_last=True, save_top_k=0)
    trainer = _trainer(cfg, stage_dir, "compressor", [ckpt], max_epochs=c.epochs,
                       check_val_every_n_epoch=max(1, c.epochs // 6))
    trainer.fit(module, loader, val_loader, ckpt_path=_last_ckpt(stage_dir) if resume else None)
    if pooler is not None:
        pooler.requires_grad_(True)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    state = {f"compressor.{k}": v for k, v in vae.state_dict().items()}
    if pooler is not None:
        state.update({f"pooler.{k}": v for k, v in pooler.state_dict().items()})
    atomic_save_safetensors(state, done)
    atomic_write_json(stage_dir / "metrics.json", metrics)
    if module.head is not None:
        _say(f"stage 1 (compressor): validation answer-head accuracy {metrics.get('val/probe_accuracy', float('nan')):.3f}")
    return vae, metrics


def train_variant(cfg: TrainConfig, variant: str, lm: LM, data: HandoffDataModule, vae: BetaVAE | None,
                  resume: bool, pooler: AttentionPooler | None = None) -> tuple[HandoffModule, dict]:
    stage_dir = cfg.run_dir / "stages" / variant
    done = stage_dir / f"{variant}.safetensors"
    L.seed_everything(cfg.trainer.seed, verbose=False)
    module = HandoffModule(variant, lm, cfg.handoff, vae=vae, val_decode_size=cfg.data.val_decode_size,
                           pooler=pooler if variant == "ilcp" else None)
    if resume and done.is_file():
        module.load_trained_state(load_file(str(done)))
        _say(f"stage 2 ({variant}): finished earlier, loaded")
        return module, json.loads((stage_dir / "metrics.json").read_text())
    tr, fr = parameter_counts(module)
    _say(f"stage 2 ({variant}): {tr:,} trainable parameters, {fr:,} frozen (the LM); "
         f"{cfg.handoff.max_steps} steps of batch {cfg.handoff.batch_size}")
    ckpt = ModelCheckpoint(dirpath=str(stage_dir / "checkpoints"), filename="best-{step}",
                           monitor="val/exact_match", mode="max", save_top_k=1, save_last=True)
    h = cfg.handoff
    trainer = _trainer(cfg, stage_dir, variant, [ckpt], max_steps=h.max_steps,
                       val_check_interval=min(h.val_every_steps, h.max_steps), check_val_every_n_epoch=None,
                       limit_val_batches=1.0)
    t0 = time.perf_counter()
    last = _last_ckpt(stage_dir) if resume else None
    if last is not None:
        _say(f"stage 2 ({variant}): resuming from {last}")
    with warnings.catch_warnings():
        # The frozen LM is in eval mode on purpose (see HandoffModule.train).
        warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
        trainer.fit(module, datamodule=data, ckpt_path=last)
    trainer.save_checkpoint(stage_dir / "checkpoints" / "last.ckpt")
    if trainer.global_step % min(h.val_every_steps, h.max_steps) != 0:
        trainer.validate(module, datamodule=data, verbose=False)  # the final state is always measured
    seconds = time.perf_counter() - t0
    curve = _read_curve(cfg, variant)
    best_path = ckpt.best_model_path
    if best_path:
        module.load_state_dict(_load_ckpt_state(Path(best_path)), strict=False)
    best = max(curve, key=lambda r: r.get("val/exact_match", -1.0)) if curve else {}
    metrics = {
        "variant": variant, "steps": int(trainer.global_step), "train_seconds": round(seconds, 1),
        "best_step": best.get("step"), "best_val_exact_match": best.get("val/exact_match"),
        "final_val_exact_match": curve[-1].get("val/exact_match") if curve else None,
        "final_val_loss": curve[-1].get("val/loss") if curve else None,
        "curve": curve, "val_decode_size": cfg.data.val_decode_size,
    }
    atomic_save_safetensors(module.trained_state(), done)
    atomic_write_json(stage_dir / "metrics.json", metrics)
    return module, metrics


@dataclass
class TrainResult:
    run_dir: Path
    metrics: dict
    modules: dict  # variant -> HandoffModule (best validation weights)


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, lm: LM | None = None) -> TrainResult:
    """Run both stages for every configured variant and export to ``cfg.run_dir``."""
    from .export import export_run

    cfg.validate()
    run_dir = cfg.run_dir
    if run_dir.exists() and any(run_dir.iterdir()) and not (resume or overwrite):
        raise FileExistsError(
            f"{run_dir} already holds a run: pass --resume to continue it, --overwrite to start it "
            f"again, or choose another run_name=..."
        )
    if overwrite and not resume and run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "train_config.yaml")
    t_start = time.perf_counter()
    if lm is None:
        lm = load_lm(cfg.lm.spec, dtype=cfg.lm.dtype, cache_dir=cfg.lm.cache_dir)
    _say(f"LM {lm.spec}: fingerprint {lm.fingerprint}, hidden {lm.hidden_size}, dtype {lm.dtype}")
    train_rows, val_rows = prepare_data(cfg, lm)
    vae, compressor_metrics = None, {}
    pooler = make_pooler(cfg, train_rows.state_dim) if train_rows.tokens else None
    if "ilcp" in cfg.handoff.variants:
        vae, compressor_metrics = train_compressor(cfg, lm, train_rows, val_rows, resume, pooler)
    data = HandoffDataModule(train_rows, val_rows, cfg.handoff.batch_size, cfg.trainer.seed)
    modules, variant_metrics = {}, {}
    for variant in cfg.handoff.variants:
        modules[variant], variant_metrics[variant] = train_variant(cfg, variant, lm, data, vae, resume, pooler)
        _say(f"stage 2 ({variant}): best validation exact match {variant_metrics[variant]['best_val_exact_match']}")
    metrics = {
        "compressor": compressor_metrics, "variants": variant_metrics,
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "train_rows": len(train_rows), "val_rows": len(val_rows),
    }
    export_run(cfg, lm, modules, metrics, pool_dim=vae.input_dim if vae is not None else train_rows.state_dim)
    _say(f"exported to {run_dir} in {metrics['total_seconds']:.0f}s total")
    return TrainResult(run_dir=run_dir, metrics=metrics, modules=modules)
