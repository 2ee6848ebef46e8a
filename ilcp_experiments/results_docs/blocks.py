"""The blocks of the README and docs/results/babilong.md that compare folders: the results at a
glance (table and figure), the BABILong tables, targets and figures, the served receivers' load
figures and the datasets block. Each names the folders it reads; a missing folder drops its rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from ilcp.formatting import byte_count, percent

from .folders import BABILONG_DOC, TRAIN_METRICS, experiment_folders, is_eval, json_files, load

FIGURE = "at_a_glance.png"
BABILONG_PREFIX = "babilong"
BABILONG_CURRENT = ("babilong-story", "babilong-rclc", "babilong-cold-read-tuned", "babilong-text-tuned")  # in full in the README
HELDOUT_RUNS = (("babilong-story-heldout", "trained on task 1"),  # folders of held-out tasks 2 and 3 at 2k
                ("babilong-mix", "trained on tasks 1, 7 and 8"))
# cold_read_tuned read at length: (folder, how its vectors were trained), every one found is a target's reference
TEXT_TUNED_FOLDERS = (("babilong-cold-read-tuned", "trained on the plain stories"),
                      ("babilong-text-tuned", "trained at 0.5k"))
# folder-name prefix -> {method its run trained otherwise than the default run: (the name shown, what it is)}
RELABELED = {"babilong-text-tuned": {"cold_read_tuned": ("cold_read_tuned@0.5k", "cold_read_tuned with vectors "
                                                         "trained at 0.5k (`configs/babilong-text-tuned.yaml`), "
                                                         "`cold_read_tuned` with the default run's (plain stories)")}}

# The results at a glance: (task, what is handed over, folder, method). Every figure of the
# README's table is read from these folders' results.json.
GLANCE = (
    ("babi:1", "nothing (question alone)", "main-held", "no_context"),
    ("babi:1", "nothing, 8 tuned vectors", "main-held", "prompt_tuned"),
    ("babi:1", "text (cold read)", "main-held", "cold_read"),
    ("babi:1", "text, 8 tuned vectors", "main-held", "cold_read_tuned"),
    ("babi:1", "ILCP: one 32-float latent (default)", "main-held", "ilcp"),
    ("babi:1", "RCLC: overlap rows r4, 8 tuned vectors", "rclc-tuned200-babi1/b", "rclc:overlap:r4:tuned"),
    ("babi:1", "RCLC: chunkkv rows b16, zero-shot", "default-rclc", "rclc:chunkkv:b16"),
    ("babi:11", "nothing, 8 tuned vectors", "babi11-reference", "prompt_tuned"),
    ("babi:11", "text, 8 tuned vectors", "babi11-reference", "cold_read_tuned"),
    ("babi:11", "ILCP: one 32-float latent (default recipe)", "babi11-default", "ilcp"),
    ("facts-heldout", "text, 8 tuned vectors", "facts1-reconstruct", "cold_read_tuned"),
    ("facts-heldout", "ILCP: pooled 128-float latent", "facts1-reconstruct", "ilcp"),
    ("facts-heldout", "ILCP: token codec (configs/facts-codec.yaml)", "facts-codec-dot128", "ilcp"),
)
_TASK_NOTES = {
    "babi:1": "bAbI task 1 (trained on)",
    "babi:11": "bAbI task 11 (held out)",
    "facts-heldout": "facts, values never seen in training (one fact)",
}




def glance_rows(results_dir: Path) -> list[dict]:
    """The `GLANCE` rows with their metrics (rows whose folder or method is missing are left out)."""
    rows = []
    for task, what, folder, method in GLANCE:
        data = load(results_dir / folder / "results.json")
        m = (((data or {}).get("tasks") or {}).get(task) or {}).get("methods", {}).get(method)
        if m is not None:
            rows.append({"task": task, "what": what, "folder": folder, "method": method, "metrics": m})
    return rows


def glance_table(results_dir: Path, link_prefix: str = "") -> str:
    """The README's results at a glance: one table."""
    out = ["| task | handed over | method | exact match % [95% CI] | questions | wire bytes | receiver prefill "
           "positions | receiver TTFT ms (p50) | data |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in glance_rows(results_dir):
        m = r["metrics"]
        ttft = _ttft(m)
        top = r["folder"].split("/")[0]
        out.append(f"| {_TASK_NOTES.get(r['task'], r['task'])} | {r['what']} | `{r['method']}` "
                   f"| {percent(m['exact_match'], m.get('exact_match_ci'))} | {m['n']} | {byte_count(m.get('wire_bytes'), whole=True)} "
                   f"| {m.get('prefill_positions', 0):.0f} | {'-' if ttft is None else f'{1000 * ttft:.0f}'} "
                   f"| [{top}]({link_prefix}{top}/README.md) |")
    return "\n".join(out)


def _ttft(metrics: dict) -> float | None:
    return ((metrics.get("latency") or {}).get("receiver_ttft_s") or {}).get("p50")


def _ms(latency: dict | None, key: str, stat: str) -> str:
    value = ((latency or {}).get(key) or {}).get(stat)
    return "-" if value is None else f"{1000 * value:,.0f}"


def _task_order(name: str) -> tuple:
    """BABILong tasks by bAbI task, then length; other names after them, by name."""
    from ilcp.tasks.babilong_context import is_babilong_name, parse_babilong_name

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
            ttft = [x for x in map(_ttft, ms) if x is not None]
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
    from ilcp.tasks.babilong_context import is_babilong_name, parse_babilong_name
    from ilcp.evaluation.plots import length_curves, plot_accuracy_vs_length, plot_accuracy_vs_ttft

    current = _current_babilong(results_dir)
    merged = _over_lengths(current)
    upto_2k = {"tasks": {k: t for k, t in _over_lengths(current, keep_single=True)["tasks"].items()
                         if is_babilong_name(k) and parse_babilong_name(k).length <= 2048}}
    timed = any(_ttft(points[-1][2])
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
        ratios = [f"{name} 1/{_ttft(m['cold_read']) / _ttft(m['ilcp']):.0f}" for name, m in
                  (("bfloat16", at_2k), ("float32", fp32)) if {"ilcp", "cold_read"} <= set(m)
                  and _ttft(m["ilcp"]) and _ttft(m["cold_read"])]
        bare = at_2k.get("no_context")  # no prefix at all: the receiver's fixed cost bounds every ratio
        floor = (f" (no_context, reading no context at all, 1/{_ttft(cold) / _ttft(bare):.0f} under bfloat16: the "
                 "receiver's fixed cost)" if bare and _ttft(bare) and _ttft(cold) else "")
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
    one line each. Without ``full`` (the README's block): the table and the figures, and a link to
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


SERVED_FOLDER = "served-load"


def served_block(results_dir: Path, link_prefix: str = "") -> str:
    """The served receivers' load and fault figures of ``served-load/served_load.json``
    (`benchmarks/served_load.py`): throughput and time to answer per handoff and number of agents,
    the killed-server run and the refused payloads."""
    data = load(results_dir / SERVED_FOLDER / "served_load.json")
    if data is None:
        return "No served-receiver measurements yet."
    record = data.get("provenance") or {}
    agents = sorted({int(k.split("agents=")[1]) for k in data if "agents=" in k})
    kinds = [k[:-len(" serial")] for k in data if k.endswith(" serial")]
    out = [f"`{record.get('command', 'benchmarks/served_load.py')}` ({record.get('conditions', 'conditions not recorded')}; "
           f"{record.get('machine', 'machine not recorded')}, {record.get('date', 'date not recorded')}, "
           f"[{SERVED_FOLDER}]({link_prefix}{SERVED_FOLDER}/README.md)):", "",
           "| handoff | requests | serial answers/s | "
           + " | ".join(f"{n} agents: answers/s, p50 / p99 s, equal to serial" for n in agents) + " |",
           "|---|---|---|" + "---|" * len(agents)]
    for kind in kinds:
        cells = []
        for n in agents:
            m = data.get(f"{kind} agents={n}") or {}
            cells.append(f"{m.get('answers/s', 0):.1f}, {m.get('p50 s', 0):.1f} / {m.get('p99 s', 0):.1f}, "
                         f"{m.get('equal to serial', '-')}")
        serial = data[f"{kind} serial"]
        out.append(f"| {kind} | {serial['requests']} | {serial['answers/s']:.1f} | " + " | ".join(cells) + " |")
    fault = data.get("fault")
    if fault:
        out += ["", f"Server killed {fault['killed at s']:.0f} s into a 32-agent run and restarted "
                    f"({fault['restart s']:.0f} s): of {fault['requests']:,} requests {fault['answered']:,} answered "
                    f"({fault['answered equal to serial']:,} equal to serial) and {fault['ServerError']:,} raised "
                    f"`ServerError`; other exceptions: {len(fault['other exceptions'])}; agents left waiting: "
                    f"{fault['agents still waiting at the end']}; slowest request {fault['slowest request s']:.1f} s "
                    f"(timeout {fault['timeout s']:.0f} s)."]
    refusals = data.get("refusals")
    if refusals:
        refused = [k for k, v in refusals.items() if isinstance(v, str) and v.startswith("refused")]
        out.append(f"Payloads refused before any request: {', '.join(refused)} "
                   f"({refusals.get('requests that reached the server', '?')} requests reached the server).")
    return "\n".join(out)


# The README's "your own data and real text" block: (folder, the task it trained on, what it is)
DATASET_FOLDERS = (("squad", "squad", "SQuAD v1.1 subset, 506 test questions of 53 articles no other split holds"),
                   ("babi-all", "babi:all", "every shipped bAbI task at once (15 tasks, balanced training rows)"))


def _training_minutes(folder: Path) -> str:
    metrics = load(folder / TRAIN_METRICS) or {}
    seconds = metrics.get("total_seconds")
    return "not recorded" if seconds is None else f"{seconds / 60:.0f} min"


def datasets_block(results_dir: Path, link_prefix: str = "") -> str:
    """The default recipe on real text and on every bAbI task (`DATASET_FOLDERS`): exact match and
    F1 with intervals per method on ``squad``; on ``babi:all`` each method's exact match averaged
    over the tasks (every task weighted equally) with its weakest and strongest task."""
    out = []
    for name, task, what in DATASET_FOLDERS:
        folder = results_dir / name
        data = load(folder / "results.json")
        if data is None:
            continue
        record = data.get("provenance") or {}
        commands = record.get("command") or []
        commands = [commands] if isinstance(commands, str) else commands
        out += [f"**`{task}`**: {what}; trained in {_training_minutes(folder)} "
                f"([{name}]({link_prefix}{name}/README.md), {record.get('machine', 'machine not recorded')}, "
                f"{record.get('date', 'date not recorded')}, {data['settings'].get('torch_threads')} thread(s)"
                + (f"; {record['conditions']}" if record.get("conditions") else "") + "):", ""]
        tasks = data.get("tasks") or {}
        if task in tasks:
            t = tasks[task]
            out += ["| method | exact match % [95% CI] | F1 % [95% CI] | questions | wire bytes | receiver prefill "
                    "positions | receiver TTFT ms p50 |", "|---|---|---|---|---|---|---|"]
            for method, m in t["methods"].items():
                ttft = ((m.get("latency") or {}).get("receiver_ttft_s") or {}).get("p50")
                out.append(f"| `{method}` | {percent(m['exact_match'], m.get('exact_match_ci'))} "
                           f"| {percent(m.get('f1'), m.get('f1_ci'))} | {m['n']} | {byte_count(m.get('wire_bytes'), whole=True)} "
                           f"| {m.get('prefill_positions', 0):.0f} | {'-' if ttft is None else f'{1000 * ttft:.0f}'} |")
        else:
            methods = list(dict.fromkeys(mm for t in tasks.values() for mm in t["methods"]))
            out += [f"| method | exact match %, mean of {len(tasks)} tasks | weakest task | strongest task "
                    "| questions per task |", "|---|---|---|---|---|"]
            for method in methods:
                per = {k: t["methods"][method] for k, t in tasks.items() if method in t["methods"]}
                if len(per) < len(tasks):
                    continue
                scores = {k: m["exact_match"] for k, m in per.items()}
                low, high = min(scores, key=scores.get), max(scores, key=scores.get)
                out.append(f"| `{method}` | {percent(sum(scores.values()) / len(scores))} "
                           f"| {low} {percent(scores[low])} | {high} {percent(scores[high])} "
                           f"| {min(m['n'] for m in per.values())} |")
        out += ["", "```bash", *commands, "```", ""]
    return "\n".join(out).rstrip("\n") or "No measurements on these tasks yet."


def draw_at_a_glance(results_dir: Path) -> Path | None:
    """docs/results/at_a_glance.png: bAbI task 1's rows of the results at a glance, exact match
    against wire bytes, beside the receiver's time to first token against context length from
    the same folder as the default run's row. None when the data is missing."""
    rows = [r for r in glance_rows(results_dir) if r["task"] == "babi:1"]
    if not rows:
        return None
    from ilcp.evaluation.plots import pyplot

    plt = pyplot()
    sweep = ((load(results_dir / rows[0]["folder"] / "results.json") or {}).get("context_length") or {}).get("rows")
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 6.5, 4.6), squeeze=False)
    ax = axes[0][0]
    for i, r in enumerate(rows):
        m = r["metrics"]
        em, ci = m["exact_match"], m.get("exact_match_ci") or (m["exact_match"], m["exact_match"])
        label = f"{r['what']} ({byte_count(m['wire_bytes'], whole=True)} B)"
        if m["wire_bytes"] > 0:
            ax.errorbar([m["wire_bytes"]], [em], yerr=[[em - ci[0]], [ci[1] - em]], fmt="o", capsize=3,
                        color=f"C{i % 10}", label=label)
        else:
            ax.axhline(em, linestyle="--", color=f"C{i % 10}", label=label)
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("bytes handed over per request (log)")
    ax.set_ylabel("exact match")
    ax.set_title("bAbI task 1, SmolLM2-135M: accuracy against bytes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left")
    if sweep:
        ax = axes[0][1]
        for i, name in enumerate(dict.fromkeys(r["method"] for r in sweep)):
            points = sorted((r for r in sweep if r["method"] == name), key=lambda r: r["context_tokens"])
            ax.plot([r["context_tokens"] for r in points], [1000 * r["receiver_ttft_s"]["p50"] for r in points],
                    marker="o", color=f"C{i % 10}", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("receiver time to first token, ms (p50)")
        ax.set_title("What the receiver pays as the context grows")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = results_dir / FIGURE
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path




# The question-blind handoff (configs/general.yaml): one run's eval over its trained and held-out tasks
GENERAL_FOLDER = "general"
GENERAL_FIGURES = ("general_squad_f1.png", "general_tasks.png")
# Other handoffs read on the general run's questions, shown beside its methods: (folder, the method
# in that folder, the column's name). A task joins only where the folder has it with as many questions.
GENERAL_SIDE = (("general-codec", "ilcp", "codec"), ("general-pooled", "ilcp", "pooled"),
                ("general-long", "cold_read_tuned", "cold_read_tuned (long)"), ("general-long", "ilcp", "ilcp (long)"))


def _general(results_dir: Path) -> dict | None:
    """The general run's results with the `GENERAL_SIDE` columns merged in (``sides``: the folders
    that gave one)."""
    data = load(results_dir / GENERAL_FOLDER / "results.json")
    if data is None or not data.get("tasks"):
        return None
    data["sides"] = []
    for folder, method, column in GENERAL_SIDE:
        side = (load(results_dir / folder / "results.json") or {}).get("tasks") or {}
        joined = False
        for name, task in data["tasks"].items():
            found = (side.get(name) or {}).get("methods", {}).get(method)
            if found is not None and side[name].get("n") == task.get("n"):
                task["methods"][column] = found
                joined = True
        if joined and folder not in data["sides"]:
            data["sides"].append(folder)
    return data


def general_block(results_dir: Path, link_prefix: str = "") -> str:
    """The general run's exact match per task, trained tasks then held-out ones, with each method's
    mean over each group and, on ``squad``, F1 and the receiver's prefix positions; the figures.
    Columns of `GENERAL_SIDE` folders follow the run's own methods."""
    data = _general(results_dir)
    if data is None:
        return "No measurements of the general handoff yet (`configs/general.yaml`)."
    tasks = data["tasks"]
    methods = list(dict.fromkeys(m for t in tasks.values() for m in t["methods"]))
    groups = (("trained", [k for k, t in tasks.items() if t.get("seen_in_training")]),
              ("held out", [k for k, t in tasks.items() if not t.get("seen_in_training")]))
    out = ["| task | " + " | ".join(f"`{m}`" for m in methods) + " |", "|---|" + "---|" * len(methods)]
    for label, names in groups:
        for name in names:
            cells = [percent(tasks[name]["methods"][m]["exact_match"]) if m in tasks[name]["methods"] else "-"
                     for m in methods]
            out.append(f"| {name}{' (held out)' if label == 'held out' else ''} | " + " | ".join(cells) + " |")
        if names:
            means = []
            for m in methods:
                scores = [tasks[n]["methods"][m]["exact_match"] for n in names if m in tasks[n]["methods"]]
                means.append(percent(sum(scores) / len(scores)) if len(scores) == len(names) else "-")
            out.append(f"| **mean, {label} ({len(names)})** | " + " | ".join(means) + " |")
    squad = tasks.get("squad")
    if squad:
        out += ["", "`squad`: " + "; ".join(
            f"`{m}` F1 {percent(v.get('f1'), v.get('f1_ci'))} with {v.get('prefill_positions', 0):.0f} prefix positions"
            for m, v in squad["methods"].items()) + "."]
    figures = [f"![{name[:-4]}]({link_prefix}{GENERAL_FOLDER}/{name})" for name in GENERAL_FIGURES
               if (results_dir / GENERAL_FOLDER / name).is_file()]
    out += ["", "Data: " + ", ".join(f"[{name}]({link_prefix}{name}/README.md)"
                                      for name in (GENERAL_FOLDER, *data["sides"])) + "."]
    if figures:
        out += ["", " ".join(figures)]
    return "\n".join(out)


def draw_general(results_dir: Path) -> list[Path]:
    """The general run's figures, in its folder: F1 against the receiver's prefix positions on
    ``squad`` (one point per method), and exact match per task, trained tasks then held-out ones,
    one bar per method. None drawn without the run's results."""
    data = _general(results_dir)
    if data is None:
        return []
    from ilcp.evaluation.plots import pyplot

    plt = pyplot()
    folder, tasks, drawn = results_dir / GENERAL_FOLDER, data["tasks"], []
    squad = tasks.get("squad")
    if squad:
        fig, ax = plt.subplots(figsize=(6.5, 4.4))
        for i, (method, m) in enumerate(squad["methods"].items()):
            f1, ci = m.get("f1"), m.get("f1_ci")
            if f1 is None:
                continue
            yerr = [[f1 - ci[0]], [ci[1] - f1]] if ci else None
            ax.errorbar([m.get("prefill_positions", 0)], [f1], yerr=yerr, fmt="o", capsize=3, color=f"C{i % 10}",
                        label=method)
        ax.set_xlabel("receiver prefix positions (mean)")
        ax.set_ylabel("F1")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"squad, articles never seen (n={squad['n']})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        drawn.append(folder / GENERAL_FIGURES[0])
        fig.savefig(drawn[-1], dpi=110, metadata={"Software": None})
        plt.close(fig)
    names = ([k for k, t in tasks.items() if t.get("seen_in_training")]
             + [k for k, t in tasks.items() if not t.get("seen_in_training")])
    methods = list(dict.fromkeys(m for t in tasks.values() for m in t["methods"]))
    fig, ax = plt.subplots(figsize=(max(6.5, 0.55 * len(names) * max(1, len(methods)) / 2), 4.4))
    width = 0.8 / max(1, len(methods))
    for j, method in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(names))]
        ys = [tasks[n]["methods"].get(method, {}).get("exact_match") or 0.0 for n in names]
        ax.bar(xs, ys, width=width, color=f"C{j % 10}", label=method)
    held = sum(not tasks[n].get("seen_in_training") for n in names)
    if held:
        ax.axvline(len(names) - held - 0.5, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n + ("*" if not tasks[n].get("seen_in_training") else "") for n in names], rotation=60,
                       fontsize=7)
    ax.set_ylabel("exact match")
    ax.set_ylim(0, 1.02)
    ax.set_title("exact match per task: trained, then held out (*)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    drawn.append(folder / GENERAL_FIGURES[1])
    fig.savefig(drawn[-1], dpi=110, metadata={"Software": None})
    plt.close(fig)
    return drawn
