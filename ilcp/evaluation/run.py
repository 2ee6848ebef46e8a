"""`evaluate`: every method of the protocol on the run's task (and held-out tasks), with latency.

    from ilcp.eval_config import EvalConfig
    from ilcp.evaluation.run import evaluate
    results = evaluate("checkpoints/default", EvalConfig(tasks=["babi:2"], limit=200, out="results/default"))
    results = evaluate("checkpoints/default", tasks=["babi:2"], limit=200)   # the same fields as keywords

The settings are one `EvalConfig`; `evaluate` opens the run (`open_session`, `.session`) and runs
the parts below as separate functions over it, in this order.

The run's training task and its settings come from its config.json (``task``, ``task_settings``:
the facts task is rebuilt with the run's number of facts, distractors and seed; bAbI tasks read
the ``en`` test file). Every task is asked the questions of one split (``split``: test, or
validation, the rows each source holds out of training: bAbI's from the run's variant and seed).
For each task (the run's training task plus the ``tasks`` given) and each method (`evaluate_task`):
1. accuracy, batched (`.batching`): the method builds the receiver prefixes of every row, one greedy decoder
   answers them; exact match and contains on the normalised first line, token F1, 95% Wilson
   intervals of the two accuracies, wire bytes and tensor bytes per request and prefill positions
   (a method whose receiver starts from no embedding prefix, e.g. ``kv_relay:...``, decodes its
   rows itself: ``HandoffMethod.decodes_itself``);
2. latency (`.timing`), per request and unbatched, on the first ``latency_n`` rows (after one untimed
   warm-up request): sender time (`HandoffMethod.send`), receiver time to first token (its
   `receive` plus the prefill of `decode_one`), and the handoff time, their sum.
With ``engine="vllm"`` step 1 decodes the same prefixes through a vLLM engine too (`.decoders`):
each method's metrics gain the vLLM answers' accuracy and their agreement with the HF decoder's
(summed over every task and method by `engine_agreement`).
With ``throughput_batches`` the receiver's decode is benchmarked in questions per second at those
batch sizes (ilcp and cold_read; HF, and vLLM with that engine: `throughput_table`).
Then the receiver's time to first token against context length on the facts task (no_context,
cold_read, ilcp: `context_length_sweep`), and, for a run trained on the facts task, accuracy
against the number of facts in the context (ilcp, prompt_tuned, cold_read_tuned:
`facts_count_sweep`; these three and `engine_agreement` are `.side_sweeps`). The result dict is
written as results.json, results.md and PNG plots when ``out`` is given (`ilcp.evaluation.report`);
each finished (task, method) is saved as it ends, for ``resume`` (`.resume`).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ..engines.vllm import VLLMDecoder
from ..eval_config import EvalConfig
from ..formatting import percent
from ..io import atomic_write_text
from ..lm import LM
from ..encoder.pooling import context_lengths
from ..precision import autocast
from ..progress import keep_talking, lines
from ..provenance import provenance
from ..tasks import EvalRows, Task
from .batching import accuracy, accuracy_shared
from .rclc_methods import sender_states
from .report import write_report
from .resume import part_key, part_path, read_part, write_part
from .session import EvalSession, heldout_tasks, open_session, parse_task, run_facts_settings, training_tasks
from .side_sweeps import context_length_sweep, engine_agreement, facts_count_sweep, throughput_table
from .timing import latency

__all__ = ["evaluate", "evaluate_task", "open_session", "parse_task", "run_facts_settings"]


def evaluate(
    ckpt: str | os.PathLike,
    config: EvalConfig | None = None,
    *,
    lm: LM | None = None,
    vllm: VLLMDecoder | None = None,
    log: Callable[[str], None] | None = None,
    **settings,
) -> dict:
    """Evaluate the methods of a trained run; returns the results dict (and writes it to ``config.out``).

    The parts run in this order, every forward inside the run's compute precision: accuracy and
    latency per task (`evaluate_task`), the vLLM engine's agreement with HF (`engine_agreement`),
    the receiver-throughput table (`throughput_table`), the context-length sweep
    (`context_length_sweep`) and the facts-count sweep (`facts_count_sweep`).

    Args:
        ckpt: the run directory (``checkpoints/RUN``).
        config: the settings (`ilcp.eval_config.EvalConfig`, whose fields say what each does);
            None builds one from ``settings``.
        lm: the run's LM already loaded (else loaded from config.json's spec, on ``config.device``).
        vllm: a `VLLMDecoder` on ``lm`` to use instead of starting an engine (engine="vllm").
        log: called with progress lines (eval.py logs them); None is silent.
        **settings: `EvalConfig` fields (``methods=["ilcp"], limit=8``), replacing those of
            ``config`` when one is given.

    With engine="vllm" every method's prefixes are decoded by the HF decoder and through one vLLM
    engine, and each method's metrics gain a ``"vllm"`` entry (exact match, contains, F1,
    agreement with HF; or ``"unavailable"`` and why); latency and the sweeps stay on the HF
    decoder. The default precision is the one the run trained at (config.json ``lm.precision``);
    the vLLM engine computes in its own dtype.

    Raises:
        ExportError: ``ckpt`` is not a finished run, its signature does not verify under
            ``config.export_key`` (or it carries none), ``lm`` is another LM than the run's, or a facts
            task is asked of a run whose config.json records no facts settings (``task_settings``).
        ValueError: an unknown method, task or engine, or a bad number.
        TypeError: a keyword that is not an `EvalConfig` field.
        ImportError: engine="vllm" without vLLM installed (the message names .venv-vllm).
        RuntimeError: the vLLM engine did not start.
    """
    t_start = time.perf_counter()
    if config is None:
        config = EvalConfig(**settings)
    elif settings:
        config = replace(config, **settings)
    elif not isinstance(config, EvalConfig):
        raise TypeError(f"config must be an EvalConfig, got {type(config).__name__}")
    with keep_talking("evaluation", enabled=lines(config.progress)):
        return _evaluate(ckpt, config, lm, vllm, log, t_start)


def _evaluate(ckpt, config: EvalConfig, lm: LM | None, vllm: VLLMDecoder | None, log, t_start: float) -> dict:
    session = open_session(ckpt, config, lm=lm, vllm=vllm, log=log)
    lm = session.lm
    results: dict = {
        "run": {"path": str(session.ckpt), "lm_spec": session.run_config["lm"]["spec"],
                "fingerprint": lm.fingerprint,
                "train_task": "+".join(s.name for s in training_tasks(session.run_config["task"])),
                **({"heldout_tasks": held} if (held := heldout_tasks(session.run_config, session.ckpt)) else {}),
                "latent_dim": session.handoff.spec.latent_dim if session.handoff is not None else None,
                "num_memory_tokens": session.run_config.get("num_memory_tokens"),
                "export_verified": config.export_key is not None},
        "settings": {"split": config.split, "limit": config.limit, "latency_n": config.latency_n, "batch_size": config.batch_size,
                     "max_new_tokens": config.max_new_tokens, "intervals": "wilson", "seed": config.seed,
                     "methods": session.asked, "tasks": [s.name for s in session.tasks], "device": str(lm.device),
                     "engine": config.engine, "precision": session.precision,
                     "torch_threads": torch.get_num_threads()},
        "vllm": session.engine_info,
        "provenance": provenance(),
        "tasks": {},
        "skipped": session.skipped,
    }
    predictions: dict[str, tuple[list[dict], dict[str, list[str]], dict[str, list[str]]]] = {}
    # Every task's rows first: a bad file is refused before anything is evaluated or written.
    built = {spec.name: spec.eval_rows(config.limit, session.task_context) for spec in session.tasks}
    with autocast(session.precision, lm.device):  # every forward of every method at the run's precision
        for spec in session.tasks:
            results["tasks"][spec.name], predictions[spec.name] = evaluate_task(session, spec, built[spec.name])
        results["agreement"] = engine_agreement(session, results["tasks"])
        results["throughput"] = throughput_table(session)
        results["context_length"] = context_length_sweep(session)
        results["facts_count"] = facts_count_sweep(session)
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    if config.out is not None:
        write_report(results, config.out)
        _write_predictions(Path(config.out), predictions)
    return results


def evaluate_task(session: EvalSession, spec: Task,
                  built: EvalRows | None = None) -> tuple[dict, tuple[list[dict], dict, dict]]:
    """Accuracy (batched, HF and with engine="vllm" vLLM too) and latency (unbatched, the first
    ``latency_n`` rows) of every bound method on one task's split (``built``: its rows, when
    already built).

    Returns:
        (the task's entry of results["tasks"], (rows, HF predictions by method, vLLM predictions by
        method)) for predictions.jsonl.
    """
    cfg, say = session.config, session.say
    built = built or spec.eval_rows(cfg.limit, session.task_context)
    rows, available, source = built.rows, built.available, built.source
    seen = spec.name in session.trained_on
    say(f"task {spec.name} ({'seen in training' if seen else 'held out'}): {len(rows)} of {available} "
        f"{cfg.split} questions, {len(session.methods)} methods")
    task_result = {"seen_in_training": seen, "source": source, "n": len(rows), "available": available,
                   "limit": cfg.limit, "methods": {}}
    lengths = context_lengths(session.lm.tokenizer, [r["context"] for r in rows]) if rows else [0]
    task_result["context_tokens"] = {"mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)}
    if session.handoff is not None:  # the ilcp sender reads at most the export's max_length tokens
        cut = sum(n > session.handoff.max_length for n in lengths)
        task_result["ilcp_max_length"], task_result["ilcp_truncated"] = session.handoff.max_length, cut
        if cut:
            say(f"  {cut} of {len(rows)} contexts are longer than the export's max_length of "
                f"{session.handoff.max_length} tokens: the ilcp sender reads their last tokens")
    by_method: dict[str, list[str]] = {}
    by_method_vllm: dict[str, list[str]] = {}
    parts = {m.name: (part_path(cfg.out, spec.name, m.name) if cfg.out is not None else None,
                      part_key(session, spec.name, m.name)) for m in session.methods}
    saved_parts = {name: read_part(part, key) if cfg.resume and part is not None else None
                   for name, (part, key) in parts.items()}
    shared = [m for m in session.methods if m.shares_sender_states and saved_parts[m.name] is None]
    accuracy_done: dict[str, tuple] = {}
    if len(shared) > 1:  # every context's sender state built once for all of them
        say(f"  {len(shared)} methods share each context's sender state: their accuracy runs question chunk by "
            "question chunk, all of them on each chunk")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*longer than this export's max_length.*")
            done = accuracy_shared(shared, rows, sender_states(shared[0].ctx), batch_size=cfg.batch_size,
                                   max_new_tokens=cfg.max_new_tokens, progress=cfg.progress,
                                   desc=f"{spec.name} {len(shared)} rclc/kv_relay rows accuracy", vllm=session.vllm,
                                   open_text=spec.open_answers)
        accuracy_done = {m.name: d for m, d in zip(shared, done)}
    for m in session.methods:
        part, key = parts[m.name]
        saved = saved_parts[m.name]
        if saved is not None:
            metrics, preds, vllm_preds = saved
            task_result["methods"][m.name], by_method[m.name] = metrics, preds
            if vllm_preds is not None:
                by_method_vllm[m.name] = vllm_preds
            say(f"  {m.name:>16}: exact match {percent(metrics['exact_match'], metrics['exact_match_ci'], unit='%')} "
                f"(saved by an earlier evaluation, {part})")
            continue
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # counted once above, not warned per context
            warnings.filterwarnings("ignore", message=".*longer than this export's max_length.*")
            if m.name in accuracy_done:
                metrics, preds, vllm_preds, accuracy_s = accuracy_done[m.name]
            else:
                metrics, preds, vllm_preds = accuracy(m, rows, batch_size=cfg.batch_size,
                                                      max_new_tokens=cfg.max_new_tokens,
                                                      progress=cfg.progress, desc=f"{spec.name} {m.name} accuracy",
                                                      vllm=session.vllm, open_text=spec.open_answers)
                accuracy_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            metrics["latency"] = latency(m, rows[:cfg.latency_n], cfg.max_new_tokens, cfg.progress,
                                         f"{spec.name} {m.name} latency")
        metrics["seconds"] = {"accuracy": round(accuracy_s, 2), "latency": round(time.perf_counter() - t1, 2)}
        task_result["methods"][m.name] = metrics
        by_method[m.name] = preds
        if part is not None:  # one finished (task, method) survives a stopped evaluation
            write_part(part, key, metrics, preds, vllm_preds)
        if vllm_preds is not None:
            by_method_vllm[m.name] = vllm_preds
        say(f"  {m.name:>16}: exact match {percent(metrics['exact_match'], metrics['exact_match_ci'], unit='%')}, "
            f"contains {percent(metrics['contains'], metrics['contains_ci'], unit='%')}, "
            f"{metrics['wire_bytes']:,.0f} B on the wire ({accuracy_s:.0f}s accuracy, "
            f"{metrics['seconds']['latency']:.0f}s latency)")
        if "vllm" in metrics:
            v = metrics["vllm"]
            say(f"  {'':>16}  " + (v["unavailable"] if "unavailable" in v else
                                   f"vLLM: exact match {percent(v['exact_match'], v['exact_match_ci'], unit='%')}, agreement "
                                   f"with HF {percent(v['agreement'], unit='%')} ({v['disagree']} of {v['n']} differ)"))
    return task_result, (rows, by_method, by_method_vllm)


def _write_predictions(out: Path, predictions: dict) -> None:
    """predictions.jsonl: one line per task, method and question (for reading the answers)."""
    lines = []
    for task, (rows, by_method, by_method_vllm) in predictions.items():
        for method, preds in by_method.items():
            on_vllm = by_method_vllm.get(method)
            for i, (row, p) in enumerate(zip(rows, preds)):
                line = {"task": task, "method": method, "id": row["id"], "question": row["question"],
                        "answer": row["answer"], "prediction": p}
                if on_vllm is not None:
                    line["prediction_vllm"] = on_vllm[i]
                lines.append(json.dumps(line))
    atomic_write_text(out / "predictions.jsonl", "\n".join(lines) + ("\n" if lines else ""))
