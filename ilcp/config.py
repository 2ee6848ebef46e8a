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
import textwrap
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from .config_sections import CompressorConfig, DataConfig, HandoffConfig, LMConfig, ReconstructConfig, TrainerConfig
from .encoder.kinds import MemoryKind, memory_from_settings

# settings of the training config's earlier shape, each with the key that holds it now: an old
# config is refused in one line naming the new key
MOVED = {
    "compressor.pooling": "compressor.memory.kind",
    "compressor.pool_queries": "compressor.memory.pool_queries",
    "compressor.chunk_tokens": "compressor.memory.chunk_tokens",
    "compressor.tokens_per_slot": "compressor.memory.tokens_per_slot",
    "compressor.min_slots": "compressor.memory.min_slots",
    "compressor.max_slots": "compressor.memory.max_slots",
    "compressor.slot_adapter_rank": "compressor.memory.adapter_rank",
    "compressor.slot_adapter_targets": "compressor.memory.adapter_targets",
}



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
        c, r = self.compressor, self.reconstruct
        if c.story_attention_weight > 0 and not self.data.task.startswith("babilong"):
            raise ValueError(f"compressor.story_attention_weight > 0 needs a BABILong task (data.task "
                             f"'babilong:N:LENGTH'), where the story's place in the context is known; got "
                             f"{self.data.task!r}")
        if not c.memory.reads_sender_lm and (r.texts != ["task"] or r.continuation > 0 or r.text_tokens > 0):
            raise ValueError("reconstruct.texts besides 'task', reconstruct.continuation and reconstruct.text_tokens "
                             "read texts whose sender states are not cached: they need a memory kind that reads the "
                             f"sender's LM (compressor.memory.kind=slots), not {c.memory.kind!r}")
        c.memory.check_run(self)
        if self.reconstruct.enabled and "ilcp" not in self.handoff.variants:
            raise ValueError("reconstruct.steps > 0 trains the ilcp encoder: add ilcp to handoff.variants")
        if self.handoff.max_steps == 0 and not (self.reconstruct.enabled or self.compressor.init_from
                                                or c.memory.exports_as_started):
            raise ValueError("handoff.max_steps=0 exports the encoder without an answer stage: it needs a pretraining "
                             "stage (reconstruct.steps > 0) or compressor.init_from to have trained it")
        if (self.reconstruct.token_steps > 0 or self.reconstruct.token_weight > 0) and not (
                c.memory.chunk_tokens > 0 and self.handoff.num_memory_tokens == c.memory.chunk_tokens):
            raise ValueError("reconstruct.token_steps / token_weight read memory vector j of a chunk of tokens as its "
                             "j-th token: they need compressor.memory.chunk_tokens > 0 and handoff.num_memory_tokens "
                             "equal to it")
        if self.trainer.precision == "bf16-mixed" and self.lm.dtype == "float16":
            raise ValueError(f"trainer.precision {self.trainer.precision} with lm.dtype float16: pick one "
                             "half-precision type")

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.run_name

    def to_dict(self) -> dict:
        """The config as nested plain values (``compressor.memory`` as its ``kind`` and settings)."""
        out = dataclasses.asdict(self)
        out["compressor"]["memory"] = self.compressor.memory.settings()
        return out


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
    # an override of a memory kind comes first and starts that kind from its defaults: the file's
    # settings of another kind are dropped, the other overrides then apply to the new kind
    overrides = sorted(overrides, key=lambda item: not item.split("=", 1)[0].strip().endswith("memory.kind"))
    for item in overrides:
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
        if parts[-2:-1] == ["memory"] and parts[-1] == "kind" and node.get("kind") != value:
            node.clear()
        node[parts[-1]] = value
    return from_dict(TrainConfig, data)


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types by name."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    moved = [f"{prefix}{name}" for name in unknown if f"{prefix}{name}" in MOVED]
    if moved:
        example = "compressor.memory.kind=slots" if moved[0] == "compressor.pooling" else f"{MOVED[moved[0]]}=..."
        raise ValueError(f"{moved[0]} is now {MOVED[moved[0]]} (the memory kind and its own settings, "
                         f"e.g. {example}; configs/README.md)")
    if unknown:
        raise ValueError(_unknown_fields(data, unknown, list(fields), prefix))
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if isinstance(hint, type) and issubclass(hint, MemoryKind):
            kwargs[name] = memory_from_settings(value or {}, fields[name].default, prefix=f"{prefix}{name}.")
        elif dataclasses.is_dataclass(hint):
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
        if isinstance(hint, type) and issubclass(hint, MemoryKind):
            paths += [f"{prefix}{name}.kind"]
        elif dataclasses.is_dataclass(hint):
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


def settings_help() -> str:
    """Every training setting with its help, default and bounds, read from the declarations
    (`ilcp.settings`): the sections' fields, and each memory kind's own settings."""
    from .encoder.kinds import memory_kinds
    from .names import MEMORY_KINDS
    from .settings import describe

    def memory(name, declared):
        if not name.endswith(".memory"):
            return None
        rows = [(f"{name}.kind", f"{declared.help} (default {declared.default.kind!r})")]
        for kind, cls in memory_kinds().items():
            entry = MEMORY_KINDS.get(kind)
            rows.append((f"{name}.kind={kind}", entry.help if entry else cls.__doc__.split(".")[0]))
            rows += cls.describe_settings(f"{name}.")
        return rows

    lines = ["settings (section.key=value; `python train.py --help` reads them from the config's declarations):"]
    for key, text in describe(TrainConfig, expand=memory):
        lines.append(textwrap.fill(text, width=100, initial_indent=f"  {key}: ", subsequent_indent="      ",
                                   break_on_hyphens=False))
    return "\n".join(lines)


def is_chunk_recipe(path: str | None) -> bool:
    """Whether a YAML file is a chunk pretraining recipe (its top level names ``chunk_tokens``), which
    ``python train.py --config FILE`` runs as `ilcp.training.chunk_recipe.train_recipe` instead of the
    handoff pipeline."""
    if not path or not Path(path).is_file():
        return False
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(loaded, dict) and "chunk_tokens" in loaded
