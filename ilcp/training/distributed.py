"""Training on several devices: the processes of one run, and what only the first one does.

``python train.py trainer.devices=N trainer.strategy=ddp`` runs N processes. The command the
user ran is rank 0: it prepares the run directory, then starts the other ranks (Lightning's
launcher runs the same command line again, with ``LOCAL_RANK`` set) and every rank joins one
process group (gloo on CPU, nccl on CUDA); the stages' Lightning Trainers reuse it. Processes
started by an external launcher (torchrun, SLURM) skip the start and join the same way.

Rank 0 alone checks and prepares the run directory (``--overwrite`` and ``--resume``'s clean-up
happen once, before the other ranks exist), extracts and caches the sender states while the
others wait, writes every stage's files, the export and the logs. The batch sizes of the config
are global: each of N ranks takes ``batch_size / N`` rows a step, so a step sees what a step on
one device sees.

Without several processes every function here is what one process does: rank 0 of a world of 1.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor

from ..io import atomic_save_safetensors, atomic_write_json


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if _initialised() else 1


def rank() -> int:
    return dist.get_rank() if _initialised() else 0


def is_main() -> bool:
    """Whether this process writes the run's files (rank 0, or the only process)."""
    return rank() == 0


def barrier() -> None:
    if _initialised():
        dist.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not _initialised():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reduce_sum(t: Tensor) -> Tensor:
    """The sum of `t` over the ranks (a new tensor)."""
    t = t.clone()
    if _initialised():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_rows(t: Tensor) -> Tensor:
    """Every rank's rows of `t` (R_i, ...), concatenated in rank order; ranks may hold different counts."""
    if not _initialised():
        return t
    n = world_size()
    counts = [torch.zeros(1, dtype=torch.long, device=t.device) for _ in range(n)]
    dist.all_gather(counts, torch.tensor([t.shape[0]], dtype=torch.long, device=t.device))
    most = int(max(c.item() for c in counts))
    padded = t.new_zeros((most, *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[: int(c.item())] for p, c in zip(parts, counts)])


def check_global_batch(batch_size: int, name: str, ranks: int) -> None:
    """ValueError naming the setting when `ranks` ranks cannot share a batch of `batch_size` evenly."""
    if batch_size % ranks:
        raise ValueError(f"{name}={batch_size} is the global batch and does not divide among {ranks} devices: "
                         f"choose a multiple of {ranks}")


def save_stage(metrics_path, metrics: dict, weights_path, tensors: dict[str, Tensor]) -> None:
    """Rank 0 writes a finished stage's metrics, then its weights (which mark the stage done);
    every rank waits until both are written."""
    if is_main():
        atomic_write_json(metrics_path, metrics)
        atomic_save_safetensors(tensors, weights_path)
    barrier()


class Processes:
    """The processes of a run with `trainer` settings (`ilcp.config_sections.TrainerConfig`).

    Before `launch`, `is_main` tells whether this process is rank 0 (the ranks come from the
    environment a launcher set); `launch` starts the other ranks where needed and joins the
    process group; `finish` waits for every rank, `abort` stops the ranks this process started."""

    def __init__(self, trainer):
        self._fabric = None
        if trainer.devices == 1 and trainer.num_nodes == 1:
            return
        probe = L.Fabric(accelerator=trainer.accelerator, devices=trainer.devices, num_nodes=trainer.num_nodes)
        if probe.world_size > 1:
            # Only the launcher and the process group of this Fabric are used: the Trainers of the
            # stages run trainer.strategy (ddp, fsdp, ...) inside the processes it starts.
            self._fabric = L.Fabric(accelerator=trainer.accelerator, devices=trainer.devices,
                                    num_nodes=trainer.num_nodes, strategy="ddp")

    @property
    def world_size(self) -> int:
        return self._fabric.world_size if self._fabric is not None else 1

    @property
    def is_main(self) -> bool:
        return self._fabric is None or self._fabric.global_rank == 0

    def launch(self) -> None:
        if self._fabric is not None:
            self._fabric.launch()

    def main_first(self):
        """A block rank 0 runs first; the other ranks run it once rank 0 has (no time limit)."""
        return self._fabric.rank_zero_first() if self._fabric is not None else contextlib.nullcontext()

    def finish(self) -> None:
        """Every rank has finished: wait for the ranks this process started, leave the group."""
        if self._fabric is None:
            return
        barrier()
        if _initialised():
            dist.destroy_process_group()
        failed = [proc.args for proc in self._children() if proc.wait() != 0]
        if failed:
            raise RuntimeError(f"{len(failed)} of the ranks this process started failed after training")

    def abort(self) -> None:
        """This rank failed: stop the ranks it started (they would wait for it forever)."""
        for proc in self._children():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)

    def _children(self) -> list:
        """The processes Lightning's launcher started from this one (none elsewhere)."""
        if self._fabric is None:
            return []
        launcher = getattr(self._fabric._strategy, "launcher", None)
        return list(getattr(launcher, "procs", []))
