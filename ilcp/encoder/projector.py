"""The gated MLP that turns a received latent into K soft-prompt vectors for the receiver's LM.

    proj = GatedLatentToMemoryProjector(latent_dim=32, num_memory_tokens=8, model_hidden=576)
    proj.calibrate_output_norm(mean_token_embedding_norm(model))   # ilcp.lm
    memory = proj(z, dtype=model.dtype)           # (B, 8, 576)

A SiLU trunk feeds a gate head (sigmoid) and a value head (raw); their element-wise product is
reshaped to (batch, K, model_hidden). The trunk and gate run in float32 whatever the LM's dtype;
only the output is cast to it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class GatedLatentToMemoryProjector(nn.Module):
    """z (B, latent_dim) -> memory vectors (B, K, model_hidden).

    Args:
        latent_dim: width of the received latent.
        num_memory_tokens: K, the number of soft-prompt vectors.
        model_hidden: the receiver LM's embedding width.
        hidden: width of the trunk.
    """

    def __init__(self, latent_dim: int, num_memory_tokens: int, model_hidden: int, hidden: int = 512):
        super().__init__()
        for name, value in (("latent_dim", latent_dim), ("num_memory_tokens", num_memory_tokens),
                            ("model_hidden", model_hidden), ("hidden", hidden)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.latent_dim, self.num_memory_tokens, self.model_hidden = int(latent_dim), int(num_memory_tokens), int(model_hidden)
        self.hidden = int(hidden)
        out = self.num_memory_tokens * self.model_hidden
        self.trunk = nn.Sequential(nn.Linear(latent_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU())
        self.gate_head = nn.Linear(hidden, out)
        self.value_head = nn.Linear(hidden, out)

    def forward(self, z: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        if z.dim() != 2:
            raise ValueError(f"z must be (batch, latent_dim), got shape {tuple(z.shape)}")
        if z.shape[1] != self.latent_dim:
            raise ValueError(f"z has width {z.shape[1]}, the projector expects {self.latent_dim}")
        params_dtype = self.gate_head.weight.dtype
        with torch.autocast(device_type=z.device.type, enabled=False):
            h = self.trunk(z.to(params_dtype))
            gate = torch.sigmoid(self.gate_head(h).float())
            value = self.value_head(h).float()
            memory = (gate * value).view(z.shape[0], self.num_memory_tokens, self.model_hidden)
        return memory.to(dtype) if dtype is not None else memory

    @torch.no_grad()
    def calibrate_output_norm(self, target_norm: float, samples: int = 256, seed: int = 0) -> float:
        """Rescale the value head so memory vectors from z ~ N(0, I) have mean norm `target_norm`.

        Soft prompts far from the scale of real token embeddings train poorly; the output is
        linear in the value head, so scaling its weight and bias scales every vector exactly.
        Returns the factor applied.
        """
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(samples, self.latent_dim, generator=g).to(self.gate_head.weight)
        current = float(self(z).norm(dim=-1).mean())
        factor = float(target_norm) / max(current, 1e-12)
        self.value_head.weight.mul_(factor)
        self.value_head.bias.mul_(factor)
        return factor
