"""Sending: a context's text -> the sender LM's states -> the encoder's latents -> a payload.

`Sender.send` runs the sender forward training ran (`ilcp.encoder.pooling.sender_token_states`,
over the context's last ``max_length`` tokens, right padded; for memory slots, the slots' forward
after the context, `ilcp.encoder.slots.slot_states`), then the encoder pools the states and
encodes z = mu, which `ilcp.wire.payload.pack` stages with the LM fingerprint. A sender that
already ran the LM over the context hands its outputs to `send_from_hidden_states`: no second
forward. `ilcp.handoff.ILCPHandoff` is the facade agent code uses.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..checks import positive_int, text_input
from ..compat import output_cache_or_none
from ..lm import LM
from ..precision import autocast
from ..wire.payload import TransportPayload, pack
from .model import ILCPEncoder
from .pooling import layer_states, length_batches, pad_id_of, pad_right, sender_token_states
from .spec import EncoderSpec

__all__ = ["MAX_BATCH_TOKENS", "MAX_SEND_CHARACTERS", "Sender"]

MAX_BATCH_TOKENS = 16384  # padded positions per sender forward (`Sender.latents`)
# Characters of all the contexts of one send together (`max_characters`), checked before any is
# tokenised: 2 MiB of text, about half a million tokens of English prose, 64 full 8,192-token
# contexts. Each context alone is bounded by the LM's positions (`ilcp.checks.text_input`).
MAX_SEND_CHARACTERS = 1 << 21


class Sender:
    """The sending side of one export for one frozen LM.

    Args:
        lm: the frozen LM bundle the sender runs.
        encoder: the export's trained encoder.
        spec: the export's encoder settings (`ilcp.encoder.spec.EncoderSpec`).
        fingerprint: the LM fingerprint payloads carry.
        device: where the encoder runs.
        precision: the compute precision of the sender forward and the encoder (`ilcp.precision`).
        payload_dtype: dtype of z on the wire (`ilcp.wire.dtypes`).
    """

    def __init__(self, lm: LM, encoder: ILCPEncoder, spec: EncoderSpec, fingerprint: str, *,
                 device: torch.device, precision: str, payload_dtype: str):
        self.lm, self.encoder, self.spec, self.fingerprint = lm, encoder, spec, fingerprint
        self.device, self.precision, self.payload_dtype = device, precision, payload_dtype

    @property
    def layers(self) -> tuple[int, ...]:
        return self.spec.layers

    @property
    def max_length(self) -> int:
        return self.spec.max_length

    def compute(self):
        """The context every forward of the sender runs in: autocast at its precision."""
        return autocast(self.precision, self.device)

    def pack(self, z: Tensor) -> TransportPayload:
        """A latent (Z,), (N, Z), (B, Z) or (B, N, Z) staged as a payload of this LM."""
        return pack(z, lm_fingerprint=self.fingerprint, dtype=self.payload_dtype)

    def sender_inputs(self, contexts: Sequence[str], *,
                      max_characters: int | None = MAX_SEND_CHARACTERS) -> dict[str, Tensor]:
        """Token ids as training pooled them: no special tokens, right-padded; a context longer
        than the export's ``max_length`` keeps its last ``max_length`` tokens, with a warning.

        Returns:
            {"input_ids": (B, S) long, "attention_mask": (B, S) long} on the LM's device.

        Raises:
            ValueError: no contexts, a non-string, a context with no tokens or only whitespace,
                one that is not valid Unicode, or one longer than the LM's context could hold
                (`ilcp.checks.text_input`: refused before it is tokenised); contexts of more than
                ``max_characters`` characters together (default `MAX_SEND_CHARACTERS`; None: no
                bound), refused before any is tokenised.
        """
        if isinstance(contexts, str) or not isinstance(contexts, Sequence) or len(contexts) == 0:
            raise ValueError("contexts must be a non-empty list of strings")
        if any(not isinstance(c, str) for c in contexts):
            raise ValueError("contexts must be strings")
        if max_characters is not None:
            positive_int("max_characters", max_characters)
        for i, context in enumerate(contexts):
            text_input("the context" if len(contexts) == 1 else f"context {i}", context, self.lm.max_positions)
            if context and not context.strip():
                raise ValueError("cannot send a context of only whitespace (it carries nothing to hand over)")
        total = sum(len(c) for c in contexts)
        if max_characters is not None and total > max_characters:
            raise ValueError(f"these {len(contexts)} contexts hold {total:,} characters together, more than "
                             f"max_characters={max_characters:,} (ilcp.encoder.send.MAX_SEND_CHARACTERS by default): send "
                             f"them in several calls, or pass a larger max_characters")
        ids = self.lm.tokenizer(list(contexts), add_special_tokens=False)["input_ids"]
        if any(len(seq) == 0 for seq in ids):
            raise ValueError("cannot send an empty context (it has no tokens)")
        cut = [len(seq) for seq in ids if len(seq) > self.max_length]
        if cut:
            # stacklevel 5: the line that called ILCPHandoff.send (through latents and the facade)
            warnings.warn(f"{len(cut)} of {len(ids)} context(s) are longer than this export's max_length of "
                          f"{self.max_length} tokens (the longest {max(cut)}): the sender reads their last "
                          f"{self.max_length} tokens, as training did", UserWarning, stacklevel=5)
            ids = [seq[-self.max_length:] for seq in ids]
        input_ids, mask = pad_right(ids, pad_id_of(self.lm.tokenizer))
        return {"input_ids": input_ids.to(self.lm.device), "attention_mask": mask.to(self.lm.device)}

    def latents(self, contexts: Sequence[str], *, batch_size: int = 16,
                max_batch_tokens: int | None = MAX_BATCH_TOKENS,
                max_characters: int | None = MAX_SEND_CHARACTERS) -> list[Tensor]:
        """z = mu of each context: the sender forward training ran, one per batch of similar
        lengths (at most ``batch_size`` contexts and ``max_batch_tokens`` padded positions, so
        long contexts go a few, or one, at a time), then the encoder.

        Returns:
            one float32 tensor per context, in the order given, on the encoder's device: (Z,), or
            (N_i, Z) for a run with one latent per chunk (N_i the context's chunks).
        """
        batch_size = positive_int("batch_size", batch_size)
        inputs = self.sender_inputs(contexts, max_characters=max_characters)  # validates and truncates
        ids, attention = inputs["input_ids"], inputs["attention_mask"]

        def states_of(rows: list[int], width: int) -> tuple[Tensor, Tensor]:
            mask = attention[rows, :width]
            with torch.no_grad(), self.compute():
                if self.encoder.reads_sender_lm:  # memory slots: their states after the context, and their mask
                    return self.encoder.lm_states(self.lm.model, mask, self.layers, input_ids=ids[rows, :width])
                return sender_token_states(self.lm.model, ids[rows, :width], mask, self.layers), mask

        return self.encode_in_batches(attention.sum(-1).tolist(), batch_size, states_of, max_batch_tokens)

    def encode_in_batches(self, lengths: Sequence[int], batch_size: int,
                          states_of: Callable[[list[int], int], tuple[Tensor, Tensor]],
                          max_batch_tokens: int | None = MAX_BATCH_TOKENS) -> list[Tensor]:
        """Each context's latent, encoding contexts of similar lengths together.

        Args:
            lengths: each context's token count.
            batch_size: contexts per batch.
            max_batch_tokens: padded positions per batch at most (a longer context goes alone).
            states_of: ``(rows, width) -> (states (B, width, D), mask (B, width))``, the sender
                states of those contexts, right-padded to ``width``.

        Returns:
            one float32 latent per context, in the order of ``lengths`` (see `latents`).
        """
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        out: list[Tensor] = [None] * len(lengths)  # type: ignore[list-item]
        for batch in length_batches([lengths[i] for i in order], batch_size, max_batch_tokens):
            rows = [order[j] for j in batch]
            states, mask = states_of(rows, max(lengths[i] for i in rows))
            for i, z in zip(rows, self.encode_states(states, mask)):
                out[i] = z
        return out

    @torch.no_grad()
    def encode_states(self, states: Tensor, attention_mask: Tensor) -> list[Tensor]:
        """Right-padded sender states (B, S, D) and their mask (B, S) -> each row's latent, (Z,)
        or (N_i, Z) with one latent per chunk (the encoder's real chunks only)."""
        mask = attention_mask.to(self.device)
        with self.compute():
            z = self.encoder.latent(states.to(self.device), mask).float()
        if not self.encoder.chunked:
            return list(z)
        real = self.encoder.latent_mask(mask)
        return [z[row][real[row]] for row in range(z.shape[0])]

    def pack_latents(self, latents: list[Tensor], single: bool) -> TransportPayload:
        """One payload for the latents of `latents` (one context when `single`, else stacked).

        Raises:
            ValueError: contexts that carry different numbers of latents.
        """
        if single:
            return self.pack(latents[0])
        if len({tuple(t.shape) for t in latents}) > 1:
            raise ValueError(f"these contexts carry different numbers of latents ({self.encoder.latent_unit()}): send them "
                             "with send_each")
        return self.pack(torch.stack(latents))

    def send(self, context: str | Sequence[str], *, batch_size: int = 16,
             max_characters: int | None = MAX_SEND_CHARACTERS) -> TransportPayload:
        """Encode and pack a context.

        Args:
            context: one context string (payload latent (Z,), or (N, Z) with one latent per
                chunk) or a list of them (payload latent (B, Z), or (B, N, Z) when every context
                has N chunks; `send_each` sends contexts of any lengths).
            batch_size: contexts per sender forward.
            max_characters: the contexts' characters together at most (`MAX_SEND_CHARACTERS`,
                2,097,152, by default; None: no bound), checked before any is tokenised.

        Returns:
            the payload, on the CPU, carrying this LM's fingerprint.

        Raises:
            ValueError: not a string or a non-empty list of strings; an empty context; a
                batch_size that is not a positive int; more than ``max_characters`` characters
                together, or one context longer than the LM's context could hold; chunked contexts with different numbers
                of chunks in one payload.
        """
        single = isinstance(context, str)
        return self.pack_latents(self.latents([context] if single else context, batch_size=batch_size,
                                              max_characters=max_characters), single)

    def send_each(self, contexts: Sequence[str], *, batch_size: int = 16,
                  max_characters: int | None = MAX_SEND_CHARACTERS) -> list[TransportPayload]:
        """One payload per context (batched sender forwards), whatever their lengths; the same
        bound as `send` on their characters together."""
        return [self.pack(z) for z in self.latents(contexts, batch_size=batch_size, max_characters=max_characters)]

    def send_from_hidden_states(self, outputs, attention_mask: Tensor) -> TransportPayload:
        """Pack the contexts a sender's own forward already encoded; runs no forward.

        Args:
            outputs: the LM's outputs with ``hidden_states`` (``output_hidden_states=True``), over
                the context tokens as `sender_inputs` gives them (what training pooled).
            attention_mask: (B, S), 1 on real tokens.

        Returns:
            a payload with latent (B, Z).

        Raises:
            ValueError: a mask that is not (B, S), or a row of it with no real token.
        """
        if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2 or attention_mask.numel() == 0:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be a non-empty (B, S) tensor, got {shape}")
        empty = (attention_mask.sum(-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"attention_mask row(s) {empty[:4]} mark no real token (all zeros): there is no context "
                             "to send")
        longest = int(attention_mask.sum(-1).max())
        if longest > self.max_length:
            # stacklevel 3: the line that called ILCPHandoff.send_from_hidden_states (through the facade)
            warnings.warn(f"the sender's forward covers {longest} tokens, more than this export's max_length of "
                          f"{self.max_length}: the encoder reads them all, though training read at most "
                          f"{self.max_length}", UserWarning, stacklevel=3)
        with torch.no_grad(), self.compute():
            mask = attention_mask.to(self.device)
            if self.encoder.reads_sender_lm:  # memory slots read the forward's cache: N more positions
                cache = output_cache_or_none(outputs)
                if cache is None:
                    raise ValueError("this run's memory slots read the sender's key/value cache: run the forward with "
                                     "use_cache=True")
                states, mask = self.encoder.lm_states(self.lm.model, mask, self.layers, cache=cache)
            else:
                states = layer_states(outputs, self.layers).to(self.device)
            z = self.encoder.latent(states, mask).float()
            if self.encoder.chunked and not bool(self.encoder.latent_mask(mask).all()):
                raise ValueError("these contexts carry different numbers of latents: run the forward on one "
                                 "context at a time, or use send_each")
            return self.pack(z)
