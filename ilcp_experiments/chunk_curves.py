"""``python -m ilcp_experiments curves RUN [RUN ...] --out docs/results/chunk-memory``: the held-out
read-back curves of chunk pretraining runs (`ilcp.training.chunk_pretrain`), as a plot against steps
and hours, a markdown table and ``chunk_curves.json`` (every run's settings, sessions with their
provenance, and rows), from each run's ``curve.jsonl``, ``no_memory.json``, ``sessions.json`` and
``state/state.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ilcp.io import atomic_write_text


def read_run(folder: Path) -> dict:
    folder = Path(folder)
    curve = folder / "curve.jsonl"
    if not curve.exists():
        raise FileNotFoundError(f"{curve} does not exist (not a chunk pretraining folder)")
    rows = [json.loads(line) for line in curve.read_text().splitlines() if line.strip()]
    state = json.loads((folder / "state" / "state.json").read_text())
    base_path = folder / "no_memory.json"
    base = json.loads(base_path.read_text()) if base_path.exists() else {}
    sessions_path = folder / "sessions.json"
    sessions = json.loads(sessions_path.read_text()) if sessions_path.exists() else []
    full_path = folder / "full_width.json"  # a beta-VAE per chunk (ilcp.training.chunk_latent): the writer it narrows
    run = {"name": folder.name, "rows": rows, "config": state["config"], "no_memory": base, "sessions": sessions,
           "steps": state["step"], "hours": round(state["seconds"] / 3600, 2)}
    if "vae" in state:
        run.update(vae=state["vae"], writer_from=state["writer_from"], writer=state["writer"],
                   full_width=json.loads(full_path.read_text()) if full_path.exists() else {})
    return run


def heading(run: dict) -> str:
    cfg = run["config"]
    if "vae" in run:
        form = "a linear beta-VAE per chunk (started from the principal directions)" if run["vae"].get("linear") \
            else "a beta-VAE per chunk"
        return (f"### {run['name']}: {form}, latent {run['vae']['latent_dim']} floats (beta "
                f"{run['vae']['beta']}), over the writer {run['writer_from']} (c = {run['writer']['chunk_tokens']}, "
                f"frozen); {cfg['steps']} vector-fit steps of {cfg['batch_chunks']} chunks"
                + (f", then {cfg['receiver_steps']} read-back steps" if cfg.get("receiver_steps") else ""))
    extra = "".join([f", the LM as writer (adapters of rank {cfg.get('sender_rank')} on its top {cfg['sender_layers']} "
                     "layers)" if cfg.get("sender_layers") else "",
                     ", the direct path" if cfg.get("direct") else "",
                     f", {cfg['reading_vectors']} reading vectors" if cfg.get("reading_vectors") else "",
                     f", {cfg['continuation_tokens']} tokens of continuation" if cfg.get("continuation_tokens") else "",
                     f", from {Path(cfg['init_from']).name}" if cfg.get("init_from") else ""])
    return (f"### {run['name']}: c = {cfg['chunk_tokens']}, {cfg.get('window_chunks', 1)} vector(s) a text, "
            f"batch {cfg['batch_chunks']}, lr {cfg['lr']}{extra}")


def sets_of(run: dict) -> list[str]:
    return [k for k, v in run["rows"][0].items() if isinstance(v, dict)]


def table(runs: list[dict]) -> str:
    lines = []
    for run in runs:
        sets = sets_of(run)
        lines += [heading(run), "",
                  "| step | hours | train loss | " + " | ".join(f"{s} acc / exact / loss" for s in sets) + " |",
                  "|---:|---:|---:|" + "---|" * len(sets)]
        for label, base in (("no memory", run["no_memory"]), ("the writer's full width", run.get("full_width"))):
            if base:
                lines.append(f"| {label} | - | - | " + " | ".join(
                    f"{base[s]['token_accuracy']:.3f} / {base[s]['exact']:.3f} / {base[s]['loss']:.2f}" for s in sets)
                    + " |")
        for r in run["rows"]:
            loss = "-" if r.get("train_loss") is None else f"{r['train_loss']:.3f}"
            lines.append(f"| {r['step']} | {r['seconds'] / 3600:.2f} | {loss} | " + " | ".join(
                f"{r[s]['token_accuracy']:.3f} / {r[s]['exact']:.3f} / {r[s]['loss']:.2f}" for s in sets) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one panel per held-out set; a colour per run, the same in every panel
    sets = list(dict.fromkeys(s for run in runs for s in sets_of(run)))
    fig, axes = plt.subplots(2, len(sets), figsize=(4.2 * len(sets), 7), sharey="col", squeeze=False)
    colours = plt.get_cmap("tab10")
    for i, run in enumerate(runs):
        for j, s in enumerate(sets):
            if s not in run["rows"][0]:
                continue
            acc = [r[s]["token_accuracy"] for r in run["rows"]]
            kw = {"marker": "o", "ms": 3, "color": colours(i % 10), "label": run["name"]}
            axes[0][j].plot([r["step"] for r in run["rows"]], acc, **kw)
            axes[1][j].plot([r["seconds"] / 3600 for r in run["rows"]], acc, **kw)
            if run["no_memory"]:
                axes[0][j].axhline(run["no_memory"][s]["token_accuracy"], color=colours(i % 10), ls=":", lw=1)
            if run.get("full_width"):
                axes[0][j].axhline(run["full_width"][s]["token_accuracy"], color=colours(i % 10), ls="--", lw=1)
    for j, s in enumerate(sets):
        axes[0][j].set_title(f"held out: {s}")
    top, bottom = fig.axes[:len(sets)], fig.axes[len(sets):]
    for ax in top:
        ax.set_xlabel("step")
    for ax in bottom:
        ax.set_xlabel("hours trained (one CPU thread)")
    top[0].set_ylabel("token accuracy (dotted: no memory" + (", dashed: the writer's full width)"
                                                          if any(run.get("full_width") for run in runs) else ")"))
    bottom[0].set_ylabel("token accuracy")
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    top[0].legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ilcp_experiments curves", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="chunk pretraining folders")
    p.add_argument("--out", type=Path, required=True, help="folder for curves.png and curves.md")
    args = p.parse_args(argv)
    try:
        runs = [read_run(folder) for folder in args.runs]
    except (FileNotFoundError, KeyError, json.JSONDecodeError) as e:
        print(f"error: {e}")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    plot(runs, args.out / "curves.png")
    atomic_write_text(args.out / "curves.md", table(runs))
    from ilcp.io import atomic_write_json
    from ilcp.provenance import provenance

    atomic_write_json(args.out / "chunk_curves.json", {"provenance": provenance(), "runs": runs})
    print(f"wrote {args.out / 'curves.png'} and {args.out / 'curves.md'}")
    return 0
