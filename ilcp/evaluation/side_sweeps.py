"""The parts of an evaluation beside per-task accuracy and latency, each over the `EvalSession`:
the vLLM engine's agreement with HF over every task (`engine_agreement`), the receiver's decode
throughput (`throughput_table`), time to first token against context length
(`context_length_sweep`) and, for a facts-trained run, accuracy against the number of facts
(`facts_count_sweep`)."""

from __future__ import annotations

from ..progress import tracked
from ..stats import latency_summary
from ..tasks import count_tokens, facts_for_length, make_facts
from .batching import accuracy
from .decoders import THROUGHPUT_METHODS, receiver_throughput
from .session import EvalSession
from .timing import time_request

__all__ = ["FACTS_COUNT_METHODS", "LENGTH_METHODS", "context_length_sweep", "engine_agreement", "facts_count_sweep",
           "throughput_table"]

LENGTH_METHODS = ("no_context", "cold_read", "ilcp")
FACTS_COUNT_METHODS = ("ilcp", "prompt_tuned", "cold_read_tuned")


def engine_agreement(session: EvalSession, tasks: dict) -> dict | None:
    """With engine="vllm": the agreement of the vLLM and HF answers over every question of every
    method that ran on both (``tasks``: results["tasks"]); None otherwise."""
    if session.config.engine != "vllm":
        return None
    same = total = 0
    unavailable = {}
    for task, t in tasks.items():
        for name, m in t["methods"].items():
            v = m.get("vllm") or {}
            if "unavailable" in v:
                unavailable[f"{task} {name}"] = v["unavailable"]
            elif v:
                total += v["n"]
                same += v["n"] - v["disagree"]
    return {"questions": total, "agree": same, "agreement": same / total if total else None,
            "unavailable": unavailable}


def throughput_table(session: EvalSession) -> dict | None:
    """With ``throughput_batches``: the receiver's decode in questions per second of
    `THROUGHPUT_METHODS` at those batch sizes, on the first ``throughput_n`` questions of the first
    task, HF and (with the engine) vLLM; None without batches or without those methods."""
    cfg, say = session.config, session.say
    if not cfg.throughput_batches:
        return None
    spec = session.tasks[0]
    methods = session.methods_named(THROUGHPUT_METHODS)
    if not methods:
        return None
    rows = spec.eval_rows(cfg.throughput_n, session.task_context).rows
    say(f"receiver throughput on {spec.name}: {', '.join(m.name for m in methods)}, {len(rows)} "
        f"questions, batches {cfg.throughput_batches}" + (", HF and vLLM" if session.vllm is not None else ", HF"))
    return {"task": spec.name, **receiver_throughput(methods, rows, cfg.throughput_batches,
                                                     max_new_tokens=cfg.max_new_tokens, decoder=session.vllm,
                                                     log=say)}


def context_length_sweep(session: EvalSession) -> dict | None:
    """Receiver time to first token of `LENGTH_METHODS` on facts contexts of about each of
    ``lengths`` tokens (``length_n`` requests each, of the split asked, seeded by ``seed``); None without
    lengths or without those methods."""
    cfg, say = session.config, session.say
    methods = session.methods_named(LENGTH_METHODS)
    lengths, n, max_new_tokens = cfg.lengths, cfg.length_n, cfg.max_new_tokens
    if not methods or not lengths:
        return None
    say(f"context-length sweep: {', '.join(m.name for m in methods)} at {list(lengths)} tokens, {n} requests each")
    tokenizer = session.lm.tokenizer
    rows_out = []
    warmed = set()
    for target in lengths:
        settings = facts_for_length(target, tokenizer)
        rows = make_facts(n, split=cfg.split, seed=cfg.seed, **settings).to_list()
        tokens = sum(count_tokens(r["context"], tokenizer) for r in rows) / len(rows)
        for m in methods:
            if m.name not in warmed:
                time_request(m, rows[0], max_new_tokens=max_new_tokens)
                warmed.add(m.name)
            timed = [time_request(m, r, max_new_tokens=max_new_tokens)
                     for r in tracked(rows, f"length {target} {m.name}", progress=cfg.progress)]
            rows_out.append({
                "method": m.name, "target_tokens": target, "context_tokens": tokens, **settings,
                "prefill_positions": sum(t.prefill_positions for t in timed) / len(timed),
                "wire_bytes": sum(t.wire_bytes for t in timed) / len(timed),
                "sender_s": latency_summary([t.sender_s for t in timed]),
                "receiver_ttft_s": latency_summary([t.receiver_ttft_s for t in timed]),
                "handoff_s": latency_summary([t.handoff_s for t in timed]),
            })
        say(f"  ~{tokens:.0f} tokens: " + ", ".join(
            f"{r['method']} TTFT {1000 * r['receiver_ttft_s']['p50']:.0f} ms" for r in rows_out if r["target_tokens"] == target))
    return {"targets": list(lengths), "requests_per_point": n, "rows": rows_out,
            "ilcp_pooled_max_length": session.handoff.max_length if session.handoff is not None else None}


def facts_count_sweep(session: EvalSession) -> dict | None:
    """For a run trained on the facts task: accuracy of `FACTS_COUNT_METHODS` on facts contexts with
    each of ``facts_counts`` facts (the run's distractor count, ``facts_count_limit`` questions
    each); a run trained on training values only is asked held-out values, so the sweep measures
    reading (so a validation evaluation of such a run skips the sweep: only the test split holds
    held-out values). None for another run, without counts or without those methods."""
    cfg, say = session.config, session.say
    if session.run_config["task"] != "facts" or not cfg.facts_counts:
        return None
    methods = session.methods_named(FACTS_COUNT_METHODS)
    if not methods:
        return None
    counts, n, settings = cfg.facts_counts, cfg.facts_count_limit, session.facts_settings
    heldout = {"value_split": "heldout"} if settings.get("value_split") == "train" else {}
    if heldout and cfg.split != "test":
        say("facts-count sweep skipped: the run trained on training values, and only the test split holds held-out ones")
        return None
    say(f"facts-count sweep: {', '.join(m.name for m in methods)} at {list(counts)} facts, {n} questions each")
    rows_out = []
    for count in counts:
        rows = make_facts(n, n_facts=count, n_distractors=settings["n_distractors"], seed=settings["seed"],
                          split=cfg.split, **heldout).to_list()
        for m in methods:
            metrics, _, _ = accuracy(m, rows, batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
                                     progress=cfg.progress, desc=f"{count} facts {m.name}")
            rows_out.append({"method": m.name, "n_facts": count, "n_distractors": settings["n_distractors"],
                             **{k: metrics[k] for k in ("n", "exact_match", "exact_match_ci", "contains", "contains_ci", "f1")}})
        say(f"  {count} facts: " + ", ".join(
            f"{r['method']} {100 * r['exact_match']:.0f}%" for r in rows_out if r["n_facts"] == count))
    return {"counts": list(counts), "questions_per_point": n, "rows": rows_out}
