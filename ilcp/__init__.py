"""ilcp: hand an LLM agent's context to another agent in latent form instead of text.

Two paths, measured against the text handoff on the same tasks:
- ILCP: pooled hidden state -> beta-VAE latent (32 floats) -> gated-MLP soft prompt.
- RCLC (`ilcp.rclc`): a budgeted selection of the sender's input-embedding rows.
"""

__version__ = "0.1.0"
