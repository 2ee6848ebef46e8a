"""One trained encoder's reconstruction validation loss through both routes of a batch: one padded
forward, or length groups (`ilcp.encoder.pooling.length_groups`), in float32 and in bfloat16.

Training runs each batch in length groups (the sender's slot forward and the receiver's loss)
unless ``trainer.length_groups`` is false; a row's logits then come from a forward beside other
rows than in one padded forward. This reads a
fixed export (a pretraining run's folder) on the pretraining recipe's validation texts both ways,
with the LM in float32 throughout (``32-true``) and held in bfloat16 as a bf16-mixed run holds it
(`ilcp.precision.hold`: a long unpadded prefill then takes `ilcp.attention`'s blocked attention),
and prints each mean loss and the largest per-batch difference: whether the two routes score the
same weights alike, apart from how training moves under them.

    python benchmarks/route_agreement.py --export runs/pretrain
    python benchmarks/route_agreement.py --export /tmp/pre/base --set data.val_size=16 --json /tmp/routes.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from ilcp.config import TrainConfig, load_config
from ilcp.encoder.slots import SlotEncoder
from ilcp.encoder.spec import ExportError
from ilcp.io import atomic_write_json
from ilcp.precision import autocast
from ilcp.provenance import provenance
from ilcp.training.data import HandoffDataModule, prepare_data, sender_max_length
from ilcp.training.init_from import pretrained_encoder
from ilcp.training.pipeline import load_run_lm
from ilcp.training.reconstruction_stage import ReconstructionModule, pretraining_rows

REPO = Path(__file__).resolve().parent.parent
PRECISIONS = ("32-true", "bf16-mixed")


@torch.no_grad()
def batch_losses(module: ReconstructionModule, batches: list[dict], precision: str) -> list[float]:
    """Each validation batch's reconstruction loss at ``precision``, through the route the module
    and its sender are set to."""
    losses = []
    for batch in batches:
        with autocast(precision, "cpu"):
            batch, targets, prompt_ids = module.tasks(batch)
            loss, _ = module.reconstruction_loss(batch, module.memory(batch), targets, prompt_ids)
        losses.append(float(loss))
    return losses


def set_route(module: ReconstructionModule, cfg: TrainConfig, grouped: bool) -> None:
    """Both parts of a training batch's forward through one route, as ``trainer.length_groups`` sets them:
    the receiver's loss (the module) and the slot sender (bound again)."""
    module.grouped = grouped
    if isinstance(module.source, SlotEncoder):  # other encoders read cached states: no sender forward
        module.source.bind_sender(module.lm, module.tokenizer, module.max_context_tokens, cfg.data.pool_layers,
                                  grouped=grouped)


def replace_precision(cfg: TrainConfig, precision: str) -> TrainConfig:
    """``cfg`` computing at ``precision``."""
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, precision=precision))


def reading(cfg: TrainConfig) -> tuple[ReconstructionModule, list[dict]]:
    """(the reconstruction module of the export's encoder over the run's LM, the validation batches)."""
    lm = load_run_lm(cfg)
    encoder = pretrained_encoder(cfg, lm, sender_max_length(cfg, lm))
    _, val_rows = prepare_data(cfg, lm)
    texts = pretraining_rows(cfg, lm, val_rows, "validation")
    module = ReconstructionModule(encoder, lm, cfg).eval()
    return module, list(HandoffDataModule(texts, texts, cfg.reconstruct.batch_size, cfg.trainer.seed).val_dataloader())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", required=True, help="a run folder or export whose encoder is read")
    parser.add_argument("--config", default=str(REPO / "configs" / "pretrain.yaml"),
                        help="the recipe whose validation texts are read (its encoder settings must match)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, [*args.set, f"compressor.init_from={args.export}"])
    except (OSError, ValueError) as e:
        parser.error(str(e))

    losses, rows, texts = {}, [], []
    for precision in PRECISIONS:  # a fresh LM each: held in bfloat16 as training holds it, or float32 throughout
        try:
            module, batches = reading(replace_precision(cfg, precision))
        except ExportError as e:
            parser.error(str(e))
        if not rows:
            texts = [t for b in batches for t in b["context"]]
            print(f"{len(texts)} validation texts in {len(batches)} batches of up to {cfg.reconstruct.batch_size}",
                  flush=True)
            print("| route | precision | validation loss | seconds |\n|---|---|---|---|")
        sizes = [len(b["context"]) for b in batches]
        for name, grouped in (("one padded forward", False), ("length groups", True)):
            set_route(module, cfg, grouped)
            start = time.perf_counter()
            each = batch_losses(module, batches, precision)
            mean = sum(x * n for x, n in zip(each, sizes)) / sum(sizes)  # as validation weighs its batches
            losses[name, precision] = each
            rows.append({"route": name, "precision": precision, "val_loss": mean, "batch_losses": each,
                         "seconds": time.perf_counter() - start})
            print(f"| {name} | {precision} | {mean:.4f} | {rows[-1]['seconds']:.0f} |", flush=True)
        del module
    gaps = {precision: max(abs(a - b) for a, b in zip(losses["one padded forward", precision],
                                                      losses["length groups", precision])) for precision in PRECISIONS}
    print("largest per-batch difference between the routes: "
          + ", ".join(f"{gap:.4f} in {precision}" for precision, gap in gaps.items()))
    if args.json:
        atomic_write_json(Path(args.json), {"provenance": provenance(), "export": args.export, "texts": len(texts),
                                            "largest_batch_difference": gaps, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
