"""Progress lines of a training run, and the Lightning pieces every stage shares: its trainer,
which stops a stage whose loss turns NaN or infinite (`NonFiniteLoss`), its logs and checkpoints."""

from __future__ import annotations

import csv
import logging
import pickle
import shutil
import warnings
import zipfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn

from .. import host_memory
from ..io import file_kind
from ..precision import resolve
from ..progress import Ticker, bars, lines
from .distributed import is_main


def say(msg: str) -> None:
    """A progress line on the ``ilcp.training`` logger (the command lines print it as ``[ilcp] ...``),
    from rank 0 only when several processes train."""
    if is_main():
        logging.getLogger("ilcp.training").info(msg)


def _loss_of(outputs):
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss.detach() if isinstance(loss, Tensor) else loss


class ProgressLines(L.Callback):
    """A stage's progress as plain lines (`ilcp.progress.Ticker`), for output that is not a
    terminal: the optimizer step of the budget, the epoch and the last batch's loss while
    training; the batches done while validating."""

    def __init__(self, name: str):
        self.name = name
        self._train: Ticker | None = None
        self._val: Ticker | None = None

    def on_train_start(self, trainer, pl_module):
        total = trainer.estimated_stepping_batches
        self._train = Ticker(self.name, total=int(total) if total != float("inf") else None, unit="steps").__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._train is not None:
            epochs = f" of {trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
            self._train.update(done=trainer.global_step, epoch=f"{trainer.current_epoch + 1}{epochs}",
                               loss=_loss_of(outputs))

    def on_train_end(self, trainer, pl_module):
        if self._train is not None:
            self._train.__exit__()
            self._train = None

    def on_validation_start(self, trainer, pl_module):
        total = sum(int(n) for n in trainer.num_val_batches if n != float("inf"))
        self._val = Ticker(f"{self.name}: validation", total=total or None, unit="batches").__enter__()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self._val is not None:
            self._val.update(1)

    def on_validation_end(self, trainer, pl_module):
        if self._val is not None:
            self._val.__exit__()
            self._val = None


class GiveBackFreedMemory(L.Callback):
    """`ilcp.host_memory.give_back_freed_memory` as a stage starts and after each validation pass:
    a few calls a stage (a call after every step costs a fifth of a pretraining step's time on this CPU)."""

    def on_fit_start(self, trainer, pl_module):
        host_memory.give_back_freed_memory()

    def on_validation_end(self, trainer, pl_module):
        host_memory.give_back_freed_memory()


class NonFiniteLoss(ValueError):
    """A stage's training loss that turned NaN or infinite (one line naming the stage and the step)."""


class StopOnNonFiniteLoss(L.Callback):
    """Stops a stage at the first NaN or infinite training loss, before its backward pass: the
    stage's weights never take that step, and the run stops with a `NonFiniteLoss` naming the stage
    and the optimizer step. Every process decides together, so all stop at the same step."""

    def __init__(self, name: str):
        self.name = name

    def on_before_backward(self, trainer, pl_module, loss):
        bad = not bool(torch.isfinite(loss.detach()).all())
        if trainer.strategy.reduce_boolean_decision(bad, all=False):
            raise NonFiniteLoss(
                f"stage {self.name}: the training loss is {loss.detach().float().mean().item()} at step "
                f"{trainer.global_step + 1} (epoch {trainer.current_epoch + 1}): training stopped, nothing exported; "
                "check the task's rows and the sender-state cache, or lower the stage's learning rate")


def parameter_counts(module: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts."""
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return trainable, frozen


def run_precision(cfg) -> str:
    """The run's compute precision, ``trainer.precision`` with ``auto`` resolved for the device
    the run trains on (`ilcp.precision.resolve`); ``auto`` with an LM whose weights are already
    half precision (``lm.dtype``) is 32-true: the weights set the precision then."""
    t = cfg.trainer
    if t.precision == "auto" and cfg.lm.dtype != "float32":
        return "32-true"
    cuda = t.accelerator in ("gpu", "cuda") or (t.accelerator == "auto" and torch.cuda.is_available())
    return resolve(t.precision, "cuda" if cuda else "cpu")


def make_trainer(cfg, stage_dir: Path, name: str, callbacks: list, **kwargs) -> L.Trainer:
    """A Trainer with the run's accelerator settings and precision, logging to ``RUN/logs/NAME``,
    stopping at a non-finite loss (`StopOnNonFiniteLoss`), giving freed memory back between its
    passes (`GiveBackFreedMemory`); with ``trainer.progress``, Lightning's bar on a terminal and
    `ProgressLines` elsewhere."""
    t = cfg.trainer
    callbacks = [*callbacks, StopOnNonFiniteLoss(name), GiveBackFreedMemory()]
    if lines(t.progress):
        callbacks = [*callbacks, ProgressLines(name)]
    return L.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=t.strategy,
        precision=run_precision(cfg), logger=CSVLogger(str(cfg.run_dir / "logs"), name=name, version=""),
        callbacks=callbacks, enable_progress_bar=bars(t.progress), enable_model_summary=False,
        default_root_dir=str(stage_dir), num_sanity_val_steps=0,
        log_every_n_steps=1,  # every step's loss; an interval above an epoch's batches logs nothing (and warns)
        use_distributed_sampler=False,  # the loaders shard the global batches themselves (`data.row_loader`)
        **kwargs,
    )


def _earlier_folder(cfg, name: str) -> Path:
    """Where the CSV logs of a stage's interrupted attempts are kept: ``RUN/logs/NAME.earlier``."""
    return cfg.run_dir / "logs" / f"{name}.earlier"


def _earlier_logs(folder: Path) -> list[Path]:
    """The CSV logs of a stage's interrupted attempts (metrics.N.csv), oldest first."""
    found = [p for p in folder.glob("metrics.*.csv") if p.name.split(".")[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split(".")[1]))


def prepare_stage_log(cfg, name: str, resuming: bool) -> None:
    """Before a stage's trainer starts: Lightning's CSV logger deletes ``metrics.csv`` (and warns)
    when it finds its folder not empty, so the folder is emptied here. Resuming from a checkpoint,
    the rows logged before the interruption move to ``RUN/logs/NAME.earlier/metrics.N.csv``
    (`read_curve` reads them too); a stage that starts afresh drops every earlier log."""
    if not is_main():
        return
    folder, earlier = cfg.run_dir / "logs" / name, _earlier_folder(cfg, name)
    current = folder / "metrics.csv"
    if resuming and current.is_file():
        earlier.mkdir(parents=True, exist_ok=True)
        current.rename(earlier / f"metrics.{len(_earlier_logs(earlier))}.csv")
    elif not resuming:
        shutil.rmtree(earlier, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)


def ignore_resume_warnings() -> None:
    """Inside ``warnings.catch_warnings()``, around ``trainer.fit(ckpt_path=last)``: two warnings
    Lightning gives every resumed stage, about states this package means. The checkpoint folder
    holds the checkpoint being resumed from (and the best one so far), and a stage resumes at the
    checkpoint's optimizer step with the epoch's batches drawn afresh from the start of the
    seeded order, as Lightning's plain DataLoader resumes."""
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty\.")
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended "
                                              r"and your dataloader is not resumable\.")


def read_curve(cfg, name: str) -> list[dict]:
    """Validation rows of a stage's CSV logs, a resumed stage's earlier ones included:
    [{step, val/loss, val/exact_match, ...}], a step validated again keeping its last values."""
    folder = cfg.run_dir / "logs" / name
    rows = []
    for path in _earlier_logs(_earlier_folder(cfg, name)) + [p for p in (folder / "metrics.csv",) if p.is_file()]:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                vals = {k: float(v) for k, v in r.items() if k.startswith("val/") and v not in ("", None)}
                if vals:
                    step = vals.pop("val/step", float(r["step"]))  # the optimizer step validated
                    rows.append({"step": int(step), **vals})
    merged: dict[int, dict] = {}
    for r in rows:
        merged.setdefault(r["step"], {}).update(r)
    return [merged[s] for s in sorted(merged)]


def last_checkpoint(stage_dir: Path) -> Path | None:
    """The stage's ``last.ckpt`` to resume from, checked readable (`read_checkpoint`); None when
    there is none."""
    p = stage_dir / "checkpoints" / "last.ckpt"
    if not (p.exists() or p.is_symlink()):
        return None
    read_checkpoint(p)
    return p


def read_checkpoint(path: Path) -> dict:
    """A Lightning checkpoint, read without unpickling arbitrary objects (``weights_only``).

    Raises:
        ValueError: one line naming the file, why it cannot be read (not a regular file, truncated,
            not a checkpoint, pickled objects that are not tensors, which are refused unread) and
            how to continue.
    """
    if not path.is_file():
        raise ValueError(f"{path} cannot be resumed from: it is {file_kind(path)}, not a regular file; continue "
                         "with --resume --discard-last (the unfinished stage starts again) or remove it")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        if zipfile.is_zipfile(path) or _starts_as_pickle(path):
            problem = ("it holds pickled objects other than tensors and plain values (refused unread: no code in it "
                       "ran)")
        else:
            problem = "it is not a checkpoint (neither the zip archive torch.save writes nor a pickle)"
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0].split(". ")[0].rstrip(".")  # torch's first sentence
        problem = f"it is truncated or not a checkpoint ({reason})"
    else:
        if isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), dict):
            return checkpoint
        problem = "it is not a Lightning checkpoint (no state_dict)"
    raise ValueError(f"{path} cannot be resumed from: {problem}; continue with --resume --discard-last (the "
                     "unfinished stage starts again) or delete the file")


def _starts_as_pickle(path: Path) -> bool:
    """Whether a file begins with pickle's protocol opcode (a pickle, or torch.save's legacy format)."""
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"


def checkpoint_state(path: Path) -> dict[str, Tensor]:
    """A Lightning checkpoint's state dict, read without unpickling arbitrary objects."""
    return read_checkpoint(path)["state_dict"]
