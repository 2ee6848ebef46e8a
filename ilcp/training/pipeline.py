"""`train(cfg)`: the whole run, for one frozen LM loaded once.

1. data (`ilcp.training.data`): task rows and the sender's states of every context, cached;
2. stage 1 (`ilcp.training.compressor_stage`): pooler and beta-VAE of the ILCP encoder;
   optionally (``reconstruct.steps > 0``) the reconstruction stage
   (`ilcp.training.reconstruction_stage`): the whole encoder, projector included, trained so the
   frozen LM regenerates each context from its memory vectors;
3. stage 2 (`ilcp.training.handoff_stage`): each variant's memory source through the frozen LM;
4. export (`ilcp.export`) to ``checkpoints/RUN``.

Each stage keeps a ``last.ckpt`` and writes its trained tensors when done; ``resume=True`` skips
finished stages and continues the unfinished one. With several devices every rank runs `train`;
rank 0 alone prepares the run directory and writes files (`ilcp.training.distributed`).
Each stage's wall time is recorded in metrics.json (``stage_seconds``: lm (loading it), data
(task rows and the sender's states), compressor, reconstruct, every variant, export); ``on_stage_done(name)`` is called after each.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from .. import export
from ..config import TrainConfig, flatten, save_config
from ..io import atomic_write_json
from ..lm import LM, load_lm
from .compressor_stage import train_compressor
from .data import HandoffDataModule, prepare_data, sender_max_length
from .distributed import Processes, check_global_batch, is_main
from .handoff_stage import format_vectors_from, train_variant
from .reconstruction_stage import train_reconstruction
from .log import run_precision, say


@dataclass
class TrainResult:
    run_dir: Path
    metrics: dict
    sources: dict  # variant -> trained memory source (best validation weights)


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, lm: LM | None = None,
          on_stage_done: Callable[[str], None] | None = None) -> TrainResult:
    """Run both stages for every configured variant and export to ``cfg.run_dir``.

    ``on_stage_done(name)`` is called once a stage (lm, data, compressor, reconstruct, a variant,
    export) is done and saved, before the next begins.

    With several devices (``trainer.devices``, ``trainer.num_nodes``) this runs in every rank:
    the command that was run is rank 0 and starts the others, which run the same command (see
    `ilcp.training.distributed`); rank 0 alone prepares the run directory and writes files."""
    cfg.validate()
    cfg = copy.deepcopy(cfg)  # data.max_length=0 is resolved on this copy once the LM is loaded
    procs = Processes(cfg.trainer)
    for name in ("compressor.batch_size", "reconstruct.batch_size", "handoff.batch_size"):
        section, key = name.split(".")
        check_global_batch(getattr(getattr(cfg, section), key), name, procs.world_size)
    if procs.is_main:  # before the other ranks exist: no rank sees a half-prepared directory
        if overwrite and lm is None and cfg.run_dir.exists():
            # an LM spec that does not load fails here, before --overwrite deletes the old run
            lm = load_lm(cfg.lm.spec, dtype=cfg.lm.dtype, cache_dir=cfg.lm.cache_dir)
        _prepare_run_dir(cfg, resume, overwrite)
    procs.launch()
    try:
        result = _train(cfg, resume, lm, procs, StageClock(on_stage_done))
    except BaseException:
        procs.abort()
        raise
    procs.finish()
    return result


def _prepare_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool) -> None:
    """Refuse an existing run unless resumed or overwritten; delete what --overwrite replaces and
    what a kill left half written; save the resolved config."""
    run_dir = cfg.run_dir
    started = _started(run_dir)
    if started and not (resume or overwrite):
        raise FileExistsError(
            f"{run_dir} already holds a run: pass --resume to continue it, --overwrite to start it "
            f"again, or choose another run_name=..."
        )
    if run_dir.exists() and any(run_dir.iterdir()) and not _looks_like_run(run_dir):
        raise FileExistsError(f"{run_dir} exists and is not a run directory of this package: choose another "
                              "run_name or out_dir (nothing was deleted)")
    if resume and started:
        _check_resumed_settings(cfg, run_dir / "train_config.yaml")
        for tmp in run_dir.rglob(".*.tmp"):  # atomic writes cut short by a kill
            tmp.unlink(missing_ok=True)
    elif run_dir.exists() and (overwrite or not started):
        shutil.rmtree(run_dir)  # a run to redo, or a start that failed before any stage
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "train_config.yaml")


class StageClock:
    """Wall seconds of each stage of a run, in order, and the caller's hook after each."""

    def __init__(self, on_done: Callable[[str], None] | None = None):
        self.seconds: dict[str, float] = {}
        self._on_done = on_done
        self._start = self._last = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 1)
        self._last = now
        if self._on_done is not None:
            self._on_done(name)

    @property
    def total(self) -> float:
        return round(time.perf_counter() - self._start, 1)


def _train(cfg: TrainConfig, resume: bool, lm: LM | None, procs: Processes, clock: StageClock) -> TrainResult:
    run_dir = cfg.run_dir
    # rank 0 first: it converts the LM and extracts the sender states into the caches the others read
    with procs.main_first():
        if lm is None:
            lm = load_lm(cfg.lm.spec, dtype=cfg.lm.dtype, cache_dir=cfg.lm.cache_dir)
        precision = run_precision(cfg)
        say(f"LM {lm.spec}: fingerprint {lm.fingerprint}, hidden {lm.hidden_size}, dtype {lm.dtype}, compute "
            f"precision {precision}")
        cfg.data.max_length = sender_max_length(cfg, lm)  # 0: whole contexts, up to the LM's own limit
        say(f"the sender reads contexts of up to {cfg.data.max_length} tokens")
        clock.done("lm")
        if cfg.handoff.format_from not in ("", "cold_read_tuned"):
            format_vectors_from(cfg.handoff.format_from, lm)  # another run's vectors: refused before any stage
        train_rows, val_rows = prepare_data(cfg, lm)
    clock.done("data")
    encoder, compressor_metrics, reconstruct_metrics = None, {}, {}
    if "ilcp" in cfg.handoff.variants:
        encoder, compressor_metrics = train_compressor(cfg, lm, train_rows, val_rows, resume)
        clock.done("compressor")
        if cfg.reconstruct.enabled:
            reconstruct_metrics = train_reconstruction(cfg, lm, encoder, train_rows, val_rows, resume)
            clock.done("reconstruct")
    data = HandoffDataModule(train_rows, val_rows, cfg.handoff.batch_size, cfg.trainer.seed)
    sources, variant_metrics = {}, {}
    for variant in training_order(cfg):
        sources[variant], variant_metrics[variant] = train_variant(cfg, variant, lm, data, encoder, resume, sources)
        say(f"stage 2 ({variant}): best validation exact match {variant_metrics[variant]['best_val_exact_match']}")
        clock.done(variant)
    metrics = {
        "compressor": compressor_metrics, "reconstruct": reconstruct_metrics, "variants": variant_metrics,
        "train_rows": len(train_rows), "val_rows": len(val_rows), "precision": precision,
        "stage_seconds": clock.seconds, "total_seconds": clock.total,
    }
    if is_main():
        export.export_run(cfg, lm, sources, metrics, precision=precision)
        clock.done("export")
        metrics["total_seconds"] = clock.total
        atomic_write_json(run_dir / "metrics.json", metrics)  # not among the export's digests
    times = ", ".join(f"{name} {seconds:.0f}s" for name, seconds in clock.seconds.items())
    say(f"exported to {run_dir} in {metrics['total_seconds']:.0f}s total ({times})")
    return TrainResult(run_dir=run_dir, metrics=metrics, sources=sources)


def training_order(cfg: TrainConfig) -> list[str]:
    """The configured variants in order, but for the one ilcp reads its format vectors from
    (``handoff.format_from``), which is trained first."""
    order = list(cfg.handoff.variants)
    if cfg.handoff.format_from in order:
        order.remove(cfg.handoff.format_from)
        order.insert(0, cfg.handoff.format_from)
    return order


# settings a resumed run may change: they do not change what it trains
# (batch sizes are global, so the number of devices does not change what a step sees)
_RESUMABLE = {"trainer.progress", "lm.cache_dir", "trainer.devices", "trainer.num_nodes", "trainer.strategy",
              "trainer.accelerator"}
# step budgets a resumed run may raise (it trains further), never lower
_EXTENDABLE = {"handoff.max_steps", "reconstruct.steps"}


def _started(run_dir: Path) -> bool:
    """Whether a run has begun a stage (a failed start writes only its resolved config)."""
    return (run_dir / "stages").is_dir() or (run_dir / export.CONFIG_FILE).is_file()


def _looks_like_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in ("train_config.yaml", "stages", export.CONFIG_FILE, "logs"))


def _check_resumed_settings(cfg: TrainConfig, saved_path: Path) -> None:
    """A resumed run must train what it started to: ValueError naming any changed setting, but
    for a raised step budget, which is recorded in ``resumes.json`` beside the config."""
    if not saved_path.is_file():
        return
    try:
        saved = flatten(yaml.safe_load(saved_path.read_text()) or {})
    except yaml.YAMLError as e:
        raise ValueError(f"{saved_path} is not readable YAML ({e}): start the run again with --overwrite") from None
    now = flatten(cfg.to_dict())
    # a setting the package gained after the run started was, for that run, its default
    defaults = flatten(TrainConfig().to_dict())
    saved = {**{k: v for k, v in defaults.items() if k not in saved}, **saved}
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and k not in _RESUMABLE)
    raised = [k for k in changed if k in _EXTENDABLE and isinstance(saved.get(k), int) and now[k] > saved[k]]
    changed = [k for k in changed if k not in raised]
    if changed:  # refused before anything is recorded
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:6])
        raise ValueError(f"--resume with changed settings ({details}): resume with the run's own settings, or "
                         "start again with --overwrite or another run_name")
    if raised:
        log = saved_path.parent / "resumes.json"
        history = json.loads(log.read_text()) if log.is_file() else []
        history.append({k: [saved[k], now[k]] for k in raised})
        atomic_write_json(log, history)
