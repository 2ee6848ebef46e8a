"""The export directory of a training run, and reading it back.

    checkpoints/RUN/
      config.json                  sorted keys: sizes, beta, LM spec + fingerprint, pooling, files
      model.safetensors            ilcp: compressor.* (with its standardisation stats) + projector.*
                                   (+ pooler.* when the run used attention pooling)
      prompt_tuned.safetensors     soft_prompt (K, H)
      cold_read_tuned.safetensors  soft_prompt (K, H)
      train_config.yaml            the resolved training config
      metrics.json                 validation curves and final figures per variant

This module is the only place that names state-dict keys: `encoder_state` / `load_encoder_state`
for an `ILCPEncoder`, `soft_prompt_state` / `load_soft_prompt` for a `ConstantMemory`, and
`trained_state` / `load_trained_state` for either (training's stage files use them too).

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
from .encoder import POOLING_KINDS, ConstantMemory, ILCPEncoder, MemorySource
from .io import atomic_save_safetensors, atomic_write_json
from .pooling import AttentionPooler
from .projector import GatedLatentToMemoryProjector

EXPORT_FORMAT = "ilcp-export"
EXPORT_VERSION = 1
BASELINES = ("prompt_tuned", "cold_read_tuned")
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# the state-dict prefixes of the exported files
_PARTS = {"compressor": "vae", "projector": "projector", "pooler": "pooler"}
_SOFT_PROMPT = "soft_prompt"


class ExportError(ValueError):
    """An export directory is missing, incomplete, or made for another LM."""


# --------------------------------------------------------------------------------------------
# state dicts


def encoder_state(encoder: ILCPEncoder) -> dict[str, Tensor]:
    """The encoder's tensors with export names: compressor.*, projector.* (when built), pooler.*
    (attention pooling), detached on the CPU."""
    state = {}
    for prefix, attr in _PARTS.items():
        part = getattr(encoder, attr)
        if part is not None:
            state.update({f"{prefix}.{k}": v.detach().cpu() for k, v in part.state_dict().items()})
    return state


def load_encoder_state(encoder: ILCPEncoder, state: dict[str, Tensor], *, source: str = "the weights") -> None:
    """Load `encoder_state` tensors into `encoder` (parts it has; a projector-less state leaves its
    projector as it is). Raises ExportError when a part the encoder has is missing or does not fit."""
    for prefix, attr in _PARTS.items():
        part = getattr(encoder, attr)
        tensors = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
        if part is None:
            if tensors:
                raise ExportError(f"{source} hold {prefix}.* tensors, but the config names no {prefix}")
            continue
        if not tensors:
            if prefix == "projector":
                continue
            raise ExportError(f"{source} hold no {prefix}.* tensors")
        try:
            part.load_state_dict(tensors)
        except RuntimeError as e:
            raise ExportError(f"{source}: the {prefix} tensors do not fit the config: {str(e).splitlines()[0]}") from None


def soft_prompt_state(source: ConstantMemory) -> dict[str, Tensor]:
    return {_SOFT_PROMPT: source.soft_prompt.detach().cpu()}


def load_soft_prompt(state: dict[str, Tensor], *, source: str = "the weights") -> Tensor:
    """The (K, H) soft prompt of a `soft_prompt_state`, float32."""
    if _SOFT_PROMPT not in state or state[_SOFT_PROMPT].dim() != 2:
        raise ExportError(f"{source} hold no (K, H) {_SOFT_PROMPT} tensor")
    return state[_SOFT_PROMPT].float()


def trained_state(source: MemorySource) -> dict[str, Tensor]:
    """The trained tensors of any memory source, with export names."""
    if isinstance(source, ILCPEncoder):
        return encoder_state(source)
    return soft_prompt_state(source)


def load_trained_state(source: MemorySource, state: dict[str, Tensor], *, origin: str = "the weights") -> None:
    if isinstance(source, ILCPEncoder):
        load_encoder_state(source, state, source=origin)
    else:
        source.soft_prompt.data.copy_(load_soft_prompt(state, source=origin))


def has_encoder_layout(state: dict[str, Tensor]) -> bool:
    """Whether a stage file uses this package's export names (earlier versions did not)."""
    return any(k.startswith("compressor.") for k in state)


# --------------------------------------------------------------------------------------------
# writing


def encoder_config(encoder: ILCPEncoder, *, layers, max_length: int) -> dict:
    """The config.json entries that rebuild `encoder` (see `build_encoder`)."""
    vae, projector = encoder.vae, encoder._projector()
    pooling = {"kind": encoder.pooling, "layers": [int(i) for i in layers], "max_length": int(max_length)}
    if encoder.pooler is not None:
        pooling["num_queries"] = encoder.pooler.num_queries
    if encoder.chunked:
        pooling["chunk_tokens"] = encoder.chunk_tokens
    return {
        "latent_dim": vae.latent_dim,
        "num_memory_tokens": projector.num_memory_tokens,
        "compressor": {"input_dim": vae.input_dim, "hidden_dim": vae.hidden_dim, "beta": vae.beta},
        "projector": {"hidden": projector.hidden},
        "pooling": pooling,
        "normalisation": f"{MODEL_FILE}: compressor.input_mean, compressor.input_std (train split)",
    }


def export_run(cfg, lm, sources: dict[str, MemorySource], metrics: dict) -> Path:
    """Write the trained memory sources of a run into ``cfg.run_dir`` (see the module docstring)."""
    run_dir = cfg.run_dir
    files = {}
    for name, source in sources.items():
        fname = MODEL_FILE if name == "ilcp" else f"{name}.safetensors"
        atomic_save_safetensors(trained_state(source), run_dir / fname, {"format": "pt"})
        files[name] = fname
    atomic_write_json(run_dir / "metrics.json", metrics)
    d = cfg.data
    config = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "package_version": __version__,
        "lm": {"spec": lm.spec, "fingerprint": lm.fingerprint, "dtype": cfg.lm.dtype, "hidden_size": lm.hidden_size},
        "num_memory_tokens": cfg.handoff.num_memory_tokens,
        "task": d.task,
        "task_settings": {"babi_variant": d.babi_variant, "facts_n_facts": d.facts_n_facts,
                          "facts_n_distractors": d.facts_n_distractors, "facts_value_split": d.facts_value_split,
                          "seed": d.seed},
        "files": files,
        "train_config": "train_config.yaml",
        "metrics": "metrics.json",
    }
    if "ilcp" in sources:
        config.update(encoder_config(sources["ilcp"], layers=d.pool_layers, max_length=d.max_length))
    atomic_write_json(run_dir / CONFIG_FILE, config)
    return run_dir


def save_encoder(encoder: ILCPEncoder, config: dict, path: str | Path) -> Path:
    """Write one encoder as an export (config.json + model.safetensors) into `path`; `config` is
    an export config (its lm, task and pooling entries are kept)."""
    path = Path(path)
    atomic_save_safetensors(encoder_state(encoder), path / MODEL_FILE, {"format": "pt"})
    config = json.loads(json.dumps(config))
    pooling = config.get("pooling", {})
    config.update(encoder_config(encoder, layers=pooling.get("layers", [-1]), max_length=pooling.get("max_length", 512)))
    config["files"] = {"ilcp": MODEL_FILE}
    config["package_version"] = __version__
    for key in ("train_config", "metrics"):  # files of a training run, not written here
        config.pop(key, None)
    atomic_write_json(path / CONFIG_FILE, config)
    return path


# --------------------------------------------------------------------------------------------
# reading


def pooling_kind(config: dict) -> str:
    """The export's pooling kind, "mean" or "attention" (exports of 0.1 said "masked_mean")."""
    kind = config.get("pooling", {}).get("kind", "mean")
    kind = "mean" if kind == "masked_mean" else kind
    if kind not in POOLING_KINDS:
        raise ExportError(f"unknown pooling kind {kind!r} in config.json (this package reads {', '.join(POOLING_KINDS)})")
    return kind


def build_encoder(config: dict, state: dict[str, Tensor] | None = None, *, source: str = "the weights") -> ILCPEncoder:
    """The `ILCPEncoder` an export's config describes, with `state`'s weights when given, in eval mode."""
    pooling = config.get("pooling", {})
    c = config["compressor"]
    pooler = None
    if pooling_kind(config) == "attention":
        dim = config["lm"]["hidden_size"] * len(pooling.get("layers", [-1]))
        pooler = AttentionPooler(dim, int(pooling["num_queries"]))
    encoder = ILCPEncoder(
        BetaVAE(c["input_dim"], config["latent_dim"], c["hidden_dim"], c["beta"]),
        GatedLatentToMemoryProjector(config["latent_dim"], config["num_memory_tokens"], config["lm"]["hidden_size"],
                                     config["projector"]["hidden"]),
        pooler,
        chunk_tokens=int(pooling.get("chunk_tokens", 0)),
    )
    if state is not None:
        load_encoder_state(encoder, state, source=source)
    return encoder.eval()


@dataclass
class ExportedRun:
    """The trained memory sources of one export, on the CPU in float32."""

    path: Path
    config: dict
    encoder: ILCPEncoder | None = None
    soft_prompts: dict[str, Tensor] = field(default_factory=dict)  # baseline name -> (K, H)

    @property
    def fingerprint(self) -> str:
        return self.config["lm"]["fingerprint"]

    @property
    def lm_spec(self) -> str:
        return self.config["lm"]["spec"]


def read_config(path: str | Path) -> dict:
    path = Path(path)
    cfg_path = path / CONFIG_FILE
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
    """Read every trained memory source of an export (no LM needed)."""
    path = Path(path)
    config = read_config(path)
    run = ExportedRun(path=path, config=config)
    for name, fname in config.get("files", {}).items():
        fpath = path / fname
        if not fpath.is_file():
            raise ExportError(f"{fpath} is listed in config.json but missing")
        state = load_file(str(fpath))
        if name == "ilcp":
            run.encoder = build_encoder(config, state, source=str(fpath))
        else:
            run.soft_prompts[name] = load_soft_prompt(state, source=str(fpath))
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
