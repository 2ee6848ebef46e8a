"""The token IDs of an in-prompt RCLC selection, framed as the evaluation's cold-read prompt: the
prefix an ``rclc:<selector>:r<N>`` row prefills, which training's ``selection_tuned`` variant
trains on (`ilcp.evaluation.rclc_methods` explains the slot boundary).

Between `ilcp.rclc` (the selection) and `ilcp.receiver.rclc_prompts` (the framing), so that the
receiver imports nothing from `ilcp.rclc`.
"""

from __future__ import annotations

from . import rclc
from .names import DEFAULT_SELECTOR
from .receiver.rclc_prompts import receiver_framing

__all__ = ["SELECTORS", "selection_prompt_ids"]

SELECTORS = rclc.selectors.BY_NAME  # name -> ready-made selector, for every name of ilcp.names.SELECTORS


def selection_prompt_ids(lm, rows, *, selector: str = DEFAULT_SELECTOR, ratio: int | None = None,
                         budget: int | None = None) -> dict[tuple[str, str], list[int]]:
    """The in-prompt RCLC prompt of each distinct ``(context, question)`` of ``rows``, as token IDs.

    The IDs are the cold-read prompt's tokens before the context slot, the sender's tokens at the
    positions ``selector`` keeps for the question (relative budget ``ratio`` or bounded
    ``budget``), then the tokens after the slot: the prefix an ``rclc:<selector>:r<ratio>`` row
    prefills, whose rows are the embeddings of exactly these tokens (the selection_tuned
    variant trains on them). Each distinct context's sender state is built once
    (`ilcp.rclc.sender_from_hf`, one prefill) and every question asked of it selects on it
    (`ilcp.rclc.transfer_sync`, as `RCLCMethod`); the states are not kept.

    Raises:
        ValueError: an unknown selector, or a bad budget (`ilcp.rclc.budget`).
    """
    if selector not in SELECTORS:
        raise ValueError(f"unknown selector {selector!r}; known: {', '.join(sorted(SELECTORS))}")
    model, tokenizer = lm.model, lm.tokenizer
    framing = receiver_framing(tokenizer)
    receiver = rclc.HFReceiver(model, tokenizer, messages=framing.messages, placement="in_prompt",
                               slot_template=framing.slot_template)
    questions: dict[str, dict[str, None]] = {}
    for row in rows:
        questions.setdefault(row["context"], {})[row["question"]] = None
    out: dict[tuple[str, str], list[int]] = {}
    for context, asked in questions.items():
        state = rclc.sender_from_hf(model, tokenizer, framing.lead + context.strip())
        for question in asked:
            deliveries: list[rclc.Delivery] = []
            rclc.transfer_sync(state, deliveries.append, question.strip(), ratio=ratio, budget=budget,
                               selector=SELECTORS[selector], record_selection=True)
            kept = deliveries[0].messages[0].selection.indices
            rendered = receiver.render(question.strip())
            out[(context, question)] = (rendered.before[0].tolist() + state.token_ids[kept].tolist()
                                        + rendered.after[0].tolist())
    return out
