"""The chunk memory kind's settings (``compressor.memory.kind=chunk``, config.json's
``pooling.kind`` "chunk"): one memory vector per chunk of ``chunk_tokens`` context tokens, written
by one shared writer from the chunk's input embeddings (layer 0, so ``data.pool_layers=[0]``) and
read by the receiver as it is, in the chunks' order. The writer is an MLP over the embeddings
(``writer: mlp``, `ilcp.encoder.chunk.ChunkWriter`: no LM forward) or the LM itself with
low-rank adapters on its top ``sender_layers`` layers (``writer: sender``,
`ilcp.encoder.chunk_sender.SenderChunkWriter`: one short LM forward per chunk); the adapted LM
modules are recorded in config.json (``adapters``, filled in from the LM when training starts) and
the writer is bound to the LM where the handoff is built.

The writer is pretrained on text alone by `ilcp.training.chunk_pretrain`; a run starts from such a
pretraining with ``compressor.memory.writer_from=FOLDER`` and trains tuned vectors before the
prompt (``handoff.format_vectors``) and, with ``handoff.finetune_encoder``, the writer itself.
With ``latent`` > 0 a beta-VAE per chunk (fitted over that writer by `ilcp.training.chunk_latent`,
``latent_from``) narrows each vector to ``latent`` floats on the wire; the receiver reads its
decoding.

Standard library only at import time (a config naming the kind is checked before torch loads).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ..settings import setting
from .kinds import MAX_COUNT, MemoryKind

if TYPE_CHECKING:
    from .chunk import ChunkEncoder, ChunkPooler, ChunkVAE

__all__ = ["ChunkMemory"]


@dataclass(frozen=True)
class ChunkMemory(MemoryKind):
    """One vector per chunk of ``chunk_tokens`` tokens, the LM's width, written by one shared MLP
    (``width`` floats per token, ``inner`` hidden) or by the LM with adapters (``writer: sender``,
    ``sender_layers``, ``sender_rank``), and sent as it is."""

    kind: ClassVar[str] = "chunk"
    exports_as_started: ClassVar[bool] = True  # a pretrained writer (writer_from), or the untrained one's first tokens

    chunk_tokens: int = setting(8, "context tokens per chunk: one memory vector each", minimum=1, maximum=MAX_COUNT)
    width: int = setting(256, "floats each token is projected to before the writer's MLP reads the chunk", minimum=1,
                         maximum=MAX_COUNT)
    inner: int = setting(1024, "the writer MLP's hidden width", minimum=1, maximum=MAX_COUNT)
    direct: bool = setting(False, "add to the writer a path linear in the token embeddings (one matrix per place in "
                                  "the chunk, shared by the whole vocabulary)", omit_default=True)
    writer: str = setting("mlp", "what writes a chunk's vector: mlp (an MLP over its token embeddings) or sender "
                                 "(the LM itself reads the chunk, then a memory token; adapters on its top layers)",
                          choices=("mlp", "sender"), omit_default=True)
    sender_layers: int = setting(8, "writer sender: the top decoder layers whose linear maps get adapters", minimum=1,
                                 maximum=MAX_COUNT, written_with="writer")
    sender_rank: int = setting(16, "writer sender: the adapters' rank", minimum=1, maximum=MAX_COUNT,
                               written_with="writer")
    # ((LM module name, in, out), ...) the sender writer adapts: config.json's ``adapters``, filled in from the LM
    adapters: tuple = setting((), "the LM modules the sender writer adapts and their sizes", written_with="writer",
                              configurable=False, compare=False)
    latent: int = setting(0, "floats a chunk crosses the wire as, through a beta-VAE per chunk (0 = the writer's "
                             "vector, the LM's width)", minimum=0, maximum=MAX_COUNT, omit_default=True)
    # the VAE's form, recorded from latent_from's run: linear (one matrix each way) or the MLP
    latent_linear: bool = setting(False, "with latent > 0: the beta-VAE is linear (one matrix each way), as "
                                         "latent_from's run fitted it", configurable=False, omit_default=True)
    latent_from: str = setting("", "with latent > 0: the --out folder of python -m ilcp.training.chunk_latent, a "
                                   "beta-VAE fitted over the vectors of writer_from's writer",
                               exported=False, compare=False)
    writer_from: str = setting("", "a shipped chunk writer (pretrained/smollm2-chunk8) or a chunk pretraining folder "
                                   "(python -m ilcp.training.chunk_pretrain --out DIR) whose writer the run starts "
                                   "from ('' = an untrained writer)",
                               exported=False, compare=False)

    def check(self) -> None:
        modules = tuple(tuple(m) for m in self.adapters)
        if not all(len(m) == 3 and isinstance(m[0], str) and all(isinstance(v, int) and not isinstance(v, bool)
                                                                  and v >= 1 for v in m[1:]) for m in modules):
            raise ValueError(f"{self.name_of('adapters')} must list [LM module name, in, out] triples")
        object.__setattr__(self, "adapters", modules)
        if modules and self.writer != "sender":
            raise ValueError(f"{self.name_of('adapters')} belong to {self.name_of('writer')} sender")

    @property
    def lm_writes(self) -> bool:
        """Whether the LM itself writes the vectors (``writer: sender``)."""
        return self.writer == "sender"

    # ------------------------------------------------------------------ what training asks

    def check_run(self, cfg) -> None:
        if bool(self.latent) != bool(self.latent_from):
            raise ValueError("compressor.memory.latent > 0 starts from a fitted beta-VAE: set both "
                             "compressor.memory.latent and compressor.memory.latent_from (the --out folder of "
                             "python -m ilcp.training.chunk_latent over writer_from's writer), or neither")
        if list(cfg.data.pool_layers) != [0]:
            raise ValueError("compressor.memory.kind=chunk writes from the context's input embeddings: set "
                             f"data.pool_layers=[0] (got {list(cfg.data.pool_layers)})")
        h = cfg.handoff
        if "ilcp" in h.variants and not (h.finetune_encoder or h.format_vectors or h.max_steps == 0):
            raise ValueError("compressor.memory.kind=chunk reads its vectors as they are (no projector): train the "
                             "writer (handoff.finetune_encoder=true) or tuned vectors before the prompt "
                             "(handoff.format_vectors > 0)"
                             + ("; handoff.format_from's vectors are kept frozen" if h.format_from else ""))

    def start(self, cfg, lm, train) -> ChunkEncoder:
        """The writer, untrained (it hands over each chunk's first token) or from ``writer_from``;
        there is no stage 1: nothing is fitted on cached states."""
        import dataclasses

        from ..training.log import say

        vae = self.load_latent(Path(self.latent_from), lm.hidden_size) if self.latent else None
        if self.lm_writes:  # a writer bound to this LM; the modules it adapts are recorded in config.json
            from .chunk import ChunkPooler
            from .chunk_sender import SenderChunkWriter, memory_token_id

            table = lm.model.get_input_embeddings().weight
            try:  # the memory token: the end-of-text token's embedding (writer_from's replaces it)
                writer = SenderChunkWriter.for_model(lm.model, self.chunk_tokens, table[memory_token_id(lm.tokenizer)],
                                                     layers=self.sender_layers, rank=self.sender_rank)
            except ValueError as e:
                raise ValueError(f"compressor.memory.sender_layers={self.sender_layers}: {e}") from None
            kind, pooler = dataclasses.replace(self, adapters=writer.adapted_modules), ChunkPooler(writer)
        else:
            kind, pooler = self, self.pooler(lm.hidden_size, hidden_size=lm.hidden_size)
        if vae is not None:
            kind = dataclasses.replace(kind, latent_linear=vae.linear)
        encoder = kind.encoder(vae, None, pooler)
        if self.writer_from:
            self.load_writer(encoder, Path(self.writer_from), lm.fingerprint)
            say(f"stage 1 (compressor): chunk memory, the writer from {self.writer_from}"
                + (f", a {self.latent}-float latent a chunk from {self.latent_from}" if self.latent else ""))
        else:
            say(f"stage 1 (compressor): chunk memory, an untrained {self.describe_writer()} (one vector per "
                f"{self.chunk_tokens} tokens)")
        return encoder

    def load_latent(self, folder: Path, hidden_size: int) -> ChunkVAE:
        """The beta-VAE of a chunk latent run (`ilcp.training.chunk_latent`'s ``state/``), which must
        narrow to ``latent`` floats the vectors of this run's writer (``writer_from``)."""
        import json

        from safetensors.torch import load_file

        from .chunk import ChunkVAE

        state = folder / "state" / "state.json"
        where = "compressor.memory.latent_from"
        try:
            meta = json.loads(state.read_text())
            vae, fitted_on = meta["vae"], meta["writer_from"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ValueError(f"{where}: {folder} holds no chunk latent run (no readable state/state.json); give the "
                             "--out folder of python -m ilcp.training.chunk_latent") from None
        if vae.get("latent_dim") != self.latent or vae.get("input_dim") != hidden_size:
            raise ValueError(f"{where}: {folder} narrows vectors of {vae.get('input_dim')} floats to "
                             f"{vae.get('latent_dim')}; this run sets compressor.memory.latent={self.latent} for an LM "
                             f"of width {hidden_size}")
        if not self.writer_from or Path(fitted_on).resolve() != Path(self.writer_from).resolve():
            raise ValueError(f"{where}: {folder} was fitted over the writer of {fitted_on}; this run's writer is "
                             f"{self.writer_from or 'untrained'} (compressor.memory.writer_from): fit the VAE over "
                             "that writer")
        module = ChunkVAE(hidden_size, self.latent, int(vae["hidden_dim"]), float(vae["beta"]),
                          linear=bool(vae.get("linear", False)))
        module.load_state_dict(load_file(str(folder / "state" / "vae.safetensors")))
        return module

    def load_writer(self, encoder: ChunkEncoder, folder: Path, fingerprint: str | None = None) -> None:
        """The writer weights of a shipped writer or a chunk pretraining folder, whose settings must
        be these (`ilcp.encoder.chunk_files`)."""
        from .chunk_files import read_writer_state

        encoder.writer.load_state_dict(read_writer_state(folder, encoder.writer.settings(), fingerprint))

    def describe(self) -> str:
        return "chunk memory"

    def describe_writer(self) -> str:
        if self.lm_writes:
            return f"writer (the LM, rank-{self.sender_rank} adapters on its top {self.sender_layers} layers)"
        return "writer (an MLP over the token embeddings)"

    def card_unit(self) -> str:
        if self.latent:
            return (f"one latent per {self.chunk_tokens} context tokens: one shared {self._writer_words()} writes a "
                    "vector of the LM's "
                    f"width, a beta-VAE per chunk narrows it to {self.latent} floats on the wire, the receiver reads "
                    "its decoding")
        return (f"one vector of the LM's width per {self.chunk_tokens} context tokens, written by one shared "
                f"{self._writer_words()}")

    def _writer_words(self) -> str:
        if self.lm_writes:
            return f"function (the LM with rank-{self.sender_rank} adapters on its top {self.sender_layers} layers)"
        return "MLP"

    # ------------------------------------------------------------------ the modules

    @classmethod
    def from_encoder(cls, encoder) -> ChunkMemory | None:
        from .chunk import ChunkEncoder, ChunkVAE

        if not isinstance(encoder, ChunkEncoder):
            return None
        from .chunk_sender import SenderChunkWriter

        w = encoder.writer
        latent = encoder.vae.latent_dim if isinstance(encoder.vae, ChunkVAE) else 0
        if isinstance(w, SenderChunkWriter):
            return cls(chunk_tokens=w.chunk_tokens, writer="sender", sender_layers=w.layers, sender_rank=w.rank,
                       adapters=w.adapted_modules, latent=latent)
        return cls(chunk_tokens=w.chunk_tokens, width=w.width, inner=w.inner, direct=w.direct is not None,
                   latent=latent)

    def pooler(self, state_dim: int, hidden_size: int | None = None) -> ChunkPooler:
        from .chunk import ChunkPooler, ChunkWriter

        if self.lm_writes:
            from .chunk_sender import SenderChunkWriter

            if not self.adapters:
                raise ValueError(f"{self.name_of('writer')} sender: the adapted LM modules are filled in from the LM "
                                 f"({self.name_of('adapters')}); none are recorded")
            return ChunkPooler(SenderChunkWriter(hidden_size or state_dim, self.chunk_tokens, self.adapters,
                                                 layers=self.sender_layers, rank=self.sender_rank))
        return ChunkPooler(ChunkWriter(hidden_size or state_dim, self.chunk_tokens, width=self.width, inner=self.inner,
                                       direct=self.direct))

    def encoder(self, vae, projector, pooler, **receiver) -> ChunkEncoder:
        """The chunk encoder around the pooler's writer. The projector an export's spec builds is not
        used (each latent is read as one memory vector); nor is its VAE without ``latent`` (the vector
        crosses as it is). With ``latent`` the VAE of the spec's sizes is the chunk VAE."""
        from .chunk import ChunkEncoder, ChunkVAE

        if self.latent and not isinstance(vae, ChunkVAE):
            if vae is None or vae.latent_dim != self.latent:
                raise ValueError(f"chunk memory with latent={self.latent}: needs a VAE of that latent width")
            vae = ChunkVAE(vae.input_dim, vae.latent_dim, vae.hidden_dim, vae.beta, linear=self.latent_linear)
        encoder = ChunkEncoder(pooler.writer, vae if self.latent else None, **receiver)
        encoder.memory_kind = self
        return encoder
