"""The chunk memory kind's settings (``compressor.memory.kind=chunk``, config.json's
``pooling.kind`` "chunk"): one memory vector per chunk of ``chunk_tokens`` context tokens, written
by one shared `ilcp.encoder.chunk.ChunkWriter` from the chunk's input embeddings (layer 0, so
``data.pool_layers=[0]``: no sender forward) and read by the receiver as it is, in the chunks' order.

The writer is pretrained on text alone by `ilcp.training.chunk_pretrain`; a run starts from such a
pretraining with ``compressor.memory.writer_from=FOLDER`` and trains tuned vectors before the
prompt (``handoff.format_vectors``) and, with ``handoff.finetune_encoder``, the writer itself.

Standard library only at import time (a config naming the kind is checked before torch loads).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ..settings import setting
from .kinds import MAX_COUNT, MemoryKind

if TYPE_CHECKING:
    from .chunk import ChunkEncoder, ChunkPooler

__all__ = ["ChunkMemory"]


@dataclass(frozen=True)
class ChunkMemory(MemoryKind):
    """One vector per chunk of ``chunk_tokens`` tokens, the LM's width, written by one shared MLP
    (``width`` floats per token, ``inner`` hidden) and sent as it is."""

    kind: ClassVar[str] = "chunk"
    exports_as_started: ClassVar[bool] = True  # a pretrained writer (writer_from), or the untrained one's first tokens

    chunk_tokens: int = setting(8, "context tokens per chunk: one memory vector each", minimum=1, maximum=MAX_COUNT)
    width: int = setting(256, "floats each token is projected to before the writer's MLP reads the chunk", minimum=1,
                         maximum=MAX_COUNT)
    inner: int = setting(1024, "the writer MLP's hidden width", minimum=1, maximum=MAX_COUNT)
    direct: bool = setting(False, "add to the writer a path linear in the token embeddings (one matrix per place in "
                                  "the chunk, shared by the whole vocabulary)", omit_default=True)
    writer_from: str = setting("", "a shipped chunk writer (pretrained/smollm2-chunk8) or a chunk pretraining folder "
                                   "(python -m ilcp.training.chunk_pretrain --out DIR) whose writer the run starts "
                                   "from ('' = an untrained writer)",
                               exported=False, compare=False)

    # ------------------------------------------------------------------ what training asks

    def check_run(self, cfg) -> None:
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
        from ..training.log import say

        encoder = self.encoder(None, None, self.pooler(lm.hidden_size, hidden_size=lm.hidden_size))
        if self.writer_from:
            self.load_writer(encoder, Path(self.writer_from), lm.fingerprint)
            say(f"stage 1 (compressor): chunk memory, the writer from {self.writer_from}")
        else:
            say(f"stage 1 (compressor): chunk memory, an untrained writer (one vector per {self.chunk_tokens} tokens)")
        return encoder

    def load_writer(self, encoder: ChunkEncoder, folder: Path, fingerprint: str | None = None) -> None:
        """The writer weights of a shipped writer or a chunk pretraining folder, whose settings must
        be these (`ilcp.encoder.chunk_files`)."""
        from .chunk_files import read_writer_state

        encoder.writer.load_state_dict(read_writer_state(folder, encoder.writer.settings(), fingerprint))

    def describe(self) -> str:
        return "chunk memory"

    def card_unit(self) -> str:
        return f"one vector of the LM's width per {self.chunk_tokens} context tokens, written by one shared MLP"

    # ------------------------------------------------------------------ the modules

    @classmethod
    def from_encoder(cls, encoder) -> ChunkMemory | None:
        from .chunk import ChunkEncoder

        if not isinstance(encoder, ChunkEncoder):
            return None
        w = encoder.writer
        return cls(chunk_tokens=w.chunk_tokens, width=w.width, inner=w.inner, direct=w.direct is not None)

    def pooler(self, state_dim: int, hidden_size: int | None = None) -> ChunkPooler:
        from .chunk import ChunkPooler, ChunkWriter

        return ChunkPooler(ChunkWriter(hidden_size or state_dim, self.chunk_tokens, width=self.width, inner=self.inner,
                                       direct=self.direct))

    def encoder(self, vae, projector, pooler, **receiver) -> ChunkEncoder:
        """The chunk encoder around the pooler's writer; the VAE and projector an export's spec
        builds are not used (the vector crosses as it is, read as one memory vector)."""
        from .chunk import ChunkEncoder

        encoder = ChunkEncoder(pooler.writer, **receiver)
        encoder.memory_kind = self
        return encoder
