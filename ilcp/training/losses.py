"""Each training stage's loss: one list of named, weighted terms, built in one place from the
stage's config section (`compressor_terms`, `answer_terms`, `reconstruction_terms`).

A term is its name (what the log calls it, ``train/<name>``), its weight (a number, or a
function of the global step: the KL's warm-up) and the function that computes its value from
the stage's module, the batch and what the stage's forward shared with every term (``out``).
The loss is the weighted sum of the terms in list order (`weighted_sum`); a term whose
function returns None (no story tokens in this batch, say) adds nothing. A new term is one
function and one entry in its stage's list:

    def entropy_term(module, batch, out):
        return out["weights"].entropy().mean()

    terms.append(LossTerm("entropy", cfg.entropy_weight, entropy_term))   # in compressor_terms
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

__all__ = ["LossTerm", "answer_terms", "compressor_terms", "reconstruction_terms", "weighted_sum"]


@dataclass(frozen=True)
class LossTerm:
    """One term of a stage's loss: ``weight x value(module, batch, out)``."""

    name: str
    weight: float | Callable[[int], float]
    value: Callable[[object, dict, dict], Tensor | None]

    def weight_at(self, step: int) -> float:
        return self.weight(step) if callable(self.weight) else self.weight


def weighted_sum(terms: list[LossTerm], module, batch: dict, out: dict, step: int) -> tuple[Tensor, dict[str, Tensor]]:
    """(the loss: the terms' weighted sum in list order, each term's unweighted value by name)."""
    total, values = None, {}
    for term in terms:
        value = term.value(module, batch, out)
        if value is None:
            continue
        values[term.name] = value
        weight = term.weight_at(step)
        part = value if weight == 1.0 and not callable(term.weight) else weight * value
        total = part if total is None else total + part
    if total is None:
        raise ValueError(f"no loss term applies to this batch (terms: {', '.join(t.name for t in terms)})")
    return total, values


def _entry(name: str) -> Callable[[object, dict, dict], Tensor | None]:
    """A term whose value the stage's forward computed under `name` (None when it did not)."""
    return lambda module, batch, out: out.get(name)


# --------------------------------------------------------------------------------------------
# the stages' terms


def compressor_terms(cfg) -> list[LossTerm]:
    """Stage 1 (``compressor``): the VAE's reconstruction, the KL at ``beta`` ramped over
    ``kl_warmup_steps``, and the answer head's and story attention's cross-entropies at their
    weights (when above 0)."""
    def kl_weight(step: int) -> float:
        return cfg.beta if cfg.kl_warmup_steps == 0 else cfg.beta * min(1.0, step / cfg.kl_warmup_steps)

    terms = [LossTerm("recon", 1.0, _entry("recon")), LossTerm("kl", kl_weight, _entry("kl"))]
    if cfg.answer_head_weight > 0:
        terms.append(LossTerm("answer_ce", cfg.answer_head_weight, _entry("answer_ce")))
    if cfg.story_attention_weight > 0:
        terms.append(LossTerm("story_ce", cfg.story_attention_weight, _entry("story_ce")))
    return terms


def distillation_term(module, batch: dict, out: dict) -> Tensor | None:
    """KL(teacher || receiver) over the answer tokens (`HandoffModule._distillation`), in training."""
    return module._distillation(batch, out["logits"], out["targets"]) if module.training else None


def answer_terms(cfg, distills: bool) -> list[LossTerm]:
    """The answer stage (``handoff``): the answer tokens' cross-entropy; the distillation term at
    ``distill_weight`` for a source that does not read the context text (`distills`); the
    posterior's KL at ``joint_kl_weight``."""
    terms = [LossTerm("answer_ce", 1.0, _entry("answer_ce"))]
    if cfg.distill_weight > 0 and distills:
        terms.append(LossTerm("distill", cfg.distill_weight, distillation_term))
    if cfg.joint_kl_weight > 0:
        terms.append(LossTerm("kl", cfg.joint_kl_weight, _entry("kl")))
    return terms


def reconstruction_terms(cfg) -> list[LossTerm]:
    """The reconstruction stage (``reconstruct``): the regenerated text's cross-entropy, the
    latents' KL at ``beta`` (when above 0), the token loss at ``token_weight`` (when above 0)."""
    terms = [LossTerm("reconstruction_ce", 1.0, _entry("reconstruction_ce"))]
    if cfg.beta > 0:
        terms.append(LossTerm("kl", cfg.beta, _entry("kl")))
    if cfg.token_weight > 0:
        terms.append(LossTerm("token", cfg.token_weight, lambda module, batch, out: module.token_loss_of(out)))
    return terms
