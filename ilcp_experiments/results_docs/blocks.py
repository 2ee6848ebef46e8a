"""The generated blocks that compare folders: the README's results at a glance (table and figure),
the served receivers' load figures (docs/serving.md) and the datasets block; the BABILong blocks are in `babilong`, the
question-blind handoff's in `general`. Each names the folders it reads; a missing folder drops its
rows.
"""

from __future__ import annotations

from pathlib import Path

from ilcp.formatting import byte_count, percent

from .folders import TRAIN_METRICS, load

FIGURE = "at_a_glance.png"


# The results at a glance: (task, what is handed over, folder, method). Every figure of the
# README's table is read from these folders' results.json: the trained task, a held-out task, real
# text and one long context, each with the text handoff, ILCP and RCLC where a folder measured them
# (and the question with the run's tuned vectors alone, the floor a handoff must beat).
GLANCE = (
    ("babi:1", "question, 8 tuned vectors", "main-length-groups", "prompt_tuned"),
    ("babi:1", "text", "main-length-groups", "cold_read"),
    ("babi:1", "text, 8 tuned vectors", "main-length-groups", "cold_read_tuned"),
    ("babi:1", "ILCP: 32-float latent", "main-length-groups", "ilcp"),
    ("babi:1", "RCLC rows, 8 tuned vectors", "rclc-tuned200-babi1/b", "rclc:overlap:r4:tuned"),
    ("babi:1", "RCLC rows, zero-shot", "default-rclc", "rclc:chunkkv:b16"),
    ("babi:11", "question, 8 tuned vectors", "babi11-reference", "prompt_tuned"),
    ("babi:11", "text, 8 tuned vectors", "babi11-reference", "cold_read_tuned"),
    ("babi:11", "ILCP: 32-float latent", "babi11-default", "ilcp"),
    ("babi:11", "RCLC rows, 8 tuned vectors (general run)", "general-frozen-run", "rclc:overlap:r4:tuned"),
    ("squad", "question, 8 tuned vectors", "squad", "prompt_tuned"),
    ("squad", "text, 8 tuned vectors", "squad", "cold_read_tuned"),
    ("squad", "ILCP: 32-float latent", "squad", "ilcp"),
    ("squad", "RCLC rows, 8 tuned vectors", "squad", "rclc:overlap:r4:tuned"),
    ("babilong:1:2k", "question, 8 tuned vectors", "babilong-story", "prompt_tuned"),
    ("babilong:1:2k", "text", "babilong-story", "cold_read"),
    ("babilong:1:2k", "ILCP: 32-float latent (trained at 0.5k)", "babilong-story", "ilcp"),
    ("babilong:1:2k", "RCLC rows, 8 tuned vectors", "babilong-rclc-2k", "rclc:overlap:r16:tuned"),
)
_TASK_NOTES = {
    "babi:1": "bAbI 1",
    "babi:11": "bAbI 11 (held out)",
    "squad": "SQuAD",
    "babilong:1:2k": "BABILong 1, 2k tokens",
}
# The score of each task's row: SQuAD is scored by F1 (its answers are spans), the others by exact match.
_SCORES = {"squad": ("F1", "f1")}
_EXACT = ("EM", "exact_match")


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
    """The README's results at a glance: one table, each row's folder a reference link defined
    below it (so a row stays short)."""
    out = ["| task | handed over | method | score % [95% CI] | questions | wire bytes | receiver prefill positions "
           "| receiver TTFT ms p50 | data |",
           "|---|---|---|---|---|---|---|---|---|"]
    folders: list[str] = []
    for r in glance_rows(results_dir):
        m = r["metrics"]
        ttft = receiver_ttft(m)
        top = r["folder"].split("/")[0]
        label, key = _SCORES.get(r["task"], _EXACT)
        folders += [] if top in folders else [top]
        out.append(f"| {_TASK_NOTES.get(r['task'], r['task'])} | {r['what']} | `{r['method']}` "
                   f"| {label} {percent(m.get(key), m.get(f'{key}_ci'))} | {m['n']} "
                   f"| {byte_count(m.get('wire_bytes'), whole=True)} | {m.get('prefill_positions', 0):,.0f} "
                   f"| {'-' if ttft is None else f'{1000 * ttft:.0f}'} | [{top}] |")
    out += [""] + [f"[{top}]: {link_prefix}{top}/README.md" for top in folders]
    return "\n".join(out)


def receiver_ttft(metrics: dict) -> float | None:
    return ((metrics.get("latency") or {}).get("receiver_ttft_s") or {}).get("p50")




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


# The "datasets" block, the default recipe on real text and on every bAbI task (no page holds it
# now; docs/running.md links the folders): (folder, the task it trained on, what it is)
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
