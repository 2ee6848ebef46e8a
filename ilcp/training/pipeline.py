"""`train(cfg)`: the whole run, for one frozen LM loaded once.

1. data (`ilcp.training.data`): task rows and the sender's states of every context, cached;
2. stage 1 (`ilcp.training.compressor_stage`): pooler and beta-VAE of the ILCP encoder;
   optionally (``reconstruct.steps > 0``) the reconstruction stage
   (`ilcp.training.reconstruction_stage`): the whole encoder, projector included, trained so the
   frozen LM regenerates each context from its memory vectors;
3. stage 2 (`ilcp.training.handoff_stage`): each variant's memory source through the frozen LM;
4. export (`ilcp.export`) to ``checkpoints/RUN``.

Each stage keeps a ``last.ckpt`` and writes its trained tensors when done; ``resume=True`` skips
finished stages and continues the unfinished one.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .. import export
from ..config import TrainConfig, save_config
from ..lm import LM, load_lm
from .compressor_stage import train_compressor
from .data import HandoffDataModule, prepare_data
from .handoff_stage import train_variant
from .reconstruction_stage import train_reconstruction
from .log import say


@dataclass
class TrainResult:
    run_dir: Path
    metrics: dict
    sources: dict  # variant -> trained memory source (best validation weights)


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, lm: LM | None = None) -> TrainResult:
    """Run both stages for every configured variant and export to ``cfg.run_dir``."""
    cfg.validate()
    run_dir = cfg.run_dir
    if run_dir.exists() and any(run_dir.iterdir()) and not (resume or overwrite):
        raise FileExistsError(
            f"{run_dir} already holds a run: pass --resume to continue it, --overwrite to start it "
            f"again, or choose another run_name=..."
        )
    if overwrite and not resume and run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "train_config.yaml")
    t_start = time.perf_counter()
    if lm is None:
        lm = load_lm(cfg.lm.spec, dtype=cfg.lm.dtype, cache_dir=cfg.lm.cache_dir)
    say(f"LM {lm.spec}: fingerprint {lm.fingerprint}, hidden {lm.hidden_size}, dtype {lm.dtype}")
    train_rows, val_rows = prepare_data(cfg, lm)
    encoder, compressor_metrics, reconstruct_metrics = None, {}, {}
    if "ilcp" in cfg.handoff.variants:
        encoder, compressor_metrics = train_compressor(cfg, lm, train_rows, val_rows, resume)
        if cfg.reconstruct.steps > 0:
            reconstruct_metrics = train_reconstruction(cfg, lm, encoder, train_rows, val_rows, resume)
    data = HandoffDataModule(train_rows, val_rows, cfg.handoff.batch_size, cfg.trainer.seed)
    sources, variant_metrics = {}, {}
    for variant in cfg.handoff.variants:
        sources[variant], variant_metrics[variant] = train_variant(cfg, variant, lm, data, encoder, resume)
        say(f"stage 2 ({variant}): best validation exact match {variant_metrics[variant]['best_val_exact_match']}")
    metrics = {
        "compressor": compressor_metrics, "reconstruct": reconstruct_metrics, "variants": variant_metrics,
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "train_rows": len(train_rows), "val_rows": len(val_rows),
    }
    export.export_run(cfg, lm, sources, metrics)
    say(f"exported to {run_dir} in {metrics['total_seconds']:.0f}s total")
    return TrainResult(run_dir=run_dir, metrics=metrics, sources=sources)
