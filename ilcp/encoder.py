"""Memory sources: what the receiver's frozen LM reads in front of its prompt.

Every trained variant is a memory source with one interface, so training, export and serving
handle them alike:

- `ILCPEncoder` (the ILCP path): the sender's token states -> pooled state (masked mean, or a
  learned `AttentionPooler`) -> beta-VAE latent z = mu -> gated projector -> K memory vectors.
  The latent is what crosses the handoff: ``encoder.latent(states, mask)`` on the sender,
  ``encoder.memory(z)`` on the receiver.
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

from .compressor import BetaVAE, kl_divergence
from .pooling import AttentionPooler, masked_mean_pool
from .projector import GatedLatentToMemoryProjector

POOLING_KINDS = ("mean", "attention")


class ILCPEncoder(nn.Module):
    """Optional attention pooler, beta-VAE and projector: the ILCP modules as one object.

    Args:
        vae: the beta-VAE (its input width is the pooled state's width).
        projector: z (B, Z) -> memory (B, K, H); None while only stage 1 has run.
        pooler: learned attention pooling over token states; None for the masked mean.

    Raises:
        ValueError: the parts do not fit together (widths).
    """

    reads_context_text = False

    def __init__(self, vae: BetaVAE, projector: GatedLatentToMemoryProjector | None = None,
                 pooler: AttentionPooler | None = None):
        super().__init__()
        if pooler is not None and pooler.output_dim != vae.input_dim:
            raise ValueError(f"the pooler gives {pooler.output_dim} floats, the VAE reads {vae.input_dim}")
        if projector is not None and projector.latent_dim != vae.latent_dim:
            raise ValueError(f"the projector reads {projector.latent_dim} floats, the VAE gives {vae.latent_dim}")
        self.vae, self.projector, self.pooler = vae, projector, pooler
        self.encoder_frozen = False

    # -------------------------------------------------------------------------- description

    @property
    def pooling(self) -> str:
        """"mean" or "attention"."""
        return "mean" if self.pooler is None else "attention"

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

    def pool(self, states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Sender states -> pooled (B, D') float32 (see `pool_states`)."""
        return pool_states(self.pooler, states, attention_mask)

    def encode(self, states: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(mu, logvar), each (B, Z) float32, of the sender states (see `pool`)."""
        return self.vae.encode(self.pool(states, attention_mask))

    def latent(self, states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The payload: z = mu, (B, Z) float32."""
        return self.encode(states, attention_mask)[0]

    # ---------------------------------------------------------------------------- receiver

    def memory(self, latent: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """z (B, Z) -> memory vectors (B, K, H), cast to `dtype` when given."""
        return self._projector()(latent, dtype=dtype)

    # ---------------------------------------------------------------------------- training

    def memory_for_batch(self, batch: dict, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(memory (B, K, H) in `dtype`, mean KL of the batch's posteriors)."""
        states, mask = sender_states_of(batch)
        mu, logvar = self.encode(states, mask)
        return self.memory(mu, dtype), kl_divergence(mu, logvar).mean()

    def freeze_encoder(self) -> None:
        """Pooler and VAE stop learning and stay in eval mode (the projector still learns)."""
        self.encoder_frozen = True
        self.vae.requires_grad_(False)
        if self.pooler is not None:
            self.pooler.requires_grad_(False)

    def parameter_groups(self, lr: float, encoder_lr: float) -> list[dict]:
        """Optimizer groups: the projector at `lr`, pooler and VAE at `encoder_lr` unless frozen."""
        groups = [{"params": list(self._projector().parameters()), "lr": lr}]
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


class ConstantMemory(nn.Module):
    """K learned vectors, the same for every context: the tuned baselines' memory source.

    Args:
        soft_prompt: (K, H) initial vectors (copied).
        reads_context_text: the receiver also reads the context text (cold_read_tuned) or not
            (prompt_tuned).
    """

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

    def memory_for_batch(self, batch: dict, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(the K vectors repeated for each row (B, K, H) in `dtype`, zero KL)."""
        b = len(batch["question"])
        return self.soft_prompt.to(dtype).unsqueeze(0).expand(b, -1, -1), self.soft_prompt.new_zeros(())

    def parameter_groups(self, lr: float, encoder_lr: float) -> list[dict]:
        return [{"params": [self.soft_prompt], "lr": lr}]


MemorySource = ILCPEncoder | ConstantMemory


def pool_states(pooler: AttentionPooler | None, states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Token states (B, S, D) with their mask (B, S) -> pooled (B, D') float32: the masked mean
    (pooler None) or the attention pooler's output.

    Mean-pooled states computed ahead of time, (B, D) with no mask, pass through; an attention
    pooler needs the token states.
    """
    if attention_mask is None:
        if states.dim() != 2:
            raise ValueError(f"token states (batch, seq, dim) need their attention mask, got {tuple(states.shape)}")
        if pooler is not None:
            raise ValueError("this encoder pools with attention: give it token states and their mask, not pooled states")
        return states.float()
    if pooler is not None:
        return pooler(states, attention_mask)
    return masked_mean_pool(states, attention_mask).float()


def sender_states_of(batch: dict) -> tuple[Tensor, Tensor | None]:
    """A training batch's sender states: (tokens (B, S, D), mask (B, S)) or (pooled (B, D), None)."""
    if "tokens" in batch:
        return batch["tokens"], batch["token_mask"]
    if "pooled" in batch:
        return batch["pooled"], None
    raise ValueError("the batch carries no sender states (neither 'tokens' nor 'pooled')")
