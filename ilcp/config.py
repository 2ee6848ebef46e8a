"""Typed training configuration: defaults, then a YAML file, then ``key=value`` overrides.

    cfg = load_config("configs/tiny.yaml", ["handoff.max_steps=4", "run_name=smoke"])

`TrainConfig` holds the sections of `ilcp.config_sections`. Every field carries its help text
(``field(metadata={"help": ...})``); `__post_init__` checks each section, and
`TrainConfig.validate` checks combinations, so a bad config is a ValueError naming the field
before any model loads.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from .config_sections import CompressorConfig, DataConfig, HandoffConfig, LMConfig, ReconstructConfig, TrainerConfig



@dataclass
class TrainConfig:
    run_name: str = field(default="default", metadata={"help": "the run's folder under out_dir"})
    out_dir: str = field(default="checkpoints", metadata={"help": "where runs are written"})
    lm: LMConfig = field(default_factory=LMConfig)
    data: DataConfig = field(default_factory=DataConfig)
    compressor: CompressorConfig = field(default_factory=CompressorConfig)
    reconstruct: ReconstructConfig = field(default_factory=ReconstructConfig)
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if not self.run_name or "/" in self.run_name or self.run_name in {".", ".."}:
            raise ValueError(f"run_name must be a plain folder name, got {self.run_name!r}")
        if self.data.val_decode_size > self.data.val_size:
            raise ValueError(
                f"data.val_decode_size ({self.data.val_decode_size}) must be <= data.val_size ({self.data.val_size})"
            )
        if self.handoff.joint_kl_weight > 0 and not self.handoff.finetune_encoder:
            raise ValueError("handoff.joint_kl_weight needs handoff.finetune_encoder=true (a frozen encoder has no KL to train)")
        c = self.compressor
        if (c.pooling == "attention" and "ilcp" in self.handoff.variants
                and not (self.handoff.finetune_encoder or c.answer_head_weight > 0 or self.reconstruct.enabled)):
            raise ValueError("compressor.pooling=attention needs handoff.finetune_encoder=true, "
                             "compressor.answer_head_weight > 0 or reconstruct.steps > 0 (nothing else teaches the "
                             "pooler's queries)")
        if c.story_attention_weight > 0 and not self.data.task.startswith("babilong"):
            raise ValueError(f"compressor.story_attention_weight > 0 needs a BABILong task (data.task "
                             f"'babilong:N:LENGTH'), where the story's place in the context is known; got "
                             f"{self.data.task!r}")
        if c.pooling == "slots" and not (self.handoff.finetune_encoder or self.reconstruct.enabled or c.init_from):
            raise ValueError("compressor.pooling=slots trains the slots and the VAE in stage 2 unless a pretraining "
                             "stage (reconstruct.steps > 0) or compressor.init_from trained them: it needs "
                             "handoff.finetune_encoder=true")
        r = self.reconstruct
        if c.pooling != "slots" and (r.texts != ["task"] or r.continuation > 0 or r.text_tokens > 0):
            raise ValueError("reconstruct.texts besides 'task', reconstruct.continuation and reconstruct.text_tokens "
                             "read texts whose sender states are not cached: they need compressor.pooling=slots")
        if c.pooling == "slots" and self.reconstruct.token_steps + self.reconstruct.token_weight > 0:
            raise ValueError("reconstruct.token_steps / token_weight read chunks of tokens, not memory slots")
        if self.reconstruct.enabled and "ilcp" not in self.handoff.variants:
            raise ValueError("reconstruct.steps > 0 trains the ilcp encoder: add ilcp to handoff.variants")
        if self.handoff.max_steps == 0 and not (self.reconstruct.enabled or self.compressor.init_from):
            raise ValueError("handoff.max_steps=0 exports the encoder without an answer stage: it needs a pretraining "
                             "stage (reconstruct.steps > 0) or compressor.init_from to have trained it")
        if (self.reconstruct.token_steps > 0 or self.reconstruct.token_weight > 0) and not (
                self.compressor.chunk_tokens > 0 and self.handoff.num_memory_tokens == self.compressor.chunk_tokens):
            raise ValueError("reconstruct.token_steps / token_weight read memory vector j of a chunk as its j-th token: "
                             "they need compressor.chunk_tokens > 0 and handoff.num_memory_tokens equal to it")
        if self.trainer.precision == "bf16-mixed" and self.lm.dtype == "float16":
            raise ValueError(f"trainer.precision {self.trainer.precision} with lm.dtype float16: pick one "
                             "half-precision type")

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.run_name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Defaults, then the YAML file at `path` (if any), then ``section.key=value`` overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        loaded = yaml.safe_load(path.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value (e.g. handoff.max_steps=50)")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw.strip() else None
        if isinstance(value, dict) and not raw.lstrip().startswith("{"):
            value = raw.strip()  # "jsonl:" read as a YAML mapping: the text as it was typed
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = value
    return from_dict(TrainConfig, data)


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types by name."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ValueError(_unknown_fields(data, unknown, list(fields), prefix))
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = from_dict(hint, value or {}, prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(str(e)) from None


def _unknown_fields(data: dict, unknown: list, known: list[str], prefix: str) -> str:
    """One line naming the unknown keys of a section, each with the closest valid key: a close
    spelling in the same section, else a key of that name in another section."""
    def suggestion(name: str) -> str | None:
        close = get_close_matches(name, known, n=1)
        if close:
            return prefix + close[0]
        elsewhere = [path for path in _field_paths(TrainConfig) if path.rsplit(".", 1)[-1] == name]
        return " or ".join(filter(None, [", ".join(elsewhere[:-1]), *elsewhere[-1:]])) or None

    suggested = {name: suggestion(str(name)) for name in unknown}
    listing = f"known: {', '.join(prefix + k for k in known)}"
    if len(unknown) == 1:
        name, = unknown
        kind = "section" if isinstance(data[name], dict) else "field"
        hint = f"did you mean {suggested[name]}?" if suggested[name] else listing
        return f"unknown config {kind} {prefix}{name}; {hint}"
    names = ", ".join(f"{prefix}{name}" + (f" (did you mean {suggested[name]}?)" if suggested[name] else "")
                      for name in unknown)
    return f"unknown config fields {names}" + ("" if all(suggested.values()) else f"; {listing}")


def _field_paths(cls, prefix: str = "") -> list[str]:
    """Every ``section.key`` (and top-level key) of dataclass `cls`."""
    paths = []
    for name, hint in get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            paths += _field_paths(hint, f"{prefix}{name}.")
        else:
            paths.append(f"{prefix}{name}")
    return paths


def _coerce(value, hint, name: str):
    if hint is Any:
        return value
    args = [a for a in get_args(hint) if a is not type(None)]
    if get_origin(hint) is not None and type(None) in get_args(hint):
        if value is None:
            return None
        hint = args[0]
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
        if value is None:  # ``name=`` (nothing after it) reads as YAML's null: the empty string
            return ""
    elif hint is list or get_origin(hint) is list:
        if isinstance(value, list):
            return value
    else:
        return value
    raise ValueError(f"config field {name!r} expects {getattr(hint, '__name__', hint)}, got {value!r}")


def save_config(cfg: TrainConfig, path: Path) -> None:
    """The resolved config as YAML (written atomically)."""
    from .io import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=True))


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested config dict as {"section.key": value}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
