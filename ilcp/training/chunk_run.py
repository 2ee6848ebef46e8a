"""What the chunk memory's resumable command-line runs share (`ilcp.training.chunk_pretrain`,
`ilcp.training.chunk_latent`): AdamW's moments saved by parameter name and put back, the
command line's tail that loads the LM and turns a user's mistake into one line, and
``python train.py --config RECIPE`` for a chunk pretraining recipe (`train_recipe`)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch
import yaml
from torch import Tensor

from ..lm import LMLoadError, load_lm

__all__ = ["adam_moments", "parse_flag", "restore_adam_moments", "run_with_lm", "train_recipe"]


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


def train_recipe(path: str, overrides: list[str], *, resume: bool = False, overwrite: bool = False) -> int:
    """``python train.py --config RECIPE [key=value ...]`` for a chunk pretraining recipe: the same run as
    ``python -m ilcp.training.chunk_pretrain --config RECIPE --out OUT_DIR/RUN_NAME``, its settings
    overridden as ``steps=3000``; ``run_name`` (default: the recipe's file name) and ``out_dir``
    (default ``checkpoints``) name the folder. A user's mistake is one line on stderr and exit code 2."""
    from .chunk_pretrain import load_settings, pretrain

    given, place = {}, {"out_dir": "checkpoints", "run_name": Path(path).stem}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            print(f"error: override {item!r} is not key=value (a chunk pretraining recipe's keys are flat: "
                  f"steps=3000)", file=sys.stderr)
            return 2
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        (place if key in place else given)[key] = value
    try:
        cfg, runtime = load_settings(path, given)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(str(place["out_dir"])) / str(place["run_name"])
    if overwrite and out.exists():
        shutil.rmtree(out)
    print(f"[chunk] {path}: chunk pretraining into {out}", flush=True)
    return run_with_lm(runtime, lambda lm: pretrain(out, lm, cfg, resume=resume, log=lambda m: print(m, flush=True)))
