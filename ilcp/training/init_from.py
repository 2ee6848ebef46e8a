"""A run's encoder started from a pretrained one: ``compressor.init_from=PATH``.

PATH is an export folder (config.json + model.safetensors: a pretrained encoder shipped with the
repository, or any run's export). It is read as every export is (`ilcp.export.read_export`:
schema, config.json's own digest, each weights file's sha256), and refused in one line when it
was made for another LM (its fingerprint), when a file was tampered with, or when its encoder
is not the one this run's settings describe (each differing setting named, with the value that
would match). The run then starts from its weights, projector included, instead of stage 1.
"""

from __future__ import annotations

from ..config import TrainConfig
from ..encoder.model import ILCPEncoder
from ..encoder.spec import EncoderSpec, ExportError
from ..export import check_fingerprint, read_config, read_export
from ..lm import LM
from .log import say

__all__ = ["pretrained_encoder", "settings_it_needs"]


def settings_it_needs(cfg: TrainConfig, spec: EncoderSpec) -> dict[str, tuple]:
    """``{run setting: (this run's value, the pretrained encoder's)}`` for every setting that
    shapes the encoder and differs between the two (empty when they agree)."""
    c = cfg.compressor
    ours = {
        "compressor.latent_dim": (c.latent_dim, spec.latent_dim),
        "compressor.hidden_dim": (c.hidden_dim, spec.hidden_dim),
        "handoff.num_memory_tokens": (cfg.handoff.num_memory_tokens, spec.num_memory_tokens),
        "handoff.projector_hidden": (cfg.handoff.projector_hidden, spec.projector_hidden),
        "data.pool_layers": (list(cfg.data.pool_layers), list(spec.layers)),
        **c.memory.differences(spec.memory),  # the memory kind compares its own settings
    }
    return {name: pair for name, pair in ours.items() if pair[0] != pair[1]}


def pretrained_encoder(cfg: TrainConfig, lm: LM, max_length: int) -> ILCPEncoder:
    """The encoder of ``compressor.init_from``, checked against this LM and this run's settings,
    ready for the run's later stages (a slot encoder bound to the sender LM).

    Raises:
        ExportError: one line: not an export, a tampered file, another LM, no encoder, or an
            encoder other than this run's settings describe.
    """
    path = cfg.compressor.init_from
    where = f"compressor.init_from={path}"
    try:
        check_fingerprint(read_config(path), lm.fingerprint)  # another LM, before any weights are read
        run = read_export(path)
    except ExportError as e:
        raise ExportError(f"{where}: {e}") from None
    if run.encoder is None:
        raise ExportError(f"{where}: the export holds no encoder (it was trained without 'ilcp')")
    differ = settings_it_needs(cfg, run.spec)
    if differ:
        fixes = ", ".join(f"{name}={theirs}" for name, (_, theirs) in differ.items())
        ours = ", ".join(f"{name} {mine}" for name, (mine, _) in differ.items())
        raise ExportError(f"{where}: its encoder is not the one this run describes (this run: {ours}); set {fixes}, "
                          "or drop compressor.init_from")
    encoder = run.encoder
    encoder.bind_lm(lm.model)
    if encoder.reads_sender_lm:
        encoder.bind_sender(lm.model, lm.tokenizer, max_length, cfg.data.pool_layers, grouped=cfg.trainer.length_groups)
    say(f"stage 1 (compressor): the encoder starts from {path} ({sum(p.numel() for p in encoder.parameters()):,} "
        "parameters, projector included)")
    return encoder
