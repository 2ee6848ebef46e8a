"""What a receiver checks of a call before it opens a payload or tokenises a question: the
questions (how many, how long, valid text), the decoding settings, and the room a prompt leaves
for its answer in the LM's positions. Each refusal is one ValueError line naming the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..checks import positive_int, text_input
from ..lm import LM

__all__ = ["MAX_RECEIVE_CHARACTERS", "MAX_RECEIVE_QUESTIONS", "check_room", "checked_decoding", "checked_questions"]

# Characters of all the questions of one receive together, checked before any is tokenised (each
# alone is bounded by the LM's positions, `ilcp.checks.text_input`): 1 MiB, as many questions as
# a long batch asks, far below what would exhaust memory.
MAX_RECEIVE_CHARACTERS = 1 << 20
# Questions of one call, checked before anything is tokenised, unsealed or projected: each
# question of `receive` reads its own latent, so the payload, its projection and the prefixes
# grow with the count (1,024 one-latent prefixes of SmolLM2 hold about 120 MB).
MAX_RECEIVE_QUESTIONS = 1024


def checked_questions(question, max_positions: int | None) -> tuple[bool, list[str]]:
    """``(single, questions)`` of a question or a list of them, refused (ValueError, one line)
    before any is tokenised: not a string or a non-empty list of strings, more than
    `MAX_RECEIVE_QUESTIONS` of them, an empty one, one that is not valid Unicode or longer than
    ``max_positions`` tokens could hold, more than `MAX_RECEIVE_CHARACTERS` characters together."""
    single = isinstance(question, str)
    if not single and (not isinstance(question, Sequence) or isinstance(question, (bytes, bytearray))):
        raise ValueError(f"question must be a string or a non-empty list of strings, got "
                         f"{type(question).__name__}")
    if not single and len(question) > MAX_RECEIVE_QUESTIONS:
        raise ValueError(f"{len(question):,} questions were given in one call, more than {MAX_RECEIVE_QUESTIONS:,} "
                         "(ilcp.receiver.receive.MAX_RECEIVE_QUESTIONS): ask them in several calls")
    questions = [question] if single else list(question)
    if not questions or any(not isinstance(q, str) for q in questions):
        raise ValueError("question must be a string or a non-empty list of strings")
    if any(not q.strip() for q in questions):
        raise ValueError("a question must not be empty")
    for i, q in enumerate(questions):
        text_input("the question" if single else f"question {i}", q, max_positions)
    total = sum(len(q) for q in questions)
    if total > MAX_RECEIVE_CHARACTERS:
        raise ValueError(f"these {len(questions)} questions hold {total:,} characters together, more than "
                         f"{MAX_RECEIVE_CHARACTERS:,} (ilcp.receiver.receive.MAX_RECEIVE_CHARACTERS): ask them in "
                         "several calls")
    return single, questions


def checked_decoding(max_new_tokens, batch_size, stop_at_newline) -> None:
    """Refuse decoding settings no decode runs with (ValueError, one line)."""
    positive_int("max_new_tokens", max_new_tokens)
    positive_int("batch_size", batch_size)
    if not isinstance(stop_at_newline, bool):
        raise ValueError(f"stop_at_newline must be True or False, got {stop_at_newline!r}")


def check_room(lm: LM, longest: int, max_new_tokens: int) -> None:
    """Refuse a receiver prompt of ``longest`` positions that with ``max_new_tokens`` exceeds the LM."""
    limit = getattr(getattr(lm.model, "config", None), "max_position_embeddings", None)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"the receiver's prompt ({longest} positions) plus {max_new_tokens} new tokens exceeds "
                         f"this LM's context of {limit} positions: shorten the question")
