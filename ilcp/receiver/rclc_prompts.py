"""RCLC rows framed as the evaluation's prompts: the receiver settings that reproduce the cold-read
and question prompts of `ilcp.receiver.prompts`, and the token IDs of an in-prompt selection.

Shared by the evaluation's RCLC rows (`ilcp.evaluation.rclc_methods`, which explains the slot
boundary) and by training's ``selection_tuned`` variant, which trains on exactly the prefixes an
``rclc:<selector>:r<N>`` row prefills.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import rclc
from ..names import DEFAULT_SELECTOR
from .prompts import SYSTEM, cold_read_user_text, question_user_text, render

__all__ = ["SELECTORS", "ReceiverFraming", "receiver_framing", "selection_prompt_ids"]

SELECTORS = rclc.selectors.BY_NAME  # name -> ready-made selector, for every name of ilcp.names.SELECTORS

_CONTEXT_MARK = "\x00RCLC-CONTEXT\x00"
_REQUEST_MARK = "\x00RCLC-REQUEST\x00"


@dataclass(frozen=True)
class ReceiverFraming:
    """How the evaluation's prompts map onto `ilcp.rclc.HFReceiver`.

    Attributes:
        messages: the receiver's chat history (the fixed system message), or None for a
            tokenizer without a chat template (the system text is then part of the templates).
        slot_template: the in-prompt user turn, with ``{context}`` and ``{request}``.
        lead: what the sender puts before the context text (``" "`` when the template drops the
            space after ``"Context:"``, else ``""``).
        question_turn: the prompt the prefix placement pops with, for a question.
    """

    messages: list[dict] | None
    slot_template: str
    lead: str
    question_turn: Callable[[str], str]


def receiver_framing(tokenizer) -> ReceiverFraming:
    """The HFReceiver settings that reproduce `ilcp.receiver.prompts`' cold-read and question prompts.

    With a chat template, the receiver renders ``[system, user]`` as `ilcp.receiver.prompts.render` does;
    without one, the templates hold the whole plain-text prompt.
    """
    user = cold_read_user_text(_CONTEXT_MARK, _REQUEST_MARK)
    lead = ""
    if f" {_CONTEXT_MARK}" in user:
        user, lead = user.replace(f" {_CONTEXT_MARK}", _CONTEXT_MARK), " "
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": SYSTEM}]
        question_turn = question_user_text
    else:
        messages = None
        user = render(tokenizer, user)

        def question_turn(question: str) -> str:
            return render(tokenizer, question_user_text(question))

    template = user.replace(_CONTEXT_MARK, "{context}").replace(_REQUEST_MARK, "{request}")
    return ReceiverFraming(messages=messages, slot_template=template, lead=lead, question_turn=question_turn)


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
