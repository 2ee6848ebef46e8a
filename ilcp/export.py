"""The export directory of a training run, and reading it back.

    checkpoints/RUN/
      config.json                  sorted keys: sizes, beta, LM spec + fingerprint, pooling, files
      model.safetensors            ilcp: compressor.* (with its standardisation stats) + projector.*
                                   (+ pooler.* when the run used attention pooling)
      prompt_tuned.safetensors     soft_prompt (K, H)
      cold_read_tuned.safetensors  soft_prompt (K, H)
      train_config.yaml            the resolved training config
      metrics.json                 validation curves and final figures per variant

Only trained modules are written, never the frozen LM. Every file is written atomically, and
config.json last, so a directory with a config.json holds a complete export. Reading never
unpickles (safetensors only), and `check_fingerprint` refuses an export made for another LM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file
from torch import Tensor

from . import __version__
from .compressor import BetaVAE
from .pooling import AttentionPooler
from .io import atomic_save_safetensors, atomic_write_json
from .projector import GatedLatentToMemoryProjector

EXPORT_FORMAT = "ilcp-export"
EXPORT_VERSION = 1
BASELINES = ("prompt_tuned", "cold_read_tuned")


class ExportError(ValueError):
    """An export directory is missing, incomplete, or made for another LM."""


def export_run(cfg, lm, modules: dict, metrics: dict, pool_dim: int) -> Path:
    """Write the trained variants of a run into ``cfg.run_dir`` (see the module docstring)."""
    run_dir = cfg.run_dir
    files = {}
    if "ilcp" in modules:
        atomic_save_safetensors(modules["ilcp"].trained_state(), run_dir / "model.safetensors", {"format": "pt"})
        files["ilcp"] = "model.safetensors"
    for name in BASELINES:
        if name in modules:
            atomic_save_safetensors(modules[name].trained_state(), run_dir / f"{name}.safetensors", {"format": "pt"})
            files[name] = f"{name}.safetensors"
    atomic_write_json(run_dir / "metrics.json", metrics)
    c, h, d = cfg.compressor, cfg.handoff, cfg.data
    config = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "package_version": __version__,
        "lm": {"spec": lm.spec, "fingerprint": lm.fingerprint, "dtype": cfg.lm.dtype, "hidden_size": lm.hidden_size},
        "latent_dim": c.latent_dim,
        "num_memory_tokens": h.num_memory_tokens,
        "compressor": {"input_dim": int(pool_dim), "hidden_dim": c.hidden_dim, "beta": c.beta},
        "projector": {"hidden": h.projector_hidden},
        "pooling": _pooling_config(cfg),
        "normalisation": "model.safetensors: compressor.input_mean, compressor.input_std (train split)",
        "task": d.task,
        "task_settings": {"babi_variant": d.babi_variant, "facts_n_facts": d.facts_n_facts,
                          "facts_n_distractors": d.facts_n_distractors, "seed": d.seed},
        "files": files,
        "train_config": "train_config.yaml",
        "metrics": "metrics.json",
    }
    atomic_write_json(run_dir / "config.json", config)
    return run_dir


def _pooling_config(cfg) -> dict:
    pooling = {"kind": "masked_mean", "layers": list(cfg.data.pool_layers), "max_length": cfg.data.max_length}
    if cfg.compressor.pooling == "attention":
        pooling.update(kind="attention", num_queries=cfg.compressor.pool_queries)
    return pooling


def build_pooler(config: dict, state: dict[str, Tensor] | None = None) -> AttentionPooler | None:
    """The attention pooler an export's config names (weights from `state`), or None for the mean."""
    pooling = config.get("pooling", {})
    kind = pooling.get("kind", "masked_mean")
    if kind == "masked_mean":
        return None
    if kind != "attention":
        raise ExportError(f"unknown pooling kind {kind!r} in config.json (this package reads masked_mean, attention)")
    dim = config["lm"]["hidden_size"] * len(pooling.get("layers", [-1]))
    pooler = AttentionPooler(dim, int(pooling["num_queries"]))
    if state is not None:
        weights = {k[len("pooler."):]: v for k, v in state.items() if k.startswith("pooler.")}
        if not weights:
            raise ExportError("config.json names an attention pooler, but the weights hold no pooler.* tensors")
        pooler.load_state_dict(weights)
    return pooler.eval()


@dataclass
class ExportedRun:
    """The trained modules of one export, on the CPU in float32."""

    path: Path
    config: dict
    compressor: BetaVAE | None = None
    projector: GatedLatentToMemoryProjector | None = None
    pooler: AttentionPooler | None = None  # None: the masked mean
    soft_prompts: dict[str, Tensor] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return self.config["lm"]["fingerprint"]

    @property
    def lm_spec(self) -> str:
        return self.config["lm"]["spec"]


def read_config(path: str | Path) -> dict:
    path = Path(path)
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise ExportError(f"{str(path)!r} is not a directory; pass a run folder such as checkpoints/default")
    if not cfg_path.is_file():
        raise ExportError(f"{str(path)!r} holds no config.json: not a finished export (train with python train.py)")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{cfg_path} is not valid JSON: {e}") from e
    if config.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{cfg_path} is not an ilcp export (format {config.get('format')!r})")
    if config.get("format_version") != EXPORT_VERSION:
        raise ExportError(f"{cfg_path} has export format version {config.get('format_version')}, this package reads {EXPORT_VERSION}")
    return config


def read_export(path: str | Path) -> ExportedRun:
    """Read every trained module of an export (no LM needed)."""
    path = Path(path)
    config = read_config(path)
    run = ExportedRun(path=path, config=config)
    files = config.get("files", {})
    for name, fname in files.items():
        fpath = path / fname
        if not fpath.is_file():
            raise ExportError(f"{fpath} is listed in config.json but missing")
        state = load_file(str(fpath))
        if name == "ilcp":
            c = config["compressor"]
            run.compressor = BetaVAE(c["input_dim"], config["latent_dim"], c["hidden_dim"], c["beta"])
            run.compressor.load_state_dict({k[11:]: v for k, v in state.items() if k.startswith("compressor.")})
            run.projector = GatedLatentToMemoryProjector(
                config["latent_dim"], config["num_memory_tokens"], config["lm"]["hidden_size"], config["projector"]["hidden"]
            )
            run.projector.load_state_dict({k[10:]: v for k, v in state.items() if k.startswith("projector.")})
            run.compressor.eval(), run.projector.eval()
            run.pooler = build_pooler(config, state)
        else:
            run.soft_prompts[name] = state["soft_prompt"].float()
    return run


def check_fingerprint(config: dict, fingerprint: str) -> None:
    """Raise ExportError when the export was trained on another LM than the one given."""
    expected = config["lm"]["fingerprint"]
    if fingerprint != expected:
        raise ExportError(
            f"this export was trained on LM {config['lm']['spec']!r} with fingerprint {expected}, but the "
            f"LM given has fingerprint {fingerprint}: load the same weights, dtype and tokenizer "
            "(or train a new run for this LM)"
        )

