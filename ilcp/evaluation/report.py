"""The written report of an evaluation: results.json, results.md and the plots.

- `accuracy_summary`: exact match, contains and F1 of predictions, with intervals (`ilcp.stats`);
- `write_report`: results.json (the dict `evaluate` returns), results.md (a table per task,
  the HF-against-vLLM table and the receiver-throughput table when measured, the
  context-length table, the facts-count table), and the PNG plots (matplotlib, Agg backend).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

from ..io import atomic_write_json, atomic_write_text
from ..formatting import byte_count, percent
from ..stats import bootstrap_interval, mean, wilson_interval

__all__ = [
    "accuracy_summary",
    "markdown_report",
    "plot_accuracy_vs_bytes",
    "plot_selection_budgets",
    "selection_curves",
    "plot_accuracy_vs_facts",
    "plot_ttft_vs_length",
    "write_report",
]

PLOT_ACCURACY = "accuracy_vs_payload_bytes.png"
PLOT_TTFT = "ttft_vs_context_length.png"
PLOT_FACTS = "accuracy_vs_num_facts.png"
PLOT_BUDGETS = "selection_budgets.png"
PLOT_LENGTH = "accuracy_vs_context_length.png"
PLOT_LENGTH_TTFT = "accuracy_vs_receiver_ttft.png"
_SELECTION_ROW = re.compile(r"(rclc|kv_relay):([A-Za-z0-9_]+):([rb])([0-9]+)((?::[A-Za-z_]+)*)\Z")


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


def length_curves(results: dict) -> dict[int, dict[str, list[tuple[float, str, dict]]]]:
    """The BABILong tasks of a result grouped for the length plots: bAbI task number -> method ->
    [(mean context tokens, task name, the method's metrics)], shortest context first. Only bAbI
    tasks evaluated at two or more lengths."""
    from ..names import is_babilong_name, parse_babilong_name

    by_task: dict[int, list[tuple[str, dict]]] = {}
    for name, t in results.get("tasks", {}).items():
        if is_babilong_name(name):
            by_task.setdefault(parse_babilong_name(name).number, []).append((name, t))
    curves: dict[int, dict[str, list[tuple[float, str, dict]]]] = {}
    for number, tasks in by_task.items():
        if len(tasks) < 2:
            continue
        methods: dict[str, list[tuple[float, str, dict]]] = {}
        for name, t in tasks:
            tokens = float((t.get("context_tokens") or {}).get("mean", 0.0))
            for method, m in t["methods"].items():
                methods.setdefault(method, []).append((tokens, name, m))
        curves[number] = {k: sorted(v, key=lambda p: p[0]) for k, v in methods.items()}
    return curves


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
        f"`{results['run']['train_task']}`. Limit per task: {limit}; latency: the first {s['latency_n']} "
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
# plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy_vs_bytes(results: dict, path: Path) -> Path:
    """Exact match (with 95% intervals) against wire bytes per request, log x, one panel per
    task; methods that send nothing are horizontal dashed lines."""
    plt = _pyplot()

    tasks = list(results["tasks"].items())
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for ax, (task, t) in zip(axes[0], tasks):
        positive = [m["wire_bytes"] for m in t["methods"].values() if m["wire_bytes"] > 0]
        placed: dict[float, int] = {}
        for i, (name, m) in enumerate(t["methods"].items()):
            colour = f"C{i % 10}"
            em, ci = m["exact_match"], m["exact_match_ci"] or (m["exact_match"], m["exact_match"])
            if m["wire_bytes"] > 0:
                # Methods sending the same bytes (cold_read, cold_read_tuned) sit side by side.
                shift = placed.get(m["wire_bytes"], 0)
                placed[m["wire_bytes"]] = shift + 1
                ax.errorbar([m["wire_bytes"] * 1.04 ** shift], [em], yerr=[[em - ci[0]], [ci[1] - em]], fmt="o",
                            color=colour, capsize=3, label=f"{name} ({m['wire_bytes']:,.0f} B)")
            else:
                ax.axhline(em, linestyle="--", color=colour, label=f"{name} (0 B)")
        if positive:  # at least a decade, so the log axis has labelled ticks
            ax.set_xlim(min(positive) / 4, max(positive) * 4)
        _bytes_axes(ax, task, t, legend_size=7)
    return _save(fig, path)


def _bytes_axes(ax, task: str, t: dict, legend_size: int) -> None:
    """Exact match against log wire bytes: the axes, title, grid and legend of a task panel."""
    from matplotlib import ticker

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("payload bytes on the wire per request (log)")
    ax.set_ylabel("exact match")
    ax.set_title(f"{task} (n={t['n']})" + ("" if t["seen_in_training"] else ", held out"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size, loc="best")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def selection_curves(methods: dict) -> dict[str, list[tuple[str, dict]]]:
    """The RCLC and KV relay rows of one task grouped into budget curves: ``family:selector[:option]``
    -> [(row name, its metrics)] by ascending wire bytes, for curves of at least two budgets. An
    r1 row (every row kept, the same for every selector) joins each curve of its family and option."""
    curves: dict[str, list[tuple[str, dict]]] = {}
    full: dict[tuple[str, str], list[tuple[str, dict]]] = {}
    for name, m in methods.items():
        match = _SELECTION_ROW.match(name)
        if match is None:
            continue
        family, selector, kind, n, options = match.groups()
        if (kind, n) == ("r", "1"):
            full.setdefault((family, options), []).append((name, m))
        curves.setdefault(f"{family}:{selector}{options}", []).append((name, m))
    for key, rows in curves.items():
        family, rest = key.split(":", 1)
        options = rest[len(rest.split(":")[0]):]
        rows += [r for r in full.get((family, options), []) if r[0] not in dict(rows)]
        rows.sort(key=lambda r: r[1]["wire_bytes"])
    return {k: v for k, v in curves.items() if len(v) >= 2}


def plot_selection_budgets(results: dict, path: Path) -> Path | None:
    """Exact match against wire bytes with one line per selector (and option) through its budgets,
    one panel per task; the other methods as reference points (0-byte ones as dashed lines).
    None (nothing written) when no task has a curve of two budgets."""
    tasks = [(task, t, selection_curves(t["methods"])) for task, t in results["tasks"].items()]
    tasks = [x for x in tasks if x[2]]
    if not tasks:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.8), squeeze=False)
    selectors = sorted({key.split(":")[1] for _, _, curves in tasks for key in curves})
    styles = {"": "-", ":tuned": "--", ":selection_tuned": ":", ":prefix": "-."}
    for ax, (task, t, curves) in zip(axes[0], tasks):
        on_curve = {name for rows in curves.values() for name, _ in rows}
        for key, rows in sorted(curves.items()):  # colour: the selector; line: the option; square: kv_relay
            family, selector, *options = key.split(":")
            option = "".join(f":{o}" for o in options)
            x = [m["wire_bytes"] for _, m in rows]
            y = [m["exact_match"] for _, m in rows]
            low = [m["exact_match"] - (m["exact_match_ci"] or [m["exact_match"]] * 2)[0] for _, m in rows]
            high = [(m["exact_match_ci"] or [m["exact_match"]] * 2)[1] - m["exact_match"] for _, m in rows]
            ax.errorbar(x, y, yerr=[low, high], linestyle=styles.get(option, "-"),
                        marker="s" if family == "kv_relay" else "o", color=f"C{selectors.index(selector) % 10}",
                        capsize=2, markersize=3, elinewidth=0.6, label=key)
        colour = len(selectors)
        for name, m in t["methods"].items():
            if name in on_curve:
                continue
            if m["wire_bytes"] > 0:
                ax.plot([m["wire_bytes"]], [m["exact_match"]], marker="*", markersize=10, linestyle="none",
                        color=f"C{colour % 10}", label=f"{name} ({m['wire_bytes']:,.0f} B)")
            else:
                ax.axhline(m["exact_match"], linestyle="--", color=f"C{colour % 10}", label=f"{name} (0 B)")
            colour += 1
        _bytes_axes(ax, task, t, legend_size=6)
    return _save(fig, path)


def plot_ttft_vs_length(sweep: dict, path: Path) -> Path:
    """Receiver time to first token (p50, with the p99 as a bar top) against context tokens."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    methods = list(dict.fromkeys(r["method"] for r in sweep["rows"]))
    for i, name in enumerate(methods):
        rows = sorted((r for r in sweep["rows"] if r["method"] == name), key=lambda r: r["context_tokens"])
        x = [r["context_tokens"] for r in rows]
        p50 = [1000 * r["receiver_ttft_s"]["p50"] for r in rows]
        p99 = [1000 * r["receiver_ttft_s"]["p99"] for r in rows]
        ax.errorbar(x, p50, yerr=[[0] * len(x), [b - a for a, b in zip(p50, p99)]], marker="o", capsize=3,
                    color=f"C{i % 10}", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context tokens (facts task)")
    ax.set_ylabel("receiver time to first token, ms (p50; bar to p99)")
    ax.set_title("Receiver cold start against context length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_accuracy_vs_facts(sweep: dict, path: Path) -> Path:
    """Exact match (with 95% intervals) against the number of facts in the context."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    methods = list(dict.fromkeys(r["method"] for r in sweep["rows"]))
    for i, name in enumerate(methods):
        rows = sorted((r for r in sweep["rows"] if r["method"] == name), key=lambda r: r["n_facts"])
        x = [r["n_facts"] for r in rows]
        em = [r["exact_match"] for r in rows]
        lo = [e - (r["exact_match_ci"] or (e, e))[0] for e, r in zip(em, rows)]
        hi = [(r["exact_match_ci"] or (e, e))[1] - e for e, r in zip(em, rows)]
        ax.errorbar(x, em, yerr=[lo, hi], marker="o", capsize=3, color=f"C{i % 10}", label=name)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("facts in the context")
    ax.set_ylabel("exact match")
    ax.set_title("Accuracy against the number of facts (facts task)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _errorbar(ax, x, metrics: list[dict], **kwargs) -> None:
    em = [m["exact_match"] for m in metrics]
    ci = [m["exact_match_ci"] or (e, e) for e, m in zip(em, metrics)]
    ax.errorbar(x, em, yerr=[[e - c[0] for e, c in zip(em, ci)], [c[1] - e for e, c in zip(em, ci)]],
                capsize=3, **kwargs)


def plot_accuracy_vs_length(results: dict, path: Path) -> Path | None:
    """Exact match (95% intervals) against the mean context length, one line per method and one
    panel per bAbI task evaluated at two or more BABILong lengths; None when there is none."""
    curves = length_curves(results)
    if not curves:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.4), squeeze=False)
    for ax, (number, methods) in zip(axes[0], curves.items()):
        for i, (method, points) in enumerate(methods.items()):
            _errorbar(ax, [p[0] for p in points], [p[2] for p in points], marker="o", color=f"C{i % 10}",
                      label=method)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("context tokens (mean)")
        ax.set_ylabel("exact match")
        ax.set_title(f"bAbI task {number} in background prose (BABILong)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def plot_accuracy_vs_ttft(results: dict, path: Path) -> Path | None:
    """Exact match against the receiver's time to first token (p50, log), one point per method,
    for the longest BABILong length of each bAbI task with timed requests; None when none."""
    panels = []
    for number, methods in length_curves(results).items():
        timed = [(method, points[-1]) for method, points in methods.items()
                 if ((points[-1][2].get("latency") or {}).get("receiver_ttft_s") or {}).get("p50")]
        if timed:
            panels.append((number, timed))
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.4), squeeze=False)
    for ax, (number, timed) in zip(axes[0], panels):
        for i, (method, (tokens, name, m)) in enumerate(timed):
            ttft = m["latency"]["receiver_ttft_s"]["p50"] * 1000
            _errorbar(ax, [ttft], [m], fmt="o", color=f"C{i % 10}", label=f"{method} ({ttft:,.0f} ms)")
        ax.set_xscale("log")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("receiver time to first token, ms (p50, log)")
        ax.set_ylabel("exact match")
        ax.set_title(f"{timed[0][1][1]}: accuracy against receiver cost")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


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
