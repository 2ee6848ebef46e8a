"""What an ILCP latent carries, in words: the receiver's reconstruction of a few test contexts.

    python scripts/reconstruct.py --ckpt checkpoints/facts1-reconstruct                # the export
    python scripts/reconstruct.py --ckpt checkpoints/facts1-reconstruct --stage reconstruct  # after that stage

Each context of the run's task (validation split, training values for the facts task) is sent,
and the receiver decodes ``[memory ; "Repeat the context..."]`` greedily (`ILCPHandoff.reconstruct`).
``--stage reconstruct`` uses the weights the reconstruction stage wrote, before the answer stage
fine-tuned them. Meaningful for runs trained with ``reconstruct.steps > 0``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from safetensors.torch import load_file

from ilcp import export
from ilcp.cli import setup_logging
from ilcp.config import load_config
from ilcp.handoff import ILCPHandoff
from ilcp.lm import load_lm
from ilcp.tasks import load_task
from ilcp.training.data import task_kwargs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a run folder written by train.py")
    parser.add_argument("--stage", default=None, help="a finished stage whose weights to use (e.g. reconstruct)")
    parser.add_argument("-n", type=int, default=6, help="contexts to reconstruct (default 6)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    run_dir = Path(args.ckpt)
    try:
        run = export.read_export(run_dir)
        if run.encoder is None:
            raise export.ExportError(f"{run_dir} holds no ILCP weights")
        if args.stage is not None:
            weights = run_dir / "stages" / args.stage / f"{args.stage}.safetensors"
            if not weights.is_file():
                raise export.ExportError(f"{weights} does not exist: no finished stage {args.stage!r}")
            export.load_encoder_state(run.encoder, load_file(str(weights)), source=str(weights))
        cfg = load_config(run_dir / "train_config.yaml")
    except ValueError as e:
        parser.error(str(e))
    setup_logging()
    lm = load_lm(run.config["lm"]["spec"], dtype=run.config["lm"].get("dtype", "float32"))
    handoff = ILCPHandoff.from_export(run, lm)
    rows = load_task(cfg.data.task, "validation", **task_kwargs(cfg, "validation", args.n)).to_list()[: args.n]
    payloads = handoff.send_each([r["context"] for r in rows])
    said = [handoff.reconstruct(p, args.max_new_tokens)[0] for p in payloads]
    for row, text in zip(rows, said):
        print(f"context: {row['context']}\nsaid:    {text.strip()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
