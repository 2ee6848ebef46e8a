"""The BABILong blocks of docs/long-contexts.md and docs/results/babilong.md: the tables over lengths, the RCLC
grids, the targets and the figures. Each names the folders it reads; a missing folder drops its rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from ilcp.formatting import byte_count, percent

from .blocks import receiver_ttft
from .folders import BABILONG_DOC, experiment_folders, is_eval, json_files, load

BABILONG_PREFIX = "babilong"
# in full on docs/long-contexts.md
BABILONG_CURRENT = ("babilong-story", "babilong-rclc", "babilong-cold-read-tuned", "babilong-text-tuned")
HELDOUT_RUNS = (("babilong-story-heldout", "trained on task 1"),  # folders of held-out tasks 2 and 3 at 2k
                ("babilong-mix", "trained on tasks 1, 7 and 8"))
# cold_read_tuned read at length: (folder, how its vectors were trained), every one found is a target's reference
TEXT_TUNED_FOLDERS = (("babilong-cold-read-tuned", "trained on the plain stories"),
                      ("babilong-text-tuned", "trained at 0.5k"))
# folder-name prefix -> {method its run trained otherwise than the default run: (the name shown, what it is)}
RELABELED = {"babilong-text-tuned": {"cold_read_tuned": ("cold_read_tuned@0.5k", "cold_read_tuned with vectors "
                                                         "trained at 0.5k (`configs/babilong-text-tuned.yaml`), "
                                                         "`cold_read_tuned` with the default run's (plain stories)")}}


def _ms(latency: dict | None, key: str, stat: str) -> str:
    value = ((latency or {}).get(key) or {}).get(stat)
    return "-" if value is None else f"{1000 * value:,.0f}"


def _task_order(name: str) -> tuple:
    """BABILong tasks by bAbI task, then length; other names after them, by name."""
    from ilcp.names import is_babilong_name, parse_babilong_name

    if is_babilong_name(name):
        task = parse_babilong_name(name)
        return (0, task.number, task.length, name)
    return (1, 0, 0, name)


def _babilong_tables(evals: list[tuple[Path, dict]], link_prefix: str) -> list[str]:
    """One table over the given eval results: a row per method evaluated on two tasks or more (the
    package's own rows last), its exact match [95% CI] on each task (a task's methods gathered from
    every folder, the first folder winning a method), then what it cost the receiver at the longest
    context; the folders the cells come from on the line below."""
    merged = _over_lengths(evals)["tasks"]
    tasks = sorted((task for task, t in merged.items() if t["methods"]), key=_task_order)
    if not tasks:
        return []
    methods = list(dict.fromkeys(m for task in tasks for m in merged[task]["methods"]))
    methods.sort(key=lambda m: m.startswith(("rclc:", "kv_relay:")))  # the package's own rows last
    sources: list[str] = []  # the folders the cells come from (the first to hold a method on a task)
    claimed: set[tuple[str, str]] = set()
    for folder, data in evals:
        for task, t in data["tasks"].items():
            mine = {(task, m) for m in t["methods"] if m in methods} - claimed
            claimed |= mine
            if mine and folder.name not in sources:
                sources.append(folder.name)
    tokens, longest = max(((merged[task].get("context_tokens") or {}).get("mean", 0), task) for task in tasks)
    costs = ["wire bytes", "receiver prefill positions", "receiver TTFT ms p50 / p99", "sender ms p50",
             "sender reusing its forward ms p50"]
    out = [f"Exact match % [95% CI] by task (n questions); what each handoff cost the receiver at {longest}"
           + (f" ({tokens:,.0f} context tokens on average)" if tokens else "") + ":", "",
           "| method | " + " | ".join(f"{task} (n={'/'.join(map(str, sorted({v['n'] for v in merged[task]['methods'].values()})))})"
                                      for task in tasks) + " | " + " | ".join(costs) + " |",
           "|---|" + "---|" * (len(tasks) + len(costs))]
    for m in methods:
        cells = [percent(t["methods"][m]["exact_match"], t["methods"][m].get("exact_match_ci"))
                 if m in (t := merged[task])["methods"] else "-" for task in tasks]
        cost = merged[longest]["methods"].get(m)
        if cost is None:
            cells += ["-"] * len(costs)
        else:
            lat = cost.get("latency")
            cells += [byte_count(cost.get("wire_bytes"), whole=True), f"{cost.get('prefill_positions', 0):,.0f}",
                      f"{_ms(lat, 'receiver_ttft_s', 'p50')} / {_ms(lat, 'receiver_ttft_s', 'p99')}",
                      _ms(lat, "sender_s", "p50"), _ms(lat, "sender_reusing_forward_s", "p50")]
        out.append(f"| `{m}` | " + " | ".join(cells) + " |")
    out += ["", "Data: " + ", ".join(f"[{name}]({link_prefix}{name}/README.md)" for name in sources) + "."]
    return out


_RCLC_ROW = re.compile(r"rclc:(?P<selector>[a-z]+):(?P<budget>r\d+)(?P<tuned>:tuned)?$")
_RELAY_ROW = re.compile(r"(?P<selector>kv_relay:[a-z]+):(?P<budget>r\d+)(?P<tuned>:tuned)?$")


def _rclc_grids(evals: list[tuple[Path, dict]], link_prefix: str) -> list[str]:
    """For each task with RCLC rows of two budgets or more (gathered from every folder, the first
    folder winning a row): exact match by selector (rows) and budget, zero-shot and ``:tuned``
    (columns), the kv_relay rows (cache entries of a selector's rows) under them, and each budget's
    mean prefill positions and receiver TTFT p50 over the RCLC rows."""
    by_task: dict[str, dict] = {}
    for folder, data in evals:
        for task, t in data["tasks"].items():
            entry = by_task.setdefault(task, {"rows": {}, "relay": {}, "sources": []})
            for name, metrics in t["methods"].items():
                match = _RCLC_ROW.match(name) or _RELAY_ROW.match(name)
                if match is None:
                    continue
                key = (match["selector"], match["budget"], bool(match["tuned"]))
                target = entry["relay"] if name.startswith("kv_relay:") else entry["rows"]
                if key not in entry["rows"] and key not in entry["relay"]:
                    target[key] = metrics
                    if folder.name not in entry["sources"]:
                        entry["sources"].append(folder.name)
    out: list[str] = []
    for task in sorted(by_task, key=_task_order):
        rows, relay, sources = by_task[task]["rows"], by_task[task]["relay"], by_task[task]["sources"]
        budgets = sorted({b for _, b, _ in [*rows, *relay]}, key=lambda b: int(b[1:]))
        if len({b for _, b, _ in rows}) < 2:
            continue
        columns = [(b, tuned) for tuned in (False, True) for b in budgets
                   if any(k[1:] == (b, tuned) for k in [*rows, *relay])]
        selectors = list(dict.fromkeys(k[0] for k in rows)) + list(dict.fromkeys(k[0] for k in relay))
        ns = sorted({m["n"] for m in rows.values()})
        links = ", ".join(f"[{name}]({link_prefix}{name}/README.md)" for name in sources)
        out += [f"RCLC rows at {task} (n={'/'.join(map(str, ns))}, {links}); exact match % [95% CI]"
                + (", r1 is every row (the cold read's prefix)" if "r1" in budgets else "") + ":", "",
                "| selector | " + " | ".join(f"{b}{' :tuned' if tuned else ''}" for b, tuned in columns) + " |",
                "|---|" + "---|" * len(columns)]
        every = {**rows, **relay}
        for sel in selectors:
            cells = [percent(every[(sel, b, tuned)]["exact_match"], every[(sel, b, tuned)].get("exact_match_ci"))
                     if (sel, b, tuned) in every else "-" for b, tuned in columns]
            out.append(f"| `{sel}`{' (cache entries)' if sel.startswith('kv_relay:') else ''} | " + " | ".join(cells) + " |")

        def budget_cost(b, tuned, rows=rows):
            ms = [m for k, m in rows.items() if k[1:] == (b, tuned)]
            if not ms:
                return "-"
            positions = sum(m.get("prefill_positions", 0) for m in ms) / len(ms)
            ttft = [x for x in map(receiver_ttft, ms) if x is not None]
            return f"{positions:,.0f}" + (f" / {1000 * sum(ttft) / len(ttft):,.0f}" if ttft else "")

        out += ["| prefill positions / TTFT ms p50 (mean over selectors) | "
                + " | ".join(budget_cost(b, tuned) for b, tuned in columns) + " |", ""]
    return out


BABILONG_FIGURES = ("babilong_lengths.png", "babilong_ttft_2k.png")


def _current_babilong(results_dir: Path) -> list[tuple[Path, dict]]:
    """(folder, eval result) of every `BABILONG_CURRENT` folder, its methods renamed by `RELABELED`."""
    return [(folder, _relabeled(folder.name, d)) for folder in experiment_folders(results_dir)
            if folder.name.startswith(BABILONG_CURRENT)
            for d in map(load, json_files(folder)) if d is not None and is_eval(d)]


def _relabeled(folder: str, data: dict) -> dict:
    names = next((n for prefix, n in RELABELED.items() if folder.startswith(prefix)), None)
    if not names:
        return data
    tasks = {task: {**t, "methods": {names[m][0] if m in names else m: v for m, v in t["methods"].items()}}
             for task, t in data["tasks"].items()}
    return {**data, "tasks": tasks}


def _over_lengths(evals: list[tuple[Path, dict]], *, keep_single: bool = False) -> dict:
    """The current BABILong results as one eval result: each task's methods from every folder
    (the first folder wins a method), only the methods evaluated on two tasks or more; with
    ``keep_single``, the best RCLC row of each budget too (by exact match, then contains)."""
    tasks: dict[str, dict] = {}
    for _, d in evals:
        for task, t in d["tasks"].items():
            merged = tasks.setdefault(task, {**t, "methods": {}})
            for m, metrics in t["methods"].items():
                merged["methods"].setdefault(m, metrics)
    count: dict[str, int] = {}
    for t in tasks.values():
        for m in t["methods"]:
            count[m] = count.get(m, 0) + 1
    for t in tasks.values():
        best: dict[str, tuple] = {}
        for m, v in t["methods"].items():
            match = _RCLC_ROW.match(m)
            if keep_single and match and count[m] == 1:
                rank = (v["exact_match"], v.get("contains", 0.0))
                if match["budget"] not in best or rank > best[match["budget"]][0]:
                    best[match["budget"]] = (rank, m)
        chosen = {m for _, m in best.values()}
        t["methods"] = {m: v for m, v in t["methods"].items() if count[m] > 1 or m in chosen}
    return {"tasks": tasks}


def _babilong_figures(results_dir: Path) -> list[tuple[str, Callable, dict]]:
    """What `draw_babilong` draws: (file name, plot function, its results) for each figure the
    current BABILong folders have data for."""
    from ilcp.names import is_babilong_name, parse_babilong_name
    from ilcp.evaluation.plots import length_curves, plot_accuracy_vs_length, plot_accuracy_vs_ttft

    current = _current_babilong(results_dir)
    merged = _over_lengths(current)
    upto_2k = {"tasks": {k: t for k, t in _over_lengths(current, keep_single=True)["tasks"].items()
                         if is_babilong_name(k) and parse_babilong_name(k).length <= 2048}}
    timed = any(receiver_ttft(points[-1][2])
                for methods in length_curves(upto_2k).values() for points in methods.values())
    figures = [(BABILONG_FIGURES[0], plot_accuracy_vs_length, merged)] if length_curves(merged) else []
    return figures + ([(BABILONG_FIGURES[1], plot_accuracy_vs_ttft, upto_2k)] if timed else [])


def draw_babilong(results_dir: Path) -> list[Path]:
    """docs/results/babilong_lengths.png (exact match against context length, one line per method
    evaluated at two lengths or more) and babilong_ttft_2k.png (exact match against the receiver's
    time to first token at the longest length up to 2k; those methods and the best RCLC row of
    each budget), over the current BABILong folders."""
    return [plot(results, results_dir / name) for name, plot, results in _babilong_figures(results_dir)]


def _task_methods(results_dir: Path, folder: str, task: str) -> dict:
    data = load(results_dir / folder / "results.json") or {}
    return ((data.get("tasks") or {}).get(task) or {}).get("methods") or {}


def babilong_targets(results_dir: Path) -> list[str]:
    """Where the long-context recipe stands against the four BABILong targets, each computed from
    the results folders named in it (a target whose folders are missing is left out)."""
    out = []
    at_2k = _task_methods(results_dir, "babilong-story", "babilong:1:2k")
    tuned = [(m["cold_read_tuned"], how, folder) for folder, how in TEXT_TUNED_FOLDERS
             if "cold_read_tuned" in (m := _task_methods(results_dir, folder, "babilong:1:2k"))]
    fp32 = _task_methods(results_dir, "latency-babilong-story-float32", "babilong:1:2k")
    if {"ilcp", "cold_read"} <= set(at_2k) and tuned:
        ilcp, cold = at_2k["ilcp"], at_2k["cold_read"]
        ratios = [f"{name} 1/{receiver_ttft(m['cold_read']) / receiver_ttft(m['ilcp']):.0f}" for name, m in
                  (("bfloat16", at_2k), ("float32", fp32)) if {"ilcp", "cold_read"} <= set(m)
                  and receiver_ttft(m["ilcp"]) and receiver_ttft(m["cold_read"])]
        bare = at_2k.get("no_context")  # no prefix at all: the receiver's fixed cost bounds every ratio
        floor = (f" (no_context, reading no context at all, 1/{receiver_ttft(cold) / receiver_ttft(bare):.0f} under bfloat16: the "
                 "receiver's fixed cost)" if bare and receiver_ttft(bare) and receiver_ttft(cold) else "")
        against = " and ".join(f"{percent(m['exact_match'])}% (its vectors {how}, `{folder}`)" for m, how, folder in tuned)
        ns = "/".join(str(n) for n in dict.fromkeys([ilcp["n"], *(m["n"] for m, _, _ in tuned)]))
        out.append(f"- 2k, ilcp at or above cold_read_tuned with at most 1/16 of the text's positions and 1/10 of "
                   f"its time to first token: ilcp {percent(ilcp['exact_match'])}% against cold_read_tuned {against} "
                   f"on {ns} questions, prefix 1/{cold['prefill_positions'] / ilcp['prefill_positions']:.0f} "
                   f"of the text's positions, time to first token {', '.join(ratios)}{floor}.")
    at_4k = _task_methods(results_dir, "babilong-story-4k", "babilong:1:4k")
    at_05 = _task_methods(results_dir, "babilong-story", "babilong:1:0.5k")
    plain = _task_methods(results_dir, "babilong-default", "babilong:1:0")
    if "ilcp" in at_4k and "ilcp" in at_05:
        keep = at_4k["ilcp"]["exact_match"] / max(at_05["ilcp"]["exact_match"], 1e-9)
        fall = (f"; the cold read falls from {percent(plain['cold_read']['exact_match'])}% on the plain story to "
                f"{percent(at_4k['cold_read']['exact_match'])}% at 4k" if "cold_read" in plain and "cold_read" in at_4k
                else "")
        out.append(f"- 4k keeps at least 90% of 0.5k: ilcp keeps {100 * keep:.0f}% "
                   f"({percent(at_4k['ilcp']['exact_match'])}% on {at_4k['ilcp']['n']} questions against "
                   f"{percent(at_05['ilcp']['exact_match'])}% on {at_05['ilcp']['n']}){fall}.")
    rclc: dict = {}  # every RCLC row at 2k, from the 2k folders (the first folder winning a row)
    for folder, d in _current_babilong(results_dir):
        if folder.name.startswith("babilong-rclc-2k"):
            for m, v in ((d["tasks"].get("babilong:1:2k") or {}).get("methods") or {}).items():
                rclc.setdefault(m, v)
    r8 = {m: v for m, v in rclc.items() if (match := _RCLC_ROW.match(m)) and match["budget"] == "r8"}
    r1 = {m: v for m, v in rclc.items() if (match := _RCLC_ROW.match(m)) and match["budget"] == "r1"}
    if r8 and r1:
        best8 = max(r8, key=lambda m: (r8[m]["exact_match"], r8[m]["contains"]))
        best1 = max(r1, key=lambda m: (r1[m]["exact_match"], r1[m]["contains"]))
        out.append(f"- 2k, the best selector at r8 keeps 95% of r1: `{best8}` {percent(r8[best8]['exact_match'])}% "
                   f"exact ({percent(r8[best8]['contains'])}% contains) against `{best1}` "
                   f"{percent(r1[best1]['exact_match'])}% ({percent(r1[best1]['contains'])}% contains): at 0% exact match "
                   "the ratio says nothing; on contains r8 keeps "
                   f"{100 * r8[best8]['contains'] / max(r1[best1]['contains'], 1e-9):.0f}%.")
    runs = []
    for folder, trained in HELDOUT_RUNS:
        gaps = []
        for task in ("babilong:2:2k", "babilong:3:2k"):
            m = _task_methods(results_dir, folder, task)
            if {"ilcp", "prompt_tuned"} <= set(m):
                gaps.append(f"{task} {100 * (m['ilcp']['exact_match'] - m['prompt_tuned']['exact_match']):+.0f} points")
        if gaps:
            runs.append(f"{trained} (`{folder}`): {', '.join(gaps)}")
    if runs:
        out.append(f"- held-out tasks, ilcp at least 10 points above prompt_tuned: {'; '.join(runs)}.")
    return out


def babilong_block(results_dir: Path, link_prefix: str = "", *, full: bool = True) -> str:
    """Every folder whose name starts with ``babilong``: those of `BABILONG_CURRENT` as one table of
    exact match per task and method over lengths with the receiver's cost at the longest length,
    the grids of RCLC rows by selector and budget, the targets and the figures; the other folders
    one line each. Without ``full`` (docs/long-contexts.md's block): the table and the figures, and a link to
    `BABILONG_DOC` for the grids, the targets and the other folders."""
    folders = [f for f in experiment_folders(results_dir) if f.name.startswith(BABILONG_PREFIX)]
    if not folders:
        return "No BABILong measurements yet."
    current = _current_babilong(results_dir)
    earlier = [f"[{f.name}]({link_prefix}{f.name}/README.md)" for f in folders if not f.name.startswith(BABILONG_CURRENT)]
    out = []
    if current:
        out = _babilong_tables(current, link_prefix) + [""]
        shown = {f.name for f, _ in current}
        renamed = [f"`{new}` is {how}" for prefix, names in RELABELED.items()
                   if any(name.startswith(prefix) for name in shown)
                   for new, how in names.values()]
        if renamed:
            out += ["; ".join(renamed) + ".", ""]
        if full:
            out += _rclc_grids(current, link_prefix)
            targets = babilong_targets(results_dir)
            if targets:
                out += ["The targets (test split, SmolLM2-135M, this CPU), computed from the folders above:", ""]
                out += targets + [""]
        else:
            out += [f"RCLC rows by selector and budget (every selector at r4, r8 and r16, zero-shot and tuned, r1, "
                    f"kv_relay), the targets and the other recipes: [{BABILONG_DOC}]({link_prefix}{BABILONG_DOC}).", ""]
    figures = [f"![{name[:-4]}]({link_prefix}{name})" for name, _, _ in _babilong_figures(results_dir)]
    if current and figures:
        out += [" ".join(figures), ""]
    if earlier and (full or not current):
        out.append("Other recipes: " + "; ".join(earlier) + ".")
    return "\n".join(out).rstrip("\n")
