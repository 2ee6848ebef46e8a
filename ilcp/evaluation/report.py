"""The written report of an evaluation: results.json, results.md and the plots.

- `accuracy_summary`: exact match, contains and F1 of predictions, with intervals (`ilcp.stats`);
- `write_report`: results.json (the dict `evaluate` returns), results.md (a table per task,
  the HF-against-vLLM table and the receiver-throughput table when measured, the
  context-length table, the facts-count table), and the PNG plots (`ilcp.evaluation.plots`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from ..io import atomic_write_json, atomic_write_text
from ..formatting import byte_count, percent
from ..stats import bootstrap_interval, mean, wilson_interval
from .plots import (length_curves, plot_accuracy_vs_bytes, plot_accuracy_vs_facts, plot_accuracy_vs_length,
                    plot_accuracy_vs_ttft, plot_selection_budgets, plot_ttft_vs_length)

__all__ = [
    "accuracy_summary",
    "markdown_report",
    "write_report",
]

PLOT_ACCURACY = "accuracy_vs_payload_bytes.png"
PLOT_TTFT = "ttft_vs_context_length.png"
PLOT_FACTS = "accuracy_vs_num_facts.png"
PLOT_BUDGETS = "selection_budgets.png"
PLOT_LENGTH = "accuracy_vs_context_length.png"
PLOT_LENGTH_TTFT = "accuracy_vs_receiver_ttft.png"


def accuracy_summary(predictions: Sequence[str], answers: Sequence, *, open_text: bool = False) -> dict:
    """n, exact match, contains (each with its Wilson interval) and token F1 (with a bootstrap
    interval) of predictions; an answer is a string or a list of accepted answers. ``open_text``:
    exact match is SQuAD's (`ilcp.metrics.squad_scores`), as for SQuAD and a user's files."""
    from ..metrics import contains_answer, exact_match, squad_scores

    scores = [squad_scores(p, a, lists=not open_text) for p, a in zip(predictions, answers)]
    em = ([s[0] for s in scores] if open_text else
          [float(exact_match(p, a)) for p, a in zip(predictions, answers)])
    contains = [float(contains_answer(p, a)) for p, a in zip(predictions, answers)]
    f1 = [s[1] for s in scores]
    return {"n": len(answers), "exact_match": mean(em), "exact_match_ci": wilson_interval(em),
            "contains": mean(contains), "contains_ci": wilson_interval(contains), "f1": mean(f1),
            "f1_ci": bootstrap_interval(f1), "scoring": "squad" if open_text else "closed"}


def accepted_answers(row: dict) -> list[str]:
    """A task row's accepted answers (``answers``; rows without it: ``[answer]``)."""
    return list(row.get("answers") or [row["answer"]])


# --------------------------------------------------------------------------------------------
# markdown


def _ms(summary: dict | None, key: str) -> str:
    if not summary or summary.get(key) is None:
        return "-"
    return f"{1000 * summary[key]:.1f}"


def _method_table(methods: dict, limit) -> list[str]:
    lines = [
        "| method | n (limit) | exact match % [95% CI] | contains % [95% CI] | F1 % [95% CI] | wire bytes | tensor bytes "
        "| prefill positions | sender ms p50 / p99 | receiver TTFT ms p50 / p99 | handoff ms p50 / p99 | timed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in methods.items():
        lat = m.get("latency", {})
        lines.append(
            f"| {name} | {m['n']} ({limit or 'all'}) | {percent(m['exact_match'], m['exact_match_ci'])} "
            f"| {percent(m['contains'], m['contains_ci'])} | {percent(m['f1'], m.get('f1_ci'))} "
            f"| {byte_count(m['wire_bytes'])} | {byte_count(m['tensor_bytes'])} | {m['prefill_positions']:.1f} "
            f"| {_ms(lat.get('sender_s'), 'p50')} / {_ms(lat.get('sender_s'), 'p99')} "
            f"| {_ms(lat.get('receiver_ttft_s'), 'p50')} / {_ms(lat.get('receiver_ttft_s'), 'p99')} "
            f"| {_ms(lat.get('handoff_s'), 'p50')} / {_ms(lat.get('handoff_s'), 'p99')} "
            f"| {lat.get('n', 0)} |"
        )
    return lines


def _qps(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _engine_sections(results: dict) -> list[str]:
    """The HF-against-vLLM table (engine "vllm") and the receiver-throughput table."""
    out: list[str] = []
    if results.get("settings", {}).get("engine") == "vllm":
        info = results.get("vllm") or {}
        summary = results.get("agreement") or {}
        out += ["## Receiver decoding: HF against vLLM", "",
                f"The same prefixes of every question decoded by the HF greedy decoder and through one vLLM engine "
                f"(vLLM {info.get('vllm_version')}, {info.get('dtype')}, prompt embeddings, greedy, the same stop "
                "rule and token budget). Agreement: questions whose normalised first lines are identical. "
                f"Over all methods: {percent(summary.get('agreement'))}% ({summary.get('agree')} of "
                f"{summary.get('questions')} questions).", "",
                "| task | method | n | HF exact match % [95% CI] | vLLM exact match % [95% CI] | agreement % [95% CI] "
                "| differ | HF decode s | vLLM decode s |",
                "|---|---|---|---|---|---|---|---|---|"]
        notes = []
        for task, t in results["tasks"].items():
            for name, m in t["methods"].items():
                v = m.get("vllm")
                if not v:
                    continue
                if "unavailable" in v:
                    out.append(f"| {task} | {name} | {m['n']} | {percent(m['exact_match'], m['exact_match_ci'])} "
                               "| unavailable | - | - | - | - |")
                    notes.append(f"- {task} {name}: {v['unavailable']}")
                    continue
                out.append(f"| {task} | {name} | {v['n']} | {percent(m['exact_match'], m['exact_match_ci'])} "
                           f"| {percent(v['exact_match'], v['exact_match_ci'])} | {percent(v['agreement'], v['agreement_ci'])} "
                           f"| {v['disagree']} | {m.get('decode_s', 0):.1f} | {v['decode_s']:.1f} |")
                for d in v.get("disagreements", []):
                    notes.append(f"- {task} {name}, question {d['id']} ({d['question']!r}, answer {d['answer']!r}): "
                                 f"HF {d['hf']!r}, vLLM {d['vllm']!r}")
        out += [""] + (notes + [""] if notes else [])
    tp = results.get("throughput")
    if tp and tp.get("rows"):
        has_vllm = any("vllm_qps" in r or "vllm_unavailable" in r for r in tp["rows"])
        out += ["## Receiver throughput (questions per second)", "",
                f"The receiver's decode of the first {tp['questions']} questions of {tp['task']} (prefixes built "
                f"beforehand, untimed; greedy, {results['settings']['max_new_tokens']} new tokens at most), B "
                f"questions per decoder call, after one untimed call; torch threads {tp.get('threads')}.", ""]
        if has_vllm:
            out += ["| method | batch | n | prefix positions (mean) | HF q/s | vLLM q/s | vLLM / HF |",
                    "|---|---|---|---|---|---|---|"]
        else:
            out += ["| method | batch | n | prefix positions (mean) | HF q/s |", "|---|---|---|---|---|"]
        for r in tp["rows"]:
            row = f"| {r['method']} | {r['batch']} | {r['n']} | {r['mean_prefix_positions']:.0f} | {_qps(r['hf_qps'])} |"
            if has_vllm:
                if "vllm_qps" in r:
                    row += f" {_qps(r['vllm_qps'])} | {r['vllm_qps'] / r['hf_qps']:.2f}x |"
                else:
                    row += " unavailable | - |"
            out.append(row)
        out.append("")
    return out


def _context_note(task: dict) -> str:
    """The contexts' length, and how many the ilcp sender cut to its export's max_length."""
    tokens = task.get("context_tokens")
    if not tokens:
        return ""
    note = f"; contexts of {tokens['mean']:.0f} tokens on average, {tokens['max']} at most"
    if task.get("ilcp_truncated"):
        note += (f"; {task['ilcp_truncated']} longer than the ilcp export's max_length of {task['ilcp_max_length']} "
                 "tokens (the sender read their last tokens)")
    return note


def _length_section(results: dict) -> list[str]:
    """Exact match and what each method costs the receiver, per BABILong length."""
    curves = length_curves(results)
    if not curves:
        return []
    out = ["## Exact match against context length (BABILong)", "",
           "Per bAbI task, method and context length: exact match, what the receiver prefills, the bytes "
           "handed over and the receiver's time to first token (p50 / p99 over the timed requests), with the "
           "sender's time beside it.", "",
           "| bAbI task | method | context tokens | exact match % [95% CI] | prefill positions | wire bytes "
           "| receiver TTFT ms p50 / p99 | sender ms p50 | sender ms p50, its forward already run |",
           "|---|---|---|---|---|---|---|---|---|"]
    for number, methods in curves.items():
        for method, points in methods.items():
            for tokens, _, m in points:
                lat = m.get("latency") or {}
                out.append(f"| {number} | {method} | {tokens:.0f} | {percent(m['exact_match'], m['exact_match_ci'])} "
                           f"| {m.get('prefill_positions', 0):.0f} | {byte_count(m['wire_bytes'])} "
                           f"| {_ms(lat.get('receiver_ttft_s'), 'p50')} / {_ms(lat.get('receiver_ttft_s'), 'p99')} "
                           f"| {_ms(lat.get('sender_s'), 'p50')} | {_ms(lat.get('sender_reusing_forward_s'), 'p50')} |")
    return out + [""]


def _tasks_overview(tasks: dict) -> list[str]:
    """With several tasks (a mix such as babi:all is reported task by task): exact match per task
    and method in one table, then the mean over the tasks (each task weighted equally)."""
    if len(tasks) < 2:
        return []
    methods = list(dict.fromkeys(name for t in tasks.values() for name in t["methods"]))
    out = ["## Exact match % by task", "", "| task | n | " + " | ".join(f"`{m}`" for m in methods) + " |",
           "|---|---|" + "---|" * len(methods)]
    for task, t in tasks.items():
        cells = [percent(t["methods"][m]["exact_match"]) if m in t["methods"] else "-" for m in methods]
        out.append(f"| {task}{'' if t['seen_in_training'] else ' (held out)'} | {t['n']} | " + " | ".join(cells) + " |")
    means = []
    for m in methods:
        scores = [t["methods"][m]["exact_match"] for t in tasks.values() if m in t["methods"]]
        means.append(percent(sum(scores) / len(scores)) if len(scores) == len(tasks) else "-")
    out += [f"| mean over {len(tasks)} tasks | | " + " | ".join(means) + " |", ""]
    return out


def markdown_report(results: dict) -> str:
    """The human-readable report of an `evaluate` result."""
    s = results["settings"]
    limit = s["limit"] if s["limit"] else "none (whole split)"
    out = [
        f"# Handoff evaluation: {results['run']['path']}",
        "",
        f"LM `{results['run']['lm_spec']}` (fingerprint {results['run']['fingerprint']}), trained on "
        f"`{results['run']['train_task']}`. "
        + ("Questions of the validation split of each task (not its test split). "
           if s.get("split", "test") != "test" else "")
        + f"Limit per task: {limit}; latency: the first {s['latency_n']} "
        f"rows of each task, one request at a time; batch size {s['batch_size']}; greedy, "
        f"{s['max_new_tokens']} new tokens at most. Compute precision {s.get('precision', '32-true')} on "
        f"{s.get('device', '?')} with {s.get('torch_threads', '?')} torch threads; {results.get('seconds', '?')} s "
        "in all.",
        "",
        "Exact match and contains are on the normalised first line of the answer; intervals are 95% "
        "Wilson score intervals over questions (F1: a percentile bootstrap over questions). A task with "
        "open-text answers (SQuAD, a user's files) is scored as SQuAD scores it: exact match and token F1 "
        "with the official answer normalisation, the best over every accepted answer. Wire bytes: what crosses the handoff per "
        "request (ILCP: `len(payload.to_bytes())`; text methods: the context's utf-8 bytes; RCLC: the "
        "selected rows in the LM's dtype, `Delivery.nbytes`, no framing). Tensor bytes: the tensors "
        "inside it (ILCP: the latent; RCLC: the rows; text: 0). Receiver "
        "TTFT: from the received message to the first answer token (parsing, projection, prompt "
        "embedding and prefill). Handoff: sender time + receiver TTFT.",
        "",
    ]
    out += _tasks_overview(results["tasks"])
    for task, t in results["tasks"].items():
        seen = "seen in training" if t["seen_in_training"] else "held out (not seen in training)"
        out += [f"## {task} ({seen})", "",
                f"{t['source']}; n = {t['n']} of {t['available']} questions (limit {t['limit'] or 'none'})"
                + _context_note(t) + ".", ""]
        out += _method_table(t["methods"], t["limit"]) + [""]
    sweep = results.get("context_length")
    if sweep and sweep.get("rows"):
        out += ["## Receiver time to first token against context length (facts task)", "",
                "| method | target tokens | context tokens (mean) | prefill positions | n | receiver TTFT ms p50 / p99 "
                "| sender ms p50 |",
                "|---|---|---|---|---|---|---|"]
        for r in sweep["rows"]:
            out.append(f"| {r['method']} | {r['target_tokens']} | {r['context_tokens']:.0f} | {r['prefill_positions']:.0f} "
                       f"| {r['receiver_ttft_s']['n']} | {_ms(r['receiver_ttft_s'], 'p50')} / "
                       f"{_ms(r['receiver_ttft_s'], 'p99')} | {_ms(r['sender_s'], 'p50')} |")
        if sweep.get("ilcp_pooled_max_length"):
            out.append(f"\nThe ilcp sender pools at most the last {sweep['ilcp_pooled_max_length']} tokens of a context "
                       "(the run's pooling setting); the receiver's prefix does not grow with the context.")
        out.append("")
    out += _length_section(results)
    out += _engine_sections(results)
    facts = results.get("facts_count")
    if facts and facts.get("rows"):
        out += ["## Accuracy against the number of facts in the context (facts task)", "",
                "| method | facts | n | exact match % [95% CI] | contains % [95% CI] |", "|---|---|---|---|---|"]
        for r in facts["rows"]:
            out.append(f"| {r['method']} | {r['n_facts']} | {r['n']} | {percent(r['exact_match'], r['exact_match_ci'])} "
                       f"| {percent(r['contains'], r['contains_ci'])} |")
        out.append("")
    if results.get("skipped"):
        out += ["## Skipped methods", ""] + [f"- {k}: {v}" for k, v in results["skipped"].items()] + [""]
    if results.get("plots"):
        out += ["## Plots", ""] + [f"- {p}" for p in results["plots"]] + [""]
    out.append(f"Evaluation time: {results['seconds']:.0f} s.")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# writing


def _finite(obj):
    """JSON-safe copy: NaN and infinities become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_report(results: dict, out_dir: str | Path) -> dict:
    """Write the plots, results.md and results.json into ``out_dir`` (atomically each).

    Fills ``results["plots"]`` with the PNG file names and returns ``results``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    if results["tasks"]:
        plots.append(plot_accuracy_vs_bytes(results, out / PLOT_ACCURACY).name)
        for plot in (plot_selection_budgets(results, out / PLOT_BUDGETS),
                     plot_accuracy_vs_length(results, out / PLOT_LENGTH),
                     plot_accuracy_vs_ttft(results, out / PLOT_LENGTH_TTFT)):
            if plot is not None:
                plots.append(plot.name)
    if results.get("context_length") and results["context_length"].get("rows"):
        plots.append(plot_ttft_vs_length(results["context_length"], out / PLOT_TTFT).name)
    if results.get("facts_count") and results["facts_count"].get("rows"):
        plots.append(plot_accuracy_vs_facts(results["facts_count"], out / PLOT_FACTS).name)
    results["plots"] = plots
    atomic_write_text(out / "results.md", markdown_report(results))
    atomic_write_json(out / "results.json", _finite(results))
    return results
