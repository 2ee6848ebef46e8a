"""The beta-VAE that compresses a pooled sender state into a small latent (32 floats by default).

A shared fully connected body feeds two heads, mu and logvar; the decoder maps a latent back to
the (standardised) pooled vector. Training samples z with the reparameterisation trick; at
inference z = mu, so the payload is deterministic.

The standardisation statistics (per-dimension mean and std of the training pooled states) are
buffers of the module, so they are saved and loaded with its weights.

    vae = BetaVAE(input_dim=576, latent_dim=32)
    vae.set_standardisation(train_pooled)          # (N, 576), train split only
    mu, logvar = vae.encode(pooled)                # (B, 32) each
    out = vae(pooled); loss = out.recon + vae.beta * out.kl
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


def kl_divergence(mu: Tensor, logvar: Tensor) -> Tensor:
    """KL(N(mu, exp(logvar)) || N(0, I)) per row, closed form: (B, Z) -> (B,)."""
    return -0.5 * torch.sum(1.0 + logvar - mu.pow(2) - logvar.exp(), dim=-1)


@dataclass
class VAEOutput:
    reconstruction: Tensor  # (B, D), standardised space
    target: Tensor  # (B, D), the standardised input
    mu: Tensor  # (B, Z)
    logvar: Tensor  # (B, Z)
    z: Tensor  # (B, Z), sampled in training mode, mu in eval mode
    recon: Tensor  # scalar: mean squared error per dimension
    kl: Tensor  # scalar: mean KL per example


class BetaVAE(nn.Module):
    """beta-VAE over pooled states.

    Args:
        input_dim: D, the pooled state's width.
        latent_dim: Z, the payload's width (32 floats = 128 bytes in float32).
        hidden_dim: width of the shared body and of the decoder.
        beta: weight of the KL term in `loss`.
    """

    def __init__(self, input_dim: int, latent_dim: int = 32, hidden_dim: int = 512, beta: float = 1.0):
        super().__init__()
        for name, value in (("input_dim", input_dim), ("latent_dim", latent_dim), ("hidden_dim", hidden_dim)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        self.input_dim, self.latent_dim, self.hidden_dim, self.beta = int(input_dim), int(latent_dim), int(hidden_dim), float(beta)
        self.body = nn.Sequential(
            nn.Linear(input_dim, hidden_dim), nn.SiLU(), nn.Linear(hidden_dim, hidden_dim), nn.SiLU()
        )
        self.mu_head = nn.Linear(hidden_dim, latent_dim)
        self.logvar_head = nn.Linear(hidden_dim, latent_dim)
        self.decoder = nn.Sequential(
            nn.Linear(latent_dim, hidden_dim), nn.SiLU(), nn.Linear(hidden_dim, hidden_dim), nn.SiLU(),
            nn.Linear(hidden_dim, input_dim),
        )
        self.register_buffer("input_mean", torch.zeros(input_dim))
        self.register_buffer("input_std", torch.ones(input_dim))

    @torch.no_grad()
    def set_standardisation(self, pooled: Tensor, eps: float = 1e-6) -> None:
        """Per-dimension mean and std from training pooled states (N, D)."""
        self._check(pooled)
        if pooled.shape[0] < 2:
            raise ValueError("need at least 2 pooled states to compute standardisation statistics")
        pooled = pooled.float()
        self.input_mean.copy_(pooled.mean(0))
        self.input_std.copy_(pooled.std(0).clamp(min=eps))

    def standardise(self, pooled: Tensor) -> Tensor:
        return (pooled.float() - self.input_mean) / self.input_std

    def encode(self, pooled: Tensor) -> tuple[Tensor, Tensor]:
        """(B, D) raw pooled states -> (mu, logvar), each (B, Z), float32."""
        self._check(pooled)
        h = self.body(self.standardise(pooled))
        return self.mu_head(h), self.logvar_head(h).clamp(-10.0, 10.0)

    def freeze_unreached(self, kl_in_loss: bool) -> None:
        """Stop training what an answer loss never reaches: the decoder, and the logvar head unless
        the loss has the posterior's KL term."""
        self.decoder.requires_grad_(False)
        self.logvar_head.requires_grad_(kl_in_loss)

    @staticmethod
    def reparameterise(mu: Tensor, logvar: Tensor) -> Tensor:
        return mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)

    def decode(self, z: Tensor) -> Tensor:
        """(B, Z) -> (B, D) reconstruction in the standardised space."""
        return self.decoder(z)

    def latent(self, pooled: Tensor) -> Tensor:
        """The payload: z = mu, (B, Z)."""
        return self.encode(pooled)[0]

    def forward(self, pooled: Tensor) -> VAEOutput:
        mu, logvar = self.encode(pooled)
        z = self.reparameterise(mu, logvar) if self.training else mu
        recon = self.decode(z)
        target = self.standardise(pooled)
        return VAEOutput(
            reconstruction=recon, target=target, mu=mu, logvar=logvar, z=z,
            recon=torch.mean((recon - target) ** 2), kl=kl_divergence(mu, logvar).mean(),
        )

    def _check(self, pooled: Tensor) -> None:
        if pooled.dim() != 2 or pooled.shape[1] != self.input_dim:
            raise ValueError(f"pooled states must be (batch, {self.input_dim}), got {tuple(pooled.shape)}")


def active_units(mu: Tensor, threshold: float = 0.01) -> int:
    """Latent dimensions whose posterior mean varies across inputs: Var_x[mu_x] > threshold."""
    if mu.shape[0] < 2:
        return 0
    return int((mu.float().var(0) > threshold).sum())
