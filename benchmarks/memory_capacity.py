"""How much of a text K memory vectors can carry to the frozen receiver, and how much each encoder's do.

The receiver reads the layout reconstruction training uses (`ilcp.receiver.prefix.receiver_prefix`
with the reconstruction instruction as ``prompt_ids``): K memory vectors, the instruction, then
it must say the text. Texts are held out: SQuAD validation contexts, the background prose's test
split and bAbI test stories (every shipped task's, or one task's: ``babi:N``), each cut to its
first L tokens (a text shorter than L is left out).

- The ceiling: for each K, K vectors per text optimized with Adam against the frozen receiver (its
  weights never change; only the vectors have a gradient), every text of an (L, K) cell in one
  batch with its own vectors, started at random directions of the input embeddings' mean norm.
- Each encoder as trained (``--encoder RUN``): the text sent through the run's sender, its memory
  vectors (`ILCPHandoff.memory_vectors`) read in the same layout; K is the run's.

Per text: the teacher-forced token accuracy and loss, whether greedy decoding from the memory
gives the text's L tokens exactly, the correct greedy prefix (tokens before the first mismatch),
and the text's cross-entropy without memory (the receiver reading the instruction alone).

    OMP_NUM_THREADS=1 python benchmarks/memory_capacity.py --texts 4 --lengths 16 32 64 --steps 100
    python benchmarks/memory_capacity.py --lm tiny-qwen3 --lengths 8 --ks 1 2 --texts 2 --steps 10 --out /tmp/mc
    python benchmarks/memory_capacity.py --encoder checkpoints/default --encoder checkpoints/general
    python benchmarks/memory_capacity.py --sources squad --lengths 32 --ks 4 --texts 4 --steps 200
    python benchmarks/memory_capacity.py --sources babi:1 babi:16 --lengths 32 --texts 8 --no-ceiling --encoder RUN
    python benchmarks/memory_capacity.py --lengths 32 --ks 4 --texts 2 --encoder RUN --ceiling-from earlier.json

``--ceiling-from`` takes the ceiling cells of an earlier run's JSON where they were computed for the
same texts, K, LM, steps, learning rate and seed (the costly part; encoders come and go).

It writes memory_capacity.json (every cell and text, the settings, the LM, the provenance),
memory_capacity.png (token accuracy against tokens per vector) and the folder's README.md (the
results documents' renderer, `ilcp_experiments.results_docs`, with the folder's notes.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from ilcp.export import ExportError
from ilcp.handoff import ILCPHandoff
from ilcp.io import atomic_write_json, atomic_write_text
from ilcp.lm import DEFAULT_LM, LM, LMLoadError, load_lm
from ilcp.provenance import command_line, provenance
from ilcp.receiver.decoding import greedy_decode_ids
from ilcp.receiver.prefix import receiver_prefix
from ilcp.receiver.prompts import reconstruction_prompt
from ilcp.tasks import available_tasks, babi_stories, load_task
from ilcp.tasks.background import background_sentences
from ilcp.wire.dtypes import DTYPES
from ilcp.wire.payload import pack

SOURCES = ("squad", "background", "babi")
JSON_NAME, TABLE_NAME, PLOT_NAME = "memory_capacity.json", "memory_capacity.md", "memory_capacity.png"
PASSAGE_WORDS = 160  # a background passage: consecutive sentences of one book up to this many words
CEILING = "ceiling"


# ------------------------------------------------------------------------------------- the texts


def source_name(name: str) -> str:
    """A source as --sources takes it: one of `SOURCES`, or ``babi:N`` (one bAbI task's test
    stories; N a task with files, as ``babi:all`` reads them). Otherwise a usage error naming them."""
    task = name[len("babi:"):] if name.startswith("babi:") else ""
    if name in SOURCES or (task.isdigit() and int(task) in available_tasks()):
        return name if name in SOURCES else f"babi:{int(task)}"
    raise argparse.ArgumentTypeError(f"unknown source {name!r}; known: {', '.join(SOURCES)}, or babi:N for N in "
                                     f"{', '.join(map(str, available_tasks()))}")


def source_texts(source: str) -> list[str]:
    """The held-out texts of a source, in a fixed order: SQuAD validation contexts (each once),
    passages of the background prose's test split, bAbI test stories (of one task for ``babi:N``)."""
    if source == "babi" or source.startswith("babi:"):
        return babi_stories(int(source[len("babi:"):]) if ":" in source else "all", split="test")
    if source == "squad":
        return list(dict.fromkeys(load_task("squad", "validation")["context"]))
    if source == "background":
        passages, words, book = [], [], None
        for sentence in background_sentences("test"):
            if sentence.source != book or len(words) >= PASSAGE_WORDS:
                if words:
                    passages.append(" ".join(words))
                words, book = [], sentence.source
            words += sentence.text.split()
        return passages + ([" ".join(words)] if words else [])
    raise ValueError(f"unknown source {source!r}; known: {', '.join(SOURCES)}")


def held_out_texts(tokenizer, lengths, n: int, seed: int = 0, sources=SOURCES) -> dict[int, list[dict]]:
    """For each length L: up to ``n`` texts per source, each as its first L token ids, drawn in a
    seeded order of the source's texts; a text shorter than L is skipped."""
    out: dict[int, list[dict]] = {length: [] for length in lengths}
    for source in sources:
        texts = source_texts(source)
        order = list(range(len(texts)))
        random.Random(f"{seed}:{source}").shuffle(order)
        for length in lengths:
            found = 0
            for index in order:
                if found == n:
                    break
                ids = tokenizer(texts[index], add_special_tokens=False)["input_ids"]
                if len(ids) >= length:
                    out[length].append({"source": source, "index": index, "ids": ids[:length]})
                    found += 1
    return out


# ------------------------------------------------------------------------------- the reading


def instruction_ids(tokenizer) -> list[int]:
    """The reconstruction instruction's token ids, as the reconstruction stage tokenizes it."""
    return tokenizer(reconstruction_prompt(tokenizer), add_special_tokens=False)["input_ids"]


def reading_batch(lm: LM, memories, texts, instruction):
    """[memory ; instruction ; text] for each text, right padded: (embeds (B, T, H), attention
    mask (B, T), labels (B, T) with -100 everywhere but the text's positions). A memory may be None
    (the receiver reads the instruction alone)."""
    rows, labels = [], []
    for memory, ids in zip(memories, texts):
        prefix = receiver_prefix(lm.tokenizer, None, memory=memory, prompt_ids=instruction)
        rows.append(prefix.embeds(lm.model, ids))
        labels.append([-100] * len(prefix) + list(ids))
    width = max(len(r) for r in rows)
    embeds = torch.stack([F.pad(r, (0, 0, 0, width - len(r))) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=embeds.device)
    target = torch.tensor([t + [-100] * (width - len(t)) for t in labels], device=embeds.device)
    return embeds, mask, target


def text_losses(lm: LM, memories, texts, instruction) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced: each text's mean cross-entropy over its tokens (B,) and each text's token
    accuracy (B,), from one forward over the batch (with a graph when a memory has one)."""
    embeds, mask, labels = reading_batch(lm, memories, texts, instruction)
    logits = lm.model(inputs_embeds=embeds, attention_mask=mask).logits[:, :-1].float()
    labels = labels[:, 1:]
    real = labels != -100
    ce = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none") * real
    hits = (logits.argmax(-1) == labels) & real
    count = real.sum(1)
    return ce.sum(1) / count, hits.sum(1) / count


def greedy_prefix(decoded: list[int], ids: list[int]) -> int:
    """Tokens of ``decoded`` that match ``ids`` before the first mismatch."""
    n = 0
    for a, b in zip(decoded, ids):
        if a != b:
            break
        n += 1
    return n


def read_back(lm: LM, memories, texts, instruction) -> list[dict]:
    """Per text: loss and token accuracy (teacher-forced), the greedy prefix and exact
    reconstruction (greedy decoding of len(text) tokens from [memory ; instruction])."""
    with torch.no_grad():
        loss, accuracy = text_losses(lm, memories, texts, instruction)
    prefixes = [receiver_prefix(lm.tokenizer, None, memory=m, prompt_ids=instruction).embeds(lm.model).detach()
                for m in memories]
    decoded = greedy_decode_ids(lm.model, lm.tokenizer, prefixes, max_new_tokens=max(len(t) for t in texts),
                                batch_size=len(prefixes))
    out = []
    for i, ids in enumerate(texts):
        correct = greedy_prefix(decoded[i], ids)
        out.append({"token_accuracy": float(accuracy[i]), "loss": float(loss[i]), "exact": correct == len(ids),
                    "prefix": correct})
    return out


def memory_without_text(lm: LM, texts, instruction) -> list[float]:
    """Each text's cross-entropy when the receiver reads the instruction alone, teacher-forced."""
    with torch.no_grad():
        return [float(x) for x in text_losses(lm, [None] * len(texts), texts, instruction)[0]]


def embedding_norm(lm: LM) -> float:
    """The mean norm of the LM's input-embedding rows."""
    return float(lm.model.get_input_embeddings().weight.detach().float().norm(dim=-1).mean())


def random_memory(lm: LM, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """(n, k, H) random directions, each vector of the input embeddings' mean norm."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, k, lm.hidden_size, generator=g)
    return m / m.norm(dim=-1, keepdim=True) * embedding_norm(lm)


def optimized_memory(lm: LM, texts, k: int, instruction, *, steps: int, lr: float, seed: int = 0,
                     progress=None) -> torch.Tensor:
    """K vectors per text, (n, k, H), optimized with Adam on the teacher-forced loss, the receiver
    frozen; every text's vectors are its own and the texts' losses are summed, so a step is one
    forward and backward over the batch. ``progress(step, mean loss)`` is called after each step."""
    memory = random_memory(lm, len(texts), k, seed).to(lm.device).requires_grad_(True)
    opt = torch.optim.Adam([memory], lr=lr)
    for step in range(1, steps + 1):
        loss = text_losses(lm, list(memory), texts, instruction)[0].sum()
        opt.zero_grad()
        loss.backward(inputs=[memory])
        opt.step()
        if progress is not None:
            progress(step, float(loss.detach()) / len(texts))
    return memory.detach()


def encoder_memory(handoff: ILCPHandoff, text: str, dtype: str = "float32") -> torch.Tensor:
    """The memory vectors (K, H) an export's receiver reads for ``text`` sent by its sender, the
    latent crossing as bytes in the payload dtype ``dtype`` (`ilcp.wire.dtypes`)."""
    sent = handoff.send(text)
    wire = pack(sent.latent.float(), lm_fingerprint=sent.lm_fingerprint, dtype=dtype).to_bytes()
    memory = handoff.memory_vectors(wire, contexts=1)
    return memory.reshape(-1, memory.shape[-1])


def encoder_name(run: str, dtype: str) -> str:
    """An encoder's name in the tables: its run folder's, with the payload dtype unless float32."""
    name = Path(run).name or run
    return name if dtype == "float32" else f"{name} ({dtype})"


# ------------------------------------------------------------------------------------ the cells


def row_order(source: str, length: int, memory: str, k: int) -> tuple:
    """Sources in `SOURCES` order (``babi:N`` after them, by N), then lengths, the ceiling's K
    before the encoders."""
    place = SOURCES.index(source) if source in SOURCES else len(SOURCES) + int(source.split(":")[1])
    return place, length, memory != CEILING, memory, k


def summarize(cells: list[dict]) -> list[dict]:
    """Per source, length and memory (the ceiling at K, or an encoder): means over its texts."""
    groups: dict[tuple, list[dict]] = {}
    for cell in cells:
        for text in cell["texts"]:
            groups.setdefault((text["source"], cell["length"], cell["memory"], cell["k"]), []).append(text)
    rows = []
    for (source, length, memory, k), texts in sorted(groups.items(), key=lambda g: row_order(*g[0])):
        per_vector = statistics.mean(length / t.get("vectors", k) for t in texts)
        rows.append({"source": source, "L": length, "memory": memory, "K": k, "tokens_per_vector": round(per_vector, 2),
                     **text_means(texts)})
    return rows


def text_means(texts: list[dict]) -> dict:
    """Means over per-text records (`text_records`): texts, token accuracy, exact %, greedy prefix,
    loss and the cross-entropy without memory."""
    return {"texts": len(texts),
            "token_accuracy": round(statistics.mean(t["token_accuracy"] for t in texts), 4),
            "exact_pct": round(100 * statistics.mean(t["exact"] for t in texts), 1),
            "prefix": round(statistics.mean(t["prefix"] for t in texts), 2),
            "loss": round(statistics.mean(t["loss"] for t in texts), 4),
            "ce_without_memory": round(statistics.mean(t["ce_without_memory"] for t in texts), 4)}


def markdown_table(rows: list[dict]) -> str:
    """The summary as markdown: a row per source, length and memory, means over its texts."""
    lines = ["| source | L | memory | K | tokens per vector | texts | token accuracy | exact % | prefix | loss "
             "| CE without memory |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['source']} | {r['L']} | {r['memory']} | {r['K']} | {r['tokens_per_vector']:g} | {r['texts']} "
              f"| {r['token_accuracy']:.3f} | {r['exact_pct']:.0f} | {r['prefix']:.1f} | {r['loss']:.3f} "
              f"| {r['ce_without_memory']:.3f} |" for r in rows]
    return "\n".join(lines)


def text_records(texts, figures, ce, tokenizer, vectors=None) -> list[dict]:
    return [{"source": t["source"], "index": t["index"], "text": tokenizer.decode(t["ids"]), **f,
             "ce_without_memory": round(c, 4),
             **({} if vectors is None else {"vectors": v, "tokens_per_vector": round(len(t["ids"]) / v, 2)})}
            for t, f, c, v in zip(texts, figures, ce, vectors or [None] * len(texts))]


def ceiling_cell(lm, texts, k, instruction, ce, args) -> dict:
    start = time.perf_counter()
    ids = [t["ids"] for t in texts]
    memory = optimized_memory(lm, ids, k, instruction, steps=args.steps, lr=args.lr, seed=args.seed)
    figures = read_back(lm, list(memory), ids, instruction)
    return {"memory": CEILING, "length": len(ids[0]), "k": k, "steps": args.steps,
            "seconds": round(time.perf_counter() - start, 1), "texts": text_records(texts, figures, ce, lm.tokenizer)}


def earlier_ceiling(report: dict | None, lm: LM, texts, k: int, args) -> dict | None:
    """The ceiling cell of an earlier run of this benchmark (``--ceiling-from``) for these very
    texts (sources and indices, in order) and K, at the same LM, steps, learning rate and seed;
    None when it has none."""
    if report is None or report.get("lm") != lm.spec:
        return None
    settings = report.get("settings", {})
    if (settings.get("steps"), settings.get("lr"), settings.get("seed")) != (args.steps, args.lr, args.seed):
        return None
    wanted = [(t["source"], t["index"]) for t in texts]
    for cell in report.get("cells", []):
        if (cell.get("memory") == CEILING and cell.get("k") == k and cell.get("length") == len(texts[0]["ids"])
                and [(t["source"], t["index"]) for t in cell["texts"]] == wanted):
            return {**cell, "reused_from": report.get("path")}
    return None


def encoder_cell(lm, handoff, name, texts, instruction, ce, dtype: str = "float32") -> dict:
    start = time.perf_counter()
    ids = [t["ids"] for t in texts]
    memories = [encoder_memory(handoff, lm.tokenizer.decode(i), dtype) for i in ids]
    figures = read_back(lm, memories, ids, instruction)
    vectors = [int(m.shape[0]) for m in memories]
    return {"memory": name, "length": len(ids[0]), "k": Counter(vectors).most_common(1)[0][0],
            "memory_kind": handoff.spec.memory.kind, "payload_dtype": dtype, "seconds": round(time.perf_counter() - start, 1),
            "texts": text_records(texts, figures, ce, lm.tokenizer, vectors)}


# ---------------------------------------------------------------------------------- the outputs


def draw(rows: list[dict], path: Path, lm_spec: str) -> None:
    """Token accuracy (all sources) against tokens per vector: the ceiling a line per K, each
    encoder a line over the lengths."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    points: dict[tuple, dict[float, list[float]]] = {}
    for r in rows:
        key = (r["memory"], r["K"]) if r["memory"] == CEILING else (r["memory"], None)
        points.setdefault(key, {}).setdefault(r["tokens_per_vector"], []).extend([r["token_accuracy"]] * r["texts"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (memory, k), by_x in sorted(points.items(), key=lambda p: (p[0][0] != CEILING, p[0][0], p[0][1] or 0)):
        xs = sorted(by_x)
        label = f"ceiling, K={k}" if memory == CEILING else f"encoder {memory}"
        style = "-o" if memory == CEILING else "--s"
        ax.plot(xs, [statistics.mean(by_x[x]) for x in xs], style, label=label)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.set_xlabel("tokens per vector (L / K)")
    ax.set_ylabel("teacher-forced token accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"What K memory vectors carry back to {lm_spec}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table_document(report: dict) -> str:
    """memory_capacity.md: the command, then the summary table."""
    settings = report["settings"]
    return (f"# Memory capacity: {report['lm']}, {settings['steps']} Adam steps for the ceiling\n\n"
            f"```bash\n{report['provenance']['command']}\n```\n\n"
            "Means over each row's texts: token accuracy and loss (nats a token) teacher-forced, exact % of "
            "greedy reconstructions, prefix the correct greedy tokens, CE without memory the text's loss after "
            "the instruction alone.\n\n" + markdown_table(report["summary"]) + "\n")


def write_readme(out: Path) -> Path:
    """The folder's README.md as the results documents render it (its JSON, notes.md, plot)."""
    repo = str(Path(__file__).resolve().parent.parent)  # ilcp_experiments sits in the checkout, not installed
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from ilcp_experiments.results_docs import folder_readme

    atomic_write_text(out / "README.md", folder_readme(out))
    return out / "README.md"


# ------------------------------------------------------------------------------------- the command


def positive(kind):
    """An argparse type: a positive int or float."""
    what = "integer" if kind is int else "number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an {what}, got {text!r}" if kind is int
                                             else f"expected a {what}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {what}, got {text!r}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm", default=DEFAULT_LM, help="the LM spec (default: the embedded SmolLM2; tiny-qwen3 to try)")
    p.add_argument("--lengths", type=positive(int), nargs="+", default=[16, 32, 64, 128], help="L, text tokens")
    p.add_argument("--ks", type=positive(int), nargs="+", default=[1, 2, 4, 8], help="K, memory vectors (ceiling)")
    p.add_argument("--texts", type=positive(int), default=4, help="texts per source and length")
    p.add_argument("--sources", nargs="+", type=source_name, default=list(SOURCES),
                   help=f"the texts' sources: {', '.join(SOURCES)}, or babi:N (one bAbI task's test stories)")
    p.add_argument("--steps", type=int, default=200, help="Adam steps of the ceiling's vectors")
    p.add_argument("--lr", type=positive(float), default=3e-2, help="Adam's learning rate for the ceiling")
    p.add_argument("--encoder", action="append", default=[], metavar="RUN", help="a run directory (repeatable)")
    p.add_argument("--payload-dtypes", nargs="+", choices=sorted(DTYPES), default=["float32"],
                   help="each encoder's latent crosses as bytes in each of these payload dtypes")
    p.add_argument("--no-ceiling", action="store_true", help="measure the encoders only")
    p.add_argument("--ceiling-from", metavar="JSON", help="reuse the ceiling cells of an earlier run's JSON where "
                   "its texts, K, LM, steps, learning rate and seed are these (the rest are computed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/results/memory-capacity", help="the folder written")
    p.add_argument("--threads", type=positive(int), default=None, help="torch threads (default: torch's)")
    return p


def main(argv: list[str] | None = None, *, lm: LM | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error(f"--steps must be 0 or more, got {args.steps}")
    for run in args.encoder:
        if not (Path(run) / "config.json").is_file():
            p.error(f"--encoder {run}: no config.json there (give a run directory)")
    earlier = None
    if args.ceiling_from:
        try:
            earlier = {**json.loads(Path(args.ceiling_from).read_text()), "path": args.ceiling_from}
        except (OSError, ValueError) as e:
            p.error(f"--ceiling-from {args.ceiling_from}: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        lm = load_lm(args.lm) if lm is None else lm
        loaded = {run: ILCPHandoff.from_pretrained(run, lm=lm) for run in args.encoder}
        handoffs = {encoder_name(run, dtype): (h, dtype) for run, h in loaded.items() for dtype in args.payload_dtypes}
    except (ExportError, LMLoadError, ValueError) as e:
        print(f"memory_capacity: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    instruction = instruction_ids(lm.tokenizer)
    texts = held_out_texts(lm.tokenizer, args.lengths, args.texts, args.seed, args.sources)
    start, cells = time.perf_counter(), []
    plan = [(length, k) for length in args.lengths for k in ([] if args.no_ceiling else args.ks)]
    print(f"memory capacity: {lm.spec}, {torch.get_num_threads()} threads, {len(plan)} ceiling cells and "
          f"{len(handoffs)} encoder(s) over lengths {args.lengths}; texts per length: "
          f"{ {length: len(t) for length, t in texts.items()} }", flush=True)
    for length in args.lengths:
        chosen = texts[length]
        if not chosen:
            print(f"L={length}: no text that long, skipped", flush=True)
            continue
        ce = memory_without_text(lm, [t["ids"] for t in chosen], instruction)
        cells_here = [("ceiling", k) for k in ([] if args.no_ceiling else args.ks)] + [("encoder", n) for n in handoffs]
        for kind, which in cells_here:
            if kind == "ceiling":
                cell = earlier_ceiling(earlier, lm, chosen, which, args) or ceiling_cell(lm, chosen, which, instruction,
                                                                                         ce, args)
            else:
                handoff, dtype = handoffs[which]
                cell = encoder_cell(lm, handoff, which, chosen, instruction, ce, dtype)
            cells.append(cell)
            acc = statistics.mean(t["token_accuracy"] for t in cell["texts"])
            exact = sum(t["exact"] for t in cell["texts"])
            print(f"L={length} {cell['memory']} K={cell['k']}: token accuracy {acc:.3f}, exact {exact}/"
                  f"{len(cell['texts'])}; cell {cell['seconds']:.0f}s, {time.perf_counter() - start:.0f}s in all",
                  flush=True)
    rows = summarize(cells)
    command = command_line([__file__, *(sys.argv[1:] if argv is None else argv)])
    report = {
        "provenance": provenance(command), "lm": lm.spec, "hidden_size": lm.hidden_size,
        "platform": platform.platform(), "seconds": round(time.perf_counter() - start, 1),
        "settings": {"lengths": args.lengths, "ks": args.ks, "texts_per_source": args.texts, "steps": args.steps,
                     "lr": args.lr, "seed": args.seed, "threads": torch.get_num_threads(),
                     "instruction_tokens": len(instruction), "initial_vector_norm": round(embedding_norm(lm), 4),
                     "encoders": [str(r) for r in args.encoder], "sources": args.sources,
                     "payload_dtypes": args.payload_dtypes, "ceiling_from": args.ceiling_from},
        "encoders": [{"name": name, "path": str(h.source), "memory_kind": h.spec.memory.kind,
                      "pooling": h.spec.memory.entries(), "memory_vectors": h.num_memory_tokens,
                      "latent_dim": h.spec.latent_dim, "payload_dtype": dtype, "max_length": h.max_length}
                     for name, (h, dtype) in handoffs.items()],
        "summary": rows,
        "cells": cells,
    }
    atomic_write_json(out / JSON_NAME, report)
    atomic_write_text(out / TABLE_NAME, table_document(report))
    draw(rows, out / PLOT_NAME, lm.spec)
    readme = write_readme(out)
    print(markdown_table(rows), flush=True)
    print(f"wrote {out / JSON_NAME}, {out / TABLE_NAME}, {out / PLOT_NAME} and {readme}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
