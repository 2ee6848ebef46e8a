"""What each stage-2 variant is, as the training recipe needs it (`Variant`), and its step budget.

A variant's behaviour is a field here, never a branch on its name elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config_sections import HandoffConfig

__all__ = ["VARIANTS", "Variant", "variant_of", "variant_steps"]


@dataclass(frozen=True)
class Variant:
    """What a stage-2 variant is, as the training recipe needs it.

    Attributes:
        name: its name in ``handoff.variants`` and in eval's methods.
        reads_encoder: its memory is the run's encoder (latents projected to K vectors); else K
            trained constant vectors.
        reads_context_text: the receiver reads the context's text beside the memory.
        reads_selected_rows: the receiver reads the sender's selected rows (`selected_prompts`).
        own_steps: the ``handoff`` setting that gives it a budget of its own when set (> 0), in
            place of ``handoff.max_steps``; "" for none.
    """

    name: str
    reads_encoder: bool = False
    reads_context_text: bool = False
    reads_selected_rows: bool = False
    own_steps: str = ""


VARIANTS = {v.name: v for v in (
    Variant("ilcp", reads_encoder=True),
    Variant("prompt_tuned"),
    Variant("cold_read_tuned", reads_context_text=True, own_steps="cold_read_tuned_steps"),
    Variant("selection_tuned", reads_context_text=True, reads_selected_rows=True),
)}


def variant_steps(cfg: HandoffConfig, name: str) -> int:
    """The optimizer steps the variant `name` trains: its own budget when its setting is > 0,
    else ``handoff.max_steps``."""
    own = variant_of(name).own_steps
    return (getattr(cfg, own) if own else 0) or cfg.max_steps


def variant_of(name: str) -> Variant:
    """The variant named `name`; ValueError for an unknown one."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}")
    return VARIANTS[name]
