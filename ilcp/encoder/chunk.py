"""Chunk memory: one shared function writes one memory vector for each chunk of c tokens.

The context's tokens are cut into chunks of ``chunk_tokens`` (c) consecutive tokens; each chunk
is written into one vector of the receiver's input width by the same `ChunkWriter`, which reads
only that chunk's tokens. A vector therefore depends on its chunk alone: the same whether the
context is sent alone, after other text, or in a batch (tested), and a context of S tokens gives
S / c training examples of one function instead of one example of S / c functions. The receiver
reads the chunk vectors in the chunks' order, where it would read the text.

`ChunkWriter` reads the chunk's input embeddings (the frozen LM's own table, so the token ids are
all it needs): each token is projected to ``width`` floats and marked with its place in the chunk,
the c rows are read side by side by a two-layer MLP, and its output is added to the embedding of
the chunk's first token. The MLP's last layer starts at zero, so an untrained writer hands over
each chunk's first token, which the receiver reads as that token; training moves the vector from
there (a readable start learns faster than a random one). A last chunk shorter than c is padded
with the tokenizer's pad token and its real length is read too.

By default the written vector crosses the wire as it is (`PassThroughLatent`, read as it is by
`IdentityProjector`). With a beta-VAE per chunk (`ChunkVAE`, fitted by
`ilcp.training.chunk_latent`) the latent crosses instead and the receiver reads its decoding
(`DecodedVector`): ``latent`` floats a chunk on the wire in place of the LM's width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .compressor import BetaVAE
from .model import ILCPEncoder

__all__ = ["ChunkEncoder", "ChunkPooler", "ChunkVAE", "ChunkWriter", "DecodedVector", "IdentityProjector",
           "PassThroughLatent", "chunk_ids", "decode_vectors"]


def chunk_ids(ids: list[int], chunk_tokens: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """The token ids of one context cut into chunks of `chunk_tokens`: ``(chunks (N, c) long,
    lengths (N,) long)``; the last chunk is padded with `pad_id` to c tokens. An empty context
    gives no chunk."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    n = -(-len(ids) // chunk_tokens)
    chunks = torch.full((n, chunk_tokens), pad_id, dtype=torch.long)
    lengths = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        part = ids[i * chunk_tokens:(i + 1) * chunk_tokens]
        chunks[i, :len(part)] = torch.tensor(part, dtype=torch.long)
        lengths[i] = len(part)
    return chunks, lengths


class ChunkWriter(nn.Module):
    """Chunks of c token embeddings -> one memory vector each (the receiver's input width).

    Args:
        hidden_size: the LM's embedding width (the vector's width too).
        chunk_tokens: c, tokens per chunk.
        width: floats each token is projected to before the MLP reads the chunk.
        inner: the MLP's hidden width.
        direct: add a path linear in the token embeddings, one (H, H) matrix per place in the
            chunk, starting at zero: a map shared by the whole vocabulary, where the MLP's
            nonlinear path learns frequent tokens first.
        reading: tuned reading vectors, trained with the writer and read by the receiver before a
            text's chunk vectors (`with_reading`); 0: none.
    """

    def __init__(self, hidden_size: int, chunk_tokens: int, *, width: int = 256, inner: int = 1024,
                 direct: bool = False, reading: int = 0):
        super().__init__()
        if isinstance(reading, bool) or not isinstance(reading, int) or reading < 0:
            raise ValueError(f"ChunkWriter: reading must be an integer >= 0, got {reading!r}")
        for name, value in (("hidden_size", hidden_size), ("chunk_tokens", chunk_tokens), ("width", width),
                            ("inner", inner)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ChunkWriter: {name} must be a positive integer, got {value!r}")
        self.hidden_size, self.chunk_tokens, self.width, self.inner = hidden_size, chunk_tokens, width, inner
        self.token_in = nn.Linear(hidden_size, width)
        self.place = nn.Parameter(torch.randn(chunk_tokens + 1, width) * 0.02)  # c places, then "past the end"
        self.norm = nn.LayerNorm(chunk_tokens * width)
        self.mlp = nn.Sequential(nn.Linear(chunk_tokens * width, inner), nn.GELU(), nn.Linear(inner, inner), nn.GELU(),
                                 nn.Linear(inner, hidden_size))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)
        self.direct = nn.Parameter(torch.zeros(chunk_tokens, hidden_size, hidden_size)) if direct else None
        self.reading = nn.Parameter(torch.zeros(reading, hidden_size)) if reading else None

    def settings(self) -> dict:
        out = {"hidden_size": self.hidden_size, "chunk_tokens": self.chunk_tokens, "width": self.width,
               "inner": self.inner}
        if self.direct is not None:
            out["direct"] = True
        if self.reading is not None:
            out["reading"] = int(self.reading.shape[0])
        return out

    def with_reading(self, vectors: Tensor) -> Tensor:
        """A text's chunk vectors (B, N, H) -> (B, R + N, H): the reading vectors first (none: as given)."""
        if self.reading is None:
            return vectors
        return torch.cat([self.reading.to(vectors.dtype).expand(vectors.shape[0], -1, -1), vectors], dim=1)

    def forward(self, embeds: Tensor, lengths: Tensor | None = None) -> Tensor:
        """``embeds`` (N, c, H): the chunks' token embeddings; ``lengths`` (N,): each chunk's real
        tokens (default c; padding rows are read as "past the end") -> (N, H)."""
        if embeds.dim() != 3 or embeds.shape[1:] != (self.chunk_tokens, self.hidden_size):
            raise ValueError(f"ChunkWriter expects chunks of shape (N, {self.chunk_tokens}, {self.hidden_size}), "
                             f"got {tuple(embeds.shape)}")
        n, c, _ = embeds.shape
        dtype = self.token_in.weight.dtype
        embeds = embeds.to(dtype)
        x = self.token_in(embeds) + self.place[:c]
        if lengths is not None:  # rows past a chunk's end read as "past the end" alone
            real = torch.arange(c, device=embeds.device)[None, :] < lengths.to(embeds.device)[:, None]
            x = torch.where(real[..., None], x, self.place[c])
            embeds_in = embeds * real[..., None].to(dtype)
        else:
            embeds_in = embeds
        out = embeds[:, 0] + self.mlp(self.norm(x.reshape(n, c * self.width)))
        if self.direct is not None:
            out = out + torch.einsum("nch,chk->nk", embeds_in, self.direct)
        return out


class ChunkPooler(nn.Module):
    """The writer where an `ILCPEncoder` holds its pooler: one chunk's token states (its input
    embeddings, layer 0), (B, C', D) with mask (B, C'), C' <= C -> one vector (B, D) float32. The
    writer is a `ChunkWriter` or a `ilcp.encoder.chunk_sender.SenderChunkWriter` (same interface)."""

    kind = "chunk"

    def __init__(self, writer: nn.Module):
        super().__init__()
        self.writer = writer

    @property
    def dim(self) -> int:
        return self.writer.hidden_size

    @property
    def output_dim(self) -> int:
        return self.writer.hidden_size

    @property
    def chunk_tokens(self) -> int:
        return self.writer.chunk_tokens

    def forward(self, states: Tensor, attention_mask: Tensor) -> Tensor:
        c = self.chunk_tokens
        if states.dim() != 3 or states.shape[-1] != self.dim or states.shape[1] > c:
            raise ValueError(f"chunk states must be (batch, <= {c}, {self.dim}), got {tuple(states.shape)}")
        if states.shape[1] < c:
            states = torch.cat([states, states.new_zeros(states.shape[0], c - states.shape[1], self.dim)], dim=1)
        lengths = attention_mask.long().sum(-1)
        with torch.autocast(states.device.type, enabled=False):
            return self.writer(states.float(), lengths).float()


class PassThroughLatent(nn.Module):
    """Stands where the beta-VAE stands when the written vector itself crosses the wire (full
    width): z = the vector, no standardisation, no sampling, no KL."""

    beta = 0.0
    hidden_dim = 1  # no body; the export spec's smallest width

    def __init__(self, dim: int):
        super().__init__()
        self.input_dim = self.latent_dim = int(dim)

    def encode(self, pooled: Tensor) -> tuple[Tensor, Tensor]:
        if pooled.dim() != 2 or pooled.shape[1] != self.input_dim:
            raise ValueError(f"expected written vectors (batch, {self.input_dim}), got {tuple(pooled.shape)}")
        return pooled.float(), torch.zeros_like(pooled, dtype=torch.float32)

    @staticmethod
    def reparameterise(mu: Tensor, logvar: Tensor) -> Tensor:
        return mu

    def freeze_unreached(self, kl_in_loss: bool) -> None:
        """Nothing here trains."""

    def latent(self, pooled: Tensor) -> Tensor:
        return self.encode(pooled)[0]

    def set_standardisation(self, pooled: Tensor, eps: float = 1e-6) -> None:
        """Nothing to set: the vector crosses as it is."""


class IdentityProjector(nn.Module):
    """Stands where the projector stands when each received vector is read as it is: z (B, H) ->
    (B, 1, H)."""

    num_memory_tokens = 1
    hidden = 1

    def __init__(self, dim: int):
        super().__init__()
        self.latent_dim = self.model_hidden = int(dim)

    def forward(self, z: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        if z.dim() != 2 or z.shape[1] != self.latent_dim:
            raise ValueError(f"z must be (batch, {self.latent_dim}), got shape {tuple(z.shape)}")
        memory = z.float().unsqueeze(1)
        return memory if dtype is None else memory.to(dtype)


class ChunkVAE(BetaVAE):
    """The beta-VAE per chunk: the writer's vector (the LM's width) -> ``latent_dim`` floats on the
    wire -> the vector the receiver reads. Its decoder is on the answer's path here (the receiver
    reads the decoding), so an answer loss trains it; only the logvar head is left out.

    ``linear``: one matrix each way (mu, logvar and the decoder; no body), the vectors scaled by
    one number instead of per dimension, so its squared error is the receiver's own geometry; it
    starts from the writer's principal directions (`start_principal`), the best linear code of its
    width, and trains from there. Small (3 x H x Z weights) where the MLP's are 3 x hidden^2."""

    def __init__(self, input_dim: int, latent_dim: int = 32, hidden_dim: int = 512, beta: float = 1.0,
                 linear: bool = False):
        super().__init__(input_dim, latent_dim, 1 if linear else hidden_dim, beta)
        self.linear = bool(linear)
        if self.linear:
            self.body = nn.Identity()
            self.mu_head = nn.Linear(input_dim, latent_dim)
            self.logvar_head = nn.Linear(input_dim, latent_dim)
            self.decoder = nn.Linear(latent_dim, input_dim)

    def freeze_unreached(self, kl_in_loss: bool) -> None:
        self.logvar_head.requires_grad_(kl_in_loss)

    @torch.no_grad()
    def set_standardisation(self, pooled: Tensor, eps: float = 1e-6) -> None:
        super().set_standardisation(pooled, eps)
        if self.linear:  # one scale for every dimension: the raw geometry the receiver reads
            self.input_std.fill_(float(self.input_std.pow(2).mean().sqrt()))

    @torch.no_grad()
    def start_principal(self, vectors: Tensor, logvar: float = -8.0) -> Tensor:
        """A linear VAE's start: mu = the standardised vector's coordinates on the top ``latent_dim``
        principal directions of ``vectors`` (N, H), the decoder their sum back, logvar a constant.
        Returns each direction's share of the variance (H,)."""
        if not self.linear:
            raise ValueError("start_principal is the linear chunk VAE's start")
        if vectors.shape[0] < 2:
            raise ValueError("need at least 2 vectors for principal directions")
        x = self.standardise(vectors)
        _, s, vh = torch.linalg.svd(x - x.mean(0), full_matrices=False)
        top = vh[:self.latent_dim]
        if top.shape[0] < self.latent_dim:
            raise ValueError(f"{vectors.shape[0]} vectors give {top.shape[0]} principal directions, fewer than "
                             f"the latent's {self.latent_dim}")
        self.mu_head.weight.copy_(top)
        self.mu_head.bias.zero_()
        self.decoder.weight.copy_(top.T)
        self.decoder.bias.zero_()
        self.logvar_head.weight.zero_()
        self.logvar_head.bias.fill_(logvar)
        var = s.pow(2)
        return var / var.sum()


def decode_vectors(vae: BetaVAE, z: Tensor) -> Tensor:
    """Latents (N, Z) -> vectors in the writer's space (N, H): the decoding, standardisation undone."""
    return vae.decode(z.float()) * vae.input_std + vae.input_mean


class DecodedVector(nn.Module):
    """Stands where the projector stands when a chunk's latent crosses the wire: z (B, Z) -> the
    VAE's decoding (B, 1, H). The VAE is the encoder's own (its weights are the compressor's, so
    they are held here without being registered twice)."""

    num_memory_tokens = 1
    hidden = 1

    def __init__(self, vae: BetaVAE):
        super().__init__()
        self._vae = (vae,)
        self.latent_dim, self.model_hidden = vae.latent_dim, vae.input_dim

    def forward(self, z: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        if z.dim() != 2 or z.shape[1] != self.latent_dim:
            raise ValueError(f"z must be (batch, {self.latent_dim}), got shape {tuple(z.shape)}")
        memory = decode_vectors(self._vae[0], z).unsqueeze(1)
        return memory if dtype is None else memory.to(dtype)


class ChunkEncoder(ILCPEncoder):
    """The encoder of a chunk memory: one latent per chunk of c tokens, read by the receiver as one
    memory vector (K = 1): the writer's vector (the LM's width) as it is, or with `vae` its latent
    on the wire and its decoding read. It reads layer 0, the context's input embeddings: no sender
    forward."""

    def __init__(self, writer: nn.Module, vae: ChunkVAE | None = None, **receiver):
        h = writer.hidden_size
        if vae is not None and vae.input_dim != h:
            raise ValueError(f"the chunk VAE reads vectors of {vae.input_dim} floats, the writer writes {h}")
        latent, projector = (PassThroughLatent(h), IdentityProjector(h)) if vae is None else (vae, DecodedVector(vae))
        super().__init__(latent, projector, ChunkPooler(writer), chunk_tokens=writer.chunk_tokens, **receiver)

    @property
    def writer(self) -> nn.Module:
        return self.pooler.writer

    def bind_lm(self, model: nn.Module) -> None:
        """A writer that is the LM itself (`ilcp.encoder.chunk_sender.SenderChunkWriter`) writes
        with `model` from now on; the embedding MLP needs no LM."""
        bind = getattr(self.writer, "bind", None)
        if bind is not None:
            bind(model)

    def memory_for_batch(self, batch: dict, dtype: torch.dtype, sample: bool = False):
        """As `ILCPEncoder.memory_for_batch`, with no sampling and no KL (nothing is sampled)."""
        memory, _ = super().memory_for_batch(batch, dtype, sample=False)
        return memory, torch.zeros((), device=next(self.writer.parameters()).device)
