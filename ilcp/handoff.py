"""ILCPHandoff: what agent code calls to hand a context over as a latent, and to receive one.

    from ilcp.handoff import ILCPHandoff

    # agent A (sender): loads the LM named in the run's config.json
    sender = ILCPHandoff.from_pretrained("checkpoints/default")
    wire = sender.send("Mary moved to the hallway. John went to the garden.").to_bytes()  # 163 bytes

    # agent B (receiver), in another process, with its own copy of the same LM
    from ilcp.lm import load_lm
    lm = load_lm()                          # or lm=model, tokenizer=tok for a Hugging Face model
    receiver = ILCPHandoff.from_pretrained("checkpoints/default", lm=lm)
    receiver.receive(wire, "Where is John?")                        # the answer, e.g. "garden"

`send` runs the sender forward training ran (`ilcp.encoder.pooling.sender_token_states`, over the
context's last ``max_length`` tokens, right padded), then the run's `ILCPEncoder` pools the
states (mean, or the trained attention pooler) and encodes z = mu, which is packed with the LM
fingerprint into a `TransportPayload`. A sender that already
ran the LM over the context hands its outputs to `send_from_hidden_states` instead: no second
forward. `receive` verifies the payload (bytes or object) against its own LM fingerprint,
projects z to K memory vectors and greedy-decodes ``[memory ; question prompt]``.

What a receiver reads (`parse`, and every entry point that turns a payload into memory): at most
``max_payload_latents`` latents per question, or in all without a question count (default: the
latents one context gives), checked from the header before anything is read or projected;
latent values within the export's ``latent_bound`` (`ilcp.export`); memory vectors that are
finite after projection. Each refusal is one `PayloadError` line.

`save_pretrained` writes the ILCP modules in the export format of `ilcp.export` (config.json +
model.safetensors, never the frozen LM); `from_pretrained` reads any run directory and refuses an
LM whose fingerprint differs from the one the run was trained on (`ExportError`).
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from .checks import positive_int, text_input
from .receiver.decoding import greedy_decode
from .encoder.model import ILCPEncoder
from .encoder.spec import EncoderSpec
from .export import (CONFIG_FILE, ExportError, ExportedRun, check_fingerprint, load_export_lm, read_config,
                     read_export)
from .export_writing import save_encoder
from .lm import LM
from .compat import output_cache_or_none
from .encoder.kinds import memory_kind_of
from .encoder.slots import slot_states
from .encoder.pooling import layer_states, length_batches, pad_id_of, pad_right, sender_token_states
from .precision import autocast, hold, resolve
from .receiver.prefix import receiver_prefix
from .receiver.prompts import reconstruction_prompt
from .wire.payload import DEFAULT_MAX_ELEMENTS, PayloadError, ReplayGuard, TransportPayload, check_key, pack, unpack

__all__ = ["ILCPHandoff", "answers_by_request"]

MAX_BATCH_TOKENS = 16384  # padded positions per sender forward (`ILCPHandoff.latents`)
# Characters of all the contexts of one send together (`max_characters`), checked before any is
# tokenised: 2 MiB of text, about half a million tokens of English prose, 64 full 8,192-token
# contexts. Each context alone is bounded by the LM's positions (`ilcp.checks.text_input`).
MAX_SEND_CHARACTERS = 1 << 21


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


class ILCPHandoff:
    """Sender and receiver sides of the ILCP handoff for one frozen LM.

    Args:
        lm: the frozen LM bundle (model, tokenizer, spec) both agents run.
        encoder: the trained `ILCPEncoder` (pooler, beta-VAE, projector) of the export.
        config: the export's config.json as a dict: its LM entries (fingerprint, precision) and the
            encoder's settings, read once into `spec` (`ilcp.encoder.spec.EncoderSpec`).
        device: where the encoder runs; default the LM's device.
        payload_dtype: dtype of z on the wire: "float32", "float16", "bfloat16" or "int8" (per-row
            absmax with a float32 scale; see `ilcp.wire.payload`).
        auth_key: a key shared by sender and receiver (bytes, >= 16): `to_wire` seals payloads
            with HMAC-SHA256 (with a fresh nonce and the creation time) and `parse` refuses bytes
            whose tag does not verify, unsealed bytes and unsealed `TransportPayload` objects, a
            sealed payload it accepted before, and one older than ``max_age`` (`ilcp.wire.payload`
            says what the envelope promises and what it does not). None: the CRC-checked format
            only.
        max_age: with a key, seconds a sealed payload is accepted after it was sealed (None: no
            limit; replays are then refused as long as the receiver remembers their nonces).
        replay_window: with a key, seconds the receiver remembers the nonces it accepted;
            default ``max_age`` (`ilcp.wire.payload.ReplayGuard`, at most 65,536 nonces).
        precision: compute precision (`ilcp.precision`); default the config's ``lm.precision``.
        max_payload_latents: the most latents a payload may carry per question it is read with
            (`receive`, `prefixes`, the served and vLLM receivers), or in all when it is read
            without a question count (`parse`, `memory_vectors`, `reconstruct` without
            ``contexts``); default `max_chunks`, the latents one context of ``max_length`` tokens
            gives (1 for one latent per context). Checked from the payload's header, before
            anything proportional to it is read or projected.

    Raises:
        ExportError: the config was made for another LM, its encoder settings do not read, or the
            encoder does not fit them.
        ValueError: an unknown payload dtype; a max_payload_latents that is not a positive int.

    Prefer `from_pretrained`; the constructor is for modules already in memory.
    """

    def __init__(
        self,
        lm: LM,
        encoder: ILCPEncoder,
        config: dict,
        *,
        device: str | torch.device | None = None,
        payload_dtype: str | torch.dtype = "float32",
        auth_key: bytes | None = None,
        precision: str | None = None,
        max_age: float | None = 300.0,
        replay_window: float | None = None,
        max_payload_latents: int | None = None,
    ):
        if not isinstance(lm, LM):
            raise ValueError(f"lm must be an ilcp.lm.LM bundle, got {type(lm).__name__}")
        if not isinstance(encoder, ILCPEncoder) or encoder.projector is None:
            raise ValueError("encoder must be a trained ilcp.encoder.model.ILCPEncoder with its projector")
        # Computed once: the LM bundle hashes its vocabulary again on every access.
        fingerprint = lm.fingerprint
        check_fingerprint(config, fingerprint)
        self._fingerprint = fingerprint
        self.spec = EncoderSpec.from_config(config)
        held = memory_kind_of(encoder)
        if held != self.spec.memory:
            raise ExportError(f"config.json describes the memory {self.spec.memory!r}, but the encoder pools as "
                              f"{held!r}")
        n_states = getattr(getattr(lm.model, "config", None), "num_hidden_layers", None)
        if n_states is not None and not all(-(n_states + 1) <= i <= n_states for i in self.layers):
            raise ExportError(f"config.json pools layers {list(self.layers)}, but this LM has {n_states + 1} hidden "
                              f"states (indices {-(n_states + 1)}..{n_states})")
        state_dim = lm.hidden_size * len(self.layers)
        if encoder.state_dim != state_dim:
            raise ExportError(
                f"the encoder reads token states of width {encoder.state_dim}, but {len(self.layers)} layer(s) of "
                f"this LM (hidden {lm.hidden_size}) give {state_dim}"
            )
        if encoder.projector.model_hidden != lm.hidden_size:
            raise ExportError(
                f"the projector maps to (K, {encoder.projector.model_hidden}); the LM's hidden size is {lm.hidden_size}"
            )
        # Fails early with a ValueError for an unknown payload dtype.
        self.payload_dtype = pack(torch.zeros(1), lm_fingerprint=fingerprint, dtype=payload_dtype).dtype
        self.auth_key = None if auth_key is None else check_key(auth_key)
        self.replay_guard = None if auth_key is None else ReplayGuard(max_age, replay_window)
        self.lm = lm
        self.config = copy.deepcopy(config)
        self.device = torch.device(device) if device is not None else lm.device
        self.encoder = encoder.to(self.device).float().eval()
        self.max_payload_latents = (self.max_chunks if max_payload_latents is None
                                    else positive_int("max_payload_latents", max_payload_latents))
        self.encoder.bind_vocabulary(lm.model.get_input_embeddings().weight)  # used when the encoder snaps
        recorded = str(config.get("lm", {}).get("precision", "32-true"))
        self.precision = resolve(recorded if precision is None else precision, self.device)
        self.source: Path | None = None

    # ---------------------------------------------------------------------------------- loading

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        lm: LM | nn.Module | None = None,
        tokenizer=None,
        *,
        device: str | torch.device | None = None,
        payload_dtype: str | torch.dtype = "float32",
        cache_dir: str | os.PathLike | None = None,
        auth_key: bytes | None = None,
        precision: str | None = None,
        max_age: float | None = 300.0,
        replay_window: float | None = None,
        export_key: bytes | None = None,
        max_payload_latents: int | None = None,
    ) -> ILCPHandoff:
        """Load the ILCP modules of a run directory (see `ilcp.export`) for an LM.

        Args:
            path: the run directory (config.json + model.safetensors).
            lm: an `ilcp.lm.LM` bundle, or a Hugging Face causal LM (then ``tokenizer`` is
                required), or None to load the LM named in config.json with `load_lm`.
            tokenizer: the tokenizer of a bare model.
            device: where the modules run (and where a loaded LM is placed); default the LM's.
            payload_dtype: dtype of z on the wire.
            cache_dir: `load_lm`'s cache, when the LM is loaded here.
            auth_key, max_age, replay_window, max_payload_latents: see the class.
            export_key: the key the export was signed with (`ilcp.export.sign_export`): its
                config.json must carry a signature that verifies under it (`read_export`).
            precision: compute precision of the sender's forward, the encoder and the receiver's
                decode (`ilcp.precision`: "32-true", "bf16-mixed" or "auto"); default the one
                the run trained at (config.json ``lm.precision``; "32-true" when absent). An LM
                loaded here is held in bfloat16 at "bf16-mixed" (`ilcp.precision.hold`); one
                passed in is left as it is.

        Raises:
            ExportError: not an export (``path`` not a str or os.PathLike included), no ILCP
                weights in it, or an LM with another fingerprint (checked before any weights file
                is read); `ilcp.export.ExportLMError`, also an `ilcp.lm.LMLoadError`, when the LM
                config.json names cannot be loaded here.
            ValueError: a bare model without a tokenizer, a tokenizer beside an LM bundle, an
                unknown precision.
        """
        config = read_config(path, key=export_key)
        if "ilcp" not in config["files"]:
            raise ExportError(
                f"{str(path)!r} holds no ILCP weights (files: {sorted(config['files'])}); "
                "train with 'ilcp' among handoff.variants"
            )
        loaded = lm is None
        if loaded:
            if tokenizer is not None:
                raise ValueError("a tokenizer was given without its model: pass lm=model as well")
            lm = load_export_lm(config, Path(path) / CONFIG_FILE, device=device or "cpu", cache_dir=cache_dir)
        elif isinstance(lm, LM):
            if tokenizer is not None and tokenizer is not lm.tokenizer:
                raise ValueError("lm is an LM bundle, which carries its tokenizer: do not pass another one")
        elif isinstance(lm, nn.Module):
            if tokenizer is None:
                raise ValueError("a bare model needs its tokenizer: from_pretrained(path, lm=model, tokenizer=tok)")
            lm = LM(model=lm, tokenizer=tokenizer, spec=config["lm"]["spec"])
        else:
            raise ValueError(f"lm must be an ilcp.lm.LM, a torch model or None, got {type(lm).__name__}")
        # Another LM is named by its fingerprint before any weights file is read: an export of an LM
        # with the same hidden size would otherwise meet a shape check of its tensors first.
        check_fingerprint(config, lm.fingerprint)
        run = read_export(path, key=export_key)
        handoff = cls.from_export(run, lm, device=device, payload_dtype=payload_dtype, auth_key=auth_key,
                                  precision=precision, max_age=max_age, replay_window=replay_window,
                                  max_payload_latents=max_payload_latents)
        if loaded:  # an LM loaded here is this handoff's own: held once in its compute dtype
            hold(lm, handoff.precision)
        return handoff

    @classmethod
    def from_export(cls, run: ExportedRun, lm: LM, *, device: str | torch.device | None = None,
                    payload_dtype: str | torch.dtype = "float32", auth_key: bytes | None = None,
                    precision: str | None = None, max_age: float | None = 300.0,
                    replay_window: float | None = None, max_payload_latents: int | None = None) -> ILCPHandoff:
        """The handoff of an export already read (`ilcp.export.read_export`) for an LM bundle."""
        if run.encoder is None:
            raise ExportError(f"{str(run.path)!r} holds no ILCP weights; train with 'ilcp' among handoff.variants")
        handoff = cls(lm, run.encoder, run.config, device=device, payload_dtype=payload_dtype, auth_key=auth_key,
                      precision=precision, max_age=max_age, replay_window=replay_window,
                      max_payload_latents=max_payload_latents)
        handoff.source = run.path
        return handoff

    def save_pretrained(self, path: str | os.PathLike, *, key: bytes | None = None) -> Path:
        """Write config.json and model.safetensors (the encoder only) into ``path``.

        Each file is written atomically and config.json last, so a directory with a config.json
        holds a complete export; the written config lists model.safetensors as its only weights.
        With ``key``, config.json is signed (`ilcp.export.sign_config`; load it with
        ``from_pretrained(path, export_key=key)``). Returns the directory.
        """
        return save_encoder(self.encoder, self.config, path, key=key)

    # ------------------------------------------------------------------------------- properties

    @property
    def fingerprint(self) -> str:
        """The LM fingerprint payloads carry and receivers check (computed when the handoff was built)."""
        return self._fingerprint

    @property
    def layers(self) -> tuple[int, ...]:
        """The hidden-state layers the sender reads, concatenated (the export's ``pooling.layers``)."""
        return self.spec.layers

    @property
    def max_length(self) -> int:
        """The context tokens the sender reads, its last ones (the export's ``pooling.max_length``)."""
        return self.spec.max_length

    @property
    def latent_dim(self) -> int:
        return self.encoder.latent_dim

    @property
    def num_memory_tokens(self) -> int:
        """K, the memory vectors the receiver prepends to its question prompt."""
        return self.encoder.num_memory_tokens

    @property
    def tensor_bytes(self) -> int:
        """Tensor bytes of one context's payload: latent_dim x element size (128 for 32 x float32),
        plus the float32 scale for int8."""
        return self._pack(torch.zeros(self.latent_dim)).byte_length()

    @property
    def wire_bytes(self) -> int:
        """Bytes on the wire of one single-context payload (header, fingerprint, latent, CRC)."""
        return len(self._pack(torch.zeros(self.latent_dim)).to_bytes())

    # ----------------------------------------------------------------------------------- sender

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
                             f"max_characters={max_characters:,} (ilcp.handoff.MAX_SEND_CHARACTERS by default): send "
                             f"them in several calls, or pass a larger max_characters")
        ids = self.lm.tokenizer(list(contexts), add_special_tokens=False)["input_ids"]
        if any(len(seq) == 0 for seq in ids):
            raise ValueError("cannot send an empty context (it has no tokens)")
        cut = [len(seq) for seq in ids if len(seq) > self.max_length]
        if cut:
            warnings.warn(f"{len(cut)} of {len(ids)} context(s) are longer than this export's max_length of "
                          f"{self.max_length} tokens (the longest {max(cut)}): the sender reads their last "
                          f"{self.max_length} tokens, as training did", UserWarning, stacklevel=3)
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
                    return slot_states(self.lm.model, self.encoder.slots, mask, self.layers, input_ids=ids[rows, :width])
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
            return self._pack(latents[0])
        if len({tuple(t.shape) for t in latents}) > 1:
            raise ValueError(f"these contexts carry different numbers of latents ({self._per_latent()}): send them "
                             "with send_each")
        return self._pack(torch.stack(latents))

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
        return [self._pack(z) for z in self.latents(contexts, batch_size=batch_size, max_characters=max_characters)]

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
            warnings.warn(f"the sender's forward covers {longest} tokens, more than this export's max_length of "
                          f"{self.max_length}: the encoder reads them all, though training read at most "
                          f"{self.max_length}", UserWarning, stacklevel=2)
        with torch.no_grad(), self.compute():
            mask = attention_mask.to(self.device)
            if self.encoder.reads_sender_lm:  # memory slots read the forward's cache: N more positions
                cache = output_cache_or_none(outputs)
                if cache is None:
                    raise ValueError("this run's memory slots read the sender's key/value cache: run the forward with "
                                     "use_cache=True")
                states, mask = slot_states(self.lm.model, self.encoder.slots, mask, self.layers, cache=cache)
            else:
                states = layer_states(outputs, self.layers).to(self.device)
            z = self.encoder.latent(states, mask).float()
            if self.encoder.chunked and not bool(self.encoder.latent_mask(mask).all()):
                raise ValueError("these contexts carry different numbers of latents: run the forward on one "
                                 "context at a time, or use send_each")
            return self._pack(z)

    def compute(self):
        """The context every forward of this handoff runs in: autocast at its precision."""
        return autocast(self.precision, self.device)

    def _pack(self, z: Tensor) -> TransportPayload:
        return pack(z, lm_fingerprint=self.fingerprint, dtype=self.payload_dtype)

    # --------------------------------------------------------------------------------- receiver

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
        check = self._shape_check(contexts)
        if isinstance(payload, TransportPayload):
            if self.auth_key is not None:
                raise PayloadError("payload is not authenticated, but this receiver requires a shared key: hand it "
                                   "the sealed bytes (sender.to_wire(payload)), not the TransportPayload object")
            if payload.lm_fingerprint != self.fingerprint:
                raise PayloadError(
                    f"payload was made by LM {payload.lm_fingerprint}, this receiver runs {self.fingerprint}"
                )
            check(tuple(payload.latent.shape))
        else:
            payload = TransportPayload.from_bytes(payload, expected_fingerprint=self.fingerprint, key=self.auth_key,
                                                  guard=self.replay_guard, max_elements=self._max_elements(contexts),
                                                  check_shape=check)
        self._check_values(payload)
        return payload

    def _check_values(self, payload: TransportPayload) -> None:
        """Refuse latent values beyond the export's ``latent_bound`` (none for an export without one)."""
        bound = self.encoder.latent_bound
        if bound is None:
            return
        peak = float(unpack(payload, payload.latent.device, dtype=torch.float32).abs().max())
        if peak > bound:
            raise PayloadError(f"payload has a latent value of magnitude {peak:.4g}, beyond this export's latent_bound "
                               f"of {bound:.4g} (recorded at export from the latents its encoder gave in training): no "
                               "sender of this export makes it")

    @property
    def max_chunks(self) -> int:
        """The most latents one context carries: per chunk ceil(max_length / chunk_tokens), per slot
        the slots of max_length tokens, else 1."""
        return self.encoder.max_latents(self.max_length)

    def _per_latent(self) -> str:
        if self.encoder.reads_sender_lm:
            return f"one per memory slot, a slot per {self.encoder.slots.tokens_per_slot} tokens"
        return f"one per chunk of {self.encoder.chunk_tokens} tokens"

    def _max_elements(self, contexts: int | None) -> int:
        if contexts is None:
            return DEFAULT_MAX_ELEMENTS
        return max(1, contexts) * self.max_chunks * self.latent_dim

    def _shape_check(self, contexts: int | None) -> Callable[[tuple[int, ...]], None]:
        """The latent shapes this receiver reads: (Z,) or (B, Z), or per chunk (N, Z) or (B, N, Z)
        with N <= `max_chunks`; B equal to ``contexts`` when given; at most ``max_payload_latents``
        latents per context given (in all without ``contexts``)."""
        per_context = 2 if self.encoder.chunked else 1  # dims of one context's latent

        def check(shape: tuple[int, ...]) -> None:
            if len(shape) not in (per_context, per_context + 1) or shape[-1] != self.latent_dim:
                expected = "(N, Z) or (B, N, Z)" if self.encoder.chunked else "(Z,) or (B, Z)"
                raise PayloadError(f"payload latent has shape {shape}; this receiver reads {expected} with "
                                   f"Z = {self.latent_dim}")
            if self.encoder.chunked and shape[-2] > self.max_chunks:
                raise PayloadError(f"payload carries {shape[-2]} latents per context; a context of at most "
                                   f"{self.max_length} tokens (this export's max_length) gives at most "
                                   f"{self.max_chunks} ({self._per_latent()})")
            held = shape[0] if len(shape) == per_context + 1 else 1
            if contexts is not None and held != contexts:
                raise PayloadError(f"payload holds {held} latent(s) but {contexts} question(s) were given")
            count = math.prod(shape[:-1])
            questions = max(1, contexts or 1)
            if count > self.max_payload_latents * questions:
                raise PayloadError(self._over_limit(count, contexts))

        return check

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

    def to_wire(self, payload: TransportPayload) -> bytes:
        """A payload's bytes for the wire: sealed with this handoff's key when it has one."""
        return payload.to_bytes(self.auth_key)

    def memory_vectors(self, payload: TransportPayload | bytes, *, contexts: int | None = None) -> Tensor:
        """Received payload -> memory vectors (B, K, H), or (B, N * K, H) with one latent per
        chunk, in the LM's dtype, on the LM's device.

        The receiver works on its own copy of z (`unpack`), so receivers never alias a payload.
        The payload's shape is checked (`parse`, with ``contexts``) before anything is projected.

        Raises:
            PayloadError: what `parse` refuses (invalid or foreign bytes, a latent whose shape this
                export does not read, more latents than ``max_payload_latents``, a value beyond
                the export's bound), or latents that project to NaN or infinite memory vectors.
        """
        z = unpack(self.parse(payload, contexts=contexts), self.device, dtype=torch.float32)
        per_context = 2 if self.encoder.chunked else 1  # dims of one context's latent
        if z.dim() == per_context:
            z = z.unsqueeze(0)
        with torch.no_grad(), self.compute():
            memory = self.encoder.memory(z, dtype=self.lm.dtype)
        if not bool(torch.isfinite(memory).all()):
            raise PayloadError(f"payload's latents project to non-finite memory vectors (NaN or infinity in "
                               f"{str(self.lm.dtype).removeprefix('torch.')}): they lie outside what this export's "
                               "projector reads")
        return memory.to(self.lm.device)

    def prefixes(self, payload: TransportPayload | bytes, questions: Sequence[str]) -> list[Tensor]:
        """The receiver's prefixes (L_i, H), one per question and context, in the layout training
        used (`ilcp.receiver.prefix.receiver_prefix`): ``[memory ; question prompt]``, or for a run trained
        with ``handoff.memory_placement=in_prompt`` the cold-read prompt with the memory where the
        context text would stand."""
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
        for i, request in enumerate(requests):
            if not isinstance(request, (tuple, list)) or len(request) != 2:
                raise ValueError(f"request {i} must be a (payload, question or questions) pair")
            single, questions = questions_of(request[1])
            prefixes.extend(self.prefixes(request[0], questions))
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
                than the LM's context could hold (refused before it is tokenised).
        """
        single = isinstance(question, str)
        if not single and (not isinstance(question, Sequence) or isinstance(question, (bytes, bytearray))):
            raise ValueError(f"question must be a string or a non-empty list of strings, got "
                             f"{type(question).__name__}")
        questions = [question] if single else list(question)
        if not questions or any(not isinstance(q, str) for q in questions):
            raise ValueError("question must be a string or a non-empty list of strings")
        if any(not q.strip() for q in questions):
            raise ValueError("a question must not be empty")
        for i, q in enumerate(questions):
            text_input("the question" if single else f"question {i}", q, self.lm.max_positions)
        positive_int("max_new_tokens", max_new_tokens)
        prefixes = self.prefixes(payload, questions)
        limit = getattr(getattr(self.lm.model, "config", None), "max_position_embeddings", None)
        longest = max(p.shape[0] for p in prefixes)
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(f"the receiver's prompt ({longest} positions) plus {max_new_tokens} new tokens exceeds "
                             f"this LM's context of {limit} positions: shorten the question")
        with self.compute():
            answers = greedy_decode(self.lm.model, self.lm.tokenizer, prefixes, max_new_tokens=max_new_tokens,
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
        positive_int("max_new_tokens", max_new_tokens)
        memory = self.memory_vectors(payload, contexts=contexts)
        tok = self.lm.tokenizer
        instruction = tok(reconstruction_prompt(tok), add_special_tokens=False)["input_ids"]
        prefixes = [receiver_prefix(tok, None, memory=memory[i], prompt_ids=instruction).embeds(self.lm.model)
                    for i in range(memory.shape[0])]
        with self.compute():
            return greedy_decode(self.lm.model, tok, prefixes, max_new_tokens=max_new_tokens, batch_size=batch_size)

    def __repr__(self) -> str:
        return (f"ILCPHandoff(lm={self.lm.spec!r}, fingerprint={self.fingerprint}, latent_dim={self.latent_dim}, "
                f"K={self.num_memory_tokens}, payload_dtype={self.payload_dtype!r}, layers={list(self.layers)}, "
                f"max_length={self.max_length}, precision={self.precision!r})")
