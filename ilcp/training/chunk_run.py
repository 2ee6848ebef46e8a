"""What the chunk memory's resumable command-line runs share (`ilcp.training.chunk_pretrain`,
`ilcp.training.chunk_latent`): AdamW's moments saved by parameter name and put back, a flag's
true/false, and the command line's tail that loads the LM and turns a user's mistake into one line."""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import Tensor

from ..lm import LMLoadError, load_lm

__all__ = ["adam_moments", "parse_flag", "restore_adam_moments", "run_with_lm"]


def adam_moments(module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    """AdamW's moments of `module`'s parameters, by parameter name (safetensors-ready)."""
    moments = {}
    for name, p in module.named_parameters():
        st = opt.state.get(p)
        if st:
            moments[f"exp_avg.{name}"] = st["exp_avg"].detach().cpu().contiguous()
            moments[f"exp_avg_sq.{name}"] = st["exp_avg_sq"].detach().cpu().contiguous()
    return moments


def restore_adam_moments(module: torch.nn.Module, opt: torch.optim.Optimizer, moments: dict[str, Tensor],
                         step: int) -> None:
    """Put `adam_moments`' tensors back into `opt` for `module`'s parameters, at `step`."""
    for name, p in module.named_parameters():
        if f"exp_avg.{name}" in moments:
            opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": moments[f"exp_avg.{name}"].to(p.device),
                            "exp_avg_sq": moments[f"exp_avg_sq.{name}"].to(p.device)}


def parse_flag(text: str) -> bool:
    """A command line's true/false value (argparse's ``type`` for a bool setting)."""
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def run_with_lm(runtime: dict, call) -> int:
    """The command line's tail: threads as OMP_NUM_THREADS says, the LM loaded, ``call(lm)`` run; a
    user's mistake (or a loss that is no number) is one line on stderr and exit code 2."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    try:
        call(load_lm(runtime["lm"], dtype=runtime["dtype"], device=runtime["device"]))
    except (FileExistsError, ValueError, FloatingPointError, LMLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
