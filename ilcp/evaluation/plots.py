"""The PNG plots of an evaluation (matplotlib, Agg backend): accuracy against payload bytes, the
selection budgets' curves, time to first token and accuracy against context length, accuracy
against the number of facts, and accuracy against the receiver's time to first token.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "length_curves",
    "plot_accuracy_vs_bytes",
    "plot_accuracy_vs_facts",
    "plot_accuracy_vs_length",
    "plot_accuracy_vs_ttft",
    "plot_selection_budgets",
    "plot_ttft_vs_length",
    "pyplot",
    "selection_curves",
]

_SELECTION_ROW = re.compile(r"(rclc|kv_relay):([A-Za-z0-9_]+):([rb])([0-9]+)((?::[A-Za-z_]+)*)\Z")


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


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy_vs_bytes(results: dict, path: Path) -> Path:
    """Exact match (with 95% intervals) against wire bytes per request, log x, one panel per
    task; methods that send nothing are horizontal dashed lines."""
    plt = pyplot()

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
    pyplot().close(fig)
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
    plt = pyplot()
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
    plt = pyplot()
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
    plt = pyplot()
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
    plt = pyplot()
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
    plt = pyplot()
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
