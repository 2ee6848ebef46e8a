"""The sweep file read and checked into a `Sweep` (`load_sweep`), and what it asks to evaluate
(`eval_entries`); the format is described in `ilcp_experiments.sweep`.

The settings a sweep passes on are checked by their own declarations (`ilcp.settings`): a
point's overrides by the training config's (`load_config`), its eval settings and payload dtype
by `ilcp.eval_config.EvalConfig`'s bounds and choices; this module keeps only the sweep's own
defaults."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
import yaml
from ilcp.config import TrainConfig, flatten, load_config
from ilcp.config_sections import VARIANTS
from ilcp.eval_config import EvalConfig
from ilcp.settings import declared
from ilcp.names import split_task_names
from ilcp.evaluation.registry import expand_method_names, make_method
from ilcp.evaluation.run import parse_task


PLOT = "accuracy_vs_wire_bytes.png"


SWEEP_JSON = "sweep.json"


SWEEP_MD = "sweep.md"


EVAL_RECORD = "sweep_eval.json"


REFERENCE = "reference"


SELECTION = "selection"


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


_TOP_KEYS = {"name", "description", "base", "overrides", "checkpoints", "out", "eval", "reference", "selection",
             "points"}


_POINT_KEYS = {"name", "run", "overrides", "payload_dtype", "description"}


_REFERENCE_KEYS = {"methods", "run", "overrides"}


_SELECTION_KEYS = {"methods", "tasks", "limit"}


_SELECTION_FAMILIES = ("rclc", "kv_relay")


_SWEEP_OWNED = ("run_name", "out_dir", "handoff.variants")  # set by the sweep for every run

# eval's declared settings (bounds, choices), which the sweep's eval settings are checked by
_EVAL = {d.name: d for d in declared(EvalConfig)}
DTYPES = _EVAL["payload_dtype"].meta["choices"]


class SweepError(ValueError):
    """A sweep file, a run folder or a request the sweep cannot honour."""


@dataclass(frozen=True)
class EvalSettings:
    tasks: tuple[str, ...] = ()
    limit: int | None = 200
    facts_counts: tuple[int, ...] = (1, 4, 8)
    facts_count_limit: int = 50
    latency_n: int = 0
    batch_size: int = 8
    max_new_tokens: int = 8
    seed: int = 0


@dataclass(frozen=True)
class Point:
    name: str
    run: str
    overrides: tuple[str, ...]
    payload_dtype: str = "float32"
    description: str = ""


@dataclass(frozen=True)
class Reference:
    methods: tuple[str, ...]
    run: str | None  # None: no weights needed, evaluated on the first point's run
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Selection:
    methods: tuple[str, ...]
    tasks: tuple[str, ...]  # besides the training task; a subset of eval.tasks
    limit: int | None


@dataclass
class Sweep:
    path: Path
    name: str
    base: Path
    overrides: tuple[str, ...]
    points: tuple[Point, ...]
    reference: Reference | None
    eval: EvalSettings
    checkpoints: Path
    out: Path
    description: str = ""
    extra: tuple[str, ...] = ()
    selection: Selection | None = None
    configs: dict[str, TrainConfig] = field(default_factory=dict)  # run name -> resolved config

    def run_names(self) -> list[str]:
        """Every run to train, reference first, in sweep order."""
        names = [self.reference.run] if self.reference is not None and self.reference.run else []
        return list(dict.fromkeys(names + [p.run for p in self.points]))


def _find(path_text, sweep_path: Path, what: str) -> Path:
    if not isinstance(path_text, str) or not path_text.strip():
        raise SweepError(f"{sweep_path}: {what} must be a path, got {path_text!r}")
    path = Path(path_text).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [Path.cwd() / path] + [folder / path for folder in sweep_path.resolve().parents]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise SweepError(f"{sweep_path}: {what} {path_text!r} not found (looked in the current directory and in "
                     f"{sweep_path.parent} and the folders above it)")


def _overrides(value, where: str) -> tuple[str, ...]:
    """Overrides as ``key=value`` strings from a list of them, one space-separated string, or a mapping."""
    if value is None:
        return ()
    if isinstance(value, str):
        items = shlex.split(value)
    elif isinstance(value, dict):
        items = []
        for key, v in value.items():
            if not isinstance(key, str) or not key.strip():
                raise SweepError(f"{where}: override keys must be strings such as compressor.latent_dim, got {key!r}")
            items.append(f"{key}={json.dumps(v)}")
    elif isinstance(value, list):
        items = value
    else:
        raise SweepError(f"{where} must be a list of key=value strings, a mapping or a string, got {value!r}")
    out = []
    for item in items:
        if not isinstance(item, str) or "=" not in item or not item.split("=", 1)[0].strip():
            raise SweepError(f"{where}: {item!r} is not a key=value override (e.g. compressor.latent_dim=128)")
        out.append(item)
    return tuple(out)


def _owned(overrides: Sequence[str], where: str, allowed: Sequence[str] = ()) -> None:
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in _SWEEP_OWNED and key not in allowed:
            raise SweepError(f"{where}: {key} is set by the sweep (run names, the --checkpoints folder, and "
                             "handoff.variants: points train ilcp, the reference run the baselines it needs)")


def _int(value, name: str, low: int, where: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SweepError(f"{where}: {name} must be an int >= {low}, got {value!r}")
    return value


def eval_settings(raw, where: Path, limit: int | None) -> EvalSettings:
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise SweepError(f"{where}: eval must be a mapping, got {raw!r}")
    known = {f for f in EvalSettings.__dataclass_fields__}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SweepError(f"{where}: unknown eval key(s) {unknown}; known: {sorted(known)}")
    defaults = EvalSettings()
    tasks = raw.get("tasks", list(defaults.tasks)) or []
    if isinstance(tasks, str):
        tasks = split_task_names(tasks)
    if not isinstance(tasks, list):
        raise SweepError(f"{where}: eval.tasks must be a list of task names, got {tasks!r}")
    for t in tasks:
        try:
            parse_task(t)
        except ValueError as e:
            raise SweepError(f"{where}: eval.tasks: {e}") from None
    def declared_int(name: str) -> int:
        return _int(raw.get(name, getattr(defaults, name)), f"eval.{name}", _EVAL[name].meta["minimum"], where)

    lim = raw.get("limit", defaults.limit)
    lim = None if lim in (None, 0) else declared_int("limit")
    counts = raw.get("facts_counts", list(defaults.facts_counts)) or []
    if not isinstance(counts, list):
        raise SweepError(f"{where}: eval.facts_counts must be a list of ints, got {counts!r}")
    counts = [_int(c, "eval.facts_counts", 1, where) for c in counts]
    settings = EvalSettings(
        tasks=tuple(t.strip() for t in tasks),
        limit=lim,
        facts_counts=tuple(dict.fromkeys(counts)),
        facts_count_limit=declared_int("facts_count_limit"),
        latency_n=declared_int("latency_n"),
        batch_size=declared_int("batch_size"),
        max_new_tokens=declared_int("max_new_tokens"),
        seed=declared_int("seed"),
    )
    if limit is not None:
        settings = replace(settings, limit=limit, facts_count_limit=limit)
    return settings


def _section_methods(raw, where: Path, section: str, keys: set, others: str, what: str) -> tuple[list[str], list]:
    """A reference or selection mapping's checked keys, and its methods: names with the groups
    expanded, and the methods made from them."""
    if not isinstance(raw, dict):
        raise SweepError(f"{where}: {section} must be a mapping with methods {others}, got {raw!r}")
    unknown = sorted(set(raw) - keys)
    if unknown:
        raise SweepError(f"{where}: unknown {section} key(s) {unknown}; known: {sorted(keys)}")
    methods = raw.get("methods") or []
    if isinstance(methods, str):
        methods = [m for m in methods.split(",") if m.strip()]
    if not isinstance(methods, list) or not methods:
        raise SweepError(f"{where}: {section}.methods must be a non-empty list of {what}")
    try:
        names = expand_method_names(methods)
        return names, [make_method(n) for n in names]
    except ValueError as e:
        raise SweepError(f"{where}: {section}.methods: {e}") from None


def _reference(raw, where: Path, points: Sequence[Point],
               selection_needs: Sequence[str] | None = None) -> Reference | None:
    """The reference section; ``selection_needs``: the variants the selection rows (read on the
    same run) need, trained by the reference run too (None: no selection section)."""
    if raw is None:
        if selection_needs is not None:
            raise SweepError(f"{where}: selection is read on the reference run: add a reference section")
        return None
    names, made = _section_methods(raw, where, "reference", _REFERENCE_KEYS, "(and run, overrides)", "method names")
    if "ilcp" in names:
        raise SweepError(f"{where}: reference.methods lists ilcp; the sweep's points are the ilcp rows")
    required = {r for m in made for r in m.requires} | set(selection_needs or ())
    unknown_req = sorted(required - set(VARIANTS))
    if unknown_req:
        raise SweepError(f"{where}: reference methods need weights no training variant gives: {unknown_req}")
    overrides = _overrides(raw.get("overrides"), f"{where}: reference.overrides")
    _owned(overrides, f"{where}: reference.overrides")
    run = raw.get("run", REFERENCE)
    if not isinstance(run, str) or not _NAME.match(run):
        raise SweepError(f"{where}: reference.run must be a plain name (letters, digits, . _ -), got {run!r}")
    for label in (REFERENCE, SELECTION):
        if label in {p.name for p in points}:
            raise SweepError(f"{where}: a point is named {label!r}, the name of the {label} rows' evaluation; "
                             "rename the point")
    if required and run in {p.run for p in points}:
        raise SweepError(f"{where}: reference.run {run!r} is also a point's run; give it another name")
    if not required:
        if overrides:
            raise SweepError(f"{where}: reference.overrides given, but no reference method needs trained weights "
                             "(so there is no reference run to train)")
        return Reference(methods=tuple(names), run=None)
    return Reference(methods=tuple(names), run=run, overrides=overrides)


def _selection(raw, where: Path, settings: EvalSettings,
               limit: int | None) -> tuple[Selection | None, list[str] | None]:
    """The selection section and the training variants its rows need (None, None: no section)."""
    if raw is None:
        return None, None
    names, made = _section_methods(raw, where, "selection", _SELECTION_KEYS, "(and tasks, limit)",
                                   "rclc:/kv_relay: rows or groups (e.g. rclc-budgets)")
    other = [n for n in names if n.split(":")[0] not in _SELECTION_FAMILIES]
    if other:
        raise SweepError(f"{where}: selection.methods holds {other}: only rclc:... and kv_relay:... rows are drawn as "
                         "budget curves (list other methods under reference)")
    tasks = raw.get("tasks", list(settings.tasks))
    if isinstance(tasks, str):
        tasks = split_task_names(tasks)
    if (not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks)
            or not {t.strip() for t in tasks} <= set(settings.tasks)):
        raise SweepError(f"{where}: selection.tasks must be a list drawn from eval.tasks {list(settings.tasks)}, "
                         f"got {tasks!r}")
    lim = raw.get("limit", settings.limit) if limit is None else limit
    lim = None if lim in (None, 0) else _int(lim, "selection.limit", 1, where)
    needs = sorted({r for m in made for r in m.requires})
    return Selection(methods=tuple(names), tasks=tuple(t.strip() for t in tasks), limit=lim), needs


def _points(raw, where: Path) -> tuple[Point, ...]:
    if not isinstance(raw, list) or not raw:
        raise SweepError(f"{where}: points must be a non-empty list of {{name, overrides, payload_dtype}} mappings")
    points = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise SweepError(f"{where}: points[{i}] must be a mapping, got {item!r}")
        unknown = sorted(set(item) - _POINT_KEYS)
        if unknown:
            raise SweepError(f"{where}: points[{i}]: unknown key(s) {unknown}; known: {sorted(_POINT_KEYS)}")
        name = item.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise SweepError(f"{where}: points[{i}].name must be a plain name (letters, digits, . _ -), got {name!r}")
        run = item.get("run", name)
        if not isinstance(run, str) or not _NAME.match(run):
            raise SweepError(f"{where}: point {name!r}: run must be a plain name, got {run!r}")
        dtype = item.get("payload_dtype", "float32")
        if dtype not in DTYPES:
            raise SweepError(f"{where}: point {name!r}: payload_dtype must be one of {list(DTYPES)}, got {dtype!r}")
        overrides = _overrides(item.get("overrides"), f"{where}: point {name!r} overrides")
        _owned(overrides, f"{where}: point {name!r}")
        description = item.get("description", "")
        if not isinstance(description, str):
            raise SweepError(f"{where}: point {name!r}: description must be a string")
        points.append(Point(name=name, run=run, overrides=overrides, payload_dtype=dtype, description=description))
    names = [p.name for p in points]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SweepError(f"{where}: point names must be unique; repeated: {dupes}")
    seen: dict[tuple[str, str], str] = {}
    for p in points:
        if (p.run, p.payload_dtype) in seen:
            raise SweepError(f"{where}: points {seen[(p.run, p.payload_dtype)]!r} and {p.name!r} evaluate run "
                             f"{p.run!r} at the same payload dtype {p.payload_dtype}")
        seen[(p.run, p.payload_dtype)] = p.name
    return tuple(points)


def load_sweep(path: str | Path, *, out: str | Path | None = None, checkpoints: str | Path | None = None,
               limit: int | None = None, extra: Sequence[str] = ()) -> Sweep:
    """Read and check a sweep file and resolve every run's training config (nothing is loaded or
    trained). ``out``, ``checkpoints`` and ``limit`` replace the file's; ``extra`` overrides
    apply to every run last.

    Raises:
        SweepError (a ValueError): anything wrong with the file, a point or a resolved config.
    """
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"sweep file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SweepError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise SweepError(f"{path} must hold a mapping (name, base, points, ...), got {type(raw).__name__}")
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {unknown}; known: {sorted(_TOP_KEYS)}")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not _NAME.match(name):
        raise SweepError(f"{path}: name must be a plain name (letters, digits, . _ -), got {name!r}")
    if "base" not in raw:
        raise SweepError(f"{path}: base (the training config every run starts from) is required")
    base = _find(raw["base"], path, "base")
    overrides = _overrides(raw.get("overrides"), f"{path}: overrides")
    _owned(overrides, f"{path}: overrides")
    extra = _overrides(list(extra), "--set")
    _owned(extra, "--set")
    if limit is not None:
        _int(limit, "--limit", 1, path)
    points = _points(raw.get("points"), path)
    settings = eval_settings(raw.get("eval"), path, limit)
    selection, selection_needs = _selection(raw.get("selection"), path, settings, limit)
    reference = _reference(raw.get("reference"), path, points, selection_needs)
    for key, given in (("checkpoints", checkpoints), ("out", out)):
        if given is None and key in raw and (not isinstance(raw[key], str) or not raw[key].strip()):
            raise SweepError(f"{path}: {key} must be a folder path, got {raw[key]!r}")
    sweep = Sweep(
        path=path, name=name, base=base, overrides=overrides, points=points, reference=reference, eval=settings,
        checkpoints=Path(checkpoints if checkpoints is not None else raw.get("checkpoints", f"checkpoints/sweep-{name}")),
        out=Path(out if out is not None else raw.get("out", f"results/sweep-{name}")),
        description=str(raw.get("description", "") or ""), extra=extra, selection=selection,
    )
    _resolve_configs(sweep)
    return sweep


def _resolve_configs(sweep: Sweep) -> None:
    def resolve(run: str, own: Sequence[str], variants: Sequence[str], who: str) -> TrainConfig:
        items = [*sweep.overrides, *own, *sweep.extra, f"run_name={run}", f"out_dir={sweep.checkpoints}",
                 f"handoff.variants={json.dumps(list(variants))}"]
        try:
            return load_config(sweep.base, items)
        except ValueError as e:
            raise SweepError(f"{sweep.path}: {who}: {e}") from None

    configs: dict[str, TrainConfig] = {}
    first_point: dict[str, str] = {}
    for p in sweep.points:
        cfg = resolve(p.run, p.overrides, ["ilcp"], f"point {p.name!r}")
        if p.run in configs and configs[p.run].to_dict() != cfg.to_dict():
            diff = config_diff(configs[p.run].to_dict(), cfg.to_dict())
            raise SweepError(f"{sweep.path}: points {first_point[p.run]!r} and {p.name!r} share run {p.run!r} but "
                             f"resolve to different configs ({diff}): give them the same overrides or separate runs")
        configs.setdefault(p.run, cfg)
        first_point.setdefault(p.run, p.name)
    ref = sweep.reference
    if ref is not None and ref.run is not None:
        selection = sweep.selection.methods if sweep.selection is not None else ()
        required = {r for m in (*ref.methods, *selection) for r in make_method(m).requires}
        variants = [v for v in VARIANTS if v in required]
        configs[ref.run] = resolve(ref.run, ref.overrides, variants, "reference run")
    sweep.configs = {name: configs[name] for name in sweep.run_names()}


def config_diff(old: dict, new: dict, limit: int = 4) -> str:
    a, b = flatten(old), flatten(new)
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>"))
    parts = [f"{k}: {a.get(k, '<absent>')!r} there, {b.get(k, '<absent>')!r} here" for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return "; ".join(parts)


@dataclass(frozen=True)
class EvalEntry:
    label: str  # point name, or "reference"
    run: str
    methods: tuple[str, ...]
    payload_dtype: str
    kind: str  # "ilcp", "reference" or "selection"


def eval_entries(sweep: Sweep) -> list[EvalEntry]:
    entries = []
    ref = sweep.reference
    if ref is not None:
        entries.append(EvalEntry(REFERENCE, ref.run or sweep.points[0].run, ref.methods, "float32", "reference"))
    entries += [EvalEntry(p.name, p.run, ("ilcp",), p.payload_dtype, "ilcp") for p in sweep.points]
    if sweep.selection is not None:
        entries.append(EvalEntry(SELECTION, ref.run or sweep.points[0].run, sweep.selection.methods, "float32",
                                 "selection"))
    return entries


def entry_settings(sweep: Sweep, entry: EvalEntry) -> EvalSettings:
    """The eval settings of one entry: the sweep's, or for the selection rows their own tasks and
    limit and no facts-count sweep."""
    if entry.kind != "selection":
        return sweep.eval
    return replace(sweep.eval, tasks=sweep.selection.tasks, limit=sweep.selection.limit, facts_counts=())
