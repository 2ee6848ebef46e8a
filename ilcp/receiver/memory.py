"""A received memory: a handoff opened once and asked any number of questions.

    memory = handoff.open(wire)                  # checked, unsealed (the nonce spent) and projected once
    memory.ask("Where is John?")                 # -> "garden"
    memory.ask(["Where is Mary?", "Who has the apple?"])   # a batch, in order
    memory.reconstruct()                         # what the receiver says the context was

Opening (`ilcp.receiver.receive.Receiver.open_memory`) does what `receive` does before it decodes:
the bytes are unsealed (a sealed payload's nonce is spent then, once), verified, bounded,
value-checked and projected to memory vectors. A question then costs its own positions only:
where the receiver's prompt puts the memory before the question (both placements), the key/value
cache of what every question shares, ``[format vectors ;] memory ; the prompt before the question``
(`ilcp.receiver.prefix.question_stem`), is computed at the first question and kept, and each
question prefills the rest of its prompt on a copy of it (`ilcp.receiver.stem_decoding`). The
answers are those `receive` gives for the same payload and question (greedy; equal tokens up to
floating-point rounding). A question whose prompt does not start with the shared part is decoded
from its whole prefix, as `receive` does.

A payload of several contexts (``open(wire, contexts=B)``) opens into B memories: ``memory[i]``
is the i-th, asked as above. A received memory is safe to ask from several threads; it holds its
memory vectors (R, H) per context and, once asked, the shared part's cache.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from .decoding import decoded_answer, greedy_decode, greedy_decode_ids, stop_token_ids
from .prefix import ReceiverPrefix, question_stem, receiver_prefix
from .prompts import reconstruction_prompt
from .questions import check_room, checked_decoding, checked_questions
from .stem_decoding import greedy_after_stem, prefill_stem

__all__ = ["ReceivedMemory", "reconstructions"]


class ReceivedMemory:
    """The memory vectors of one or more received contexts, opened once, asked many times.

    Made by `ILCPHandoff.open` (`ilcp.receiver.receive.Receiver.open_memory`), not by hand.

    Args:
        receiver: the `Receiver` that opened the payload (its LM, encoder and precision).
        vectors: memory vectors (B, R, H) of B contexts, on the LM's device, in its dtype.
    """

    def __init__(self, receiver, vectors: Tensor):
        if not isinstance(vectors, Tensor) or vectors.dim() != 3 or vectors.shape[0] == 0:
            raise ValueError(f"vectors must be (B, R, H) memory vectors, got {getattr(vectors, 'shape', vectors)}")
        self._receiver = receiver
        self.vectors = vectors
        self._views: dict[int, ReceivedMemory] = {}
        self._stem: tuple[ReceiverPrefix | None, object] | None = None  # (stem, its cache), once asked
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """The number of contexts."""
        return int(self.vectors.shape[0])

    def __getitem__(self, index: int) -> ReceivedMemory:
        """The memory of context ``index`` (the same object on every call, so its cache is kept)."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"a received memory is indexed by an int, got {type(index).__name__}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"context {index} is out of range: this received memory holds {len(self)}")
        index %= len(self)
        if len(self) == 1:
            return self
        with self._lock:
            if index not in self._views:
                self._views[index] = ReceivedMemory(self._receiver, self.vectors[index:index + 1])
            return self._views[index]

    def __iter__(self) -> Iterator[ReceivedMemory]:
        return (self[i] for i in range(len(self)))

    @property
    def positions(self) -> int:
        """R, the memory vectors of one context (K per latent)."""
        return int(self.vectors.shape[1])

    def _one(self, what: str) -> Tensor:
        if len(self) != 1:
            raise ValueError(f"this received memory holds {len(self)} contexts: {what} one of them, "
                             f"memory[i].{what}(...)")
        return self.vectors[0]

    def prefix(self, question: str) -> Tensor:
        """The receiver's whole prefix (L, H) for ``question``, as `receive` prefills it."""
        if not isinstance(question, str):
            raise ValueError(f"question must be a string, got {type(question).__name__}")
        checked_questions(question, self._receiver.lm.max_positions)
        lm = self._receiver.lm
        return receiver_prefix(lm.tokenizer, question, source=self._receiver.encoder,
                               memory=self._one("prefix")).embeds(lm.model)

    def _shared(self, vectors: Tensor) -> tuple[ReceiverPrefix | None, object]:
        """The part every question's prefix shares and its key/value cache, computed once."""
        with self._lock:
            if self._stem is None:
                lm, receiver = self._receiver.lm, self._receiver
                stem = question_stem(lm.tokenizer, source=receiver.encoder, memory=vectors)
                cache = None
                if stem is not None:
                    with receiver.compute():
                        cache = prefill_stem(lm.model, stem.embeds(lm.model))
                self._stem = (stem, cache)
            return self._stem

    def ask(self, question: str | Sequence[str], max_new_tokens: int = 8, *, batch_size: int = 8,
            stop_at_newline: bool = False) -> str | list[str]:
        """Greedy answers to one question or a batch of them, all about this context.

        Returns:
            a string for a single question, else a list in order.

        Raises:
            ValueError: what `receive` refuses of its questions and settings (checked before
                any is tokenised), a prompt that with ``max_new_tokens`` exceeds the LM's
                positions (before any forward), or a memory of several contexts (ask
                ``memory[i]``).
        """
        single, questions = checked_questions(question, self._receiver.lm.max_positions)
        checked_decoding(max_new_tokens, batch_size, stop_at_newline)
        vectors = self._one("ask")
        receiver = self._receiver
        lm, tok = receiver.lm, receiver.lm.tokenizer
        prefixes = [receiver_prefix(tok, q, source=receiver.encoder, memory=vectors) for q in questions]
        check_room(lm, max(len(p) for p in prefixes), max_new_tokens)
        stem, cache = self._shared(vectors)
        rests = [None if stem is None else p.rest_after(stem) for p in prefixes]
        ids: list[list[int] | None] = [None] * len(questions)
        stops = stop_token_ids(lm.model, tok)
        table = lm.model.get_input_embeddings()
        with receiver.compute():
            cached = [i for i, rest in enumerate(rests) if rest is not None]
            for s in range(0, len(cached), batch_size):
                rows = cached[s:s + batch_size]
                rest_rows = [table(torch.tensor(rests[i], dtype=torch.long, device=table.weight.device))
                             for i in rows]
                for i, row in zip(rows, greedy_after_stem(lm.model, tok, cache, len(stem), rest_rows,
                                                          max_new_tokens=max_new_tokens,
                                                          stop_at_newline=stop_at_newline, stops=stops)):
                    ids[i] = row
            whole = [i for i, rest in enumerate(rests) if rest is None]
            if whole:
                decoded = greedy_decode_ids(lm.model, tok, [prefixes[i].embeds(lm.model) for i in whole],
                                            max_new_tokens=max_new_tokens, batch_size=batch_size,
                                            stop_at_newline=stop_at_newline)
                for i, row in zip(whole, decoded):
                    ids[i] = row
        answers = [decoded_answer(tok, row, stop_at_newline) for row in ids]
        return answers[0] if single else answers

    def reconstruct(self, max_new_tokens: int = 64) -> str:
        """What the receiver says this context was: greedy decoding of ``[memory ; reconstruction
        instruction]`` (meaningful for runs trained with a reconstruction stage)."""
        checked_decoding(max_new_tokens, 1, False)
        return reconstructions(self._receiver, self._one("reconstruct")[None], max_new_tokens, 1)[0]

    def __repr__(self) -> str:
        return (f"ReceivedMemory(contexts={len(self)}, positions={self.positions}, "
                f"hidden={int(self.vectors.shape[2])})")


def reconstructions(receiver, memory: Tensor, max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy decoding of ``[memory ; reconstruction instruction]`` for each context of memory
    vectors (B, R, H): what the receiver says each context was."""
    tok = receiver.lm.tokenizer
    instruction = tok(reconstruction_prompt(tok), add_special_tokens=False)["input_ids"]
    prefixes = [receiver_prefix(tok, None, memory=memory[i], prompt_ids=instruction).embeds(receiver.lm.model)
                for i in range(memory.shape[0])]
    with receiver.compute():
        return greedy_decode(receiver.lm.model, tok, prefixes, max_new_tokens=max_new_tokens, batch_size=batch_size)
