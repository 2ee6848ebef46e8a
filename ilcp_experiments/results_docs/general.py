"""The block of the question-blind handoff (configs/general.yaml) in docs/results/general.md and its
figures: one run's eval over its trained and held-out tasks, with other handoffs read on the same questions.
"""

from __future__ import annotations

from pathlib import Path

from ilcp.formatting import percent

from .folders import load

# The question-blind handoff (configs/general.yaml, from the shipped pretrained encoder, kept frozen):
# one run's eval over its trained and held-out tasks
GENERAL_FOLDER = "general-frozen-run"
GENERAL_FIGURES = ("general_squad_f1.png", "general_tasks.png")
# Other handoffs read on the general run's questions, shown beside its methods: (folder, the method
# in that folder, the column's name). A task joins only where the folder has it with as many questions.
# cold_read and no_context read no trained weights: the earlier run's rows are theirs on these questions.
GENERAL_SIDE = (("general-pretrained", "cold_read", "cold_read"), ("general-pretrained", "no_context", "no_context"),
                ("general-pretrained", "ilcp", "ilcp (sender fine-tuned)"),
                ("general-codec", "ilcp", "codec"), ("general-pooled", "ilcp", "pooled"),
                ("general-long", "cold_read_tuned", "cold_read_tuned (long)"), ("general-long", "ilcp", "ilcp (long)"),
                ("general", "ilcp", "ilcp (slots pretrained in the run)"))


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
