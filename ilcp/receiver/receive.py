"""Receiving: bytes -> one opened, verified, bounded and value-checked latent -> memory vectors
-> the receiver's prefix -> greedy decoding -> answers.

One pass down: `Receiver.open` unseals the bytes and reads the header (`ilcp.wire.payload.opened`),
checks the declared shape against this export (before anything proportional to it is read),
reads and verifies the rest, and unpacks z once, checking its values against the export's
``latent_bound``; the encoder's projector turns z into K memory vectors (`memory_vectors`, finite or
refused); `ilcp.receiver.prefix.receiver_prefix` lays them out before the question prompt as
training did; `ilcp.receiver.decoding.greedy_decode` answers. Each refusal is one `PayloadError`
or ValueError line. `ilcp.handoff.ILCPHandoff` is the facade agent code uses.

`Receiver.open_memory` stops before the question: a `ilcp.receiver.memory.ReceivedMemory` that
answers any number of questions. With a key, a payload's nonce is spent by a call that succeeds,
once (`Receiver.admitted`); a call refused after the seal was opened releases it.

What a receiver reads: at most ``max_payload_latents`` latents per question, or in all without a
question count (default: the latents one context gives); latent values within the export's
``latent_bound`` (`ilcp.export`); memory vectors that are finite after projection.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from ..checks import positive_int
from ..encoder.model import ILCPEncoder
from ..encoder.spec import EncoderSpec
from ..lm import LM
from ..precision import autocast
from ..wire.errors import PayloadError
from ..wire.payload import DEFAULT_MAX_ELEMENTS, TransportPayload, opened, unpack
from ..wire.seal import ReplayGuard
from .decoding import greedy_decode
from .memory import ReceivedMemory, reconstructions
from .prefix import format_vectors_of, question_stem, receiver_prefix
from .questions import (MAX_RECEIVE_CHARACTERS, MAX_RECEIVE_QUESTIONS, check_room, checked_decoding,
                        checked_questions)

__all__ = ["MAX_RECEIVE_CHARACTERS", "MAX_RECEIVE_QUESTIONS", "Receiver", "answers_by_request"]

class _Admission:
    """The sealed payloads one call opened: their nonces are released when the call is refused."""

    def __init__(self, guard: ReplayGuard):
        self.guard = guard
        self.envelopes = []

    def check(self, envelope) -> None:
        self.guard.check(envelope)
        self.envelopes.append(envelope)

    def release(self) -> None:
        for envelope in self.envelopes:
            self.guard.release(envelope)


def answers_by_request(answers: Sequence[str], shapes: Sequence[tuple[bool, int]]) -> list[str | list[str]]:
    """Flat answers cut back into requests (`ILCPHandoff.request_prefixes`): a string for a
    request of one question, else its list."""
    out: list[str | list[str]] = []
    start = 0
    for single, n in shapes:
        rows = list(answers[start:start + n])
        out.append(rows[0] if single else rows)
        start += n
    return out


class Receiver:
    """The receiving side of one export for one frozen LM.

    Args:
        lm: the frozen LM bundle the receiver runs.
        encoder: the export's trained encoder (its projector turns latents into memory vectors).
        spec: the export's encoder settings (`ilcp.encoder.spec.EncoderSpec`).
        fingerprint: this LM's fingerprint; payloads of another LM are refused.
        device: where the projector runs.
        precision: the compute precision of the projector and the decode (`ilcp.precision`).
        auth_key: a key shared by sender and receiver (bytes, >= 16): `ILCPHandoff.to_wire` seals
            payloads with HMAC-SHA256 (a fresh nonce and the creation time) and `parse` refuses bytes
            whose tag does not verify, unsealed bytes and unsealed `TransportPayload` objects, a
            sealed payload it accepted before, and one older than ``max_age`` (`ilcp.wire.seal`
            says what the envelope promises and what it does not). None: the CRC-checked format
            only.
        max_age: with a key, seconds a sealed payload is accepted after it was sealed (None: no
            limit; replays are then refused as long as the receiver remembers their nonces).
        replay_window: with a key, seconds the receiver remembers the nonces it accepted;
            default ``max_age`` (`ilcp.wire.seal.ReplayGuard`, at most 65,536 nonces).
        max_payload_latents: the most latents a payload may carry per question it is read with
            (`receive`, `prefixes`, the served and vLLM receivers), or in all when it is read
            without a question count (`parse`, `memory_vectors`, `reconstruct` without
            ``contexts``); default `max_chunks`, the latents one context of ``max_length`` tokens
            gives (1 for one latent per context). Checked from the payload's header, before
            anything proportional to it is read or projected.
    """

    def __init__(self, lm: LM, encoder: ILCPEncoder, spec: EncoderSpec, fingerprint: str, *, device: torch.device,
                 precision: str, auth_key: bytes | None, max_age: float | None, replay_window: float | None,
                 max_payload_latents: int):
        self.lm, self.encoder, self.spec, self.fingerprint = lm, encoder, spec, fingerprint
        self.device, self.precision = device, precision
        self.auth_key = auth_key
        self.replay_guard = None if auth_key is None else ReplayGuard(max_age, replay_window)
        self.max_payload_latents = max_payload_latents
        self._calls = threading.local()  # the admission of the call this thread is in, if any
        self._fewest: tuple[tuple, int] | None = None
        self.fewest_positions()  # the prompt template read once, while the tokenizer is at hand

    def fewest_positions(self) -> int:
        """The fewest positions a question's prefix can take: the memory rows of one latent, the
        prompt around the question and one token of question (a bound checked before a payload
        is opened; recomputed when the encoder's receiver layout changes)."""
        fmt = format_vectors_of(self.encoder)
        key = (self.encoder.placement, self.encoder.num_memory_tokens, None if fmt is None else int(fmt.shape[0]))
        if self._fewest is None or self._fewest[0] != key:
            rows = torch.zeros(self.encoder.num_memory_tokens, self.lm.hidden_size)
            stem = question_stem(self.lm.tokenizer, source=self.encoder, memory=rows)
            self._fewest = (key, (len(stem) if stem is not None else rows.shape[0]) + 1)
        return self._fewest[1]

    @contextmanager
    def admitted(self):
        """Every sealed payload opened inside the block spends its nonce only if the block ends
        without an exception: a call refused after the seal was opened (an argument, a shape, a
        value) leaves the same bytes to be opened again. Blocks nest: the outermost decides."""
        if self.replay_guard is None or getattr(self._calls, "admission", None) is not None:
            yield
            return
        admission = self._calls.admission = _Admission(self.replay_guard)
        try:
            yield
        except BaseException:
            admission.release()
            raise
        finally:
            self._calls.admission = None

    @property
    def max_length(self) -> int:
        return self.spec.max_length

    @property
    def latent_dim(self) -> int:
        return self.encoder.latent_dim

    def compute(self):
        """The context every forward of the receiver runs in: autocast at its precision."""
        return autocast(self.precision, self.device)

    def open(self, payload: TransportPayload | bytes | bytearray | memoryview, *,
             contexts: int | None = None) -> Tensor:
        """The received latent z, float32 on this receiver's device, opened and checked once: see
        `parse` for what is refused."""
        with self.admitted():
            z = unpack(self.read(payload, contexts), self.device, dtype=torch.float32)
            self._check_values(z)
        return z

    def parse(self, payload: TransportPayload | bytes | bytearray | memoryview, *,
              contexts: int | None = None) -> TransportPayload:
        """Verify a payload (bytes or object) against this receiver's LM and export: its shape
        and latent count are checked from the header, before anything proportional to it is
        read, then its values against the export's ``latent_bound``.

        Args:
            contexts: the number of contexts the caller will read (its questions): a payload
                that holds another number is refused. None: a payload of at most
                ``max_payload_latents`` latents in all.

        Raises:
            PayloadError: invalid bytes, a payload made by another LM, a latent shape this export
                does not read (more chunks than a context of ``max_length`` tokens gives, or
                another number of contexts than ``contexts``), more latents than
                ``max_payload_latents`` allows, a latent value beyond the export's bound, or, for
                a receiver with a key, unsealed bytes or objects, a replay, or a payload older
                than ``max_age``.
        """
        with self.admitted():
            payload = self.read(payload, contexts)
            self._check_values(unpack(payload, payload.latent.device, dtype=torch.float32))
        return payload

    def read(self, payload, contexts: int | None) -> TransportPayload:
        """The payload, verified against this LM and its shape against this export (values unchecked)."""
        if contexts is not None:
            positive_int("contexts", contexts)
            if contexts > MAX_RECEIVE_QUESTIONS:
                raise ValueError(f"{contexts:,} contexts in one call, more than {MAX_RECEIVE_QUESTIONS:,} "
                                 "(ilcp.receiver.receive.MAX_RECEIVE_QUESTIONS): read them in several calls")
        if isinstance(payload, TransportPayload):
            if self.auth_key is not None:
                raise PayloadError("payload is not authenticated, but this receiver requires a shared key: hand it "
                                   "the sealed bytes (sender.to_wire(payload)), not the TransportPayload object")
            if payload.lm_fingerprint != self.fingerprint:
                raise PayloadError(
                    f"payload was made by LM {payload.lm_fingerprint}, this receiver runs {self.fingerprint}"
                )
            self.check_shape(tuple(payload.latent.shape), contexts)
            return payload
        guard = getattr(self._calls, "admission", None) or self.replay_guard
        with opened(payload, max_elements=self._max_elements(contexts), key=self.auth_key, guard=guard,
                    limit=self._limit(contexts)) as header:
            self.check_shape(header.shape, contexts)
            return header.read(expected_fingerprint=self.fingerprint)

    def _check_values(self, z: Tensor) -> None:
        """Refuse latent values beyond the export's ``latent_bound`` (none for an export without one)."""
        bound = self.encoder.latent_bound
        if bound is None:
            return
        peak = float(z.abs().max())
        if peak > bound:
            raise PayloadError(f"payload has a latent value of magnitude {peak:.4g}, beyond this export's latent_bound "
                               f"of {bound:.4g} (recorded at export from the latents its encoder gave in training): no "
                               "sender of this export makes it")

    @property
    def max_chunks(self) -> int:
        """The most latents one context carries: per chunk ceil(max_length / chunk_tokens), per slot
        the slots of max_length tokens, else 1."""
        return self.encoder.max_latents(self.max_length)

    def _max_elements(self, contexts: int | None) -> int:
        if contexts is None:
            return DEFAULT_MAX_ELEMENTS
        return max(1, contexts) * self.max_chunks * self.latent_dim

    def _limit(self, contexts: int | None) -> str:
        """What `_max_elements` stands for, with the fix: the end of the refusal of longer sealed bytes."""
        if contexts is None:
            return (f"that {DEFAULT_MAX_ELEMENTS} latent values can take (latents of {self.latent_dim} values, no "
                    "question count): pass contexts= the number of contexts it holds")
        return (f"that {contexts} question(s) can take (at most {self.max_chunks} latent(s) of {self.latent_dim} "
                f"values per question, from contexts of at most {self.max_length} tokens): it holds more contexts "
                "than questions, or another export's latents; pass one question per context it holds")

    def check_shape(self, shape: tuple[int, ...], contexts: int | None) -> None:
        """Refuse a latent shape this receiver does not read: it reads (Z,) or (B, Z), or per chunk
        (N, Z) or (B, N, Z) with N <= `max_chunks`; B equal to ``contexts`` when given; at most
        ``max_payload_latents`` latents per context given (in all without ``contexts``)."""
        per_context = 2 if self.encoder.chunked else 1  # dims of one context's latent
        if len(shape) not in (per_context, per_context + 1) or shape[-1] != self.latent_dim:
            expected = "(N, Z) or (B, N, Z)" if self.encoder.chunked else "(Z,) or (B, Z)"
            raise PayloadError(f"payload latent has shape {shape}; this receiver reads {expected} with "
                               f"Z = {self.latent_dim}")
        if self.encoder.chunked and shape[-2] > self.max_chunks:
            raise PayloadError(f"payload carries {shape[-2]} latents per context; a context of at most "
                               f"{self.max_length} tokens (this export's max_length) gives at most "
                               f"{self.max_chunks} ({self.encoder.latent_unit()})")
        held = shape[0] if len(shape) == per_context + 1 else 1
        if contexts is not None and held != contexts:
            raise PayloadError(f"payload holds {held} latent(s) but {contexts} question(s) were given")
        count = math.prod(shape[:-1])
        questions = max(1, contexts or 1)
        if count > self.max_payload_latents * questions:
            raise PayloadError(self._over_limit(count, contexts))

    def _over_limit(self, count: int, contexts: int | None) -> str:
        """The refusal of a payload of `count` latents, over ``max_payload_latents``."""
        limit = self.max_payload_latents
        if contexts is None:
            return (f"payload carries {count} latents; without a question count this receiver reads at most "
                    f"{limit} (max_payload_latents={limit}): pass contexts= the number of contexts it holds, or "
                    f"raise the limit with ILCPHandoff.from_pretrained(..., max_payload_latents={count})")
        needed = -(-count // max(1, contexts))
        return (f"payload carries {count} latents for {contexts} question(s); this receiver reads at most {limit} "
                f"per question (max_payload_latents={limit}): raise the limit with "
                f"ILCPHandoff.from_pretrained(..., max_payload_latents={needed})")

    def memory_vectors(self, payload: TransportPayload | bytes, *, contexts: int | None = None) -> Tensor:
        """Received payload -> memory vectors (B, K, H), or (B, N * K, H) with one latent per
        chunk, in the LM's dtype, on the LM's device.

        The payload is opened once (`open`: its own copy of z, so receivers never alias a
        payload); its shape is checked, with ``contexts``, before anything is read or projected.

        Raises:
            PayloadError: what `parse` refuses (invalid or foreign bytes, a latent whose shape this
                export does not read, more latents than ``max_payload_latents``, a value beyond
                the export's bound), or latents that project to NaN or infinite memory vectors.
        """
        with self.admitted():
            z = self.open(payload, contexts=contexts)
            per_context = 2 if self.encoder.chunked else 1  # dims of one context's latent
            if z.dim() == per_context:
                z = z.unsqueeze(0)
            with torch.no_grad(), self.compute():
                memory = self.encoder.memory(z, dtype=self.lm.dtype)
            if not bool(torch.isfinite(memory).all()):
                raise PayloadError(f"payload's latents project to non-finite memory vectors (NaN or infinity in "
                                   f"{str(self.lm.dtype).removeprefix('torch.')}): they lie outside what this "
                                   "export's projector reads")
        return memory.to(self.lm.device)

    def open_memory(self, payload: TransportPayload | bytes, *, contexts: int | None = None):
        """A received memory (`ilcp.receiver.memory.ReceivedMemory`): the payload opened, checked
        and projected once (`memory_vectors`), to be asked any number of questions. A sealed
        payload's nonce is spent here, once, and only when the open succeeds.

        Raises:
            PayloadError: what `memory_vectors` refuses.
            ValueError: ``contexts`` not a positive int (before the payload is opened).
        """
        return ReceivedMemory(self, self.memory_vectors(payload, contexts=contexts))

    def prefixes(self, payload: TransportPayload | bytes, questions: Sequence[str]) -> list[Tensor]:
        """The receiver's prefixes (L_i, H), one per question and context, in the layout training
        used (`ilcp.receiver.prefix.receiver_prefix`): ``[memory ; question prompt]``, or for a run trained
        with ``handoff.memory_placement=in_prompt`` the cold-read prompt with the memory where the
        context text would stand."""
        with self.admitted():
            memory = self.memory_vectors(payload, contexts=len(questions))
            tok = self.lm.tokenizer
            return [receiver_prefix(tok, q, source=self.encoder, memory=memory[i]).embeds(self.lm.model)
                    for i, q in enumerate(questions)]

    def request_prefixes(self, requests, questions_of) -> tuple[list[Tensor], list[tuple[bool, int]]]:
        """Every prefix of many ``(payload, question or questions)`` requests, in order, and each
        request's shape (one question, how many) for `answers_by_request`; ``questions_of(q)``
        checks a request's question(s) and returns ``(single, questions)``. Every payload is
        checked before any answer is decoded.

        Raises:
            ValueError: an empty list or a request that is not a pair (and what ``questions_of``
                raises).
        """
        if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence) or len(requests) == 0:
            raise ValueError("requests must be a non-empty list of (payload, question or questions) pairs")
        prefixes: list[Tensor] = []
        shapes: list[tuple[bool, int]] = []
        checked = []
        for i, request in enumerate(requests):
            if not isinstance(request, (tuple, list)) or len(request) != 2:
                raise ValueError(f"request {i} must be a (payload, question or questions) pair")
            checked.append((request[0], *questions_of(request[1])))
        with self.admitted():  # a refused request leaves every payload of the call unspent
            for payload, single, questions in checked:
                prefixes.extend(self.prefixes(payload, questions))
                shapes.append((single, len(questions)))
        return prefixes, shapes

    def receive(
        self,
        payload: TransportPayload | bytes,
        question: str | Sequence[str],
        max_new_tokens: int = 8,
        *,
        batch_size: int = 8,
        stop_at_newline: bool = False,
    ) -> str | list[str]:
        """Answer questions from a received payload with greedy decoding.

        Args:
            payload: a `TransportPayload` or its bytes; must carry this LM's fingerprint.
            question: one question (for a single-latent payload) or one per latent.
            max_new_tokens: the answer's token budget.

        Returns:
            a string for a single question, else a list in order.

        Raises:
            PayloadError: invalid or foreign payload, or one that holds another number of
                latents than questions were given (refused before anything is projected).
            ValueError: a question that is not a string, empty, not valid Unicode, or longer
                than the LM's context could hold; more than `MAX_RECEIVE_QUESTIONS` questions or
                more than `MAX_RECEIVE_CHARACTERS` characters together (all refused before any is
                tokenised); a max_new_tokens or batch_size that is not a positive int, or that with
                the prompt exceeds the LM's positions. The questions and settings are checked
                before a sealed payload is opened (the prompt's length against the shortest a
                question can have), the exact prompt length once the memory is known; a call
                refused at any point spends no nonce: the same bytes can be received again.

        Several questions about one context: `open_memory` it once and ask it
        (`ilcp.receiver.memory.ReceivedMemory`).
        """
        single, questions = checked_questions(question, self.lm.max_positions)
        checked_decoding(max_new_tokens, batch_size, stop_at_newline)
        # Before the payload is opened (and before any question is tokenised): the shortest prompt
        # a question can have must leave room for max_new_tokens; the exact check follows.
        check_room(self.lm, self.fewest_positions(), max_new_tokens)
        tok = self.lm.tokenizer
        with self.admitted():  # a refused call leaves a sealed payload unspent
            prefixes = self.prefixes(payload, questions)
            check_room(self.lm, max(p.shape[0] for p in prefixes), max_new_tokens)
            with self.compute():
                answers = greedy_decode(self.lm.model, tok, prefixes, max_new_tokens=max_new_tokens,
                                        batch_size=batch_size, stop_at_newline=stop_at_newline)
        return answers[0] if single else answers

    def reconstruct(self, payload: TransportPayload | bytes, max_new_tokens: int = 64, *,
                    batch_size: int = 8, contexts: int | None = None) -> list[str]:
        """What the receiver says the handed-over contexts were: greedy decoding of
        ``[memory ; reconstruction instruction]``, one string per context of the payload.

        Meaningful for runs trained with a reconstruction stage (``reconstruct.steps > 0``); it
        shows what the latent carries, word for word. ``contexts``: the number of contexts the
        payload holds, as for `memory_vectors` (None: at most ``max_payload_latents`` latents).

        Raises:
            PayloadError: what `memory_vectors` refuses, before anything is decoded.
        """
        checked_decoding(max_new_tokens, batch_size, False)
        with self.admitted():
            return reconstructions(self, self.memory_vectors(payload, contexts=contexts), max_new_tokens, batch_size)

