"""RCLC rows framed as the evaluation's prompts: the receiver settings that reproduce the cold-read
and question prompts of `ilcp.receiver.prompts`.

Shared by the evaluation's RCLC rows (`ilcp.evaluation.rclc_methods`, which explains the slot
boundary) and by `ilcp.selection_prompts` (the token IDs of an in-prompt selection, which
training's ``selection_tuned`` variant reads). The receiver imports nothing from `ilcp.rclc`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .prompts import SYSTEM, cold_read_user_text, question_user_text, render

__all__ = ["ReceiverFraming", "receiver_framing"]

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
