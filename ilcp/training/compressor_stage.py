"""Stage 1: the beta-VAE on pooled sender states, with an optional answer head.

`CompressorModule` fits the VAE on standardised pooled states (reconstruction + beta * KL, the
KL weight ramping up from 0). An untrained attention pooler returns copies of the mean, so
without the answer head stage 1 sees what the specification's mean pool gives. With
``compressor.answer_head_weight > 0`` a small answer head reads [mu ; question features] and its
cross-entropy over the training answers joins the loss, so the latent (and the attention
pooler) learn what the answers need without an LM forward; the head is dropped afterwards. On a
BABILong task, ``compressor.story_attention_weight > 0`` adds `story_attention_loss`: the
queries are taught to spread over the story's tokens (known from the haystack's construction,
never told to the sender), which the answer head alone does not find among a thousand tokens of
prose within stage 1's steps.
"""

from __future__ import annotations

import json
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.utils.data import Dataset

from .. import export
from ..encoder.compressor import BetaVAE, active_units
from ..config import TrainConfig
from ..config_sections import CompressorConfig
from ..encoder.model import ILCPEncoder, sender_states_of
from ..lm import LM
from ..encoder.pooling import AttentionPooler
from .data import HandoffRows, collate_rows, pooled_rows, row_loader
from .distributed import gather_rows, save_stage
from .losses import LossTerm, compressor_terms, weighted_sum
from .log import ignore_resume_warnings, last_checkpoint, make_trainer, parameter_counts, prepare_stage_log, say


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


class CompressorModule(L.LightningModule):
    """The beta-VAE (and attention pooler) of an `ILCPEncoder`: MSE of standardised pooled
    states + beta * KL (warm-up from 0), plus the answer head's cross-entropy when configured.

    The attention pooler learns here only through the answer head; the reconstruction target is
    its output detached, so the pooler is not pulled towards outputs that are easy to reconstruct.
    """

    def __init__(self, encoder: ILCPEncoder, cfg: CompressorConfig, question_dim: int = 0, num_answers: int = 0):
        super().__init__()
        self.encoder, self.cfg = encoder, cfg
        self.head = None
        if cfg.answer_head_weight > 0:
            self.head = nn.Sequential(nn.Linear(encoder.latent_dim + question_dim, cfg.hidden_dim), nn.SiLU(),
                                      nn.Linear(cfg.hidden_dim, num_answers))
        elif encoder.pooler is not None and cfg.story_attention_weight == 0:
            encoder.pooler.requires_grad_(False)  # nothing would teach it: it stays the mean
        self._val_mu: list[Tensor] = []

    @property
    def loss_terms(self) -> list[LossTerm]:
        """This stage's loss, term by term (`ilcp.training.losses.compressor_terms`)."""
        return compressor_terms(self.cfg)

    def _losses(self, batch) -> dict[str, Tensor]:
        pooled = self.encoder.pooled_units(*sender_states_of(batch))
        out = self.encoder.vae(pooled.detach() if self.head is None else pooled)
        recon = torch.mean((out.reconstruction - out.target.detach()) ** 2)
        losses = {"recon": recon, "kl": out.kl, "mu": out.mu}
        if self.cfg.story_attention_weight > 0 and "story_mask" in batch:
            losses["story_ce"], losses["story_mass"] = story_attention_loss(
                self.encoder.pooler, batch["tokens"], batch["token_mask"], batch["story_mask"])
        if self.head is not None:
            logits = self.head(torch.cat([out.mu, batch["features"]], dim=-1))
            labels = batch["label"]
            known = labels != -100
            if known.any():
                losses["answer_ce"] = F.cross_entropy(logits[known], labels[known])
                losses["answer_accuracy"] = (logits.argmax(-1)[known] == labels[known]).float().mean()
            else:  # no answer the head knows (a tiny validation split): nothing to score
                losses["answer_ce"] = losses["answer_accuracy"] = logits.sum() * 0.0
        return losses

    def training_step(self, batch, batch_idx):
        out = self._losses(batch)
        loss, values = weighted_sum(self.loss_terms, self, batch, out, self.global_step)
        logged = {"train/loss": loss, **{f"train/{name}": v for name, v in values.items()},
                  **{f"train/{name}": out[name] for name in ("answer_accuracy", "story_mass") if name in out}}
        self.log_dict(logged, prog_bar=True, batch_size=len(batch["answer"]))
        return loss

    def validation_step(self, batch, batch_idx):
        out = self._losses(batch)
        self._val_mu.append(out["mu"].detach())
        logged = {"val/recon": out["recon"], "val/kl": out["kl"],
                  "val/loss": out["recon"] + self.encoder.vae.beta * out["kl"]}
        if self.head is not None:
            logged.update({"val/answer_ce": out["answer_ce"], "val/answer_accuracy": out["answer_accuracy"]})
        if "story_ce" in out:
            logged.update({"val/story_ce": out["story_ce"], "val/story_mass": out["story_mass"]})
        self.log_dict(logged, batch_size=len(batch["answer"]), sync_dist=True)

    def on_validation_epoch_end(self):
        if self._val_mu:  # every rank has validation rows (`data.GlobalBatchShards`)
            self.log("val/active_units", float(active_units(gather_rows(torch.cat(self._val_mu)))), sync_dist=True)
        self._val_mu.clear()

    def configure_optimizers(self):
        pooler = self.encoder.pooler
        pooler_params = {id(p) for p in pooler.parameters()} if pooler is not None else set()
        rest = [p for p in self.parameters() if p.requires_grad and id(p) not in pooler_params]
        groups = [{"params": rest, "lr": self.cfg.lr}]
        if pooler is not None and any(p.requires_grad for p in pooler.parameters()):
            groups.append({"params": [p for p in pooler.parameters() if p.requires_grad],
                           "lr": self.cfg.pooler_lr or self.cfg.lr})
        return torch.optim.AdamW(groups, lr=self.cfg.lr)


def story_attention_loss(pooler: AttentionPooler, tokens: Tensor, token_mask: Tensor,
                         story_mask: Tensor) -> tuple[Tensor, Tensor]:
    """How far the pooler's queries are from reading the story: the cross-entropy of each query's
    attention against the uniform distribution over the row's story tokens (mean over queries
    and rows that hold story tokens), and the attention mass on the story (the same mean).

    The target is uniform, not "any story token": a query pulled only towards story mass settles
    on a few tokens of every fact (its full stops, say) that carry no answer."""
    weights = pooler.weights(tokens, token_mask)                    # (B, S, Q)
    story = (story_mask.bool() & token_mask.bool()).unsqueeze(-1).float()
    rows = story.sum(dim=(1, 2)) > 0
    if not rows.any():
        zero = weights.sum() * 0.0
        return zero, zero
    ce = -(weights.clamp_min(1e-12).log() * story).sum(1) / story.sum(1).clamp_min(1.0)   # (B, Q)
    mass = (weights * story).sum(1)                                  # (B, Q)
    return ce[rows].mean(), mass[rows].mean()


def train_compressor(cfg: TrainConfig, lm: LM, train: HandoffRows, val: HandoffRows,
                     resume: bool) -> tuple[ILCPEncoder, dict]:
    """Stage 1: an `ILCPEncoder` without a projector yet (pooler and VAE trained), and its metrics.

    The VAE's standardisation statistics come from the untrained pooler (the mean repeated Q
    times); a pooler trained afterwards moves away from them, and the encoder, trained with it,
    absorbs the difference."""
    c = cfg.compressor
    kind = c.memory
    started = kind.start(cfg, lm, train)  # a kind that does not fit stage 1 on cached states (memory slots)
    if started is not None:
        return started, {}
    stage_dir = cfg.run_dir / "stages" / "compressor"
    done = stage_dir / "compressor.safetensors"
    pooler = kind.pooler(train.state_dim) if train.has_token_states else None
    train_pooled = pooled_rows(train, pooler, kind.chunk_tokens)
    # Seeded before the VAE is built: its initialisation must not depend on what ran earlier in
    # the process (loading or converting the LM draws random numbers too).
    L.seed_everything(cfg.trainer.seed, verbose=False)
    encoder = kind.encoder(BetaVAE(train_pooled.shape[1], c.latent_dim, c.hidden_dim, c.beta), None, pooler)
    if resume and done.is_file() and (stage_dir / "metrics.json").is_file():
        state = load_file(str(done))
        export.load_encoder_state(encoder, state, source=str(done))
        say("stage 1 (compressor): finished earlier, loaded")
        return encoder, json.loads((stage_dir / "metrics.json").read_text())
    encoder.vae.set_standardisation(train_pooled)
    train_1, val_1, n_answers = stage_one_rows(lm, train, val)
    module = CompressorModule(encoder, c, question_dim=train_1.features.shape[1], num_answers=n_answers)
    tr, fr = parameter_counts(module)
    head = f"; answer head over {n_answers} answers, weight {c.answer_head_weight}" if module.head is not None else ""
    say(f"stage 1 (compressor): {tr:,} trainable parameters, {fr:,} frozen; {c.epochs} epochs{head}")
    loader = row_loader(train_1, c.batch_size, shuffle=True, seed=cfg.trainer.seed, collate_fn=collate_stage_one)
    val_loader = row_loader(val_1, c.batch_size, shuffle=False, collate_fn=collate_stage_one)
    ckpt = ModelCheckpoint(dirpath=str(stage_dir / "checkpoints"), save_last=True, save_top_k=0)
    trainer = make_trainer(cfg, stage_dir, "compressor", [ckpt], max_epochs=c.epochs,
                           check_val_every_n_epoch=max(1, c.epochs // 6))
    last = last_checkpoint(stage_dir) if resume else None
    prepare_stage_log(cfg, "compressor", resuming=last is not None)
    with warnings.catch_warnings():
        if last is not None:
            ignore_resume_warnings()
        trainer.fit(module, loader, val_loader, ckpt_path=last)
    if pooler is not None:
        pooler.requires_grad_(True)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    save_stage(stage_dir / "metrics.json", metrics, done, export.encoder_state(encoder))
    if module.head is not None:
        say(f"stage 1 (compressor): validation answer-head accuracy {metrics.get('val/answer_accuracy', float('nan')):.3f}")
    return encoder, metrics
