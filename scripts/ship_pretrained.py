"""Ship a pretraining run's encoder in the repository: its export, checked, plus a card.

    python train.py --config configs/pretrain.yaml
    python benchmarks/memory_capacity.py --encoder checkpoints/pretrain --lengths 32 --ks 4 --out docs/results/pretrained-capacity
    python scripts/ship_pretrained.py checkpoints/pretrain --capacity docs/results/pretrained-capacity/memory_capacity.json

The run's export (config.json, model.safetensors, train_config.yaml and metrics.json) is read as
every export is (`ilcp.export.read_export`: schema, config.json's own digest, the weights'
sha256), must hold an encoder and no answer stage's weights, and its weights must stay under
`MAX_SHIPPED_BYTES`. The files are copied into a folder written beside the destination and
renamed into place once complete and read back; README.md there is the card: the recipe, the
corpus, the budget and the reading figures of ``--capacity`` (a `benchmarks/memory_capacity.py`
JSON that measured this encoder), beside the ceiling at the same K. A run starts from it with
``compressor.init_from=FOLDER``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import yaml

from ilcp.export import CONFIG_FILE, ExportError, read_export
from ilcp.io import atomic_write_text

MAX_SHIPPED_BYTES = 20 << 20  # what the repository carries for one pretrained encoder
SHIPPED = ("config.json", "model.safetensors", "train_config.yaml", "metrics.json")
DEFAULT_OUT = "pretrained/smollm2-memory"
DEFAULT_COMMAND = "python train.py --config configs/pretrain.yaml"


def capacity_rows(capacity: dict, encoder: str) -> list[dict]:
    """The capacity summary's rows of ``encoder`` (float32 payload) and of the ceiling at the same
    source, length and K, in the summary's order."""
    mine = [r for r in capacity["summary"] if r["memory"] == encoder]
    at = {(r["source"], r["L"], r["K"]) for r in mine}
    return [r for r in capacity["summary"]
            if r["memory"] == encoder or (r["memory"] == "ceiling" and (r["source"], r["L"], r["K"]) in at)]


def card(run: Path, config: dict, train_config: dict, metrics: dict, rows: list[dict], capacity: dict | None,
         command: str = DEFAULT_COMMAND) -> str:
    """The shipped encoder's README: what it is, how it was made, how well it reads back."""
    c, r, d = train_config["compressor"], train_config["reconstruct"], train_config["data"]
    pre = metrics.get("reconstruct", {})
    pooling = config["pooling"]
    lines = [
        f"# Pretrained ILCP encoder for `{config['lm']['spec']}`", "",
        f"Memory slots for the frozen LM `{config['lm']['spec']}` (fingerprint `{config['lm']['fingerprint']}`; another "
        "LM is refused): a slot per "
        f"{pooling['tokens_per_slot']} context tokens ({pooling['min_slots']} to {pooling['max_slots']}), read by the "
        f"sender's LM after the context with rank-{pooling.get('adapter_rank', 0)} adapters on its "
        f"{', '.join(pooling.get('adapter_targets', c.get('memory', {}).get('adapter_targets') or c.get('slot_adapter_targets')))} layers; each slot's state through a "
        f"beta-VAE to {config['latent_dim']} floats (beta {c['beta']}), projected to {config['num_memory_tokens']} "
        "memory vectors the receiver reads. Pretrained on text alone, never on a question.", "",
        "Start a run from it with `compressor.init_from=THIS_FOLDER`: the run's encoder settings must be these (one "
        "that differs is named with the value it needs).", "",
        "## How it was made", "",
        f"- Command: `{command}` (run `{run.name}`), then `python scripts/ship_pretrained.py`.",
        f"- Corpus: {pre.get('contexts')} distinct training texts from {', '.join(r['texts'])} "
        f"(`{d['task']}`, {d['train_size']} rows, held out: {', '.join(d.get('heldout_tasks') or []) or 'none'}; "
        f"prose passages of about {r['max_target_tokens']} tokens, at most {r['texts_per_source']}); "
        f"{round(100 * r['continuation'])}% of texts continued from the memory of their first half, the rest said back.",
        f"- Budget: {pre.get('steps')} steps of batch {r['batch_size']} ({pre.get('train_seconds')} s of training, "
        f"{round(metrics.get('total_seconds', 0))} s in all, compute precision {metrics.get('precision')}); "
        f"validation loss {_float(pre.get('first_val_loss'))} at the first validation, "
        f"{_float(pre.get('best_val_loss'))} at step {pre.get('best_step')} (kept).",
        "- Files: config.json (its own digest, the weights' sha256), model.safetensors, train_config.yaml, "
        "metrics.json.", "",
    ]
    if rows:
        settings = capacity["settings"]
        lines += ["## Reading it back", "",
                  f"`benchmarks/memory_capacity.py` on held-out texts ({', '.join(settings['sources'])}), "
                  f"{settings['texts_per_source']} per source, cut to L tokens; the ceiling is K vectors optimized "
                  f"per text against the frozen receiver ({settings['steps']} Adam steps). Machine and date: "
                  f"{capacity['provenance'].get('machine')}, {capacity['provenance'].get('date')}.", "",
                  "| source | L | memory | K | token accuracy | exact % | correct prefix |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {x['source']} | {x['L']} | {x['memory']} | {x['K']} | {x['token_accuracy']:.3f} | "
                  f"{x['exact_pct']:.0f} | {x['prefix']:.1f} |" for x in rows]
        lines.append("")
    return "\n".join(lines)


def _float(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def ship(run: Path, out: Path, capacity_file: Path | None = None, *, overwrite: bool = False,
         command: str = DEFAULT_COMMAND) -> Path:
    """Copy the checked export of ``run`` into ``out`` with its card; the folder written."""
    exported = read_export(run)
    config = exported.config
    if exported.encoder is None:
        raise ExportError(f"{run}: no encoder to ship (trained without 'ilcp')")
    if set(exported.soft_prompts):
        raise ExportError(f"{run}: it holds {', '.join(exported.soft_prompts)} too: ship a pretraining run "
                          "(configs/pretrain.yaml: variants [ilcp], handoff.max_steps 0)")
    size = (run / config["files"]["ilcp"]).stat().st_size
    if size > MAX_SHIPPED_BYTES:
        raise ExportError(f"{run / config['files']['ilcp']}: {size:,} bytes, over the {MAX_SHIPPED_BYTES:,} a shipped "
                          "encoder may weigh (a smaller latent, projector or adapter rank)")
    for name in SHIPPED:
        if not (run / name).is_file():
            raise ExportError(f"{run / name}: missing (a finished train.py run has it)")
    train_config = yaml.safe_load((run / "train_config.yaml").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    rows, capacity = [], None
    if capacity_file is not None:
        capacity = json.loads(Path(capacity_file).read_text())
        rows = capacity_rows(capacity, run.name)
        if not rows:
            raise ExportError(f"{capacity_file} holds no figures of the encoder {run.name!r} (measure it with "
                              f"benchmarks/memory_capacity.py --encoder {run})")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: pass --overwrite to replace it")
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in SHIPPED:
        shutil.copy2(run / name, partial / name)
    atomic_write_text(partial / "README.md", card(run, config, train_config, metrics, rows, capacity, command))
    read_export(partial)  # the copy reads back as the run did
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a pretraining run's folder (train.py --config configs/pretrain.yaml)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"the folder written (default {DEFAULT_OUT})")
    parser.add_argument("--capacity", help="a benchmarks/memory_capacity.py JSON that measured this run's encoder")
    parser.add_argument("--command", default=DEFAULT_COMMAND, help="the command that trained the run, for the card")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    args = parser.parse_args(argv)
    run = Path(args.run)
    if not (run / CONFIG_FILE).is_file():
        parser.error(f"{run}: no {CONFIG_FILE} there (give a finished run's folder)")
    if args.capacity and not Path(args.capacity).is_file():
        parser.error(f"--capacity {args.capacity}: no such file")
    try:
        out = ship(run, Path(args.out), Path(args.capacity) if args.capacity else None, overwrite=args.overwrite,
                   command=args.command)
    except (ExportError, FileExistsError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"shipped {run} to {out} ({size / 2**20:.1f} MiB): {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
