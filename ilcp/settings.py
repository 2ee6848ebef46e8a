"""One way to declare a setting: a dataclass field with its type (the annotation), default, help,
bounds and choices, checked by one function.

    lr: float = setting(1e-3, "stage-1 AdamW learning rate", above=0, maximum=MAX_LR)

The training config's sections (`ilcp.config_sections`), the memory kinds (`ilcp.encoder.kinds`),
the exported encoder settings (`ilcp.encoder.spec`) and eval's settings (`ilcp.eval_config`)
declare theirs this way; ``python train.py --help`` prints the help and bounds from these
declarations (`describe`), and the sweep driver's schema (`ilcp_experiments.sweep.schema`) reads
them instead of keeping its own. Standard library only: configs are checked before torch loads.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import MISSING, field

__all__ = ["MAX_LR", "MAX_WEIGHT", "Declared", "check_value", "check_declared", "declared", "describe", "setting"]

# The largest learning rate a setting accepts: far above any that trains (Adam's steps are then
# the size of the rate itself), far below what overflows float32 in the optimizer's state.
MAX_LR = 1e3
# The largest weight of a loss term, a KL weight or a temperature: far above every recipe, below
# what makes a float32 loss overflow.
MAX_WEIGHT = 1e6


def setting(default=MISSING, help: str = "", *, minimum=None, maximum=None, above=None, below=None, choices=None,
            key: str | None = None, omit_default: bool = False, written_with: str | None = None,
            optional: bool = False, exported: bool = True, configurable: bool = True, compare: bool = True,
            default_factory=MISSING):
    """A dataclass field declared as a setting.

    Args:
        default: the value when the setting is not given (a list or dict is copied per instance).
        help: one line for ``--help`` and the docs.
        minimum, maximum, above, below: the value must be >= minimum, <= maximum, > above, < below.
        choices: the value must be one of these.
        key: the setting's entry in a file that names it otherwise (config.json's
            "compressor.beta"); None: its field name.
        omit_default: written only when it differs from the default (and may be absent).
        written_with: written exactly when the named setting is written (an entry of its object).
        optional: may be absent when read, whatever else is there (an entry older files lack).
        exported: written to, and read from, an export's config.json (False: a training setting).
        configurable: set in the training config (False: filled in by the run, e.g. from the LM).
        compare: part of equality (False: a setting that does not change what is built).
    """
    meta = {"help": help, "minimum": minimum, "maximum": maximum, "above": above, "below": below, "choices": choices,
            "key": key,
            "omit_default": omit_default, "written_with": written_with, "optional": optional, "exported": exported,
            "configurable": configurable}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta, compare=compare)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, compare=compare)
    return field(default=default, metadata=meta, compare=compare)


@dataclasses.dataclass(frozen=True)
class Declared:
    """One declared setting of a dataclass: its name, type, default and declaration."""

    name: str
    type: object
    default: object
    meta: dict

    @property
    def help(self) -> str:
        return self.meta.get("help", "")

    @property
    def key(self) -> str:
        return self.meta.get("key") or self.name

    def describe(self) -> str:
        """The help line with the default and the bounds: "learning rate (default 0.001; > 0)"."""
        shown = "none" if self.default is MISSING else repr(self.default)
        return f"{self.help} ({'; '.join(filter(None, [f'default {shown}', self.bounds()]))})"

    @property
    def nullable(self) -> bool:
        """Whether None is a value of the setting's type (``int | None``)."""
        return _base_type(self.type)[1]

    def bounds(self) -> str:
        """The declared bounds and choices in words ("> 0, <= 1000"), or ""."""
        meta, parts = self.meta, []
        if meta.get("above") is not None:
            parts.append(f"> {meta['above']:g}")
        if meta.get("minimum") is not None:
            parts.append(f">= {meta['minimum']:g}")
        if meta.get("maximum") is not None:
            parts.append(f"<= {meta['maximum']:g}")
        if meta.get("below") is not None:
            parts.append(f"< {meta['below']:g}")
        if meta.get("choices") is not None:
            parts.append("one of " + ", ".join(map(str, meta["choices"])))
        return ", ".join(parts)


def declared(cls) -> list[Declared]:
    """The declared settings of dataclass `cls` (a class or an instance), in field order."""
    cls = cls if isinstance(cls, type) else type(cls)
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        found.append(Declared(f.name, hints.get(f.name, typing.Any), default, dict(f.metadata)))
    return found


def _base_type(hint):
    """(the plain type of an annotation, whether None is allowed)."""
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (_base_type(rest[0])[0] if len(rest) == 1 else typing.Any), True
    origin = typing.get_origin(hint)
    return (origin if origin is not None else hint), False


def check_value(name: str, value, hint, meta: dict) -> None:
    """Raise ValueError (one line naming `name`) when `value` is not of type `hint` (a bool is no
    number; a float must be finite) or breaks the declared bounds or choices in `meta`."""
    kind, nullable = _base_type(hint)
    if value is None and nullable:
        return
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        what = "a number"  # finite
    elif kind is int:
        ok, what = isinstance(value, int) and not isinstance(value, bool), "int"
    elif kind in (bool, str, list, dict, tuple):
        ok, what = isinstance(value, kind), kind.__name__
    else:
        ok, what = True, ""
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ValueError(f"{name} must be one of {list(meta['choices'])}, got {value!r}")
    if meta.get("minimum") is not None and value < meta["minimum"]:
        raise ValueError(f"{name} must be >= {meta['minimum']}, got {value!r}")
    if meta.get("maximum") is not None and value > meta["maximum"]:
        raise ValueError(f"{name} must be <= {meta['maximum']:,}, got {value!r}")
    if meta.get("above") is not None and not value > meta["above"]:
        raise ValueError(f"{name} must be > {meta['above']}, got {value!r}")
    if meta.get("below") is not None and not value < meta["below"]:
        raise ValueError(f"{name} must be < {meta['below']}, got {value!r}")


def check_declared(obj, name_of=lambda name: name) -> None:
    """Check every declared setting of dataclass instance `obj` (`check_value`); `name_of` turns
    a field name into the name an error gives ("compressor.lr")."""
    for d in declared(obj):
        check_value(name_of(d.name), getattr(obj, d.name), d.type, d.meta)


def describe(cls, prefix: str = "", expand=None) -> list[tuple[str, str]]:
    """``[(prefix + name, "help (default X; bounds)"), ...]`` for every setting of `cls`, the
    settings of nested dataclass sections included (the text of ``--help``). ``expand(name,
    declared)`` may give the rows of a setting itself (a section of several shapes, such as the
    memory kinds), or None for the plain row."""
    rows = []
    for d in declared(cls):
        kind, _ = _base_type(d.type)
        own = expand(f"{prefix}{d.name}", d) if expand is not None else None
        if own is not None:
            rows += own
        elif isinstance(kind, type) and dataclasses.is_dataclass(kind):
            rows += describe(kind, f"{prefix}{d.name}.", expand)
        else:
            rows.append((f"{prefix}{d.name}", d.describe()))
    return rows
