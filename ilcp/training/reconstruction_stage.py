"""The reconstruction stage: the frozen LM learns nothing; the ILCP encoder learns to make it say
the context back.

From the K memory vectors alone, followed by a fixed instruction
(`ilcp.prompts.reconstruction_prompt`), the frozen LM is trained, teacher-forced, to regenerate
the sender's context text; the cross-entropy over the context tokens trains the pooler, the
beta-VAE encoder and the projector end to end. It needs no labels, so it runs on every distinct
training context before the answer stage (``reconstruct.steps > 0``), the way ICAE,
500xCompressor and xRAG pretrain their compressors before any question is asked.
"""

from __future__ import annotations

import json

import lightning as L
import torch
from safetensors.torch import load_file
from torch import Tensor

from .. import export, prompts
from ..config import TrainConfig
from ..encoder import ILCPEncoder
from ..lm import LM
from ..pooling import TokenStates
from .data import HandoffDataModule, HandoffRows
from .distributed import save_stage
from .handoff_stage import HandoffModule, attach_projector, fit_stage
from .log import parameter_counts, say

STAGE = "reconstruct"


def distinct_contexts(rows: HandoffRows) -> HandoffRows:
    """One row per distinct context, in first-seen order, with empty question and answer."""
    first: dict[str, int] = {}
    for i, r in enumerate(rows.rows):
        first.setdefault(r["context"], i)
    keep = list(first.values())
    if rows.has_token_states:
        parts = [rows.states[i] for i in keep]
        lengths = torch.tensor([p.shape[0] for p in parts], dtype=torch.long)
        states = TokenStates(torch.cat(parts), torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
    else:
        states = rows.states[keep]
    return HandoffRows([{"context": rows.rows[i]["context"], "question": "", "answer": ""} for i in keep], states)


class ReconstructionModule(HandoffModule):
    """[K memory vectors ; reconstruction instruction ; context + end token], labels on the context.

    Args:
        encoder: the ILCP encoder with its projector.
        lm: the frozen LM.
        cfg: the run's config (``reconstruct`` section; ``handoff`` for the shared settings).
    """

    def __init__(self, encoder: ILCPEncoder, lm: LM, cfg: TrainConfig):
        super().__init__(encoder, lm, cfg.handoff, val_decode_size=0)
        self.reconstruct_cfg = cfg.reconstruct
        self.max_target_tokens = cfg.reconstruct.max_target_tokens
        self.prompt_ids = lm.tokenizer(prompts.reconstruction_prompt(lm.tokenizer), add_special_tokens=False)["input_ids"]

    def target_ids(self, context: str) -> list[int]:
        """The context's tokens and the end token; a long context keeps its first tokens."""
        ids = self.tokenizer(prompts.answer_text(context, self.tokenizer), add_special_tokens=False)["input_ids"]
        return ids[: self.max_target_tokens]

    def _teacher_forced(self, batch) -> tuple[Tensor, Tensor]:
        memory, kl = self.memory(batch)
        embed = self.lm.get_input_embeddings()
        device = embed.weight.device
        sequences, labels = [], []
        for i, context in enumerate(batch["context"]):
            target = self.target_ids(context)
            ids = torch.tensor(self.prompt_ids + target, device=device)
            sequences.append(torch.cat([memory[i], embed(ids)], dim=0))
            labels.append(torch.tensor([-100] * (memory[i].shape[0] + len(self.prompt_ids)) + target, device=device))
        return self._loss_on_tail(sequences, labels)[0], kl

    def training_step(self, batch, batch_idx):
        loss, kl = self._teacher_forced(batch)
        self.log_dict({"train/loss": loss, "train/kl": kl}, prog_bar=True, batch_size=len(batch["context"]))
        return loss

    def validation_step(self, batch, batch_idx):
        loss, _ = self._teacher_forced(batch)
        self.log("val/loss", loss, prog_bar=True, batch_size=len(batch["context"]), sync_dist=True)

    def kl_in_loss(self) -> bool:
        return False

    def configure_optimizers(self):
        r = self.reconstruct_cfg
        return self._adamw(self.source.parameter_groups(r.lr, r.encoder_lr), r.steps, r.warmup_steps)


def train_reconstruction(cfg: TrainConfig, lm: LM, encoder: ILCPEncoder, train: HandoffRows, val: HandoffRows,
                         resume: bool) -> dict:
    """Run the reconstruction stage on `encoder` in place (it gets its projector here); metrics."""
    r = cfg.reconstruct
    stage_dir = cfg.run_dir / "stages" / STAGE
    done = stage_dir / f"{STAGE}.safetensors"
    L.seed_everything(cfg.trainer.seed, verbose=False)
    attach_projector(encoder, cfg.handoff, lm)
    if resume and done.is_file() and (stage_dir / "metrics.json").is_file():
        export.load_encoder_state(encoder, load_file(str(done)), source=str(done))
        say("reconstruction: finished earlier, loaded")
        return json.loads((stage_dir / "metrics.json").read_text())
    train_ctx, val_ctx = distinct_contexts(train), distinct_contexts(val)
    module = ReconstructionModule(encoder, lm, cfg)
    tr, fr = parameter_counts(module)
    say(f"reconstruction: {len(train_ctx)} distinct contexts ({len(val_ctx)} validation); {tr:,} trainable "
        f"parameters, {fr:,} frozen; {r.steps} steps of batch {r.batch_size}")
    data = HandoffDataModule(train_ctx, val_ctx, r.batch_size, cfg.trainer.seed)
    steps, seconds, curve, best = fit_stage(cfg, STAGE, module, data, resume, monitor="val/loss", mode="min",
                                            max_steps=r.steps, val_every_steps=r.val_every_steps)
    metrics = {"steps": steps, "train_seconds": round(seconds, 1), "contexts": len(train_ctx),
               "best_step": best.get("step"), "best_val_loss": best.get("val/loss"),
               "first_val_loss": curve[0].get("val/loss") if curve else None, "curve": curve}
    save_stage(stage_dir / "metrics.json", metrics, done, export.encoder_state(encoder))
    say(f"reconstruction: validation loss {metrics['first_val_loss']} at step {curve[0]['step'] if curve else '-'}, "
        f"best {metrics['best_val_loss']} at step {metrics['best_step']}")
    return metrics
