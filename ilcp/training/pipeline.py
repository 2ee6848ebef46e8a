"""`train(cfg)`: the whole run, for one frozen LM loaded once.

1. data (`ilcp.training.data`): task rows and the sender's states of every context, cached;
2. stage 1 (`ilcp.training.compressor_stage`): pooler and beta-VAE of the ILCP encoder;
   optionally (``reconstruct.steps > 0``) the reconstruction stage
   (`ilcp.training.reconstruction_stage`): the whole encoder, projector included, trained so the
   frozen LM regenerates each context from its memory vectors;
3. stage 2 (`ilcp.training.handoff_stage`): each variant's memory source through the frozen LM;
4. export (`ilcp.export`) to ``checkpoints/RUN``.

Each stage keeps a ``last.ckpt`` and writes its trained tensors when done; ``resume=True`` skips
finished stages and continues the unfinished one (``discard_last=True`` as well: unfinished
stages start again, their checkpoints and logs dropped, for a ``last.ckpt`` that cannot be read).
Nothing is written before the settings, the run folder and the LM have been checked. With
several devices every rank runs `train`; rank 0 alone prepares the run directory and writes
files (`ilcp.training.distributed`).
Each stage's wall time is recorded in metrics.json (``stage_seconds``: lm (loading it), data
(task rows and the sender's states), compressor, reconstruct, every variant, export; a finished
run resumed adds its earlier sessions', listed in ``sessions``); ``on_stage_done(name)`` is called
after each.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from .. import export, export_writing, host_memory
from ..config import MOVED, TrainConfig, flatten, save_config
from ..io import atomic_write_json
from ..lm import LM, load_lm
from ..precision import hold
from ..progress import keep_talking, lines
from .compressor_stage import train_compressor
from .init_from import pretrained_encoder
from .data import HandoffDataModule, latent_bound, prepare_data, sender_max_length, training_task
from .distributed import Processes, check_global_batch, is_main
from .handoff_stage import format_vectors_from, train_variant
from .reconstruction_stage import check_pretraining_texts, train_reconstruction
from .log import read_checkpoint, run_precision, say


@dataclass
class TrainResult:
    run_dir: Path
    metrics: dict
    sources: dict  # variant -> trained memory source (best validation weights)


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, lm: LM | None = None,
          on_stage_done: Callable[[str], None] | None = None, discard_last: bool = False) -> TrainResult:
    """Run both stages for every configured variant and export to ``cfg.run_dir``.

    ``resume`` continues the run there (refused when there is none); with ``discard_last`` its
    unfinished stages start again rather than from their ``last.ckpt``. Every check that can
    refuse the run (settings, the folder, a changed setting on resume, the accelerator, the LM
    and the layers it pools) comes before anything is written or deleted.

    ``on_stage_done(name)`` is called once a stage (lm, data, compressor, reconstruct, a variant,
    export) is done and saved, before the next begins.

    With several devices (``trainer.devices``, ``trainer.num_nodes``) this runs in every rank:
    the command that was run is rank 0 and starts the others, which run the same command (see
    `ilcp.training.distributed`); rank 0 alone prepares the run directory and writes files.

    oneDNN's kernel caches are capped first (`ilcp.host_memory.bound_kernel_caches`: effective
    where no kernel has run in this process yet), so that batches of new lengths do not grow
    the process step after step."""
    host_memory.bound_kernel_caches()
    cfg.validate()
    if discard_last and not resume:
        raise ValueError("--discard-last goes with --resume: it starts a resumed run's unfinished stages again")
    procs = Processes(cfg.trainer)
    for name in ("compressor.batch_size", "reconstruct.batch_size", "handoff.batch_size"):
        section, key = name.split(".")
        check_global_batch(getattr(getattr(cfg, section), key), name, procs.world_size)
    if procs.is_main:  # before the other ranks exist: no rank sees a half-prepared directory
        raised = _check_run_dir(cfg, resume, overwrite, discard_last)
        check_accelerator(cfg.trainer)
        if lm is None:  # an LM spec that does not load fails here, before anything is written or deleted
            lm = load_run_lm(cfg)
        check_pool_layers(cfg, lm)
        _prepare_run_dir(cfg, resume, overwrite, discard_last, raised)
    procs.launch()
    try:
        with keep_talking("training", enabled=lines(cfg.trainer.progress)):
            result = _train(cfg, resume, lm, procs, StageClock(on_stage_done))
    except BaseException:
        procs.abort()
        raise
    finally:  # the trainers' reference cycles hold the cache's maps (and their leases) until collected
        gc.collect()
    procs.finish()
    return result


def load_run_lm(cfg: TrainConfig) -> LM:
    """The run's LM, held once in its compute dtype (`ilcp.precision.hold`): at bf16-mixed every
    frozen forward of every stage reads bfloat16 weights without recasting them."""
    lm = load_lm(cfg.lm.spec, dtype=cfg.lm.dtype, cache_dir=cfg.lm.cache_dir)
    hold(lm, run_precision(cfg))
    return lm


def _check_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool, discard_last: bool = False) -> dict:
    """Refuse, writing nothing: an out_dir that is a file, an existing run unless resumed or
    overwritten, a folder that is not a run, --resume where there is no run, changed settings on
    resume, an unfinished stage's last.ckpt that cannot be read (unless discarded). Returns the
    raised step budgets a resume records (`check_resumed_settings`)."""
    run_dir = cfg.run_dir
    for folder in (run_dir, *run_dir.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(f"{folder} is a file, not a folder: choose another out_dir (or run_name)")
            break
    started = _started(run_dir)
    if started and not (resume or overwrite):
        raise FileExistsError(
            f"{run_dir} already holds a run: pass --resume to continue it, --overwrite to start it "
            f"again, or choose another run_name=..."
        )
    if run_dir.exists() and any(run_dir.iterdir()) and not _looks_like_run(run_dir):
        raise FileExistsError(f"{run_dir} exists and is not a run directory of this package: choose another "
                              "run_name or out_dir (nothing was deleted)")
    if resume and not started and not (run_dir / "train_config.yaml").is_file():
        raise FileNotFoundError(f"--resume: {run_dir} holds no run to resume; check out_dir and run_name, or start "
                                "it without --resume")
    if resume and started:
        raised = check_resumed_settings(cfg, run_dir / "train_config.yaml")
        if not discard_last:
            for stage in _unfinished_stages(run_dir):
                last = stage / "checkpoints" / "last.ckpt"
                if last.exists() or last.is_symlink():  # a folder or a pipe there is refused too
                    read_checkpoint(last)
        return raised
    return {}


def _prepare_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool, discard_last: bool = False,
                     raised: dict | None = None) -> None:
    """After `_check_run_dir`: delete what --overwrite replaces and what a kill left half written
    (and, with ``discard_last``, the checkpoints of unfinished stages); record raised step budgets;
    save the resolved config."""
    run_dir = cfg.run_dir
    started = _started(run_dir)
    if resume and started:
        if raised:
            _record_raised(run_dir / "resumes.json", raised)
        for tmp in temporary_files(run_dir):  # writes cut short by a kill
            tmp.unlink(missing_ok=True)
        if discard_last:
            _discard_unfinished(run_dir)
    elif run_dir.exists() and (overwrite or not started):
        shutil.rmtree(run_dir)  # a run to redo, or a start that failed before any stage
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "train_config.yaml")


# this package's atomic writes (`ilcp.io`: .NAME.HEX.tmp) and safetensors' own (.tmpXXXXXX)
_TEMPORARY = re.compile(r"\..+\.[0-9a-f]+\.tmp|\.tmp[A-Za-z0-9]{6}")


def temporary_files(run_dir: Path) -> list[Path]:
    """The temporary files a killed run can leave anywhere in its folder."""
    return sorted(p for p in run_dir.rglob(".*") if p.is_file() and _TEMPORARY.fullmatch(p.name))


def _unfinished_stages(run_dir: Path) -> list[Path]:
    """The stage folders without both their NAME.safetensors and metrics.json."""
    stages = sorted(p for p in (run_dir / "stages").iterdir() if p.is_dir()) if (run_dir / "stages").is_dir() else []
    return [p for p in stages if not ((p / f"{p.name}.safetensors").is_file() and (p / "metrics.json").is_file())]


def _discard_unfinished(run_dir: Path) -> None:
    """Each unfinished stage loses its checkpoints, starting weights and logs, so it trains again
    from its beginning."""
    for stage in _unfinished_stages(run_dir):
        say(f"{stage.name}: --discard-last: its checkpoints are dropped, the stage starts again")
        shutil.rmtree(stage / "checkpoints", ignore_errors=True)
        (stage / "start.safetensors").unlink(missing_ok=True)
        shutil.rmtree(run_dir / "logs" / stage.name, ignore_errors=True)


def check_accelerator(trainer) -> None:
    """ValueError when ``trainer.accelerator`` names hardware this machine does not have."""
    import torch

    name = trainer.accelerator
    if name in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.accelerator={name} but no CUDA GPU is available here "
                         "(torch.cuda.is_available() is False): use trainer.accelerator=cpu or auto")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("trainer.accelerator=mps but MPS is not available here: use trainer.accelerator=cpu or auto")


def check_pool_layers(cfg: TrainConfig, lm: LM) -> None:
    """ValueError when ``data.pool_layers`` names a hidden state the LM does not have."""
    n = getattr(getattr(lm.model, "config", None), "num_hidden_layers", None)
    if n is None:
        return
    bad = [i for i in cfg.data.pool_layers if not -(n + 1) <= i <= n]
    if bad:
        raise ValueError(f"data.pool_layers {bad} out of range: {lm.spec} has {n + 1} hidden states (indices "
                         f"{-(n + 1)}..{n}, -1 the last)")


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
    task = training_task(cfg)  # held-out names are checked before the LM loads
    check_pretraining_texts(cfg)
    if cfg.data.heldout_tasks:
        say(f"holding out {', '.join(cfg.data.heldout_tasks)}: training on {task.name}")
    # rank 0 first: it converts the LM and extracts the sender states into the caches the others read
    with procs.main_first():
        if lm is None:
            lm = load_run_lm(cfg)
        precision = run_precision(cfg)
        say(f"LM {lm.spec}: fingerprint {lm.fingerprint}, hidden {lm.hidden_size}, dtype {lm.dtype}, compute "
            f"precision {precision}")
        max_length = sender_max_length(cfg, lm)  # data.max_length, or with 0 the LM's own limit
        say(f"the sender reads contexts of up to {max_length} tokens")
        clock.done("lm")
        if cfg.handoff.format_from not in ("", "cold_read_tuned"):
            format_vectors_from(cfg.handoff.format_from, lm)  # another run's vectors: refused before any stage
        pretrained = (pretrained_encoder(cfg, lm, max_length)  # refused before any stage too
                      if cfg.compressor.init_from and "ilcp" in cfg.handoff.variants else None)
        train_rows, val_rows = prepare_data(cfg, lm)
    clock.done("data")
    encoder, compressor_metrics, reconstruct_metrics = None, {}, {}
    if "ilcp" in cfg.handoff.variants:
        if pretrained is not None:
            encoder, compressor_metrics = pretrained, {"init_from": cfg.compressor.init_from}
        else:
            encoder, compressor_metrics = train_compressor(cfg, lm, train_rows, val_rows, resume)
        clock.done("compressor")
        if cfg.reconstruct.enabled:
            reconstruct_metrics = train_reconstruction(cfg, lm, encoder, train_rows, val_rows, resume)
            clock.done("reconstruct")
    data = HandoffDataModule(train_rows, val_rows, cfg.handoff.batch_size, cfg.trainer.seed)
    sources, variant_metrics = {}, {}
    for variant in training_order(cfg):
        sources[variant], variant_metrics[variant] = train_variant(cfg, variant, lm, data, encoder, resume, sources)
        if variant_metrics[variant]["steps"]:
            say(f"stage 2 ({variant}): best validation exact match {variant_metrics[variant]['best_val_exact_match']}")
        clock.done(variant)
    metrics = {
        "compressor": compressor_metrics, "reconstruct": reconstruct_metrics, "variants": variant_metrics,
        "train_rows": len(train_rows), "val_rows": len(val_rows), "precision": precision,
        "stage_seconds": clock.seconds, "total_seconds": clock.total,
    }
    if is_main():
        if "ilcp" in sources:  # what its receivers accept: 4x the largest |z| of these rows
            encoder = sources["ilcp"]
            encoder.latent_bound = latent_bound(encoder, [val_rows, train_rows], cfg.data.pool_batch_size,
                                                progress=cfg.trainer.progress)
            say(f"latent bound {encoder.latent_bound:.4g}: a receiver refuses a latent value beyond it"
                if encoder.latent_bound is not None else "no latent bound: every latent of these rows is 0")
        earlier = read_json_or_none(run_dir / "metrics.json") if resume else None  # a finished run resumed
        export_writing.export_run(cfg, lm, sources, metrics, precision=precision, max_length=max_length)
        clock.done("export")
        metrics["total_seconds"] = clock.total
        metrics = with_earlier_sessions(metrics, earlier)
        atomic_write_json(run_dir / "metrics.json", metrics)  # not among the export's digests
    times = ", ".join(f"{name} {seconds:.0f}s" for name, seconds in clock.seconds.items())
    say(f"exported to {run_dir} in {clock.total:.0f}s total ({times})")
    return TrainResult(run_dir=run_dir, metrics=metrics, sources=sources)


def read_json_or_none(path: Path) -> dict | None:
    """A JSON mapping, or None where the file is missing or unreadable."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def with_earlier_sessions(metrics: dict, earlier: dict | None) -> dict:
    """This session's metrics, with the earlier sessions' wall time of a finished run it resumed
    (`earlier`, that run's metrics.json) added in: ``stage_seconds`` and ``total_seconds`` sum
    every session, ``sessions`` lists each one's. A run resumed after an interruption starts from
    its checkpoints alone: the interrupted session's time is not on record."""
    if not earlier or not isinstance(earlier.get("stage_seconds"), dict):
        return metrics
    sessions = earlier.get("sessions") or [{"stage_seconds": earlier["stage_seconds"],
                                            "total_seconds": earlier.get("total_seconds", 0)}]
    sessions = [*sessions, {"stage_seconds": dict(metrics["stage_seconds"]), "total_seconds": metrics["total_seconds"]}]
    stages: dict[str, float] = {}
    for session in sessions:
        for name, seconds in session["stage_seconds"].items():
            stages[name] = round(stages.get(name, 0.0) + seconds, 1)
    return {**metrics, "stage_seconds": stages, "sessions": sessions,
            "total_seconds": round(sum(session["total_seconds"] for session in sessions), 1)}


def training_order(cfg: TrainConfig) -> list[str]:
    """The configured variants in order, but for the one ilcp reads its format vectors from
    (``handoff.format_from``), which is trained first."""
    order = list(cfg.handoff.variants)
    for first in (cfg.handoff.format_from, cfg.handoff.distill_teacher):
        if first in order:
            order.remove(first)
            order.insert(0, first)
    return order


# settings a resumed run may change: they do not change what it trains
# (batch sizes are global, so the number of devices does not change what a step sees)
_RESUMABLE = {"trainer.progress", "lm.cache_dir", "trainer.devices", "trainer.num_nodes", "trainer.strategy",
              "trainer.accelerator"}
# step budgets a resumed run may raise (it trains further), never lower
_EXTENDABLE = {"handoff.max_steps", "handoff.cold_read_tuned_steps", "reconstruct.steps"}


def _started(run_dir: Path) -> bool:
    """Whether a run has begun a stage (a failed start writes only its resolved config)."""
    return (run_dir / "stages").is_dir() or (run_dir / export.CONFIG_FILE).is_file()


def _looks_like_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in ("train_config.yaml", "stages", export.CONFIG_FILE, "logs"))


def check_resumed_settings(cfg: TrainConfig, saved_path: Path) -> dict:
    """A resumed run must train what it started to: ValueError naming any changed setting, but
    for a raised step budget, returned as {setting: [old, new]} (`_record_raised` writes it to
    ``resumes.json`` beside the config)."""
    if not saved_path.is_file():
        return {}
    try:
        loaded = yaml.safe_load(saved_path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        problem = " ".join(str(e).split())
        raise ValueError(f"{saved_path} is not readable YAML ({problem}): start the run again with --overwrite") from None
    if not isinstance(loaded, dict | None):
        raise ValueError(f"{saved_path} must hold a mapping, got {type(loaded).__name__}: start the run again with "
                         "--overwrite")
    # a run started before the memory kinds were their own section names their settings as then
    saved = {MOVED.get(k, k): v for k, v in flatten(loaded or {}).items()}
    now = flatten(cfg.to_dict())
    # a setting the package gained after the run started was, for that run, its default; the
    # memory section is its kind's settings alone (another kind's settings are not this run's)
    memory = "compressor.memory."
    has_memory = any(k.startswith(memory) for k in saved)
    defaults = flatten(TrainConfig().to_dict())
    saved = {**{k: v for k, v in defaults.items() if k not in saved and not (has_memory and k.startswith(memory))},
             **saved}
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and k not in _RESUMABLE
                     and not (k.startswith(memory) and k not in now))
    raised = [k for k in changed if k in _EXTENDABLE and isinstance(saved.get(k), int) and now[k] > saved[k]]
    changed = [k for k in changed if k not in raised]
    if changed:  # refused before anything is recorded
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:6])
        raise ValueError(f"--resume with changed settings ({details}): resume with the run's own settings, or "
                         "start again with --overwrite or another run_name")
    return {k: [saved[k], now[k]] for k in raised}


def _record_raised(log: Path, raised: dict) -> None:
    history = json.loads(log.read_text()) if log.is_file() else []
    history.append(raised)
    atomic_write_json(log, history)
