"""Stage 2: a memory source trained through the frozen LM on the answer tokens.

Every variant is a memory source (`ilcp.encoder.model`) trained with one recipe and step budget:
``ilcp`` (an `ILCPEncoder`: latent -> K memory vectors, + question prompt), ``prompt_tuned`` (a
`ConstantMemory`, + question prompt), ``cold_read_tuned`` (a `ConstantMemory` that also reads
the context text) and, when asked for, ``selection_tuned`` (a `ConstantMemory` that reads an RCLC
selection of the context in its place: the cold-read prompt with the rows of
``handoff.selection_selector`` at ``r<handoff.selection_ratio>`` in the context slot, as the
``rclc:<selector>:r<N>:selection_tuned`` eval row places them). The sequence is
``[K vectors ; rendered prompt ; answer + end token]``, left
padded, with labels only on the answer tokens; validation logs the teacher-forced loss and the
greedy exact match on a fixed subset every ``val_every_steps`` steps.
"""

from __future__ import annotations

import functools
import json
import math
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from safetensors.torch import load_file
from torch import Tensor

from .. import export
from ..receiver import prompts
from ..compat import logits_to_keep_kwargs
from ..config import TrainConfig
from ..config_sections import HandoffConfig
from ..receiver.decoding import answer_loss_and_greedy, greedy_decode, left_pad
from ..encoder.model import ConstantMemory, FormatPrompt, ILCPEncoder, MemorySource
from ..encoder.pooling import forward_groups
from ..lm import LM, mean_token_embedding_norm
from ..metrics import exact_match
from ..receiver.prefix import ReceiverPrefix, receiver_prefix
from ..encoder.projector import GatedLatentToMemoryProjector
from .data import HandoffDataModule
from ..io import atomic_save_safetensors
from .distributed import broadcast, is_main, reduce_sum, save_stage
from .recompute import recomputing
from .losses import LossTerm, answer_terms, weighted_sum
from .log import (checkpoint_state, ignore_resume_warnings, last_checkpoint, make_trainer, parameter_counts,
                  prepare_stage_log, read_curve, say)
from .variants import VARIANTS, Variant, variant_of, variant_steps  # noqa: F401 (the first two re-exported)


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """The learning rate's factor at `step`: a linear warm-up over `warmup` steps, then a cosine
    decay to 10% at `total` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def selection_score(exact_match: float, loss: float, decoded: int) -> float:
    """The answer stage's measure of a validation, higher is better: its exact match over
    `decoded` questions, a tie broken by the lower loss (the decoded questions' answer
    cross-entropy, ``val/answer_ce``). The loss enters as ``loss / (1 + loss) / decoded``, less
    than one question's share of exact match, so a validation with more questions right always
    ranks first."""
    return exact_match - loss / (1.0 + loss) / decoded


def attach_projector(encoder: ILCPEncoder, cfg: HandoffConfig, lm: LM) -> ILCPEncoder:
    """Give a stage-1 encoder its untrained projector, calibrated so memory vectors start at the
    scale of the LM's token embeddings."""
    projector = GatedLatentToMemoryProjector(encoder.latent_dim, cfg.num_memory_tokens, lm.hidden_size,
                                             cfg.projector_hidden)
    projector.calibrate_output_norm(mean_token_embedding_norm(lm.model))
    encoder.projector = projector
    return encoder


def make_memory_source(variant: str, cfg: HandoffConfig, lm: LM, encoder: ILCPEncoder | None = None,
                       trained: dict[str, MemorySource] | None = None) -> MemorySource:
    """The memory source a variant starts from; for ilcp, the encoder of the earlier stages, with
    a new projector unless the reconstruction stage trained one, frozen unless fine-tuned, and
    with ``handoff.format_from`` the named variant's vectors, taken from `trained` (the variants
    trained so far)."""
    kind = variant_of(variant)
    if kind.reads_encoder:
        if encoder is None:
            raise ValueError("the ilcp variant needs the stage-1 encoder")
        if encoder.projector is None:
            attach_projector(encoder, cfg, lm)
        if not cfg.finetune_encoder:
            encoder.freeze_encoder()
        encoder.configure_receiver(cfg.memory_placement, cfg.vocabulary_snap, cfg.snap_temperature, cfg.snap_metric)
        encoder.bind_vocabulary(lm.model.get_input_embeddings().weight)
        encoder.bind_lm(lm.model)
        if cfg.format_from:
            encoder.format_prompt = FormatPrompt(format_vectors_from(cfg.format_from, lm, trained), trainable=False)
        elif cfg.format_vectors and encoder.format_prompt is None:
            rows = ConstantMemory.from_embedding_rows(lm.model, cfg.format_vectors, reads_context_text=False)
            encoder.format_prompt = FormatPrompt(rows.soft_prompt)
        return encoder
    return ConstantMemory.from_embedding_rows(lm.model, cfg.num_memory_tokens,
                                              reads_context_text=kind.reads_context_text)


def format_vectors_from(name: str, lm: LM, trained: dict[str, MemorySource] | None = None) -> Tensor:
    """cold_read_tuned's trained vectors (K, H) for ``handoff.format_from``: the variant trained
    earlier in this run ("cold_read_tuned"), or the one exported in another run's directory,
    which must have been trained for this LM."""
    if name == "cold_read_tuned":
        if name not in (trained or {}):
            raise ValueError("handoff.format_from=cold_read_tuned: that variant must be trained before ilcp")
        return trained[name].soft_prompt.detach()
    run_dir = Path(name)
    if not (run_dir / export.CONFIG_FILE).is_file():
        raise ValueError(f"handoff.format_from={name!r}: not a run directory (no {export.CONFIG_FILE}); train that "
                         "run first, or use format_from=cold_read_tuned")
    export.check_fingerprint(export.read_config(run_dir), lm.fingerprint)  # another LM: before any tensor is read
    run = export.read_export(run_dir)
    if "cold_read_tuned" not in run.soft_prompts:
        raise ValueError(f"handoff.format_from={name!r}: that run trained no cold_read_tuned "
                         f"(files: {sorted(run.config['files'])})")
    return run.soft_prompts["cold_read_tuned"]


class HandoffModule(L.LightningModule):
    """A memory source + the receiver prompt -> the answer, through the frozen LM.

    Args:
        source: the memory source trained here (`ILCPEncoder` or `ConstantMemory`).
        lm: the frozen LM (kept in eval mode, excluded from checkpoints).
        cfg: stage-2 settings.
        val_decode_size: validation rows (the first ones) decoded for exact match.
        selected: for selection_tuned, the prompt token IDs of each ``(context, question)``
            (`ilcp.selection_prompts.selection_prompt_ids`), which replace the cold-read
            prompt of a source that reads the context; None: the context text.
        teacher: the distillation teacher's vectors (cold_read_tuned's, frozen), read in front of
            the text; None: the plain cold read.
        recompute_layers: the training forward recomputes the LM's layers in the backward pass
            (``trainer.recompute_layers``, `ilcp.training.recompute`).
        grouped: a batch's rows run as one forward per group of similar lengths
            (``trainer.length_groups``); False: one padded forward per batch.
    """

    def __init__(self, source: MemorySource, lm: LM, cfg: HandoffConfig, val_decode_size: int = 64,
                 selected: dict[tuple[str, str], list[int]] | None = None, teacher: ConstantMemory | None = None,
                 recompute_layers: bool = False, grouped: bool = True, max_steps: int | None = None):
        super().__init__()
        self.max_steps = cfg.max_steps if max_steps is None else max_steps  # the learning-rate schedule's length
        self.recompute_layers, self.grouped = recompute_layers, grouped
        self._teacher = (teacher,)  # outside the module tree: neither trained nor checkpointed here
        self.source, self.cfg, self.tokenizer, self.val_decode_size = source, cfg, lm.tokenizer, val_decode_size
        self.selected = selected
        self.lm = lm.model
        self.strict_loading = False  # checkpoints hold the trained modules only
        self._val_hits: list[tuple[int, bool, float, int]] = []  # (row, hit, answer CE summed, answer tokens)
        if isinstance(source, ILCPEncoder) and not source.encoder_frozen:
            # What this loss never reaches learns nothing here: frozen, so that no trainable
            # parameter goes without a gradient (which DDP refuses).
            source.vae.freeze_unreached(kl_in_loss=self.kl_in_loss())

    def kl_in_loss(self) -> bool:
        """Whether the training loss has the posterior's KL term (which trains the logvar head)."""
        return self.cfg.joint_kl_weight > 0

    # the frozen LM stays in eval mode whatever Lightning asks of the module
    def train(self, mode: bool = True):
        super().train(mode)
        self.lm.eval()
        return self

    def memory(self, batch: dict) -> tuple[Tensor, Tensor]:
        """(memory (B, K, H) in the LM's dtype, mean KL or 0) of a batch."""
        return self.source.memory_for_batch(batch, self.lm.get_input_embeddings().weight.dtype)

    @property
    def loss_terms(self) -> list[LossTerm]:
        """This stage's loss, term by term (`ilcp.training.losses.answer_terms`)."""
        return answer_terms(self.cfg, distills=not self.source.reads_context_text)

    def step_outputs(self, batch: dict) -> dict:
        """The forward every loss term reads: the answer tokens' cross-entropy ``answer_ce``, the
        ``logits`` and ``targets`` it was computed from, and the posterior's mean ``kl``."""
        memory, kl = self.memory(batch)
        sequences, labels = self._answer_sequences(memory, batch, self.source.reads_context_text)
        loss, logits, targets = self._loss_on_tail(sequences, labels)
        return {"answer_ce": loss, "logits": logits, "targets": targets, "kl": kl}

    def _teacher_forced(self, batch) -> tuple[Tensor, Tensor]:
        """(the loss's terms but the KL, summed with their weights; the KL)."""
        out = self.step_outputs(batch)
        loss, _ = weighted_sum([t for t in self.loss_terms if t.name != "kl"], self, batch, out, self.global_step)
        return loss, out["kl"]

    def prefix(self, memory: Tensor | None, context: str, question: str, with_context: bool) -> ReceiverPrefix:
        """One row's receiver prefix (`ilcp.receiver.prefix.receiver_prefix`): this source's layout around
        ``memory`` (K, H), or with ``memory`` None the text alone (the cold read when
        ``with_context``, the distillation teacher); selection_tuned reads its selected rows in
        place of the context."""
        selected = self.selected[(context, question)] if with_context and self.selected is not None else None
        if memory is None:
            return receiver_prefix(self.tokenizer, question, context=context if with_context else None,
                                   prompt_ids=selected)
        return receiver_prefix(self.tokenizer, question, source=self.source, memory=memory,
                               context=context if with_context else None, prompt_ids=selected)

    def _answer_sequences(self, memory, batch: dict, with_context: bool) -> tuple[list[Tensor], list[Tensor]]:
        """[receiver prefix ; answer + end token] embeddings and their labels (answer tokens only);
        ``memory`` None: no memory vectors."""
        device = self.lm.get_input_embeddings().weight.device
        sequences, labels = [], []
        for i, (context, question, answer) in enumerate(zip(batch["context"], batch["question"], batch["answer"])):
            prefix = self.prefix(None if memory is None else memory[i], context, question, with_context)
            answer_ids = self.tokenizer(prompts.answer_text(answer, self.tokenizer), add_special_tokens=False)["input_ids"]
            sequences.append(prefix.embeds(self.lm, answer_ids))
            labels.append(torch.tensor([-100] * len(prefix) + answer_ids, device=device))
        return sequences, labels

    def _distillation(self, batch: dict, logits: Tensor, targets: Tensor) -> Tensor:
        """KL(teacher || receiver) per answer token, the teacher being the frozen LM reading the
        context text (behind cold_read_tuned's vectors with ``distill_teacher=cold_read_tuned``);
        both at ``distill_temperature``, scaled by its square."""
        with torch.no_grad():
            teacher_source = self._teacher[0]
            if teacher_source is None:
                sequences, labels = self._answer_sequences(None, batch, with_context=True)
            else:
                sequences, labels = self._teacher_sequences(teacher_source, batch)
            _, teacher, teacher_targets = self._loss_on_tail(sequences, labels, n_keep=logits.shape[1] + 1)
        if not torch.equal(teacher_targets, targets):
            raise RuntimeError("teacher and receiver answer tokens are not aligned")
        t = self.cfg.distill_temperature
        known = targets != -100
        log_student = F.log_softmax(logits[known] / t, dim=-1)
        log_teacher = F.log_softmax(teacher[known] / t, dim=-1)
        return F.kl_div(log_student, log_teacher, log_target=True, reduction="batchmean") * t * t

    def _teacher_sequences(self, teacher: ConstantMemory, batch: dict) -> tuple[list[Tensor], list[Tensor]]:
        """The tuned teacher's [vectors ; cold-read prompt ; answer] sequences, as cold_read_tuned reads."""
        device = self.lm.get_input_embeddings().weight.device
        vectors = teacher.soft_prompt.detach().to(device=device, dtype=self.lm.get_input_embeddings().weight.dtype)
        sequences, labels = [], []
        for context, question, answer in zip(batch["context"], batch["question"], batch["answer"]):
            prefix = receiver_prefix(self.tokenizer, question, source=teacher, memory=vectors, context=context)
            answer_ids = self.tokenizer(prompts.answer_text(answer, self.tokenizer), add_special_tokens=False)["input_ids"]
            sequences.append(prefix.embeds(self.lm, answer_ids))
            labels.append(torch.tensor([-100] * len(prefix) + answer_ids, device=device))
        return sequences, labels

    def _loss_on_tail(self, sequences: list[Tensor], labels: list[Tensor],
                      n_keep: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Mean cross-entropy of the labelled tokens of left-padded sequences, with the logits
        (B, n_keep - 1, V) float32 and targets (B, n_keep - 1) it was computed from.

        Left padding puts every labelled token at the right edge, so only the logits of the last
        positions are computed: position t predicts token t + 1. Rows of very different lengths
        run as separate forwards (`length_groups`): the same logits, less padding."""
        device = sequences[0].device
        if n_keep is None:
            n_keep = max(len(lab) - int((lab == -100).sum()) for lab in labels) + 1
        targets = torch.full((len(labels), n_keep - 1), -100, dtype=torch.long, device=device)
        for i, lab in enumerate(labels):
            tail = lab[-(n_keep - 1):]
            targets[i, n_keep - 1 - len(tail):] = tail
        parts, rows = [], []
        for group in forward_groups([len(seq) for seq in sequences], self.grouped):
            inputs_embeds, attention_mask, position_ids = left_pad([sequences[i] for i in group])
            with recomputing(self.lm, self.recompute_layers and torch.is_grad_enabled()):
                out = self.lm(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False, **logits_to_keep_kwargs(self.lm, n_keep))
            tail = out.logits[:, -n_keep:-1].float()
            del out
            # a group narrower than n_keep: its missing leading positions carry no label
            parts.append(tail if tail.shape[1] == n_keep - 1 else F.pad(tail, (0, 0, n_keep - 1 - tail.shape[1], 0)))
            rows.extend(group)
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)  # no copy of one forward's logits (0.1 GB for 8 rows)
        if rows != sorted(rows):
            logits = logits[torch.tensor(rows, device=device).argsort()]  # back in the batch's order
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        return loss, logits, targets

    def training_step(self, batch, batch_idx):
        out = self.step_outputs(batch)
        total, values = weighted_sum(self.loss_terms, self, batch, out, self.global_step)
        logged = {"train/loss": total, "train/kl": out["kl"], **{f"train/{name}": v for name, v in values.items()}}
        self.log_dict(logged, prog_bar=True, batch_size=len(batch["answer"]))
        return total

    def validation_step(self, batch, batch_idx):
        keep = [i for i, idx in enumerate(batch["index"].tolist()) if idx < self.val_decode_size]
        if keep and len(keep) == len(batch["answer"]):
            loss, predictions, row_ce = self._loss_and_answers(batch)  # one prefill for both
        else:
            loss, _ = self._teacher_forced(batch)
            _, predictions, row_ce = self._loss_and_answers(batch, keep) if keep else (None, [], [])
        self.log("val/loss", loss, prog_bar=True, batch_size=len(batch["answer"]), sync_dist=True)
        self._val_hits.extend((int(batch["index"][i]), exact_match(p, batch["answers"][i]), *ce)
                              for p, i, ce in zip(predictions, keep, row_ce))

    def on_validation_epoch_end(self):
        if self.val_decode_size > 0:
            # each decoded row once, whichever rank decoded it: a row a short last batch repeats
            # counts once, so that two devices measure what one does
            seen = torch.zeros(self.val_decode_size, device=self.device)
            rows = torch.zeros(3, self.val_decode_size, device=self.device)  # hit, answer CE, answer tokens
            for index, hit, ce, tokens in self._val_hits:
                seen[index] += 1.0
                rows[:, index] += torch.tensor([float(hit), ce, tokens], device=self.device)
            seen = reduce_sum(seen)
            decoded = seen > 0
            if decoded.any():
                hit, ce, tokens = (reduce_sum(rows)[:, decoded] / seen[decoded]).sum(dim=1).tolist()
                em, n = hit / int(decoded.sum()), int(decoded.sum())
                self.log("val/exact_match", em, prog_bar=True, sync_dist=True)
                self.log("val/answer_ce", ce / tokens, sync_dist=True)
                self.log("val/select", selection_score(em, ce / tokens, n), sync_dist=True)
        self.log("val/step", float(self.global_step), sync_dist=True)
        self._val_hits.clear()

    @torch.no_grad()
    def _loss_and_answers(self, batch: dict, rows: list[int] | None = None
                          ) -> tuple[Tensor, list[str], list[tuple[float, int]]]:
        """The teacher-forced answer loss and the greedy answers of a batch's `rows` (default all),
        from one prefill of their receiver prefixes (`ilcp.receiver.decoding.answer_loss_and_greedy`)
        per group of similar lengths (`length_groups`): (the mean over every answer token, the
        answers, each row's (summed answer cross-entropy, answer tokens))."""
        rows = list(range(len(batch["question"]))) if rows is None else rows
        memory, _ = self.memory(batch)
        with_context = self.source.reads_context_text
        prefixes, targets = [], []
        for i in rows:
            prefixes.append(self.prefix(memory[i], batch["context"][i], batch["question"][i], with_context)
                            .embeds(self.lm))
            targets.append(self.tokenizer(prompts.answer_text(batch["answer"][i], self.tokenizer),
                                          add_special_tokens=False)["input_ids"])
        answers, row_ce = [""] * len(prefixes), [(0.0, 0)] * len(prefixes)
        for group in forward_groups([len(p) for p in prefixes], self.grouped):
            sums, said = answer_loss_and_greedy(self.lm, self.tokenizer, [prefixes[i] for i in group],
                                                [targets[i] for i in group], max_new_tokens=self.cfg.max_new_tokens,
                                                per_row=True)
            for i, text, ce in zip(group, said, sums.tolist()):
                answers[i], row_ce[i] = text, (ce, len(targets[i]))
        loss = torch.tensor(sum(ce for ce, _ in row_ce) / sum(n for _, n in row_ce), device=self.device)
        return loss, answers, row_ce

    @torch.no_grad()
    def answer(self, batch: dict, rows: list[int] | None = None) -> list[str]:
        """Greedy answers of this variant for rows of a batch (default all of them)."""
        rows = list(range(len(batch["question"]))) if rows is None else rows
        memory, _ = self.memory(batch)
        with_context = self.source.reads_context_text
        prefixes = [self.prefix(memory[i], batch["context"][i], batch["question"][i], with_context).embeds(self.lm)
                    for i in rows]
        return greedy_decode(self.lm, self.tokenizer, prefixes, max_new_tokens=self.cfg.max_new_tokens,
                             batch_size=self.cfg.batch_size)

    def configure_optimizers(self):
        return self._adamw(self.source.parameter_groups(self.cfg.lr, self.cfg.encoder_lr), self.max_steps,
                           self.cfg.warmup_steps)

    def _adamw(self, groups: list[dict], total: int, warmup: int) -> dict:
        """AdamW over `groups` with a linear warm-up, then a cosine decay to 10% at `total` steps."""
        opt = torch.optim.AdamW(groups, weight_decay=self.cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup_cosine, total=total, warmup=warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        frozen = {f"{name}." for name, child in self.named_children() if child is self.lm}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(tuple(frozen))}


def train_variant(cfg: TrainConfig, variant: str, lm: LM, data: HandoffDataModule, encoder: ILCPEncoder | None,
                  resume: bool, trained: dict[str, MemorySource] | None = None) -> tuple[MemorySource, dict]:
    """Stage 2 for one variant: its trained memory source (best validation weights) and metrics;
    `trained`: the variants trained before it in this run."""
    stage_dir = cfg.run_dir / "stages" / variant
    done = stage_dir / f"{variant}.safetensors"
    L.seed_everything(cfg.trainer.seed, verbose=False)
    source = make_memory_source(variant, cfg.handoff, lm, encoder, trained)
    if resume and done.is_file() and (stage_dir / "metrics.json").is_file():
        export.load_trained_state(source, load_file(str(done)), origin=str(done))
        say(f"stage 2 ({variant}): finished earlier, loaded")
        return source, json.loads((stage_dir / "metrics.json").read_text())
    if cfg.handoff.max_steps == 0:  # a pretraining run: the encoder as the reconstruction stage left it
        say(f"stage 2 ({variant}): no answer stage (handoff.max_steps=0): the encoder is exported as pretrained")
        return source, {"variant": variant, "steps": 0, "best_step": None, "best_val_exact_match": None, "curve": []}
    kind = variant_of(variant)
    selected = selected_prompts(cfg.handoff, lm, data) if kind.reads_selected_rows else None
    teacher = (trained or {}).get("cold_read_tuned") if cfg.handoff.distill_teacher == "cold_read_tuned" else None
    h = cfg.handoff
    budget = variant_steps(h, variant)
    module = HandoffModule(source, lm, h, val_decode_size=cfg.data.val_decode_size, selected=selected,
                           teacher=teacher, recompute_layers=cfg.trainer.recompute_layers,
                           grouped=cfg.trainer.length_groups, max_steps=budget)
    tr, fr = parameter_counts(module)
    frozen = "the LM and the encoder parts this loss does not reach" if kind.reads_encoder else "the LM"
    say(f"stage 2 ({variant}): {tr:,} trainable parameters, {fr:,} frozen ({frozen}); "
        f"{budget} steps of batch {h.batch_size}")
    steps, seconds, curve, best = fit_stage(cfg, variant, module, data, resume, monitor="val/select", mode="max",
                                            max_steps=budget, val_every_steps=h.val_every_steps,
                                            start=source if h.validate_start else None)
    metrics = {
        "variant": variant, "steps": steps, "train_seconds": round(seconds, 1),
        "best_step": best.get("step"), "best_val_exact_match": best.get("val/exact_match"),
        "final_val_exact_match": curve[-1].get("val/exact_match") if curve else None,
        "final_val_loss": curve[-1].get("val/loss") if curve else None,
        "curve": curve, "val_decode_size": cfg.data.val_decode_size,
    }
    save_stage(stage_dir / "metrics.json", metrics, done, export.trained_state(source))
    return source, metrics


def selected_prompts(cfg: HandoffConfig, lm: LM, data: HandoffDataModule) -> dict[tuple[str, str], list[int]]:
    """selection_tuned's prompts for every training and validation row, computed once for the
    stage and kept in memory: each distinct context prefilled once by the RCLC sender, then
    ``cfg.selection_selector`` at ``r<cfg.selection_ratio>`` for each of its questions."""
    from ..selection_prompts import selection_prompt_ids  # the eval row's framing and selection

    t0 = time.perf_counter()
    rows = list(data.train.rows) + list(data.val.rows)
    selected = selection_prompt_ids(lm, rows, selector=cfg.selection_selector, ratio=cfg.selection_ratio)
    say(f"stage 2 (selection_tuned): {cfg.selection_selector} r{cfg.selection_ratio} rows of "
        f"{len({c for c, _ in selected})} contexts, {len(selected)} questions, in {time.perf_counter() - t0:.1f}s")
    return selected


def fit_stage(cfg: TrainConfig, name: str, module: L.LightningModule, data: L.LightningDataModule, resume: bool, *,
              monitor: str, mode: str, max_steps: int, val_every_steps: int,
              start: MemorySource | None = None, patience: int = 0) -> tuple[int, float, list[dict], dict]:
    """Fit a through-the-LM stage for `max_steps` steps, validating every `val_every_steps` and at
    the end; keep `last.ckpt` (resume) and the best checkpoint by `monitor`, whose weights the
    module holds afterwards. Returns (optimizer steps, seconds, validation curve, best curve row).

    With `start` (the module's memory source), the starting weights are validated too, as step 0,
    and kept (``start.safetensors``) to be restored when no later step beats them. With
    `patience` > 0 the stage stops after that many validations without a better `monitor`."""
    stage_dir = cfg.run_dir / "stages" / name
    every = min(val_every_steps, max_steps)
    ckpt = ModelCheckpoint(dirpath=str(stage_dir / "checkpoints"), filename="best-{step}",
                           monitor=monitor, mode=mode, save_top_k=1, save_last=True)
    callbacks = [ckpt] + ([EarlyStopping(monitor=monitor, mode=mode, patience=patience, check_on_train_epoch_end=False)]
                          if patience > 0 else [])
    trainer = make_trainer(cfg, stage_dir, name, callbacks, max_steps=max_steps, val_check_interval=every,
                           check_val_every_n_epoch=None, limit_val_batches=1.0)
    t0 = time.perf_counter()
    last = last_checkpoint(stage_dir) if resume else None
    start_file = stage_dir / "start.safetensors"
    if last is not None:
        say(f"{name}: resuming from {last}")
    prepare_stage_log(cfg, name, resuming=last is not None)
    with warnings.catch_warnings():
        # The frozen LM is in eval mode on purpose (see HandoffModule.train).
        warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
        if last is not None:
            ignore_resume_warnings()
        if start is not None and last is None:
            if is_main():
                atomic_save_safetensors(export.trained_state(start), start_file, {"format": "pt"})
            trainer.validate(module, datamodule=data, verbose=False)  # logged as step 0
        trainer.fit(module, datamodule=data, ckpt_path=last)
    trainer.save_checkpoint(stage_dir / "checkpoints" / "last.ckpt", weights_only=False)  # resumable
    if trainer.global_step % every != 0:
        trainer.validate(module, datamodule=data, verbose=False)  # the final state is always measured
    seconds = time.perf_counter() - t0
    curve = broadcast(read_curve(cfg, name) if is_main() else None)  # rank 0 writes the log
    best_path = best_checkpoint(ckpt.best_model_path, stage_dir)
    if best_path is not None:
        module.load_state_dict(checkpoint_state(best_path), strict=False)
    sign = 1.0 if mode == "max" else -1.0
    best = max(curve, key=lambda r: sign * r.get(monitor, -sign * float("inf"))) if curve else {}
    if start is not None and best.get("step") == 0 and start_file.is_file():
        say(f"{name}: no step beat the starting weights; keeping them")
        export.load_trained_state(start, load_file(str(start_file)), origin=str(start_file))
    return int(trainer.global_step), seconds, curve, best


def best_checkpoint(recorded: str, stage_dir: Path) -> Path | None:
    """The best checkpoint of this stage: the callback's, looked up by name in this stage's
    folder (a run directory moved since its checkpoints were written keeps the old paths)."""
    if not recorded:
        return None
    path = stage_dir / "checkpoints" / Path(recorded).name
    return path if path.is_file() else None
