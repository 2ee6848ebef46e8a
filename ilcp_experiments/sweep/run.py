"""The sweep's work: which runs to train (reusing finished ones), training them, evaluating every
entry, writing the summary, and the command line (`main`)."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from ilcp.config import TrainConfig, load_config
from ilcp.eval_config import EvalConfig
from ilcp.export import read_export
from ilcp.handoff import ILCPHandoff
from ilcp.io import atomic_write_json, atomic_write_text
from ilcp.lm import load_lm
from ilcp.tasks import make_facts
from ilcp.evaluation.run import run_facts_settings, evaluate
from .render import markdown, panels_and_rows, plot
from .schema import (EVAL_RECORD, PLOT, REFERENCE, SELECTION, SWEEP_JSON, SWEEP_MD, Sweep, SweepError,
                     config_diff, entry_settings, eval_entries, load_sweep)


TEXT_METHODS = ("cold_read", "cold_read_tuned")


EMPTY_METHODS = ("no_context", "prompt_tuned")


def _shown(path: Path) -> str:
    """A path relative to the current directory when it lies below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def run_state(cfg: TrainConfig) -> tuple[str, str]:
    """What the run folder of ``cfg`` holds: ("empty" | "finished" | "unfinished" | "different", detail)."""
    run_dir = cfg.run_dir
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return "empty", ""
    saved = run_dir / "train_config.yaml"
    if not saved.is_file():
        return "different", f"{run_dir} holds files but no train_config.yaml"
    try:
        old = load_config(saved).to_dict()
    except ValueError as e:
        return "different", f"its train_config.yaml does not load with this package ({e})"
    if old != cfg.to_dict():
        return "different", f"its train_config.yaml differs ({config_diff(old, cfg.to_dict())})"
    return ("finished", "") if (run_dir / "config.json").is_file() else ("unfinished", "")


def plan_training(sweep: Sweep, *, resume: bool, overwrite: bool) -> dict[str, str]:
    """run name -> "reuse", "train", "resume" or "retrain"; raises SweepError before anything
    trains when a folder holds a different or unfinished run and the flags do not allow it."""
    plan, problems = {}, []
    for name, cfg in sweep.configs.items():
        state, detail = run_state(cfg)
        if state == "empty":
            plan[name] = "train"
        elif state == "finished":
            plan[name] = "reuse"
        elif state == "unfinished":
            if resume:
                plan[name] = "resume"
            elif overwrite:
                plan[name] = "retrain"
            else:
                problems.append(f"{cfg.run_dir} holds an unfinished run of this config: pass --resume to continue "
                                "it or --overwrite to start it again")
        elif overwrite:
            plan[name] = "retrain"
        else:
            problems.append(f"{cfg.run_dir} holds another run: {detail}. Pass --overwrite to train it again with "
                            "this config, or name the point differently")
    if problems:
        raise SweepError("; ".join(problems))
    return plan


class _LMs:
    """Frozen LMs loaded on first use, one per (spec, dtype, cache folder)."""

    def __init__(self, given, log):
        self.given, self.log, self.loaded = given, log, {}

    def __call__(self, spec: str, dtype: str = "float32", cache_dir: str | None = None):
        if self.given is not None:
            given_dtype = str(self.given.dtype).removeprefix("torch.")
            if self.given.spec != spec or given_dtype != dtype:
                raise SweepError(f"the LM passed in is {self.given.spec!r} ({given_dtype}), but a run needs "
                                 f"{spec!r} ({dtype})")
            return self.given
        key = (spec, dtype, cache_dir)
        if key not in self.loaded:
            self.log(f"loading LM {spec!r} ({dtype})")
            self.loaded[key] = load_lm(spec, dtype=dtype, cache_dir=cache_dir)
        return self.loaded[key]


def train_runs(sweep: Sweep, plan: dict[str, str], lms: _LMs, log) -> dict[str, dict]:
    from ilcp.training import train

    done = {}
    for name, action in plan.items():
        cfg = sweep.configs[name]
        if action == "reuse":
            log(f"run {name}: reusing the finished run in {cfg.run_dir} (same resolved config)")
            done[name] = {"training": "reused", "seconds": 0.0}
            continue
        log(f"run {name}: {'training' if action in ('train', 'retrain') else 'resuming'} "
            f"{'(replacing what the folder held) ' if action == 'retrain' else ''}into {cfg.run_dir}")
        t0 = time.perf_counter()
        train(cfg, resume=action == "resume", overwrite=action == "retrain",
              lm=lms(cfg.lm.spec, cfg.lm.dtype, cfg.lm.cache_dir))
        done[name] = {"training": {"train": "trained", "retrain": "retrained", "resume": "resumed"}[action],
                      "seconds": round(time.perf_counter() - t0, 1)}
        log(f"run {name}: done in {done[name]['seconds']:.0f} s")
    return done


def _run_digest(run_dir: Path) -> str:
    """sha256 of config.json and every weight file it lists: the evaluated run, byte for byte."""
    h = hashlib.sha256()
    config_path = run_dir / "config.json"
    data = config_path.read_bytes()
    h.update(data)
    for name in sorted(json.loads(data).get("files", {}).values()):
        h.update(name.encode())
        with open(run_dir / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _facts_count_bytes(run_dir: Path, config: dict, lm, methods: Sequence[str], counts: Sequence[int], n: int,
                       payload_dtype: str, batch_size: int) -> dict:
    """{count: {method: [wire bytes, tensor bytes] per request}} on the questions of evaluate()'s
    facts-count sweep (the same make_facts call), for the methods that sweep reports."""
    settings = run_facts_settings(config, run_dir)
    heldout = {"value_split": "heldout"} if settings.get("value_split") == "train" else {}
    handoff = None
    if "ilcp" in methods:
        handoff = ILCPHandoff.from_export(read_export(run_dir), lm, payload_dtype=payload_dtype)
    out = {}
    for count in counts:
        rows = make_facts(n, n_facts=count, n_distractors=settings["n_distractors"], seed=settings["seed"],
                          split="test", **heldout).to_list()
        contexts = [r["context"] for r in rows]
        per = {}
        for m in methods:
            if m == "ilcp":
                if handoff.encoder.chunked:
                    payloads = handoff.send_each(contexts, batch_size=batch_size, max_characters=None)
                    per[m] = [sum(len(p.to_bytes()) for p in payloads) / len(payloads),
                              sum(p.byte_length() for p in payloads) / len(payloads)]
                else:
                    per[m] = [float(handoff.wire_bytes), float(handoff.tensor_bytes)]
            elif m in TEXT_METHODS:
                per[m] = [sum(len(c.encode("utf-8")) for c in contexts) / len(contexts), 0.0]
            elif m in EMPTY_METHODS:
                per[m] = [0.0, 0.0]
        out[str(count)] = per
    return out


def evaluate_entries(sweep: Sweep, lms: _LMs, *, resume: bool, log) -> dict[str, dict]:
    """label -> {"results": evaluate()'s results as written, "facts_count_bytes", "evaluation", "dir"}."""
    done = {}
    for entry in eval_entries(sweep):
        s = entry_settings(sweep, entry)
        cfg = sweep.configs[entry.run]
        out = sweep.out / "evals" / entry.label
        key = {"run": entry.run, "run_digest": _run_digest(cfg.run_dir), "methods": list(entry.methods),
               "payload_dtype": entry.payload_dtype, "eval": asdict(s)}
        key = json.loads(json.dumps(key))
        record_path = out / EVAL_RECORD
        if resume and record_path.is_file() and (out / "results.json").is_file():
            record = json.loads(record_path.read_text())
            if record.get("key") == key:
                log(f"eval {entry.label}: reusing {out} (same run, methods and settings)")
                done[entry.label] = {"results": json.loads((out / "results.json").read_text()),
                                     "facts_count_bytes": record.get("facts_count_bytes") or {},
                                     "evaluation": "reused", "dir": str(out), "seconds": record.get("seconds")}
                continue
        log(f"eval {entry.label}: {', '.join(entry.methods)} on run {entry.run}"
            + (f" ({entry.payload_dtype} payload)" if entry.kind == "ilcp" else ""))
        lm = lms(cfg.lm.spec, cfg.lm.dtype, cfg.lm.cache_dir)
        t0 = time.perf_counter()
        settings = EvalConfig(tasks=list(s.tasks), methods=list(entry.methods), limit=s.limit, latency_n=s.latency_n,
                              batch_size=s.batch_size, max_new_tokens=s.max_new_tokens, lengths=[],
                              facts_counts=list(s.facts_counts), facts_count_limit=s.facts_count_limit, seed=s.seed,
                              out=out, payload_dtype=entry.payload_dtype)
        evaluate(cfg.run_dir, settings, lm=lm, log=lambda message, label=entry.label: log(f"  {label}: {message}"))
        results = json.loads((out / "results.json").read_text())
        count_bytes = {}
        sweep_rows = (results.get("facts_count") or {}).get("rows") or []
        if sweep_rows:
            methods = list(dict.fromkeys(r["method"] for r in sweep_rows))
            count_bytes = _facts_count_bytes(cfg.run_dir, json.loads((cfg.run_dir / "config.json").read_text()), lm,
                                             methods, results["facts_count"]["counts"],
                                             results["facts_count"]["questions_per_point"], entry.payload_dtype,
                                             s.batch_size)
        seconds = round(time.perf_counter() - t0, 1)
        atomic_write_json(record_path, {"key": key, "facts_count_bytes": count_bytes, "seconds": seconds})
        log(f"eval {entry.label}: done in {seconds:.0f} s")
        done[entry.label] = {"results": results, "facts_count_bytes": count_bytes, "evaluation": "evaluated",
                             "dir": str(out), "seconds": seconds}
    return done


def run_sweep(sweep: Sweep, *, resume: bool = False, overwrite: bool = False, lm=None,
              log: Callable[[str], None] = print) -> dict:
    """Train what is missing, evaluate, and write the plot, sweep.json and sweep.md into
    ``sweep.out``; returns the summary written to sweep.json.

    Args:
        lm: an `ilcp.lm.LM` to use for every run (its spec must be the runs'); None loads each
            run's LM on first need.
        resume: continue unfinished runs, and keep evaluations already written for the same run,
            methods and settings.
        overwrite: train again runs whose folder holds a different or unfinished run.
    """
    t0 = time.perf_counter()
    plan = plan_training(sweep, resume=resume, overwrite=overwrite)
    log(f"sweep {sweep.name}: {len(sweep.points)} points, {len(plan)} runs in {sweep.checkpoints} "
        f"({', '.join(f'{k}: {v}' for k, v in plan.items())}); results in {sweep.out}")
    lms = _LMs(lm, log)
    trained = train_runs(sweep, plan, lms, log)
    evals = evaluate_entries(sweep, lms, resume=resume, log=log)
    panels, rows = panels_and_rows(sweep, evals)
    ref = sweep.reference
    summary = {
        "name": sweep.name, "sweep": str(sweep.path), "base": _shown(sweep.base), "overrides": list(sweep.overrides),
        "extra": list(sweep.extra), "checkpoints": str(sweep.checkpoints), "out": str(sweep.out),
        "description": sweep.description, "eval": asdict(sweep.eval), "panels_tasks": [p["key"] for p in panels
                                                                                       if "facts_count" not in p],
        "points": [], "reference": None, "panels": panels, "rows": rows, "plot": PLOT,
    }
    for p in sweep.points:
        cfg = sweep.configs[p.run]
        summary["points"].append({
            "name": p.name, "run": p.run, "run_dir": str(cfg.run_dir), "overrides": list(p.overrides),
            "description": p.description, "payload_dtype": p.payload_dtype, "latent_dim": cfg.compressor.latent_dim,
            "chunk_tokens": cfg.compressor.memory.chunk_tokens, "reconstruct_steps": cfg.reconstruct.steps,
            "num_memory_tokens": cfg.handoff.num_memory_tokens, "training": trained[p.run]["training"],
            "train_seconds": trained[p.run]["seconds"], "evaluation": evals[p.name]["evaluation"],
            "eval_dir": evals[p.name]["dir"],
        })
    if ref is not None:
        run = ref.run or sweep.points[0].run
        summary["reference"] = {
            "methods": list(ref.methods), "run": run, "run_dir": str(sweep.configs[run].run_dir),
            "variants": list(sweep.configs[run].handoff.variants) if ref.run else [],
            "overrides": list(ref.overrides), "training": trained[run]["training"],
            "evaluation": evals[REFERENCE]["evaluation"], "eval_dir": evals[REFERENCE]["dir"],
        }
    if sweep.selection is not None:
        run = ref.run or sweep.points[0].run
        summary["selection"] = {
            "methods": list(sweep.selection.methods), "tasks": list(sweep.selection.tasks),
            "limit": sweep.selection.limit, "run": run, "evaluation": evals[SELECTION]["evaluation"],
            "eval_dir": evals[SELECTION]["dir"], "seconds": evals[SELECTION].get("seconds"),
        }
    sweep.out.mkdir(parents=True, exist_ok=True)
    plot(summary, sweep.out / PLOT)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    atomic_write_text(sweep.out / SWEEP_MD, markdown(summary))
    atomic_write_json(sweep.out / SWEEP_JSON, summary)
    log(f"wrote {PLOT}, {SWEEP_JSON} and {SWEEP_MD} to {sweep.out} ({summary['seconds']:.0f} s)")
    return summary


def build_parser() -> argparse.ArgumentParser:
    from . import __doc__ as usage

    parser = argparse.ArgumentParser(prog="python -m ilcp_experiments sweep", description=usage,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", required=True, help="the sweep file (configs/sweep/*.yaml)")
    parser.add_argument("--out", default=None, help="where the plot, sweep.json, sweep.md and the per-point "
                                                    "reports go (default: the file's out, else results/sweep-NAME)")
    parser.add_argument("--checkpoints", default=None, help="where the runs are trained (default: the file's "
                                                            "checkpoints, else checkpoints/sweep-NAME)")
    parser.add_argument("--limit", type=int, default=None,
                        help="questions per task and per number of facts (replaces eval.limit and eval.facts_count_limit)")
    parser.add_argument("--resume", action="store_true",
                        help="continue unfinished runs and keep evaluations already written for the same settings")
    parser.add_argument("--overwrite", action="store_true",
                        help="train again runs whose folder holds a different or unfinished run")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a training override for every run (repeatable), e.g. lm.cache_dir=/tmp/cache")
    return parser


def main(argv: Sequence[str] | None = None, *, lm=None, log: Callable[[str], None] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    say = log or (lambda message: print(f"[sweep] {message}", flush=True))
    try:
        sweep = load_sweep(args.sweep, out=args.out, checkpoints=args.checkpoints, limit=args.limit, extra=args.extra)
    except ValueError as e:
        parser.error(str(e))
    try:
        run_sweep(sweep, resume=args.resume, overwrite=args.overwrite, lm=lm, log=say)
    except (FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
