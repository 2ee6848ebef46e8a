"""The receiver's prompt templates: one place, used by training and by every evaluation method.

Every method asks the same question the same way, so that accuracy differences come from what the
receiver was handed, not from prompt drift:

- `question_prompt`: the question alone (no_context, prompt_tuned, ilcp: the soft prompt or
  nothing sits before it).
- `cold_read_prompt`: the context text, then the question (cold_read, cold_read_tuned).
- `reconstruction_prompt`: the fixed instruction after which the receiver regenerates the context
  from memory vectors alone (the ILCP reconstruction stage).
- `context_slot_prompt`: the cold-read prompt split at the spot where the context text would sit,
  so received embedding rows can be placed there (RCLC's in-prompt placement).

Prompts are rendered with the tokenizer's chat template (user turn + assistant prefix) when it
has one, and as plain text otherwise.
"""

from __future__ import annotations

from ..names import MEMORY_PLACEMENTS

INSTRUCTION = "Answer the question with one word."
RECONSTRUCTION_INSTRUCTION = "Repeat the context you were handed, word for word."
CONTINUATION_INSTRUCTION = "Continue the text you were handed from where it stops."
COLD_READ_INSTRUCTION = "Read the context carefully, then answer the question with one word."
# A fixed, short system message: templates that inject a default system prompt (SmolLM2 does)
# would otherwise add it, and it is the same for every method either way.
SYSTEM = "You are agent B. Another agent handed you its context."

_CONTEXT_MARK = "\x00CONTEXT\x00"


def question_user_text(question: str) -> str:
    return f"{INSTRUCTION}\nQuestion: {question.strip()}"


def cold_read_user_text(context: str, question: str) -> str:
    return f"{COLD_READ_INSTRUCTION}\nContext: {context.strip()}\nQuestion: {question.strip()}"


def render(tokenizer, user_text: str) -> str:
    """The user turn plus the assistant prefix, through the chat template when there is one.

    Qwen3-style templates get ``enable_thinking=False`` (other templates ignore the flag).
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_text}]
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    return f"{SYSTEM}\n{user_text}\nAnswer:"


def question_prompt(tokenizer, question: str) -> str:
    """The receiver's prompt with the question alone."""
    return render(tokenizer, question_user_text(question))


def cold_read_prompt(tokenizer, context: str, question: str) -> str:
    """The receiver's prompt with the whole context text before the question."""
    return render(tokenizer, cold_read_user_text(context, question))


def reconstruction_prompt(tokenizer) -> str:
    """The receiver's prompt when it must say back the context its memory vectors carry."""
    return render(tokenizer, RECONSTRUCTION_INSTRUCTION)


def continuation_prompt(tokenizer) -> str:
    """The receiver's prompt when it must go on with the text its memory vectors carry."""
    return render(tokenizer, CONTINUATION_INSTRUCTION)


def context_slot_prompt(tokenizer, question: str) -> tuple[str, str]:
    """The cold-read prompt split at the context: ``(before, after)``.

    ``before + context + after == cold_read_prompt(tokenizer, context, question)`` for any
    context without leading or trailing whitespace.
    """
    text = render(tokenizer, cold_read_user_text(_CONTEXT_MARK, question))
    before, after = text.split(_CONTEXT_MARK)
    return before, after




def memory_prompt(tokenizer, question: str, placement: str = "prefix") -> tuple[str, str]:
    """The receiver's prompt around the memory vectors: ``(before, after)``.

    ``"prefix"`` (the specification's layout): nothing before, the question prompt after.
    ``"in_prompt"``: the vectors stand where the context text stands in the cold-read prompt
    (`context_slot_prompt`), for memory that reads as the context's own tokens.
    """
    if placement == "prefix":
        return "", question_prompt(tokenizer, question)
    if placement == "in_prompt":
        return context_slot_prompt(tokenizer, question)
    raise ValueError(f"memory placement must be one of {list(MEMORY_PLACEMENTS)}, got {placement!r}")


def answer_text(answer: str, tokenizer) -> str:
    """The target continuation for training: the answer followed by the end-of-turn token."""
    eos = tokenizer.eos_token or ""
    return f"{answer.strip()}{eos}"
