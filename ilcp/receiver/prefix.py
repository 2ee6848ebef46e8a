"""The receiver's prefix: the one place that decides what a receiver reads, in which order.

Training (the answer and reconstruction stages), `ILCPHandoff`, the evaluation methods and the
vLLM receivers all build their prefixes here, so a layout is written once and cannot drift
between training and serving. The layouts, in position order:

    no memory (no_context, cold_read):       prompt
    memory, placement "prefix":              [format vectors ;] memory ; prompt
    memory, placement "in_prompt":           [format vectors ;] before ; memory ; after

where ``prompt`` is the question prompt, the cold-read prompt for a source that also reads the
context text (cold_read_tuned), or given token ids (selection_tuned's selected rows, the
reconstruction instruction); ``before`` / ``after`` is the cold-read prompt split at the context
(`ilcp.receiver.prompts.memory_prompt`). Text is tokenized without special tokens (the chat template
already holds them); every text segment is tokenized on its own, so a prefix's rows equal
the embedding lookups of its segments, whoever builds it.

    from ilcp.receiver.prefix import receiver_prefix
    prefix = receiver_prefix(tok, "Where is John?", source=encoder, memory=memory[0])
    prefix.embeds(model)          # (L, H), what the receiver prefills
    prefix.memory_span            # (start, end) of the memory vectors in it
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import prompts

__all__ = ["MemoryLayout", "ReceiverPrefix", "format_vectors_of", "question_stem", "receiver_prefix"]

# Stands for the question while `question_stem` renders the prompt around it.
_QUESTION_MARK = "\x00QUESTION\x00"


@dataclass(frozen=True)
class MemoryLayout:
    """Where memory vectors stand, for callers that hold the vectors but not the module that
    made them (an export's constant soft prompts): the attributes `receiver_prefix` reads from a
    memory source."""

    placement: str = "prefix"
    reads_context_text: bool = False
    format_prompt: None = None


@dataclass(frozen=True)
class ReceiverPrefix:
    """A receiver's prefix as segments: token ids (list[int]) or vectors ((n, H) tensors).

    Attributes:
        segments: the prefix in position order.
        memory_span: (start, end) positions of the memory vectors, or None without memory.
    """

    segments: tuple[list[int] | Tensor, ...]
    memory_span: tuple[int, int] | None

    def __len__(self) -> int:
        return sum(len(s) if isinstance(s, list) else int(s.shape[0]) for s in self.segments)

    def embeds(self, model: nn.Module, extra_ids: Sequence[int] = ()) -> Tensor:
        """The prefix's rows (L, H) in the model's embedding dtype and device, followed by the
        embeddings of ``extra_ids`` (the teacher-forced answer in training). Vectors keep their
        autograd history (soft prompts train through them)."""
        table = model.get_input_embeddings()
        weight = table.weight
        parts: list[Tensor] = []
        pending: list[int] = []

        def flush() -> None:
            if pending:
                parts.append(table(torch.tensor(pending, dtype=torch.long, device=weight.device)))
                pending.clear()

        for segment in self.segments:
            if isinstance(segment, list):
                pending.extend(segment)
            else:
                flush()
                parts.append(segment.to(device=weight.device, dtype=weight.dtype))
        pending.extend(int(i) for i in extra_ids)
        flush()
        if not parts:
            raise ValueError("the receiver prefix is empty")
        return torch.cat(parts, dim=0)

    def rest_after(self, stem: ReceiverPrefix) -> list[int] | None:
        """The token ids that follow ``stem`` (`question_stem`) in this prefix, or None where this
        prefix does not start with it or nothing follows it: its segments but the last must be
        the stem's (the same vectors, the same ids), and its last ids must start with the
        stem's last ones."""
        *head, shared = stem.segments
        if len(self.segments) != len(head) + 1 or not isinstance(shared, list):
            return None
        for mine, theirs in zip(self.segments, head):
            if isinstance(theirs, list):
                if mine != theirs:
                    return None
            elif not (mine is theirs or (isinstance(mine, Tensor) and mine.shape == theirs.shape
                                         and torch.equal(mine, theirs))):
                return None
        last = self.segments[-1]
        if not isinstance(last, list) or len(last) <= len(shared) or last[:len(shared)] != shared:
            return None
        return last[len(shared):]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _vectors(name: str, value: Tensor, hidden: int | None = None) -> Tensor:
    if not isinstance(value, Tensor) or value.dim() != 2 or not value.is_floating_point():
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{name} must be a float (n, H) tensor, got {shape}")
    if hidden is not None and value.shape[1] != hidden:
        raise ValueError(f"{name} has hidden size {value.shape[1]}, the memory has {hidden}")
    return value


def format_vectors_of(source) -> Tensor | None:
    """A memory source's learned format vectors (F, H), or None (`ilcp.encoder.model.FormatPrompt`)."""
    fmt = getattr(source, "format_prompt", None)
    return None if fmt is None else fmt.vectors


def receiver_prefix(
    tokenizer,
    question: str | None,
    *,
    source=None,
    memory: Tensor | None = None,
    context: str | None = None,
    prompt_ids: Sequence[int] | None = None,
) -> ReceiverPrefix:
    """What the receiver reads before it answers.

    Args:
        tokenizer: the receiver LM's tokenizer.
        question: the question (rendered with the fixed prompts of `ilcp.receiver.prompts`); may be None
            only with ``prompt_ids``.
        source: the memory source that made ``memory`` (an `ILCPEncoder`, a `ConstantMemory`
            or a `MemoryLayout`), whose ``placement``, ``reads_context_text`` and format vectors choose the layout;
            None for a receiver without memory, or for memory read as a plain prefix (the
            reconstruction instruction's layout).
        memory: (K, H) or (N * K, H) memory vectors, or None.
        context: the context text, for a receiver that reads it (no memory, or a source that
            ``reads_context_text``).
        prompt_ids: token ids that replace the prompt after the memory (selected rows, the
            reconstruction instruction).

    Returns:
        a `ReceiverPrefix`.

    Raises:
        ValueError: a source without memory; a source that reads the
            context text but no context; memory that is not an (n, H) float tensor.
    """
    if source is not None and memory is None:
        raise ValueError("a memory source was given without its memory vectors")
    if source is None:
        reads_context = memory is None and context is not None
    else:
        reads_context = bool(getattr(source, "reads_context_text", False))
    if prompt_ids is not None:
        prompt = [int(i) for i in prompt_ids]
    elif question is None:
        raise ValueError("a receiver prefix needs a question or prompt_ids")
    elif reads_context:
        if context is None:
            raise ValueError("this memory source reads the context text: pass context")
        prompt = _ids(tokenizer, prompts.cold_read_prompt(tokenizer, context, question))
    else:
        prompt = _ids(tokenizer, prompts.question_prompt(tokenizer, question))
    if memory is None:
        return ReceiverPrefix(segments=(prompt,), memory_span=None)

    memory = _vectors("memory", memory)
    segments: list[list[int] | Tensor] = []
    fmt = format_vectors_of(source)
    if fmt is not None:
        segments.append(_vectors("format vectors", fmt, memory.shape[1]))
    placement = getattr(source, "placement", "prefix")
    if placement != "prefix" and prompt_ids is None and not reads_context:
        before, after = prompts.memory_prompt(tokenizer, question, placement)
        if before:
            segments.append(_ids(tokenizer, before))
        prompt = _ids(tokenizer, after)
    start = sum(len(s) if isinstance(s, list) else int(s.shape[0]) for s in segments)
    segments += [memory, prompt]
    return ReceiverPrefix(segments=tuple(segments), memory_span=(start, start + int(memory.shape[0])))


def question_stem(tokenizer, *, source, memory: Tensor) -> ReceiverPrefix | None:
    """What every question's `receiver_prefix(tokenizer, question, source=source, memory=memory)`
    starts with: its segments up to and including the memory, then the ids of the prompt after
    the memory that stand before the question, less the last one (which a question's first
    characters could merge with). `ReceiverPrefix.rest_after` gives a question's own ids after it.

    None where no such part holds the memory: a source that also reads the context text (its
    prompt holds the context, not the memory), or a prompt that does not render around a question.
    """
    if source is None or getattr(source, "reads_context_text", False):
        return None
    after = prompts.memory_prompt(tokenizer, _QUESTION_MARK, getattr(source, "placement", "prefix"))[1]
    if after.count(_QUESTION_MARK) != 1:
        return None
    shared = _ids(tokenizer, after.split(_QUESTION_MARK)[0])[:-1]
    full = receiver_prefix(tokenizer, _QUESTION_MARK, source=source, memory=memory)
    return ReceiverPrefix(segments=full.segments[:-1] + (shared,), memory_span=full.memory_span)
