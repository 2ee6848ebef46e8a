"""Memory sources: what the receiver's frozen LM reads in front of its prompt.

Every trained variant is a memory source with one interface, so training, export and serving
handle them alike:

- `ILCPEncoder` (the ILCP path): the sender's token states -> pooled state (masked mean, or a
  learned `AttentionPooler`) -> beta-VAE latent z = mu -> gated projector -> K memory vectors.
  The latent is what crosses the handoff: ``encoder.latent(states, mask)`` on the sender,
  ``encoder.memory(z)`` on the receiver. With ``chunk_tokens = C > 0`` the context is cut into
  consecutive chunks of C tokens and each chunk is pooled and encoded through the same VAE, so a
  context of S tokens sends ceil(S / C) latents (B, N, Z) and the receiver reads N * K vectors:
  the payload grows with the context. ``chunk_tokens = 0`` is the specification's single latent.
- `ConstantMemory` (the tuned baselines): K learned vectors, the same for every context;
  ``reads_context_text`` says whether the receiver also reads the context (cold_read_tuned) or
  not (prompt_tuned).

    encoder = ILCPEncoder(BetaVAE(576, 32), GatedLatentToMemoryProjector(32, 8, 576))
    z = encoder.latent(states, mask)          # (B, S, 576), (B, S) -> (B, 32)
    memory = encoder.memory(z, torch.float32)  # (B, 8, 576)

Training batches are dicts with either ``"tokens"`` (B, S, D) and ``"token_mask"`` (B, S), or
``"pooled"`` (B, D) (mean pooling computed ahead of time); `memory_for_batch` reads either. The
state-dict key names of the exported files belong to `ilcp.export` alone.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import torch.nn.functional as F

from .compressor import BetaVAE, kl_divergence
from ..names import MEMORY_PLACEMENTS, SNAP_METRICS, VOCABULARY_SNAPS
from .pooling import ConcatPooler, Pooler, pool_states, pool_units, split_chunks
from .projector import GatedLatentToMemoryProjector


class ILCPEncoder(nn.Module):
    """Optional attention pooler, beta-VAE and projector: the ILCP modules as one object.

    Args:
        vae: the beta-VAE (its input width is the pooled state's width).
        projector: z (B, Z) -> memory (B, K, H); None while only stage 1 has run.
        pooler: learned attention pooling over token states, a `ConcatPooler` (chunks only:
            the chunk's token states side by side), or None for the masked mean.
        chunk_tokens: C > 0: one latent per chunk of C tokens; 0: one latent per context.
        placement, vocabulary_snap, snap_temperature, snap_metric: how the receiver reads the
            memory (see `configure_receiver`).
        format_prompt: learned vectors the receiver reads before its whole prompt, or None.

    Raises:
        ValueError: the parts do not fit together (widths).
    """

    reads_context_text = False
    reads_sender_lm = False  # its summary needs an LM forward of its own (memory slots), not given states
    memory_kind = None  # the settings (`ilcp.encoder.kinds.MemoryKind`) that built it, when a kind did

    def __init__(self, vae: BetaVAE, projector: GatedLatentToMemoryProjector | None = None,
                 pooler: Pooler | None = None, chunk_tokens: int = 0, *, placement: str = "prefix",
                 format_prompt: FormatPrompt | None = None, vocabulary_snap: str = "none",
                 snap_temperature: float = 0.02, snap_metric: str = "cosine"):
        super().__init__()
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be an int >= 0, got {chunk_tokens!r}")
        self.chunk_tokens = chunk_tokens
        if isinstance(pooler, ConcatPooler) and pooler.chunk_tokens != chunk_tokens:
            raise ValueError(f"concat pooling reads chunks of {pooler.chunk_tokens} tokens, the encoder cuts "
                             f"{chunk_tokens} (0 = no chunks)")
        if pooler is not None and pooler.output_dim != vae.input_dim:
            raise ValueError(f"the pooler gives {pooler.output_dim} floats, the VAE reads {vae.input_dim}")
        if projector is not None and projector.latent_dim != vae.latent_dim:
            raise ValueError(f"the projector reads {projector.latent_dim} floats, the VAE gives {vae.latent_dim}")
        self.vae, self.projector, self.pooler = vae, projector, pooler
        self.encoder_frozen = False
        self.format_prompt: FormatPrompt | None = format_prompt  # learned vectors before the whole prompt
        self.configure_receiver(placement, vocabulary_snap, snap_temperature, snap_metric)
        self._vocabulary: tuple[Tensor, Tensor] | None = None  # (the LM's embedding rows, 1 / their norms)
        # the largest |z| a receiver accepts, set at export from the latents training saw
        # (`ilcp.training.data.latent_bound`); None: no bound (exports written before it)
        self.latent_bound: float | None = None

    # -------------------------------------------------------------------------- description

    @property
    def pooling(self) -> str:
        """"mean", "attention" or "concat"."""
        return "mean" if self.pooler is None else self.pooler.kind

    @property
    def state_dim(self) -> int:
        """D, the width of one token state the encoder reads (hidden x pooled layers)."""
        return self.pooler.dim if self.pooler is not None else self.vae.input_dim

    @property
    def latent_dim(self) -> int:
        return self.vae.latent_dim

    @property
    def num_memory_tokens(self) -> int:
        return self._projector().num_memory_tokens

    def _projector(self) -> GatedLatentToMemoryProjector:
        if self.projector is None:
            raise ValueError("this encoder has no projector yet (only stage 1 has run)")
        return self.projector

    # ------------------------------------------------------------------------------ sender

    @property
    def chunked(self) -> bool:
        """Whether a context sends one latent per chunk of tokens."""
        return self.chunk_tokens > 0

    def max_latents(self, max_length: int) -> int:
        """The most latents a context of `max_length` tokens sends: ceil(max_length / C), or 1."""
        return -(-max_length // self.chunk_tokens) if self.chunked else 1

    def latent_unit(self) -> str:
        """What one latent of a context stands for, in words (for refusals)."""
        return f"one per chunk of {self.chunk_tokens} tokens" if self.chunked else "one per context"

    def pool(self, states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Sender states -> pooled (B, D') float32, one per context (see `pool_states`)."""
        return pool_states(self.pooler, states, attention_mask)

    def pooled_units(self, states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The pooled state of every latent the states give: (B, D') per context, or with chunks
        (U, D') for the U chunks that hold a token, in row-major order."""
        return pool_units(self.pooler, self.chunk_tokens, states, attention_mask)

    def encode(self, states: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(mu, logvar) of the sender states, float32: each (B, Z), or with chunks (B, N, Z), N the
        most chunks of any row (see `latent_mask` for which are real)."""
        if not self.chunked:
            return self.vae.encode(self.pool(states, attention_mask))
        chunk_states, chunk_mask, real = split_chunks(states, attention_mask, self.chunk_tokens)
        mu, logvar = self.vae.encode(pool_states(self.pooler, chunk_states, chunk_mask))
        b, n = real.shape
        return mu.view(b, n, -1), logvar.view(b, n, -1)

    def latent_mask(self, attention_mask: Tensor) -> Tensor:
        """(B, N) bool: which of the latents `encode` gives hold tokens ((B, 1) without chunks)."""
        if not self.chunked:
            return attention_mask.new_ones((attention_mask.shape[0], 1), dtype=torch.bool)
        lengths = attention_mask.long().sum(-1)
        n = -(-attention_mask.shape[1] // self.chunk_tokens)
        return torch.arange(n, device=attention_mask.device).unsqueeze(0) * self.chunk_tokens < lengths.unsqueeze(1)

    def latent(self, states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The payload: z = mu, (B, Z) float32, or with chunks (B, N, Z)."""
        return self.encode(states, attention_mask)[0]

    def lm_states(self, model: nn.Module, attention_mask: Tensor, layers, *, input_ids: Tensor | None = None,
                  cache=None) -> tuple[Tensor, Tensor]:
        """For an encoder that ``reads_sender_lm``: the states it encodes, read by the sender's LM
        `model` over right-padded contexts (their ids, or the cache of a forward over them), and
        their mask."""
        raise ValueError(f"a {type(self).__name__} reads the token states it is given, not the sender's LM")

    # ---------------------------------------------------------------------------- receiver

    @property
    def placement(self) -> str:
        """Where the receiver reads the memory: "prefix" or "in_prompt" (`ilcp.receiver.prompts.memory_prompt`)."""
        return self._placement

    @placement.setter
    def placement(self, placement: str) -> None:
        if placement not in MEMORY_PLACEMENTS:
            raise ValueError(f"memory placement must be one of {list(MEMORY_PLACEMENTS)}, got {placement!r}")
        self._placement = placement

    def configure_receiver(self, placement: str = "prefix", vocabulary_snap: str = "none",
                           snap_temperature: float = 0.02, snap_metric: str = "cosine") -> None:
        """How the receiver reads the memory: where (`placement`) and whether snapped to the LM's
        vocabulary (`set_vocabulary_snap`). The format prompt, which holds weights, is set apart."""
        self.placement = placement
        self.set_vocabulary_snap(vocabulary_snap, snap_temperature, snap_metric)

    def set_vocabulary_snap(self, mode: str, temperature: float = 0.02, metric: str = "cosine") -> None:
        """Whether `memory` replaces each projected vector by the LM's token embeddings it is
        closest to (see `snap_to_vocabulary`): "none", "soft" or "hard", scored by "cosine" or
        "dot"."""
        if mode not in VOCABULARY_SNAPS:
            raise ValueError(f"vocabulary snap must be one of {list(VOCABULARY_SNAPS)}, got {mode!r}")
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"the snap temperature must be > 0, got {temperature!r}")
        if metric not in SNAP_METRICS:
            raise ValueError(f"the snap metric must be one of {list(SNAP_METRICS)}, got {metric!r}")
        self.vocabulary_snap, self.snap_temperature, self.snap_metric = mode, float(temperature), metric

    def bind_vocabulary(self, embedding_weight: Tensor) -> None:
        """The receiver LM's input-embedding rows (V, H), which a snapping encoder maps its memory
        onto. Held by reference, outside the state dict: the export never carries them."""
        if embedding_weight.dim() != 2 or embedding_weight.shape[1] != self._projector().model_hidden:
            raise ValueError(f"the embedding rows are {tuple(embedding_weight.shape)}; this projector writes vectors "
                             f"of {self._projector().model_hidden}")
        weight = embedding_weight.detach()
        self._vocabulary = (weight, 1.0 / weight.float().norm(dim=-1).clamp_min(1e-8))

    def bind_lm(self, model: nn.Module) -> None:
        """The LM this encoder sends and receives with, for an encoder whose own modules run it (a
        chunk writer that is the LM itself); the others need nothing. Called wherever a handoff is
        built around an encoder."""

    def memory(self, latent: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """z (B, Z) -> memory vectors (B, K, H); with chunks, z (B, N, Z) -> (B, N * K, H), each
        latent's K vectors in chunk order, snapped to the vocabulary when the encoder does so.
        Cast to `dtype` when given."""
        if latent.dim() == 3:
            b, n, z = latent.shape
            vectors = self._projector()(latent.reshape(b * n, z), dtype=torch.float32)
            vectors = vectors.reshape(b, -1, self.projector.model_hidden)
        else:
            vectors = self._projector()(latent, dtype=torch.float32)
        if self.vocabulary_snap != "none":
            if self._vocabulary is None:
                raise ValueError("this encoder snaps its memory to the LM's vocabulary: bind_vocabulary(the LM's "
                                 "input-embedding weight) first")
            vectors = snap_to_vocabulary(vectors, *self._vocabulary, self.vocabulary_snap, self.snap_temperature,
                                         self.snap_metric)
        return vectors if dtype is None else vectors.to(dtype)

    # ---------------------------------------------------------------------------- training

    def memory_for_batch(self, batch: dict, dtype: torch.dtype,
                         sample: bool = False) -> tuple[Tensor | list[Tensor], Tensor]:
        """(memory in `dtype`, mean KL of the batch's posteriors): (B, K, H), or with chunks one
        (N_i * K, H) tensor per row, N_i its chunks; the memory of the posterior's mean, or with
        ``sample`` of a latent drawn from it."""
        states, mask = sender_states_of(batch)
        mu, logvar = self.encode(states, mask)
        latent = self.vae.reparameterise(mu, logvar) if sample else mu
        if not self.chunked:
            return self.memory(latent, dtype), kl_divergence(mu, logvar).mean()
        real = self.latent_mask(mask)
        memory = self.memory(latent, dtype)
        k = self.num_memory_tokens
        rows = [memory[i, : int(real[i].sum()) * k] for i in range(memory.shape[0])]
        return rows, kl_divergence(mu[real], logvar[real]).mean()

    def freeze_encoder(self) -> None:
        """Pooler and VAE stop learning and stay in eval mode (the projector still learns)."""
        self.encoder_frozen = True
        self.vae.requires_grad_(False)
        if self.pooler is not None:
            self.pooler.requires_grad_(False)

    def parameter_groups(self, lr: float, encoder_lr: float) -> list[dict]:
        """Optimizer groups: the projector at `lr`, pooler and VAE at `encoder_lr` unless frozen."""
        groups = [{"params": list(self._projector().parameters()), "lr": lr}]
        if self.format_prompt is not None:
            groups[0]["params"] += [p for p in self.format_prompt.parameters() if p.requires_grad]
        if not self.encoder_frozen:
            encoder = list(self.vae.parameters()) + (list(self.pooler.parameters()) if self.pooler is not None else [])
            groups.append({"params": encoder, "lr": encoder_lr})
        return groups

    def train(self, mode: bool = True):
        super().train(mode)
        if self.encoder_frozen:
            self.vae.eval()
            if self.pooler is not None:
                self.pooler.eval()
        return self


class FormatPrompt(nn.Module):
    """K learned vectors a receiver reads before its whole prompt, the same for every context:
    with ``in_prompt`` memory, they teach the answer's form the way cold_read_tuned's vectors do,
    so the projector need not bend the context's vectors to do it. ``trainable=False`` keeps
    given vectors as they are (cold_read_tuned's, with ``handoff.format_from``)."""

    def __init__(self, vectors: Tensor, trainable: bool = True):
        super().__init__()
        if vectors.dim() != 2:
            raise ValueError(f"format vectors are (K, H), got shape {tuple(vectors.shape)}")
        self.vectors = nn.Parameter(vectors.detach().float().clone(), requires_grad=trainable)

    @property
    def num_vectors(self) -> int:
        return self.vectors.shape[0]


class ConstantMemory(nn.Module):
    """K learned vectors, the same for every context: the tuned baselines' memory source.

    Args:
        soft_prompt: (K, H) initial vectors (copied).
        reads_context_text: the receiver also reads the context text (cold_read_tuned) or not
            (prompt_tuned).
    """

    placement = "prefix"

    def __init__(self, soft_prompt: Tensor, reads_context_text: bool):
        super().__init__()
        if soft_prompt.dim() != 2:
            raise ValueError(f"a soft prompt is (K, H), got shape {tuple(soft_prompt.shape)}")
        self.soft_prompt = nn.Parameter(soft_prompt.detach().float().clone())
        self.reads_context_text = bool(reads_context_text)

    @classmethod
    def from_embedding_rows(cls, model: nn.Module, num_vectors: int, reads_context_text: bool,
                            seed: int = 0) -> ConstantMemory:
        """Initialised from random rows of the LM's input-embedding table: the scale of real tokens."""
        g = torch.Generator().manual_seed(seed)
        weight = model.get_input_embeddings().weight.detach().float().cpu()
        rows = torch.randint(0, weight.shape[0], (num_vectors,), generator=g)
        return cls(weight[rows], reads_context_text)

    @property
    def num_memory_tokens(self) -> int:
        return self.soft_prompt.shape[0]

    def memory_for_batch(self, batch: dict, dtype: torch.dtype, sample: bool = False) -> tuple[Tensor, Tensor]:
        """(the K vectors repeated for each row (B, K, H) in `dtype`, zero KL; nothing to sample)."""
        b = len(batch["question"])
        return self.soft_prompt.to(dtype).unsqueeze(0).expand(b, -1, -1), self.soft_prompt.new_zeros(())

    def parameter_groups(self, lr: float, encoder_lr: float) -> list[dict]:
        return [{"params": [self.soft_prompt], "lr": lr}]


MemorySource = ILCPEncoder | ConstantMemory


def snap_to_vocabulary(vectors: Tensor, table: Tensor, inverse_norms: Tensor, mode: str,
                       temperature: float, metric: str = "cosine") -> Tensor:
    """Memory vectors (..., H) -> mixtures of the LM's embedding rows `table` (V, H), float32.

    The weights are a softmax over each vector's score against every row, at `temperature`: its
    cosine similarity (`metric` "cosine") or inner product ("dot", the logits of a codec trained
    with ``reconstruct.token_logits=dot``). "soft" reads that mixture; "hard" reads the
    best-scoring row itself, with the soft mixture's gradient (straight-through). A frozen LM reads
    its own token embeddings as it was trained to, where a projected vector that is merely close to
    one reads as noise.
    """
    table = table.to(vectors.device)
    if metric == "dot":
        scores = (vectors.to(table.dtype) @ table.T).float()
    else:
        scores = (F.normalize(vectors, dim=-1).to(table.dtype) @ table.T).float() * inverse_norms.to(vectors.device)
    if mode == "hard" and not (torch.is_grad_enabled() and vectors.requires_grad):
        return table[scores.argmax(-1)].float()
    weights = torch.softmax(scores / temperature, dim=-1)
    if mode == "hard":
        hard = F.one_hot(scores.argmax(-1), table.shape[0]).to(weights.dtype)
        weights = hard + weights - weights.detach()
    return (weights.to(table.dtype) @ table).float()


def sender_states_of(batch: dict) -> tuple[Tensor, Tensor | None]:
    """A training batch's sender states: (tokens (B, S, D), mask (B, S)) or (pooled (B, D), None)."""
    if "tokens" in batch:
        return batch["tokens"], batch["token_mask"]
    if "pooled" in batch:
        return batch["pooled"], None
    raise ValueError("the batch carries no sender states (neither 'tokens' nor 'pooled')")
