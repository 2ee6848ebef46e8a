"""Train and evaluate ILCP at several payload sizes; one plot of accuracy against wire bytes.

    python scripts/sweep.py --sweep configs/sweep/tiny.yaml --out /tmp/sweep-tiny --checkpoints /tmp/sweep-tiny-runs
    python scripts/sweep.py --sweep configs/sweep/facts.yaml                # results/sweep-facts
    python scripts/sweep.py --sweep configs/sweep/babi1.yaml                # results/sweep-babi1
    python scripts/sweep.py --sweep configs/sweep/facts.yaml --resume       # after an interruption
    python scripts/sweep.py --sweep configs/sweep/facts.yaml --limit 50     # quicker, wider intervals

`scripts/sweep.py` is this module's command line (`main`); `load_sweep` reads a sweep file and
`run_sweep` runs it, for use from Python.

Expected time on this project's 2-core CPU (SmolLM2-135M). These are estimates from the README's
figures (about 1.3 s per stage-2 step of batch 8; the facts run's 15 min 54 s for three variants;
200 ilcp questions decoded in about 36 s), not measurements of these sweeps:
- configs/sweep/tiny.yaml: about 10 s (tiny random LM; the test runs it);
- configs/sweep/facts.yaml: about 1 h 15 min: five ilcp trainings of 120 steps (about 5 min each,
  11 min with the 200-step reconstruction stage), the reference run (prompt_tuned and
  cold_read_tuned, about 10 min), the token states once (1.5 min), then about 2 min of evaluation
  per point and 10 min for the reference rows;
- configs/sweep/babi1.yaml: about 50 minutes (four ilcp trainings of about 6.5 min, the reference
  run about 12 min, evaluation about 11 min).
A second invocation reuses every finished run (only the evaluations run again: about a third of
the time); with --resume it also keeps the evaluations already written and only redraws the plot.

What it does:
1. reads the sweep file (format below) and resolves every run's training config: the base config,
   then the sweep's overrides, then the point's, then --set; ``run_name`` and ``out_dir`` (the
   --checkpoints folder) are set by the sweep. Points train ``handoff.variants=[ilcp]`` only; one
   reference run trains the tuned baselines the reference methods need (prompt_tuned,
   cold_read_tuned) once. Every config is validated before anything trains.
2. trains each run with `ilcp.training.train`, unless its folder already holds a finished run
   whose train_config.yaml resolves to the same config (then it is reused). A folder holding a
   different run is refused unless --overwrite; an unfinished run of the same config is continued
   with --resume, or started again with --overwrite.
3. evaluates each point with `ilcp.evaluation.run.evaluate` (method ilcp, at the point's wire
   dtype) and the reference run with the reference methods, on the training task's test split and
   the listed tasks, plus, for a facts-trained run, evaluate()'s accuracy against the number of
   facts (``facts_counts``). Each evaluation writes its usual report under OUT/evals/NAME/.
4. writes OUT/accuracy_vs_wire_bytes.png (exact match with 95% intervals against wire bytes per
   request, log x, one panel per task and per number of facts), OUT/sweep.json and OUT/sweep.md.

Accuracy against the number of facts comes from evaluate()'s facts-count sweep of each run
trained on the sweep's facts setting (4 facts), not from separate runs trained per number of
facts: one training per point instead of one per point and count. The 1- and 8-fact panels are
therefore runs trained on 4-fact contexts read at other lengths, for ilcp and the tuned
baselines alike; that sweep carries ilcp, prompt_tuned and cold_read_tuned only. Its rows report
no bytes, so the sweep computes them on the same questions: the packed payload of each context for
ilcp (`ILCPHandoff.send_each` at the point's dtype), the context's utf-8 bytes for the text
handoff, 0 for prompt_tuned.

The sweep file (YAML; relative paths are read from the current directory, then from the sweep
file's folder and each folder above it):

    name: facts                       # default folders: results/sweep-NAME, checkpoints/sweep-NAME
    description: ...                  # optional text, copied into sweep.md
    base: configs/facts.yaml          # the training config every run starts from
    overrides: [data.facts_value_split=train]   # every run; "key=value" strings, a mapping
                                      # {key: value} or one space-separated string
    checkpoints: checkpoints/sweep-facts        # optional; --checkpoints wins
    out: results/sweep-facts                    # optional; --out wins
    eval:
      tasks: [facts-heldout]          # besides the run's training task, which is always evaluated
      limit: 200                      # questions per task (0 or null: the whole test split)
      facts_counts: [1, 8]            # facts-trained runs: accuracy at these numbers of facts
      facts_count_limit: 100          # questions per number of facts
      latency_n: 0                    # requests timed per method and task (0: none)
      batch_size: 8
      max_new_tokens: 8
      seed: 0                         # eval seed (facts contexts of the length sweep)
    reference:                        # optional: rows other than ilcp, each at its own wire bytes
      methods: [cold_read, cold_read_tuned, prompt_tuned, rclc:cacheback:r4]
      run: reference                  # its run name (default "reference")
      overrides: []                   # training overrides of the reference run only
    selection:                        # optional: RCLC (or KV relay) rows through their budgets, read on
      methods: [rclc-budgets, rclc-budgets-tuned]   # the reference run and drawn as one curve per
      tasks: [babi:2]                 # selector; tasks: a subset of eval.tasks (default: all of them;
      limit: 100                      # the training task is always read); limit: default eval.limit
    points:
      - name: single-32               # run name too, unless run: is given
        description: ...              # optional
        overrides: [compressor.latent_dim=32]
      - name: chunk12-64-int8
        run: chunk12-64               # evaluate the run of another point (same overrides)
        overrides: [compressor.latent_dim=64, compressor.chunk_tokens=12]
        payload_dtype: int8           # float32 (default), float16, bfloat16 or int8

The reference run trains the variants its methods need (prompt_tuned for prompt_tuned,
cold_read_tuned for cold_read_tuned and rclc:...:tuned); when none needs trained weights, the
reference methods are evaluated on the first point's run instead. The selection rows are read
on the same run (which then also trains what they need: cold_read_tuned for ``:tuned``); the
sweep.md gets one table per task of exact match by selector and budget with r4/r1 and r16/r1, and
the plot one line per selector and option.

--limit N sets eval.limit, eval.facts_count_limit and selection.limit to N. --set key=value (repeatable)
adds a training override to every run (for example lm.cache_dir=... or trainer.accelerator=gpu);
it is part of the resolved config, so it decides reuse too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from ..config import VARIANTS, TrainConfig, flatten, load_config
from ..eval_config import EvalConfig
from ..export import read_export
from ..handoff import ILCPHandoff
from ..io import atomic_write_json, atomic_write_text
from ..lm import load_lm
from ..names import PAYLOAD_DTYPES as DTYPES
from ..names import split_task_names
from ..tasks import make_facts
from .registry import expand_method_names, make_method
from .report import selection_curves
from .run import run_facts_settings, evaluate, parse_task

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
_TEXT_METHODS = ("cold_read", "cold_read_tuned")
_EMPTY_METHODS = ("no_context", "prompt_tuned")


class SweepError(ValueError):
    """A sweep file, a run folder or a request the sweep cannot honour."""


# --------------------------------------------------------------------------------------------
# the sweep file


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


def _eval_settings(raw, where: Path, limit: int | None) -> EvalSettings:
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
    lim = raw.get("limit", defaults.limit)
    lim = None if lim in (None, 0) else _int(lim, "eval.limit", 1, where)
    counts = raw.get("facts_counts", list(defaults.facts_counts)) or []
    if not isinstance(counts, list):
        raise SweepError(f"{where}: eval.facts_counts must be a list of ints, got {counts!r}")
    counts = [_int(c, "eval.facts_counts", 1, where) for c in counts]
    settings = EvalSettings(
        tasks=tuple(t.strip() for t in tasks),
        limit=lim,
        facts_counts=tuple(dict.fromkeys(counts)),
        facts_count_limit=_int(raw.get("facts_count_limit", defaults.facts_count_limit), "eval.facts_count_limit", 1, where),
        latency_n=_int(raw.get("latency_n", defaults.latency_n), "eval.latency_n", 0, where),
        batch_size=_int(raw.get("batch_size", defaults.batch_size), "eval.batch_size", 1, where),
        max_new_tokens=_int(raw.get("max_new_tokens", defaults.max_new_tokens), "eval.max_new_tokens", 1, where),
        seed=_int(raw.get("seed", defaults.seed), "eval.seed", 0, where),
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
    settings = _eval_settings(raw.get("eval"), path, limit)
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
            diff = _diff(configs[p.run].to_dict(), cfg.to_dict())
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


def _shown(path: Path) -> str:
    """A path relative to the current directory when it lies below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _diff(old: dict, new: dict, limit: int = 4) -> str:
    a, b = flatten(old), flatten(new)
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>"))
    parts = [f"{k}: {a.get(k, '<absent>')!r} there, {b.get(k, '<absent>')!r} here" for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# training


def run_state(cfg: TrainConfig) -> tuple[str, str]:
    """What the run folder of ``cfg`` holds: ("empty" | "finished" | "unfinished" | "different", detail)."""
    run_dir = cfg.run_dir
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return "empty", ""
    saved = run_dir / "train_config.yaml"
    if not saved.is_file():
        return "different", f"{run_dir} holds files but no train_config.yaml"
    try:
        old = load_config(saved).to_dict()
    except ValueError as e:
        return "different", f"its train_config.yaml does not load with this package ({e})"
    if old != cfg.to_dict():
        return "different", f"its train_config.yaml differs ({_diff(old, cfg.to_dict())})"
    return ("finished", "") if (run_dir / "config.json").is_file() else ("unfinished", "")


def plan_training(sweep: Sweep, *, resume: bool, overwrite: bool) -> dict[str, str]:
    """run name -> "reuse", "train", "resume" or "retrain"; raises SweepError before anything
    trains when a folder holds a different or unfinished run and the flags do not allow it."""
    plan, problems = {}, []
    for name, cfg in sweep.configs.items():
        state, detail = run_state(cfg)
        if state == "empty":
            plan[name] = "train"
        elif state == "finished":
            plan[name] = "reuse"
        elif state == "unfinished":
            if resume:
                plan[name] = "resume"
            elif overwrite:
                plan[name] = "retrain"
            else:
                problems.append(f"{cfg.run_dir} holds an unfinished run of this config: pass --resume to continue "
                                "it or --overwrite to start it again")
        elif overwrite:
            plan[name] = "retrain"
        else:
            problems.append(f"{cfg.run_dir} holds another run: {detail}. Pass --overwrite to train it again with "
                            "this config, or name the point differently")
    if problems:
        raise SweepError("; ".join(problems))
    return plan


class _LMs:
    """Frozen LMs loaded on first use, one per (spec, dtype, cache folder)."""

    def __init__(self, given, log):
        self.given, self.log, self.loaded = given, log, {}

    def __call__(self, spec: str, dtype: str = "float32", cache_dir: str | None = None):
        if self.given is not None:
            given_dtype = str(self.given.dtype).removeprefix("torch.")
            if self.given.spec != spec or given_dtype != dtype:
                raise SweepError(f"the LM passed in is {self.given.spec!r} ({given_dtype}), but a run needs "
                                 f"{spec!r} ({dtype})")
            return self.given
        key = (spec, dtype, cache_dir)
        if key not in self.loaded:
            self.log(f"loading LM {spec!r} ({dtype})")
            self.loaded[key] = load_lm(spec, dtype=dtype, cache_dir=cache_dir)
        return self.loaded[key]


def train_runs(sweep: Sweep, plan: dict[str, str], lms: _LMs, log) -> dict[str, dict]:
    from ..training import train

    done = {}
    for name, action in plan.items():
        cfg = sweep.configs[name]
        if action == "reuse":
            log(f"run {name}: reusing the finished run in {cfg.run_dir} (same resolved config)")
            done[name] = {"training": "reused", "seconds": 0.0}
            continue
        log(f"run {name}: {'training' if action in ('train', 'retrain') else 'resuming'} "
            f"{'(replacing what the folder held) ' if action == 'retrain' else ''}into {cfg.run_dir}")
        t0 = time.perf_counter()
        train(cfg, resume=action == "resume", overwrite=action == "retrain",
              lm=lms(cfg.lm.spec, cfg.lm.dtype, cfg.lm.cache_dir))
        done[name] = {"training": {"train": "trained", "retrain": "retrained", "resume": "resumed"}[action],
                      "seconds": round(time.perf_counter() - t0, 1)}
        log(f"run {name}: done in {done[name]['seconds']:.0f} s")
    return done


# --------------------------------------------------------------------------------------------
# evaluation


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


def _entry_settings(sweep: Sweep, entry: EvalEntry) -> EvalSettings:
    """The eval settings of one entry: the sweep's, or for the selection rows their own tasks and
    limit and no facts-count sweep."""
    if entry.kind != "selection":
        return sweep.eval
    return replace(sweep.eval, tasks=sweep.selection.tasks, limit=sweep.selection.limit, facts_counts=())


def _run_digest(run_dir: Path) -> str:
    """sha256 of config.json and every weight file it lists: the evaluated run, byte for byte."""
    h = hashlib.sha256()
    config_path = run_dir / "config.json"
    data = config_path.read_bytes()
    h.update(data)
    for name in sorted(json.loads(data).get("files", {}).values()):
        h.update(name.encode())
        with open(run_dir / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _facts_count_bytes(run_dir: Path, config: dict, lm, methods: Sequence[str], counts: Sequence[int], n: int,
                       payload_dtype: str, batch_size: int) -> dict:
    """{count: {method: [wire bytes, tensor bytes] per request}} on the questions of evaluate()'s
    facts-count sweep (the same make_facts call), for the methods that sweep reports."""
    settings = run_facts_settings(config, run_dir)
    heldout = {"value_split": "heldout"} if settings.get("value_split") == "train" else {}
    handoff = None
    if "ilcp" in methods:
        handoff = ILCPHandoff.from_export(read_export(run_dir), lm, payload_dtype=payload_dtype)
    out = {}
    for count in counts:
        rows = make_facts(n, n_facts=count, n_distractors=settings["n_distractors"], seed=settings["seed"],
                          split="test", **heldout).to_list()
        contexts = [r["context"] for r in rows]
        per = {}
        for m in methods:
            if m == "ilcp":
                if handoff.encoder.chunked:
                    payloads = handoff.send_each(contexts, batch_size=batch_size)
                    per[m] = [sum(len(p.to_bytes()) for p in payloads) / len(payloads),
                              sum(p.byte_length() for p in payloads) / len(payloads)]
                else:
                    per[m] = [float(handoff.wire_bytes), float(handoff.tensor_bytes)]
            elif m in _TEXT_METHODS:
                per[m] = [sum(len(c.encode("utf-8")) for c in contexts) / len(contexts), 0.0]
            elif m in _EMPTY_METHODS:
                per[m] = [0.0, 0.0]
        out[str(count)] = per
    return out


def evaluate_entries(sweep: Sweep, lms: _LMs, *, resume: bool, log) -> dict[str, dict]:
    """label -> {"results": evaluate()'s results as written, "facts_count_bytes", "evaluation", "dir"}."""
    done = {}
    for entry in eval_entries(sweep):
        s = _entry_settings(sweep, entry)
        cfg = sweep.configs[entry.run]
        out = sweep.out / "evals" / entry.label
        key = {"run": entry.run, "run_digest": _run_digest(cfg.run_dir), "methods": list(entry.methods),
               "payload_dtype": entry.payload_dtype, "eval": asdict(s)}
        key = json.loads(json.dumps(key))
        record_path = out / EVAL_RECORD
        if resume and record_path.is_file() and (out / "results.json").is_file():
            record = json.loads(record_path.read_text())
            if record.get("key") == key:
                log(f"eval {entry.label}: reusing {out} (same run, methods and settings)")
                done[entry.label] = {"results": json.loads((out / "results.json").read_text()),
                                     "facts_count_bytes": record.get("facts_count_bytes") or {},
                                     "evaluation": "reused", "dir": str(out), "seconds": record.get("seconds")}
                continue
        log(f"eval {entry.label}: {', '.join(entry.methods)} on run {entry.run}"
            + (f" ({entry.payload_dtype} payload)" if entry.kind == "ilcp" else ""))
        lm = lms(cfg.lm.spec, cfg.lm.dtype, cfg.lm.cache_dir)
        t0 = time.perf_counter()
        settings = EvalConfig(tasks=list(s.tasks), methods=list(entry.methods), limit=s.limit, latency_n=s.latency_n,
                              batch_size=s.batch_size, max_new_tokens=s.max_new_tokens, lengths=[],
                              facts_counts=list(s.facts_counts), facts_count_limit=s.facts_count_limit, seed=s.seed,
                              out=out, payload_dtype=entry.payload_dtype)
        evaluate(cfg.run_dir, settings, lm=lm, log=lambda message, label=entry.label: log(f"  {label}: {message}"))
        results = json.loads((out / "results.json").read_text())
        count_bytes = {}
        sweep_rows = (results.get("facts_count") or {}).get("rows") or []
        if sweep_rows:
            methods = list(dict.fromkeys(r["method"] for r in sweep_rows))
            count_bytes = _facts_count_bytes(cfg.run_dir, json.loads((cfg.run_dir / "config.json").read_text()), lm,
                                             methods, results["facts_count"]["counts"],
                                             results["facts_count"]["questions_per_point"], entry.payload_dtype,
                                             s.batch_size)
        seconds = round(time.perf_counter() - t0, 1)
        atomic_write_json(record_path, {"key": key, "facts_count_bytes": count_bytes, "seconds": seconds})
        log(f"eval {entry.label}: done in {seconds:.0f} s")
        done[entry.label] = {"results": results, "facts_count_bytes": count_bytes, "evaluation": "evaluated",
                             "dir": str(out), "seconds": seconds}
    return done


# --------------------------------------------------------------------------------------------
# the table


def _panels_and_rows(sweep: Sweep, evals: dict[str, dict]) -> tuple[list[dict], list[dict]]:
    panels: dict[str, dict] = {}
    rows = []
    for entry in eval_entries(sweep):
        got = evals[entry.label]
        results = got["results"]
        point = next((p for p in sweep.points if p.name == entry.label), None) if entry.kind == "ilcp" else None

        def add(panel: str, method: str, m: dict, wire, tensor):
            rows.append({
                "panel": panel, "kind": entry.kind, "label": entry.label if entry.kind == "ilcp" else method,
                "method": method, "run": entry.run, "payload_dtype": entry.payload_dtype if method == "ilcp" else None,
                "n": m["n"], "exact_match": m["exact_match"], "exact_match_ci": m["exact_match_ci"],
                "contains": m.get("contains"), "wire_bytes": wire, "tensor_bytes": tensor,
                "description": point.description if point is not None else "",
            })

        for task, t in results["tasks"].items():
            panels.setdefault(task, {"key": task, "title": task, "source": t["source"], "n": t["n"],
                                     "seen_in_training": t["seen_in_training"]})
            for method, m in t["methods"].items():
                add(task, method, m, m["wire_bytes"], m["tensor_bytes"])
        count_sweep = results.get("facts_count") or {}
        if count_sweep.get("rows"):
            data = sweep.configs[entry.run].data
            held = data.task == "facts" and data.facts_value_split == "train"
            base = "facts-heldout" if held else "facts"
            for r in count_sweep["rows"]:
                panel = f"{base}@{r['n_facts']}"
                facts = "fact" if r["n_facts"] == 1 else "facts"
                panels.setdefault(panel, {
                    "key": panel, "title": f"{base}, {r['n_facts']} {facts} per context",
                    "source": (f"evaluate()'s facts-count sweep: {r['n_facts']} {facts}, {r['n_distractors']} "
                               f"distractors{', held-out values' if held else ''}"),
                    "n": r["n"], "seen_in_training": False, "facts_count": r["n_facts"]})
                wire, tensor = (got["facts_count_bytes"].get(str(r["n_facts"]), {}).get(r["method"]) or (None, None))
                add(panel, r["method"], r, wire, tensor)
    return list(panels.values()), rows


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _bytes(x) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def markdown(summary: dict) -> str:
    s = summary["eval"]
    extra = f"; --set `{' '.join(summary['extra'])}`" if summary["extra"] else ""
    lines = [
        f"# Payload sweep `{summary['name']}`",
        "",
        f"`python scripts/sweep.py --sweep {summary['sweep']}`: base config `{summary['base']}`, overrides "
        f"`{' '.join(summary['overrides']) or 'none'}`{extra}; "
        f"runs in `{summary['checkpoints']}`. Each eval: tasks {', '.join(summary['panels_tasks']) or '-'}, "
        f"{s['limit'] or 'all'} questions per task; facts counts {s['facts_counts'] or '-'} with "
        f"{s['facts_count_limit']} questions each (facts-trained runs); greedy, {s['max_new_tokens']} new tokens; "
        "95% Wilson score intervals.",
        "",
    ]
    if summary.get("description"):
        lines += [summary["description"].strip(), ""]
    lines += ["## Points", "",
              "| point | run | overrides | payload dtype | latent floats | chunk tokens | reconstruction steps "
              "| training | evaluation |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in summary["points"]:
        lines.append(f"| {p['name']} | {p['run']} | `{' '.join(p['overrides']) or '-'}` | {p['payload_dtype']} "
                     f"| {p['latent_dim']} | {p['chunk_tokens'] or '-'} | {p['reconstruct_steps'] or '-'} "
                     f"| {p['training']} | {p['evaluation']} |")
    ref = summary.get("reference")
    if ref:
        lines += ["", f"Reference rows: {', '.join(ref['methods'])}, evaluated on run `{ref['run']}` "
                      f"(trains {', '.join(ref['variants']) or 'nothing: none needs trained weights'}; "
                      f"training {ref['training']}, evaluation {ref['evaluation']})."]
    sel = summary.get("selection")
    if sel:
        lines += ["", f"Selection rows: {len(sel['methods'])} rclc/kv_relay rows on run `{sel['run']}`, "
                      f"{sel['limit'] or 'all'} questions per task (the training task"
                      f"{''.join(', ' + t for t in sel['tasks'])}; evaluation {sel['evaluation']}"
                      + (f", {sel['seconds']:.0f} s" if sel.get("seconds") else "") + "); tables below each panel's."]
    for panel in summary["panels"]:
        rows = sorted((r for r in summary["rows"] if r["panel"] == panel["key"] and r["kind"] != "selection"),
                      key=lambda r: (r["wire_bytes"] if r["wire_bytes"] is not None else -1, r["label"]))
        lines += ["", f"## {panel['title']}", "", f"{panel['source']}; n = {panel['n']}.", "",
                  "| row | kind | wire bytes | tensor bytes | exact match % [95% CI] | contains % | n |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            ci = r["exact_match_ci"]
            em = _pct(r["exact_match"]) + (f" [{_pct(ci[0])}, {_pct(ci[1])}]" if ci else "")
            kind = "reference" if r["kind"] == "reference" else f"ilcp {r['payload_dtype']}"
            lines.append(f"| {r['label']} | {kind} | {_bytes(r['wire_bytes'])} | {_bytes(r['tensor_bytes'])} | {em} "
                         f"| {_pct(r['contains'])} | {r['n']} |")
        lines += selection_table([r for r in summary["rows"] if r["panel"] == panel["key"]
                                  and r["kind"] == "selection"])
    if any("facts_count" in p for p in summary["panels"]):
        lines += ["", "Panels `@N` come from evaluate()'s facts-count sweep of runs trained on the base facts setting "
                      "(not from runs trained on N facts); it reports ilcp, prompt_tuned and cold_read_tuned only. "
                      "Their wire bytes are computed by the sweep on the same questions."]
    lines += ["", f"Plot: `{summary['plot']}`. Wire bytes: what crosses the handoff per request (ilcp: the packed "
                  "payload with header and CRC; text: the context's utf-8 bytes; RCLC: the selected rows). "
                  f"Sweep time: {summary['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def _budget_order(budget: str) -> tuple[int, int]:
    """r<N> by falling N (fewest rows first), then b<N> by rising N."""
    n = int(budget[1:])
    return (0, -n) if budget[0] == "r" else (1, n)


def selection_table(rows: Sequence[dict]) -> list[str]:
    """Markdown lines: exact match % of the selection rows of one panel, a line per selector and
    option, a column per budget, then r1 (every row: the same for every selector) and r4 / r1,
    r16 / r1 (each curve against the r1 row of its own family and option)."""
    curves = selection_curves({r["label"]: r for r in rows})
    if not curves:
        return []
    budgets = sorted({name.split(":")[2] for c in curves.values() for name, _ in c} - {"r1"}, key=_budget_order)
    n = sorted({r["n"] for r in rows})
    lines = ["", f"Selection rows (exact match %, n = {', '.join(map(str, n))}; ratios against the r1 row of the same "
                 "option):", "",
             "| selector | " + " | ".join(budgets) + " | r1 | r4 / r1 | r16 / r1 |",
             "|---|" + "---|" * (len(budgets) + 3)]
    for key, curve in sorted(curves.items(), key=lambda kv: (kv[0].count(":"), kv[0])):
        by_budget = {name.split(":")[2]: m for name, m in curve}
        full = by_budget.get("r1")

        def ratio(b: str) -> str:
            if full is None or b not in by_budget or not full["exact_match"]:
                return "-"
            return f"{100 * by_budget[b]['exact_match'] / full['exact_match']:.0f}%"

        cells = [_pct(by_budget[b]["exact_match"]) if b in by_budget else "-" for b in budgets]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {_pct(full['exact_match']) if full else '-'} "
                     f"| {ratio('r4')} | {ratio('r16')} |")
    return lines


# --------------------------------------------------------------------------------------------
# the plot


_REFERENCE_MARKERS = {"cold_read": "s", "cold_read_tuned": "D"}
_OTHER_MARKERS = ("^", "v", "P", "X", "<", ">", "h", "*")


_SELECTION_STYLES = {"": "-", ":tuned": "--", ":selection_tuned": ":", ":prefix": "-."}


def _selection_lines(ax, rows: Sequence[dict], selectors: Sequence[str]) -> None:
    """The selection rows of one panel as budget curves: a colour per selector (a colour map apart
    from the reference markers'), a line style per option, thin intervals."""
    from matplotlib import colormaps


    colours = colormaps["Dark2"]
    for key, curve in sorted(selection_curves({r["label"]: r for r in rows}).items()):
        family, selector, *options = key.split(":")
        x = [m["wire_bytes"] for _, m in curve]
        y = [m["exact_match"] for _, m in curve]
        ci = [m["exact_match_ci"] or (m["exact_match"], m["exact_match"]) for _, m in curve]
        ax.errorbar(x, y, yerr=[[e - lo for e, (lo, _) in zip(y, ci)], [hi - e for e, (_, hi) in zip(y, ci)]],
                    linestyle=_SELECTION_STYLES.get("".join(f":{o}" for o in options), "-"),
                    marker="s" if family == "kv_relay" else ".", markersize=4, linewidth=1, elinewidth=0.5, capsize=1.5,
                    color=colours(selectors.index(selector) % colours.N), alpha=0.85, label=key)


def plot(summary: dict, path: Path) -> Path:
    """One panel per task (and per number of facts): exact match with 95% intervals against wire
    bytes per request (log x); ilcp points labelled by name, reference methods as their own
    markers, methods that send nothing as dashed lines, selection rows as one line per selector
    and option through its budgets."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    panels = summary["panels"]
    cols = 2 if len(panels) == 4 else min(len(panels), 3)
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.8 * cols, 4.6 * nrows), squeeze=False)
    reference_names = list(dict.fromkeys(r["label"] for r in summary["rows"] if r["kind"] == "reference"))
    style = {}
    others = iter(_OTHER_MARKERS * 4)
    for i, name in enumerate(reference_names):
        style[name] = (_REFERENCE_MARKERS.get(name) or next(others), f"C{(i + 1) % 10}")
    selectors = sorted({r["label"].split(":")[1] for r in summary["rows"] if r["kind"] == "selection"})
    for ax, panel in zip(axes.flat, panels):
        rows = [r for r in summary["rows"] if r["panel"] == panel["key"] and r["exact_match"] is not None]
        selection = [r for r in rows if r["kind"] == "selection"]
        _selection_lines(ax, selection, selectors)
        rows = [r for r in rows if r["kind"] != "selection"]
        shown_n = f"n={panel['n']}"
        if {r["n"] for r in selection} - {panel["n"]}:
            shown_n += f"; selection rows n={', '.join(str(n) for n in sorted({r['n'] for r in selection}))}"
        positive = [r["wire_bytes"] for r in summary["rows"] if r["panel"] == panel["key"] and r["wire_bytes"]]
        placed: dict[float, int] = {}
        ilcp_labelled = False
        for r in sorted(rows, key=lambda r: (r["kind"] != "ilcp", r["label"])):
            em = r["exact_match"]
            lo, hi = r["exact_match_ci"] or (em, em)
            if r["wire_bytes"] is None:
                continue
            if r["wire_bytes"] <= 0:
                marker, colour = style.get(r["label"], ("o", "grey"))
                ax.axhline(em, linestyle="--", color=colour, label=f"{r['label']} (0 B)")
                continue
            shift = placed.get(r["wire_bytes"], 0)  # rows sending the same bytes sit side by side
            placed[r["wire_bytes"]] = shift + 1
            x = r["wire_bytes"] * 1.06 ** shift
            if r["kind"] == "ilcp":
                ax.errorbar([x], [em], yerr=[[em - lo], [hi - em]], fmt="o", color="C0", capsize=3,
                            label=None if ilcp_labelled else "ilcp (sweep points)")
                ilcp_labelled = True
                ax.annotate(r["label"], (x, em), xytext=(6, 3), textcoords="offset points", fontsize=7,
                            color="C0", rotation=55, ha="left", va="bottom", rotation_mode="anchor")
            else:
                marker, colour = style[r["label"]]
                ax.errorbar([x], [em], yerr=[[em - lo], [hi - em]], fmt=marker, color=colour, capsize=3,
                            label=f"{r['label']} ({r['wire_bytes']:,.0f} B)")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        if positive:
            low, high = min(positive) / 2, max(positive) * 3
            if high / low < 10:
                mid = (low * high) ** 0.5
                low, high = mid / 3.2, mid * 3.2
            ax.set_xlim(low, high)
        ax.set_ylim(-0.02, 1.12)
        ax.set_xlabel("wire bytes per request (log)")
        ax.set_ylabel("exact match (95% interval)")
        ax.set_title(f"{panel['title']} ({shown_n})", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6 if selectors else 7, loc="best", ncol=2 if selectors else 1)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"Payload sweep {summary['name']}: accuracy against wire bytes", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# the whole sweep


def run_sweep(sweep: Sweep, *, resume: bool = False, overwrite: bool = False, lm=None,
              log: Callable[[str], None] = print) -> dict:
    """Train what is missing, evaluate, and write the plot, sweep.json and sweep.md into
    ``sweep.out``; returns the summary written to sweep.json.

    Args:
        lm: an `ilcp.lm.LM` to use for every run (its spec must be the runs'); None loads each
            run's LM on first need.
        resume: continue unfinished runs, and keep evaluations already written for the same run,
            methods and settings.
        overwrite: train again runs whose folder holds a different or unfinished run.
    """
    t0 = time.perf_counter()
    plan = plan_training(sweep, resume=resume, overwrite=overwrite)
    log(f"sweep {sweep.name}: {len(sweep.points)} points, {len(plan)} runs in {sweep.checkpoints} "
        f"({', '.join(f'{k}: {v}' for k, v in plan.items())}); results in {sweep.out}")
    lms = _LMs(lm, log)
    trained = train_runs(sweep, plan, lms, log)
    evals = evaluate_entries(sweep, lms, resume=resume, log=log)
    panels, rows = _panels_and_rows(sweep, evals)
    ref = sweep.reference
    summary = {
        "name": sweep.name, "sweep": str(sweep.path), "base": _shown(sweep.base), "overrides": list(sweep.overrides),
        "extra": list(sweep.extra), "checkpoints": str(sweep.checkpoints), "out": str(sweep.out),
        "description": sweep.description, "eval": asdict(sweep.eval), "panels_tasks": [p["key"] for p in panels
                                                                                       if "facts_count" not in p],
        "points": [], "reference": None, "panels": panels, "rows": rows, "plot": PLOT,
    }
    for p in sweep.points:
        cfg = sweep.configs[p.run]
        summary["points"].append({
            "name": p.name, "run": p.run, "run_dir": str(cfg.run_dir), "overrides": list(p.overrides),
            "description": p.description, "payload_dtype": p.payload_dtype, "latent_dim": cfg.compressor.latent_dim,
            "chunk_tokens": cfg.compressor.chunk_tokens, "reconstruct_steps": cfg.reconstruct.steps,
            "num_memory_tokens": cfg.handoff.num_memory_tokens, "training": trained[p.run]["training"],
            "train_seconds": trained[p.run]["seconds"], "evaluation": evals[p.name]["evaluation"],
            "eval_dir": evals[p.name]["dir"],
        })
    if ref is not None:
        run = ref.run or sweep.points[0].run
        summary["reference"] = {
            "methods": list(ref.methods), "run": run, "run_dir": str(sweep.configs[run].run_dir),
            "variants": list(sweep.configs[run].handoff.variants) if ref.run else [],
            "overrides": list(ref.overrides), "training": trained[run]["training"],
            "evaluation": evals[REFERENCE]["evaluation"], "eval_dir": evals[REFERENCE]["dir"],
        }
    if sweep.selection is not None:
        run = ref.run or sweep.points[0].run
        summary["selection"] = {
            "methods": list(sweep.selection.methods), "tasks": list(sweep.selection.tasks),
            "limit": sweep.selection.limit, "run": run, "evaluation": evals[SELECTION]["evaluation"],
            "eval_dir": evals[SELECTION]["dir"], "seconds": evals[SELECTION].get("seconds"),
        }
    sweep.out.mkdir(parents=True, exist_ok=True)
    plot(summary, sweep.out / PLOT)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    atomic_write_text(sweep.out / SWEEP_MD, markdown(summary))
    atomic_write_json(sweep.out / SWEEP_JSON, summary)
    log(f"wrote {PLOT}, {SWEEP_JSON} and {SWEEP_MD} to {sweep.out} ({summary['seconds']:.0f} s)")
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", required=True, help="the sweep file (configs/sweep/*.yaml)")
    parser.add_argument("--out", default=None, help="where the plot, sweep.json, sweep.md and the per-point "
                                                    "reports go (default: the file's out, else results/sweep-NAME)")
    parser.add_argument("--checkpoints", default=None, help="where the runs are trained (default: the file's "
                                                            "checkpoints, else checkpoints/sweep-NAME)")
    parser.add_argument("--limit", type=int, default=None,
                        help="questions per task and per number of facts (replaces eval.limit and eval.facts_count_limit)")
    parser.add_argument("--resume", action="store_true",
                        help="continue unfinished runs and keep evaluations already written for the same settings")
    parser.add_argument("--overwrite", action="store_true",
                        help="train again runs whose folder holds a different or unfinished run")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a training override for every run (repeatable), e.g. lm.cache_dir=/tmp/cache")
    return parser


def main(argv: Sequence[str] | None = None, *, lm=None, log: Callable[[str], None] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    say = log or (lambda message: print(f"[sweep] {message}", flush=True))
    try:
        sweep = load_sweep(args.sweep, out=args.out, checkpoints=args.checkpoints, limit=args.limit, extra=args.extra)
    except ValueError as e:
        parser.error(str(e))
    try:
        run_sweep(sweep, resume=args.resume, overwrite=args.overwrite, lm=lm, log=say)
    except (FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
