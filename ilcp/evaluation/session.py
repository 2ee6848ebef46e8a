"""The run an evaluation opens once (`open_session`): its names checked, the tasks it is evaluated
on, the LM, the export, the methods bound to them and, with engine="vllm", the engine
(`start_engine`); every part of `ilcp.evaluation.run.evaluate` runs over the `EvalSession`."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engines.vllm import VLLMDecoder
from ..eval_config import EvalConfig
from ..export import CONFIG_FILE, ExportError, check_fingerprint, load_export_lm, read_config, read_export
from ..handoff import ILCPHandoff
from ..lm import LM
from ..names import split_task_names
from ..precision import hold, resolve
from ..tasks import EvalTaskContext, Task, resolve_task
from ..engines.build import require_vllm
from .decoders import require_engine, start_vllm
from .registry import EvalContext, HandoffMethod, MethodUnavailable, expand_method_names, make_method

__all__ = ["EvalSession", "heldout_tasks", "open_session", "parse_task", "resolve_tasks", "run_facts_settings",
           "start_engine", "trained_tasks", "training_tasks"]


# --------------------------------------------------------------------------------------------
# the tasks


def parse_task(name: str) -> Task:
    """The `ilcp.tasks.Task` a name given to eval stands for, checked as far as it can be without
    the LM (a bAbI task's ``en`` test file, a file task's files); ValueError naming the problem."""
    task = resolve_task(name)  # its ValueError lists the forms
    task.check_evaluable()
    return task


def training_tasks(train_task: str) -> list[Task]:
    """The tasks a run trained on, as eval reports them: its one task, or each task of a mix
    ("babi:1+2+3", "babi:all", "babilong:1+8:0.5k")."""
    return list(resolve_task(train_task).parts())


def resolve_tasks(train_task: str, extra: Sequence[str], only_extra: bool = False,
                  heldout: Sequence[str] = ()) -> list[Task]:
    """The run's training tasks and the tasks it held out (unless ``only_extra``), then each of
    ``extra`` (a mix as its tasks)."""
    if isinstance(extra, str):
        extra = split_task_names(extra)
    specs = [] if only_extra else training_tasks(train_task) + [parse_task(name) for name in heldout]
    for name in extra:
        specs += parse_task(name).parts()
    return list({s.name: s for s in specs}.values())


def heldout_tasks(config: dict, ckpt: Path) -> list[str]:
    """The single tasks a run held out of training (config.json ``heldout_tasks``, canonical names;
    none in an export written before the entry existed).

    Raises:
        ExportError: the entry is not a list of task names (one line naming config.json).
    """
    names = config.get("heldout_tasks", [])
    where = ckpt / "config.json"
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ExportError(f"{where}: heldout_tasks must be a list of task names, got {names!r}")
    singles: list[str] = []
    for name in names:
        try:
            parts = resolve_task(name).parts()
        except ValueError as e:
            raise ExportError(f"{where}: heldout_tasks: {e}") from None
        singles += [p.name for p in parts if p.name not in singles]
    return singles


def trained_tasks(config: dict, ckpt: Path) -> set[str]:
    """The names of the single tasks a run trained on: its task's parts but those it held out (an
    export whose ``task`` still names a held-out task reports that task as held out)."""
    return {s.name for s in training_tasks(config["task"])} - set(heldout_tasks(config, ckpt))


FACTS_SETTINGS = {"n_facts": "facts_n_facts", "n_distractors": "facts_n_distractors", "seed": "seed"}


def run_facts_settings(config: dict, ckpt: Path) -> dict:
    """The facts task's settings the run trained with: config.json's ``task_settings``
    (``facts_n_facts``, ``facts_n_distractors``, ``seed``), as `make_facts` arguments.

    Raises:
        ExportError: config.json records no ``task_settings`` or lacks one of those keys (an
            export written before the export recorded them: export the run again).
    """
    recorded = config.get("task_settings")
    where = ckpt / "config.json"
    if not isinstance(recorded, dict):
        raise ExportError(f"{where} records no task_settings, which the facts task needs (facts_n_facts, "
                          "facts_n_distractors, seed): export the run again with this package")
    missing = [key for key in FACTS_SETTINGS.values() if key not in recorded]
    if missing:
        raise ExportError(f"{where}: task_settings lacks {', '.join(missing)}, which the facts task needs: "
                          "export the run again with this package")
    settings = {}
    for arg, key in FACTS_SETTINGS.items():
        value = recorded[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ExportError(f"{where}: task_settings.{key} must be an int >= 0, got {value!r}")
        settings[arg] = value
    if settings["n_facts"] < 1:
        raise ExportError(f"{where}: task_settings.facts_n_facts must be >= 1, got {settings['n_facts']}")
    value_split = recorded.get("facts_value_split")
    if value_split not in (None, "train"):
        raise ExportError(f"{where}: task_settings.facts_value_split must be null or 'train', got {value_split!r}")
    if value_split is not None:
        settings["value_split"] = value_split
    return settings


# --------------------------------------------------------------------------------------------
# the session


def _resolve_methods(names: Sequence[str]) -> list[HandoffMethod]:
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError("no methods given")
    methods = [make_method(n) for n in expand_method_names(names)]
    return methods


@dataclass
class EvalSession:
    """What the parts of one evaluation share: its settings, the run, the LM, the methods bound to
    them and the vLLM engine (`open_session` builds it; `evaluate` passes it to each part)."""

    config: EvalConfig
    ckpt: Path
    run_config: dict  # the run's config.json
    lm: LM
    precision: str  # resolved: "32-true" or "bf16-mixed"
    handoff: ILCPHandoff | None  # None: the run has no ilcp encoder
    asked: list[str]  # every method asked for, groups expanded
    methods: list[HandoffMethod]  # those bound to the run, in the order asked
    skipped: dict[str, str]  # method -> why it does not run
    tasks: list[Task]  # the run's training task(s) first
    trained_on: set[str]
    facts_settings: dict | None  # the run's facts task settings when a facts task is evaluated
    task_context: EvalTaskContext  # what a task needs to build the rows of the split asked
    vllm: VLLMDecoder | None = None
    engine_info: dict | None = None
    say: Callable[[str], None] = lambda message: None

    def methods_named(self, names: Sequence[str]) -> list[HandoffMethod]:
        """The bound methods among ``names``, in the order asked."""
        return [m for m in self.methods if m.name in names]


def open_session(ckpt: str | os.PathLike, config: EvalConfig, *, lm: LM | None = None,
                 vllm: VLLMDecoder | None = None, log: Callable[[str], None] | None = None) -> EvalSession:
    """Check the run and the names in ``config``, then load the LM (unless given), the run's modules
    and, with engine="vllm", the engine; bind every method the run has weights for.

    Everything that can be checked without the LM is checked before it loads. Raises as `evaluate`.
    """
    say = log or (lambda message: None)
    require_engine(config.engine)
    ckpt = Path(ckpt)
    run_config = read_config(ckpt, config.export_key)  # with a key, its signature verifies before anything loads
    chosen = _resolve_methods(config.methods)
    task_specs = resolve_tasks(run_config["task"], config.tasks, config.only_tasks, heldout_tasks(run_config, ckpt))
    trained_on = trained_tasks(run_config, ckpt)
    facts_settings = (run_facts_settings(run_config, ckpt) if any(spec.needs_facts_settings for spec in task_specs)
                      else None)
    files = run_config.get("files", {})
    skipped: dict[str, str] = {}
    runnable = []
    for m in chosen:
        missing = [r for r in m.requires if r not in files]
        if missing:
            skipped[m.name] = f"the run has no {', '.join(missing)} weights (trained variants: {sorted(files)})"
            say(f"skipping {m.name}: {skipped[m.name]}")
        else:
            runnable.append(m)

    # The LM and the run's modules.
    loaded = lm is None
    if loaded:
        dev = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        say(f"loading LM {run_config['lm']['spec']!r} ({run_config['lm'].get('dtype', 'float32')}, {dev})")
        lm = load_export_lm(run_config, ckpt / CONFIG_FILE, device=dev)
    check_fingerprint(run_config, lm.fingerprint)
    run = read_export(ckpt, config.export_key)
    precision = resolve(config.precision or str(run_config["lm"].get("precision", "32-true")), lm.device)
    if loaded and hold(lm, precision):  # the LM this eval loaded: its weights cast to bfloat16 once
        say(f"compute precision {precision}, the LM's linear weights held in bfloat16")
    else:
        say(f"compute precision {precision}")
    handoff = (ILCPHandoff.from_export(run, lm, payload_dtype=config.payload_dtype, precision=precision)
               if run.encoder is not None else None)
    ctx = EvalContext(lm=lm, run=run, handoff=handoff, max_new_tokens=config.max_new_tokens)
    vllm, engine_info = start_engine(config, lm, vllm=vllm, log=say, precision=precision)
    bound = []
    for m in runnable:
        try:
            m.bind(ctx)
            bound.append(m)
        except MethodUnavailable as e:
            skipped[m.name] = str(e)
            say(f"skipping {m.name}: {e}")
    limit = lm.context_limit
    sender_limit = handoff.max_length if handoff is not None else limit
    task_context = EvalTaskContext(tokenizer=lm.tokenizer, split=config.split, max_tokens=limit if sender_limit >= limit else None,
                                   text_limit=limit,
                                   task_settings=dict(run_config.get("task_settings") or {}),
                                   facts_settings=facts_settings, train_task=run_config["task"])
    return EvalSession(config=config, ckpt=ckpt, run_config=run_config, lm=lm, precision=precision, handoff=handoff,
                       asked=[m.name for m in chosen], methods=bound, skipped=skipped, tasks=task_specs,
                       trained_on=trained_on, facts_settings=facts_settings, task_context=task_context, vllm=vllm,
                       engine_info=engine_info, say=say)


def start_engine(config: EvalConfig, lm: LM, *, vllm: VLLMDecoder | None = None,
                 log: Callable[[str], None] | None = None,
                 precision: str = "32-true") -> tuple[VLLMDecoder | None, dict | None]:
    """With engine="vllm": the engine (``vllm`` when given, else one started on ``lm``, its files in
    OUT/vllm or a temporary folder) and what results.json records of it; (None, None) otherwise.
    At bf16-mixed the engine it starts holds the LM in bfloat16 (faster on a CPU with bfloat16:
    docs/results/vllm-dtype), at 32-true in the LM's own dtype."""
    if config.engine != "vllm":
        return None, None
    t0 = time.perf_counter()
    if vllm is None:
        out = config.out
        folder = Path(out) / "vllm" if out is not None else Path(tempfile.mkdtemp(prefix="ilcp-vllm-"))
        dtype = "bfloat16" if precision == "bf16-mixed" else None
        vllm = start_vllm(lm, folder, kv_cache_bytes=config.vllm_kv_cache_bytes, dtype=dtype,
                          log=log or (lambda message: None))
    elif not isinstance(vllm, VLLMDecoder) or vllm.lm is not lm:
        raise ValueError("vllm must be an ilcp.engines.vllm.VLLMDecoder on the LM the evaluation uses")
    info = {"vllm_version": getattr(require_vllm(), "__version__", None),
            "dtype": str(vllm.dtype).removeprefix("torch."),
            "max_model_len": vllm.max_model_len, "start_s": round(time.perf_counter() - t0, 1)}
    return vllm, info
