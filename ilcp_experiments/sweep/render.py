"""The sweep's written form: the summary's rows, sweep.md and the plot of accuracy against wire bytes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ilcp.evaluation.plots import selection_curves
from ilcp.formatting import byte_count, percent

from .schema import Sweep, eval_entries


def panels_and_rows(sweep: Sweep, evals: dict[str, dict]) -> tuple[list[dict], list[dict]]:
    panels: dict[str, dict] = {}
    rows = []
    for entry in eval_entries(sweep):
        got = evals[entry.label]
        results = got["results"]
        point = next((p for p in sweep.points if p.name == entry.label), None) if entry.kind == "ilcp" else None

        def add(panel: str, method: str, m: dict, wire, tensor):
            rows.append({
                "panel": panel, "kind": entry.kind, "label": entry.label if entry.kind == "ilcp" else method,
                "method": method, "run": entry.run, "payload_dtype": entry.payload_dtype if method == "ilcp" else None,
                "n": m["n"], "exact_match": m["exact_match"], "exact_match_ci": m["exact_match_ci"],
                "contains": m.get("contains"), "wire_bytes": wire, "tensor_bytes": tensor,
                "description": point.description if point is not None else "",
            })

        for task, t in results["tasks"].items():
            panels.setdefault(task, {"key": task, "title": task, "source": t["source"], "n": t["n"],
                                     "seen_in_training": t["seen_in_training"]})
            for method, m in t["methods"].items():
                add(task, method, m, m["wire_bytes"], m["tensor_bytes"])
        count_sweep = results.get("facts_count") or {}
        if count_sweep.get("rows"):
            data = sweep.configs[entry.run].data
            held = data.task == "facts" and data.facts_value_split == "train"
            base = "facts-heldout" if held else "facts"
            for r in count_sweep["rows"]:
                panel = f"{base}@{r['n_facts']}"
                facts = "fact" if r["n_facts"] == 1 else "facts"
                panels.setdefault(panel, {
                    "key": panel, "title": f"{base}, {r['n_facts']} {facts} per context",
                    "source": (f"evaluate()'s facts-count sweep: {r['n_facts']} {facts}, {r['n_distractors']} "
                               f"distractors{', held-out values' if held else ''}"),
                    "n": r["n"], "seen_in_training": False, "facts_count": r["n_facts"]})
                wire, tensor = (got["facts_count_bytes"].get(str(r["n_facts"]), {}).get(r["method"]) or (None, None))
                add(panel, r["method"], r, wire, tensor)
    return list(panels.values()), rows


def markdown(summary: dict) -> str:
    s = summary["eval"]
    extra = f"; --set `{' '.join(summary['extra'])}`" if summary["extra"] else ""
    lines = [
        f"# Payload sweep `{summary['name']}`",
        "",
        f"`python -m ilcp_experiments sweep --sweep {summary['sweep']}`: base config `{summary['base']}`, overrides "
        f"`{' '.join(summary['overrides']) or 'none'}`{extra}; "
        f"runs in `{summary['checkpoints']}`. Each eval: tasks {', '.join(summary['panels_tasks']) or '-'}, "
        f"{s['limit'] or 'all'} questions per task; facts counts {s['facts_counts'] or '-'} with "
        f"{s['facts_count_limit']} questions each (facts-trained runs); greedy, {s['max_new_tokens']} new tokens; "
        "95% Wilson score intervals.",
        "",
    ]
    if summary.get("description"):
        lines += [summary["description"].strip(), ""]
    lines += ["## Points", "",
              "| point | run | overrides | payload dtype | latent floats | chunk tokens | reconstruction steps "
              "| training | evaluation |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in summary["points"]:
        lines.append(f"| {p['name']} | {p['run']} | `{' '.join(p['overrides']) or '-'}` | {p['payload_dtype']} "
                     f"| {p['latent_dim']} | {p['chunk_tokens'] or '-'} | {p['reconstruct_steps'] or '-'} "
                     f"| {p['training']} | {p['evaluation']} |")
    ref = summary.get("reference")
    if ref:
        lines += ["", f"Reference rows: {', '.join(ref['methods'])}, evaluated on run `{ref['run']}` "
                      f"(trains {', '.join(ref['variants']) or 'nothing: none needs trained weights'}; "
                      f"training {ref['training']}, evaluation {ref['evaluation']})."]
    sel = summary.get("selection")
    if sel:
        lines += ["", f"Selection rows: {len(sel['methods'])} rclc/kv_relay rows on run `{sel['run']}`, "
                      f"{sel['limit'] or 'all'} questions per task (the training task"
                      f"{''.join(', ' + t for t in sel['tasks'])}; evaluation {sel['evaluation']}"
                      + (f", {sel['seconds']:.0f} s" if sel.get("seconds") else "") + "); tables below each panel's."]
    for panel in summary["panels"]:
        rows = sorted((r for r in summary["rows"] if r["panel"] == panel["key"] and r["kind"] != "selection"),
                      key=lambda r: (r["wire_bytes"] if r["wire_bytes"] is not None else -1, r["label"]))
        lines += ["", f"## {panel['title']}", "", f"{panel['source']}; n = {panel['n']}.", "",
                  "| row | kind | wire bytes | tensor bytes | exact match % [95% CI] | contains % | n |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            ci = r["exact_match_ci"]
            em = percent(r["exact_match"], ci)
            kind = "reference" if r["kind"] == "reference" else f"ilcp {r['payload_dtype']}"
            lines.append(f"| {r['label']} | {kind} | {byte_count(r['wire_bytes'])} | {byte_count(r['tensor_bytes'])} | {em} "
                         f"| {percent(r['contains'])} | {r['n']} |")
        lines += selection_table([r for r in summary["rows"] if r["panel"] == panel["key"]
                                  and r["kind"] == "selection"])
    if any("facts_count" in p for p in summary["panels"]):
        lines += ["", "Panels `@N` come from evaluate()'s facts-count sweep of runs trained on the base facts setting "
                      "(not from runs trained on N facts); it reports ilcp, prompt_tuned and cold_read_tuned only. "
                      "Their wire bytes are computed by the sweep on the same questions."]
    lines += ["", f"Plot: `{summary['plot']}`. Wire bytes: what crosses the handoff per request (ilcp: the packed "
                  "payload with header and CRC; text: the context's utf-8 bytes; RCLC: the selected rows). "
                  f"Sweep time: {summary['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def _budget_order(budget: str) -> tuple[int, int]:
    """r<N> by falling N (fewest rows first), then b<N> by rising N."""
    n = int(budget[1:])
    return (0, -n) if budget[0] == "r" else (1, n)


def selection_table(rows: Sequence[dict]) -> list[str]:
    """Markdown lines: exact match % of the selection rows of one panel, a line per selector and
    option, a column per budget, then r1 (every row: the same for every selector) and r4 / r1,
    r16 / r1 (each curve against the r1 row of its own family and option)."""
    curves = selection_curves({r["label"]: r for r in rows})
    if not curves:
        return []
    budgets = sorted({name.split(":")[2] for c in curves.values() for name, _ in c} - {"r1"}, key=_budget_order)
    n = sorted({r["n"] for r in rows})
    lines = ["", f"Selection rows (exact match %, n = {', '.join(map(str, n))}; ratios against the r1 row of the same "
                 "option):", "",
             "| selector | " + " | ".join(budgets) + " | r1 | r4 / r1 | r16 / r1 |",
             "|---|" + "---|" * (len(budgets) + 3)]
    for key, curve in sorted(curves.items(), key=lambda kv: (kv[0].count(":"), kv[0])):
        by_budget = {name.split(":")[2]: m for name, m in curve}
        full = by_budget.get("r1")

        def ratio(b: str) -> str:
            if full is None or b not in by_budget or not full["exact_match"]:
                return "-"
            return f"{100 * by_budget[b]['exact_match'] / full['exact_match']:.0f}%"

        cells = [percent(by_budget[b]["exact_match"]) if b in by_budget else "-" for b in budgets]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {percent(full['exact_match']) if full else '-'} "
                     f"| {ratio('r4')} | {ratio('r16')} |")
    return lines


_REFERENCE_MARKERS = {"cold_read": "s", "cold_read_tuned": "D"}


_OTHER_MARKERS = ("^", "v", "P", "X", "<", ">", "h", "*")


_SELECTION_STYLES = {"": "-", ":tuned": "--", ":selection_tuned": ":", ":prefix": "-."}


def _selection_lines(ax, rows: Sequence[dict], selectors: Sequence[str]) -> None:
    """The selection rows of one panel as budget curves: a colour per selector (a colour map apart
    from the reference markers'), a line style per option, thin intervals."""
    from matplotlib import colormaps


    colours = colormaps["Dark2"]
    for key, curve in sorted(selection_curves({r["label"]: r for r in rows}).items()):
        family, selector, *options = key.split(":")
        x = [m["wire_bytes"] for _, m in curve]
        y = [m["exact_match"] for _, m in curve]
        ci = [m["exact_match_ci"] or (m["exact_match"], m["exact_match"]) for _, m in curve]
        ax.errorbar(x, y, yerr=[[e - lo for e, (lo, _) in zip(y, ci)], [hi - e for e, (_, hi) in zip(y, ci)]],
                    linestyle=_SELECTION_STYLES.get("".join(f":{o}" for o in options), "-"),
                    marker="s" if family == "kv_relay" else ".", markersize=4, linewidth=1, elinewidth=0.5, capsize=1.5,
                    color=colours(selectors.index(selector) % colours.N), alpha=0.85, label=key)


def plot(summary: dict, path: Path) -> Path:
    """One panel per task (and per number of facts): exact match with 95% intervals against wire
    bytes per request (log x); ilcp points labelled by name, reference methods as their own
    markers, methods that send nothing as dashed lines, selection rows as one line per selector
    and option through its budgets."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    panels = summary["panels"]
    cols = 2 if len(panels) == 4 else min(len(panels), 3)
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.8 * cols, 4.6 * nrows), squeeze=False)
    reference_names = list(dict.fromkeys(r["label"] for r in summary["rows"] if r["kind"] == "reference"))
    style = {}
    others = iter(_OTHER_MARKERS * 4)
    for i, name in enumerate(reference_names):
        style[name] = (_REFERENCE_MARKERS.get(name) or next(others), f"C{(i + 1) % 10}")
    selectors = sorted({r["label"].split(":")[1] for r in summary["rows"] if r["kind"] == "selection"})
    for ax, panel in zip(axes.flat, panels):
        rows = [r for r in summary["rows"] if r["panel"] == panel["key"] and r["exact_match"] is not None]
        selection = [r for r in rows if r["kind"] == "selection"]
        _selection_lines(ax, selection, selectors)
        rows = [r for r in rows if r["kind"] != "selection"]
        shown_n = f"n={panel['n']}"
        if {r["n"] for r in selection} - {panel["n"]}:
            shown_n += f"; selection rows n={', '.join(str(n) for n in sorted({r['n'] for r in selection}))}"
        positive = [r["wire_bytes"] for r in summary["rows"] if r["panel"] == panel["key"] and r["wire_bytes"]]
        placed: dict[float, int] = {}
        ilcp_labelled = False
        for r in sorted(rows, key=lambda r: (r["kind"] != "ilcp", r["label"])):
            em = r["exact_match"]
            lo, hi = r["exact_match_ci"] or (em, em)
            if r["wire_bytes"] is None:
                continue
            if r["wire_bytes"] <= 0:
                marker, colour = style.get(r["label"], ("o", "grey"))
                ax.axhline(em, linestyle="--", color=colour, label=f"{r['label']} (0 B)")
                continue
            shift = placed.get(r["wire_bytes"], 0)  # rows sending the same bytes sit side by side
            placed[r["wire_bytes"]] = shift + 1
            x = r["wire_bytes"] * 1.06 ** shift
            if r["kind"] == "ilcp":
                ax.errorbar([x], [em], yerr=[[em - lo], [hi - em]], fmt="o", color="C0", capsize=3,
                            label=None if ilcp_labelled else "ilcp (sweep points)")
                ilcp_labelled = True
                ax.annotate(r["label"], (x, em), xytext=(6, 3), textcoords="offset points", fontsize=7,
                            color="C0", rotation=55, ha="left", va="bottom", rotation_mode="anchor")
            else:
                marker, colour = style[r["label"]]
                ax.errorbar([x], [em], yerr=[[em - lo], [hi - em]], fmt=marker, color=colour, capsize=3,
                            label=f"{r['label']} ({r['wire_bytes']:,.0f} B)")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        if positive:
            low, high = min(positive) / 2, max(positive) * 3
            if high / low < 10:
                mid = (low * high) ** 0.5
                low, high = mid / 3.2, mid * 3.2
            ax.set_xlim(low, high)
        ax.set_ylim(-0.02, 1.12)
        ax.set_xlabel("wire bytes per request (log)")
        ax.set_ylabel("exact match (95% interval)")
        ax.set_title(f"{panel['title']} ({shown_n})", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6 if selectors else 7, loc="best", ncol=2 if selectors else 1)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"Payload sweep {summary['name']}: accuracy against wire bytes", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
