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

    memory = receiver.open(wire)            # opened once (a sealed wire's nonce spent once) ...
    memory.ask("Where is John?"); memory.ask(["Where is Mary?", "Who went first?"])  # ... asked many times

A facade over the protocol's parts: it loads an export (`ilcp.export`), checks that the encoder
fits the LM, and composes the sending side (`ilcp.encoder.send.Sender`: text -> LM states ->
latents -> payload) and the receiving side (`ilcp.receiver.receive.Receiver`: bytes -> one checked
latent -> memory vectors -> prefix -> answer), whose methods it exposes under their own names;
`open` is the receiver's `open_memory`, which returns a `ilcp.receiver.memory.ReceivedMemory`.

`save_pretrained` writes the ILCP modules in the export format of `ilcp.export` (config.json +
model.safetensors, never the frozen LM); `from_pretrained` reads any run directory and refuses an
LM whose fingerprint differs from the one the run was trained on (`ExportError`).
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import torch
from torch import nn

from .checks import check_key, positive_int
from .encoder.kinds import memory_kind_of
from .encoder.model import ILCPEncoder
from .encoder.send import MAX_BATCH_TOKENS, MAX_SEND_CHARACTERS, Sender
from .encoder.spec import EncoderSpec
from .export import (CONFIG_FILE, ExportError, ExportedRun, check_fingerprint, load_export_lm, read_config,
                     read_export)
from .export_writing import save_encoder
from .lm import LM
from .precision import hold, resolve
from .receiver.receive import Receiver, answers_by_request
from .wire.dtypes import dtype_name
from .wire.payload import TransportPayload

__all__ = ["MAX_BATCH_TOKENS", "MAX_SEND_CHARACTERS", "ILCPHandoff", "answers_by_request"]


def _on(part: str, method):
    """`method` of the handoff's ``part`` ("sender" or "receiver"), as a method of the handoff."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return method(getattr(self, part), *args, **kwargs)
    return call


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
        auth_key, max_age, replay_window, max_payload_latents: the receiver's (`Receiver`): a shared
            key seals and verifies payloads; the most latents a payload may carry per question.
        precision: compute precision (`ilcp.precision`); default the config's ``lm.precision``.

    Raises:
        ExportError: the config was made for another LM, its encoder settings do not read, or the
            encoder does not fit them.
        ValueError: an unknown payload dtype; a max_payload_latents that is not a positive int.

    Prefer `from_pretrained`; the constructor is for modules already in memory.
    """

    def __init__(self, lm: LM, encoder: ILCPEncoder, config: dict, *, device: str | torch.device | None = None,
                 payload_dtype: str | torch.dtype = "float32", auth_key: bytes | None = None,
                 precision: str | None = None, max_age: float | None = 300.0, replay_window: float | None = None,
                 max_payload_latents: int | None = None):
        if not isinstance(lm, LM):
            raise ValueError(f"lm must be an ilcp.lm.LM bundle, got {type(lm).__name__}")
        if not isinstance(encoder, ILCPEncoder) or encoder.projector is None:
            raise ValueError("encoder must be a trained ilcp.encoder.model.ILCPEncoder with its projector")
        # Computed once: the LM bundle hashes its vocabulary again on every access.
        fingerprint = lm.fingerprint
        check_fingerprint(config, fingerprint)
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
        payload_dtype = dtype_name(payload_dtype)  # a ValueError for an unknown payload dtype
        auth_key = None if auth_key is None else check_key(auth_key)
        self.lm = lm
        self.config = copy.deepcopy(config)
        device = torch.device(device) if device is not None else lm.device
        encoder = encoder.to(device).float().eval()
        max_payload_latents = (encoder.max_latents(self.spec.max_length) if max_payload_latents is None
                               else positive_int("max_payload_latents", max_payload_latents))
        encoder.bind_vocabulary(lm.model.get_input_embeddings().weight)  # used when the encoder snaps
        encoder.bind_lm(lm.model)  # an encoder whose writer is the LM itself
        recorded = str(config.get("lm", {}).get("precision", "32-true"))
        precision = resolve(recorded if precision is None else precision, device)
        self.sender = Sender(lm, encoder, self.spec, fingerprint, device=device, precision=precision,
                             payload_dtype=payload_dtype)
        self.receiver = Receiver(lm, encoder, self.spec, fingerprint, device=device, precision=precision,
                                 auth_key=auth_key, max_age=max_age, replay_window=replay_window,
                                 max_payload_latents=max_payload_latents)
        self.source: Path | None = None

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
        With ``key``, config.json is signed (`ilcp.export_integrity.sign_config`; load it with
        ``from_pretrained(path, export_key=key)``). Returns the directory.
        """
        return save_encoder(self.encoder, self.config, path, key=key)

    # ------------------------------------------------------------------------------- the parts

    @property
    def encoder(self) -> ILCPEncoder:
        """The export's encoder, which both sides share."""
        return self.sender.encoder

    @encoder.setter
    def encoder(self, encoder: ILCPEncoder) -> None:
        self.sender.encoder = self.receiver.encoder = encoder

    fingerprint = property(lambda self: self.sender.fingerprint, doc="The LM fingerprint payloads carry.")
    device = property(lambda self: self.sender.device, doc="Where the encoder runs.")
    precision = property(lambda self: self.sender.precision, doc="The compute precision of every forward.")
    payload_dtype = property(lambda self: self.sender.payload_dtype, doc="The dtype of z on the wire.")
    layers = property(lambda self: self.spec.layers, doc="The hidden-state layers the sender reads, concatenated.")
    max_length = property(lambda self: self.spec.max_length, doc="The context tokens the sender reads, its last ones.")
    latent_dim = property(lambda self: self.encoder.latent_dim, doc="Z, the floats of one latent.")
    num_memory_tokens = property(lambda self: self.encoder.num_memory_tokens,
                                 doc="K, the memory vectors the receiver prepends to its question prompt.")
    auth_key = property(lambda self: self.receiver.auth_key, doc="The shared key of sealed payloads, or None.")
    replay_guard = property(lambda self: self.receiver.replay_guard, doc="The receiver's replay guard, with a key.")
    max_payload_latents = property(lambda self: self.receiver.max_payload_latents,
                                   doc="The most latents a payload may carry per question.")
    max_chunks = property(lambda self: self.receiver.max_chunks, doc="The most latents one context carries.")

    @property
    def tensor_bytes(self) -> int:
        """Tensor bytes of one context's payload: latent_dim x element size (128 for 32 x float32),
        plus the float32 scale for int8."""
        return self.sender.pack(torch.zeros(self.latent_dim)).byte_length()

    @property
    def wire_bytes(self) -> int:
        """Bytes on the wire of one single-context payload (header, fingerprint, latent, CRC)."""
        return len(self.sender.pack(torch.zeros(self.latent_dim)).to_bytes())

    def to_wire(self, payload: TransportPayload) -> bytes:
        """A payload's bytes for the wire: sealed with this handoff's key when it has one."""
        return payload.to_bytes(self.auth_key)

    compute = _on("sender", Sender.compute)
    sender_inputs = _on("sender", Sender.sender_inputs)
    latents = _on("sender", Sender.latents)
    encode_in_batches = _on("sender", Sender.encode_in_batches)
    encode_states = _on("sender", Sender.encode_states)
    pack_latents = _on("sender", Sender.pack_latents)
    send = _on("sender", Sender.send)
    send_each = _on("sender", Sender.send_each)
    send_from_hidden_states = _on("sender", Sender.send_from_hidden_states)

    parse = _on("receiver", Receiver.parse)
    memory_vectors = _on("receiver", Receiver.memory_vectors)
    prefixes = _on("receiver", Receiver.prefixes)
    request_prefixes = _on("receiver", Receiver.request_prefixes)
    receive = _on("receiver", Receiver.receive)
    reconstruct = _on("receiver", Receiver.reconstruct)
    open = _on("receiver", Receiver.open_memory)

    def __repr__(self) -> str:
        return (f"ILCPHandoff(lm={self.lm.spec!r}, fingerprint={self.fingerprint}, latent_dim={self.latent_dim}, "
                f"K={self.num_memory_tokens}, payload_dtype={self.payload_dtype!r}, layers={list(self.layers)}, "
                f"max_length={self.max_length}, precision={self.precision!r})")
