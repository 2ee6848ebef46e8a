"""Ship a trained handoff in the repository: its whole export, checked, plus a card with its
evaluation, so that `ILCPHandoff.from_pretrained(FOLDER)` sends and receives with no training.

    python train.py --config configs/general-chunk.yaml
    python eval.py --ckpt checkpoints/general-chunk --only-tasks --tasks ... --out results/general-chunk
    python scripts/ship_handoff.py checkpoints/general-chunk --results results/general-chunk/results.json \
        --out pretrained/smollm2-general-chunk8

The export (config.json, every weights file it names, train_config.yaml, metrics.json) is read
as every export is (`ilcp.export.read_export`: schema, config.json's own digest, the weights'
sha256) and must hold an ILCP encoder; all its files together stay under `MAX_SHIPPED_BYTES`.
``--results`` is the eval.py results.json that measured this export (its fingerprint is
compared): the card's table is read from it, each task with its questions and 95% intervals,
held-out tasks marked. The files are copied into a folder beside the destination and renamed into
place once complete and read back.
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

MAX_SHIPPED_BYTES = 20 << 20
METHODS = ("ilcp", "cold_read_tuned", "prompt_tuned")
BASELINES = ("cold_read_tuned", "prompt_tuned")


def _score(task: str, m: dict | None) -> str:
    if m is None:
        return "-"
    key = "f1" if task == "squad" else "exact_match"
    lo, hi = m.get(f"{key}_ci") or (None, None)
    return f"{100 * m[key]:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]" if lo is not None else f"{100 * m[key]:.1f}"


def results_table(results: dict) -> list[str]:
    """One row per task (held-out tasks last): the score of each of `METHODS`, questions, and
    ILCP's wire bytes and receiver prefill positions beside the text's."""
    heldout = set((results.get("run") or {}).get("heldout_tasks") or [])
    tasks = sorted(results["tasks"], key=lambda t: (t in heldout, t != "squad", int(t.split(":")[1]) if ":" in t else 0))
    lines = ["| task | score: ilcp | cold_read_tuned (text) | prompt_tuned (question alone) | questions "
             "| ilcp wire bytes | prefill positions: ilcp / text |", "|---|---|---|---|---|---|---|"]
    for name in tasks:
        task = results["tasks"][name]
        methods = task.get("methods") or {}
        ilcp, text = methods.get("ilcp") or {}, methods.get("cold_read_tuned") or {}
        label = f"{name} (held out)" if name in heldout else name
        lines.append(f"| {label} | {_score(name, methods.get('ilcp'))} | {_score(name, methods.get('cold_read_tuned'))} "
                     f"| {_score(name, methods.get('prompt_tuned'))} | {task.get('n')} | {ilcp.get('wire_bytes', 0):,.0f} "
                     f"| {ilcp.get('prefill_positions', 0):,.0f} / {text.get('prefill_positions', 0):,.0f} |")
    return lines


def merge_baselines(results: dict, baselines: dict, source: str) -> dict:
    """`results` with the text and question-alone rows (`BASELINES`) of `baselines`, another run's
    evaluation on the same questions (the same LM, the same tasks, the same count each), where
    `results` has none: for a run that reads another run's tuned vectors and trains no baseline
    of its own. ValueError when the two evaluations did not ask the same questions."""
    if (baselines.get("run") or {}).get("fingerprint") != (results.get("run") or {}).get("fingerprint"):
        raise ValueError(f"--baselines {source} evaluated another LM (fingerprint)")
    merged = json.loads(json.dumps(results))
    taken = set()
    for name, task in merged["tasks"].items():
        other = baselines["tasks"].get(name)
        if other is None or other.get("n") != task.get("n") or other.get("split", "test") != task.get("split", "test"):
            raise ValueError(f"--baselines {source} did not ask {name}'s {task.get('n')} questions "
                             f"({'no such task' if other is None else str(other.get('n')) + ' questions'})")
        methods = task.setdefault("methods", {})
        for method in BASELINES:
            if method not in methods and method in (other.get("methods") or {}):
                methods[method] = other["methods"][method]
                taken.add(method)
    merged["baselines_from"] = source
    merged["baselines_taken"] = [m for m in BASELINES if m in taken]
    return merged


def card(run: Path, out: Path, config: dict, train_config: dict, metrics: dict, results: dict, command: str) -> str:
    h, d = train_config["handoff"], train_config["data"]
    memory = train_config["compressor"]["memory"]
    seconds = metrics.get("total_seconds") or 0
    prov = results.get("provenance") or {}
    writer = memory.get("writer_from") or ""
    return "\n".join([
        f"# A general handoff for `{config['lm']['spec']}`, ready to use", "",
        f"An ILCP handoff trained once over many tasks and never on the question it will be asked: the sender writes "
        f"the context into a `{config['pooling']['kind']}` memory, the receiver (the frozen LM `{config['lm']['spec']}`, "
        f"fingerprint `{config['lm']['fingerprint']}`; another LM is refused) reads it where the context text would "
        f"stand in its prompt. Load it and use it as it is:", "",
        "```python",
        "from ilcp import ILCPHandoff",
        f'handoff = ILCPHandoff.from_pretrained("{out}")',
        "memory = handoff.open(handoff.send(context).to_bytes())",
        "print(memory.ask(question))",
        "```", "",
        "## How it was made", "",
        f"- Command: `{command}` (run `{run.name}`), then `python scripts/ship_handoff.py`.",
        f"- Sender: {'the shipped writer `' + writer + '` (its card gives its pretraining)' if writer else 'trained in the run'}"
        f"{', kept as shipped' if not h.get('finetune_encoder') else ', fine-tuned on the answers'}.",
        f"- Answers: `{d['task']}`, {d['train_size']} rows, held out of every stage: "
        f"{', '.join(d.get('heldout_tasks') or []) or 'none'}; {_steps(h)} "
        f"({', '.join(h['variants'])}), ilcp distilled from `{h.get('distill_teacher')}` "
        f"(weight {h.get('distill_weight')}) plus the gold answers' cross-entropy{_kept(metrics)}.",
        f"- Budget: {seconds / 60:.1f} minutes in all (compute precision {metrics.get('precision')}).",
        "- Files: config.json (its own digest, the weights' sha256), "
        f"{', '.join(sorted(set(config['files'].values())))}, train_config.yaml, metrics.json.", "",
        "## How well it answers", "",
        f"{_commands(prov.get('command'))} on {prov.get('date')}, {prov.get('machine')}: the first "
        f"{max(t.get('n', 0) for t in results['tasks'].values())} "
        "test questions per task; score: exact match, on SQuAD F1, % with 95% intervals. cold_read_tuned reads the "
        "context text behind " + ("the tuned vectors this run reads too" + _taken(results)
                                  if results.get("baselines_from") else "this run's tuned vectors")
        + "; prompt_tuned reads the question alone: the floor a handoff must beat.", "",
        *results_table(results), "", summary(results), ""])


def _steps(h: dict) -> str:
    """The answer stage's budget: one per variant, or cold_read_tuned's own beside it."""
    own = h.get("cold_read_tuned_steps") or 0
    budget = f"{h['max_steps']} steps of batch {h['batch_size']} per variant"
    return f"{budget}, cold_read_tuned {own}" if own and "cold_read_tuned" in h["variants"] else budget


def _kept(metrics: dict) -> str:
    """Which of ilcp's checkpoints the export holds: the best validation exact match, and where."""
    ilcp = (metrics.get("variants") or {}).get("ilcp") or {}
    if ilcp.get("best_step") is None:
        return ""
    # runs that log val/select broke a tie by the lower validation loss; earlier runs kept the earlier step
    tie = ("a tie goes to the lower validation loss" if any("val/select" in r for r in ilcp.get("curve") or [])
           else "ties keep the earlier step")
    return (f"; the export holds ilcp at step {ilcp['best_step']} of {ilcp.get('steps')}, its best validation exact "
            f"match ({ilcp.get('best_val_exact_match')}; {tie})")


def _taken(results: dict) -> str:
    """Which baseline rows another evaluation of the same questions gave (`merge_baselines`)."""
    taken = results.get("baselines_taken") or list(BASELINES)  # a merge recorded before the list was kept
    verb = "is" if len(taken) == 1 else "are"
    return f"; {' and '.join(taken)} {verb} from `{results['baselines_from']}`, the same questions"


def _commands(command) -> str:
    commands = command if isinstance(command, list) else [command or "eval.py"]
    return ", then ".join(f"`{c}`" for c in commands)


def summary(results: dict) -> str:
    """Mean scores over the trained tasks (SQuAD apart) and over the held-out ones, per method."""
    heldout = set((results.get("run") or {}).get("heldout_tasks") or [])
    groups = {"trained bAbI tasks": [t for t in results["tasks"] if t.startswith("babi") and t not in heldout],
              "held-out tasks": [t for t in results["tasks"] if t in heldout]}
    parts = []
    for label, names in groups.items():
        if not names:
            continue
        means = {}
        for m in METHODS:  # a method not measured on every task of the group has no mean
            rows = [(results["tasks"][t]["methods"].get(m) or {}).get("exact_match") for t in names]
            means[m] = "-" if None in rows else f"{100 * sum(rows) / len(rows):.1f}"
        parts.append(f"{label} ({len(names)}), mean exact match: "
                     + ", ".join(f"{m} {means[m]}" for m in METHODS))
    return "; ".join(parts) + "."


def ship(run: Path, out: Path, results_file: Path, *, overwrite: bool = False, command: str = "",
         baselines_file: Path | None = None) -> Path:
    exported = read_export(run)
    config = exported.config
    if exported.encoder is None:
        raise ExportError(f"{run}: no ILCP encoder to ship (trained without 'ilcp')")
    names = ["config.json", *sorted(set(config["files"].values())), "train_config.yaml", "metrics.json"]
    for name in names:
        if not (run / name).is_file():
            raise ExportError(f"{run / name}: missing (a finished train.py run has it)")
    size = sum((run / name).stat().st_size for name in names)
    if size > MAX_SHIPPED_BYTES:
        raise ExportError(f"{run}: its files take {size:,} bytes, over the {MAX_SHIPPED_BYTES:,} a shipped handoff may")
    results = json.loads(Path(results_file).read_text())
    if (results.get("run") or {}).get("fingerprint") != config["lm"]["fingerprint"] or not results.get("tasks"):
        raise ValueError(f"{results_file} is not an evaluation of {run} (another LM fingerprint or no tasks)")
    if baselines_file is not None:
        results = merge_baselines(results, json.loads(Path(baselines_file).read_text()), str(baselines_file))
    train_config = yaml.safe_load((run / "train_config.yaml").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: pass --overwrite to replace it")
    command = command or f"python train.py --config configs/{run.name}.yaml"
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        for name in names:
            shutil.copy2(run / name, partial / name)
        atomic_write_text(partial / "README.md", card(run, out, config, train_config, metrics, results, command))
        read_export(partial)  # the copy reads back as the run did
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a finished train.py run's folder")
    parser.add_argument("--results", required=True, help="the eval.py results.json that measured this run")
    parser.add_argument("--out", required=True, help="the folder written (pretrained/NAME)")
    parser.add_argument("--command", default="", help="the command that trained the run (default: its config)")
    parser.add_argument("--baselines", default=None,
                        help="another eval.py results.json on the same questions whose cold_read_tuned and "
                             "prompt_tuned rows fill the card's (for a run that reads that run's tuned vectors)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    args = parser.parse_args(argv)
    run = Path(args.run)
    if not (run / CONFIG_FILE).is_file():
        parser.error(f"{run}: no {CONFIG_FILE} there (give a finished run's folder)")
    for flag, path in (("--results", args.results), ("--baselines", args.baselines)):
        if path is not None and not Path(path).is_file():
            parser.error(f"{flag} {path}: no such file")
    try:
        out = ship(run, Path(args.out), Path(args.results), overwrite=args.overwrite, command=args.command,
                   baselines_file=Path(args.baselines) if args.baselines else None)
    except (ExportError, FileExistsError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"shipped {run} to {out} ({size / 2**20:.1f} MiB): {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
