"""``python train.py --config RECIPE`` for a chunk pretraining recipe (a YAML file whose top level names
``chunk_tokens``, `ilcp.config.is_chunk_recipe`): the run of `ilcp.training.chunk_pretrain` with
train.py's conventions (``key=value`` overrides, ``run_name`` and ``out_dir``, ``--resume``, ``--overwrite``)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import yaml

from .chunk_pretrain import load_settings, pretrain
from .chunk_run import run_with_lm

__all__ = ["train_recipe"]


def train_recipe(path: str, overrides: list[str], *, resume: bool = False, overwrite: bool = False) -> int:
    """``python train.py --config RECIPE [key=value ...]`` for a chunk pretraining recipe: the same run as
    ``python -m ilcp.training.chunk_pretrain --config RECIPE --out OUT_DIR/RUN_NAME``, its settings
    overridden as ``steps=3000``; ``run_name`` (default: the recipe's file name) and ``out_dir``
    (default ``checkpoints``) name the folder. A user's mistake is one line on stderr and exit code 2."""
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
