"""Ship a chunk pretraining's writer: its weights, a sealed config.json, its curve and a card.

    python -m ilcp.training.chunk_ship checkpoints/chunk-c8 --out pretrained/smollm2-chunk8

The writer is read back on the held-out texts the curve used (`heldout_texts`: SQuAD validation
paragraphs, the books' validation passages, the held-out bAbI tasks' stories), with the frozen LM
in float32 as a run loads it: one chunk from one vector, 32-token windows from 4 vectors and
128-token windows from 16 (at c = 8), each beside the receiver with no memory, token accuracy
with a 95% interval over texts. config.json records the writer's settings, the LM's fingerprint,
the weights' sha256, the pretraining's settings, steps, hours and sessions, and these figures;
README.md is the card. The folder is written beside the destination and renamed into place once
complete and read back, so a failed ship leaves nothing half-written. A train.py run starts from
it with ``compressor.memory.kind=chunk compressor.memory.writer_from=FOLDER``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

from ..encoder.chunk import ChunkWriter
from ..encoder.chunk_files import WRITER_FILE, new_writer, read_writer_state, shipped_writer_config, writer_words
from ..io import atomic_write_json, atomic_write_text
from ..lm import LM, LMLoadError, load_lm
from .chunk_pretrain import ChunkPretrainConfig, ChunkReader, cut, even_sample, heldout_texts, tokenize, write

MAX_SHIPPED_BYTES = 20 << 20
WINDOWS = (1, 4, 16)  # vectors a read-back text is written to


@torch.no_grad()
def _per_text(writer: ChunkWriter | None, reader: ChunkReader, texts: torch.Tensor, batch: int = 32) -> list[float]:
    accs = []
    for i in range(0, len(texts), batch):
        part = texts[i:i + batch]
        memory = None if writer is None else write(writer, reader, part)
        right = reader.logits(memory, part).argmax(-1) == part.to(reader.table.device)
        accs += right.float().mean(-1).tolist()
    return accs


def _summary(accs: list[float]) -> dict:
    n = len(accs)
    mean = sum(accs) / n
    sd = math.sqrt(sum((a - mean) ** 2 for a in accs) / max(1, n - 1))
    half = 1.96 * sd / math.sqrt(n)
    return {"texts": n, "token_accuracy": round(mean, 4), "interval": [round(max(0.0, mean - half), 4),
                                                                        round(min(1.0, mean + half), 4)],
            "exact": round(sum(a == 1.0 for a in accs) / n, 4)}


def readback(writer: ChunkWriter, lm: LM, cfg: ChunkPretrainConfig, texts_per_set: int = 128,
             log=lambda _m: None) -> list[dict]:
    """Rows of held-out read-back: per source and window (vectors), the writer and no memory."""
    reader, rows = ChunkReader(lm), []
    sources = {name: tokenize(lm.tokenizer, texts) for name, texts in heldout_texts(cfg).items()}
    for vectors in WINDOWS:
        length = vectors * cfg.chunk_tokens
        for name, token_lists in sources.items():
            texts = even_sample(cut(token_lists, length), texts_per_set if vectors < 16 else texts_per_set // 4)
            if len(texts) == 0:
                continue  # no text of that source is this long
            for memory, w in (("chunk writer", writer), ("no memory", None)):
                rows.append({"source": name, "tokens": length, "vectors": vectors, "memory": memory,
                             **_summary(_per_text(w, reader, texts))})
                log(f"[ship] {name}, {length} tokens from {vectors} vector(s), {memory}: token accuracy "
                    f"{rows[-1]['token_accuracy']:.3f}, exact {rows[-1]['exact']:.3f} ({len(texts)} texts)")
    return rows


def _threads(sessions: list[dict]) -> str:
    """" (1 thread)" when every session recorded the same thread count, else ""."""
    counts = {s.get("threads") for s in sessions}
    if len(counts) != 1 or None in counts:
        return ""
    n = counts.pop()
    return f" ({n} thread{'s' if n != 1 else ''})"


def _writer_settings(w: dict) -> str:
    if w.get("kind") == "sender":
        return (f"compressor.memory.writer=sender compressor.memory.sender_layers={w['layers']} "
                f"compressor.memory.sender_rank={w['rank']} ")
    return ""


def card(config: dict, rows: list[dict], dest: str) -> str:
    p, w = config["pretraining"], config["writer"]
    c = w["chunk_tokens"]
    table = ["| held-out source | tokens | vectors | memory | token accuracy (95% interval) | exact % |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['source']} | {r['tokens']} | {r['vectors']} | {r['memory']} | {r['token_accuracy']:.3f} "
              f"({r['interval'][0]:.3f}-{r['interval'][1]:.3f}) | {100 * r['exact']:.0f} |" for r in rows]
    sessions = p["sessions"]
    return "\n".join([
        f"# Pretrained chunk writer for `{config['lm']['spec']}`", "",
        f"One memory vector of the LM's width ({w['hidden_size']} floats) per {c} context tokens, written by "
        f"{writer_words(w)}; the frozen receiver reads the vectors in the "
        f"chunks' order. For the LM `{config['lm']['spec']}` in {config['lm']['dtype']} (fingerprint "
        f"`{config['lm']['fingerprint']}`; another LM is refused). Pretrained on text alone, never on a question.", "",
        f"Start a run from it with `compressor.memory.kind=chunk {_writer_settings(w)}"
        f"compressor.memory.writer_from={dest}`.", "",
        "## How it was made", "",
        f"- Command: `{sessions[0]['command']}`"
        + (f", resumed {len(sessions) - 1} time(s)" if len(sessions) > 1 else "")
        + f"; shipped with `python -m ilcp.training.chunk_ship RUN --out {dest}`.",
        "- Corpus: the SQuAD training paragraphs shipped in data/, the background books' training passages and "
        f"{p['config']['babi_stories']} bAbI stories of the trained tasks (held-out tasks 2, 11 and 16 left out); each "
        "epoch cuts the texts into chunks at another offset.",
        *[f"- Earlier stage (`{e['folder']}`, which this run started from): {e['steps']} steps of "
          f"{e['config']['batch_chunks']} texts of {e['config'].get('window_chunks', 1)} chunk(s), "
          f"{e['seconds'] / 3600:.2f} hours." for e in p.get("earlier_stages", [])],
        f"- Budget: {p['steps']} steps of {p['config']['batch_chunks']} texts of {p['config'].get('window_chunks', 1)} "
        f"chunk(s) (AdamW, lr {p['config']['lr']}"
        + (f"; {p['config']['continuation_tokens']} tokens of continuation" if p['config'].get('continuation_tokens')
           else "")
        + f"), {p['seconds'] / 3600:.2f} hours trained on {sessions[0].get('machine', 'a CPU')}"
        f"{_threads(sessions)}; {sessions[0]['date']}"
        + (f"; {sum(e['seconds'] for e in p['earlier_stages']) / 3600 + p['seconds'] / 3600:.2f} hours in all."
           if p.get("earlier_stages") else "."),
        "- Files: writer.safetensors (float32), config.json (settings, LM fingerprint, the weights' sha256, its own "
        "digest, these figures), curve.jsonl (held-out read-back against steps and seconds).", "",
        "## Reading it back", "",
        f"Held-out texts never trained on, cut into windows of {c}, {4 * c} and {16 * c} tokens (1, 4 and 16 vectors), "
        "read back teacher-forced by the frozen receiver after the reconstruction instruction; exact = every token "
        f"right. Measured by the ship command on {config['readback_provenance']['date']}, "
        f"{config['readback_provenance']['machine']}.", "",
        *table, ""])


def earlier_stages(meta: dict, limit: int = 8) -> list[dict]:
    """The pretrainings a run started from (``init_from``, followed back), earliest first: each one's
    folder, settings, steps and seconds, so a card counts every stage's budget."""
    stages, seen = [], set()
    source = meta["config"].get("init_from")
    while source and len(stages) < limit and source not in seen:
        seen.add(source)
        state = Path(source) / "state" / "state.json"
        if not state.is_file():
            raise ValueError(f"the run started from {source} (init_from), which holds no state/state.json: its "
                             "budget cannot be counted on the card; ship from where that folder is")
        earlier = json.loads(state.read_text())
        stages.insert(0, {"folder": str(source), "config": earlier["config"], "steps": earlier["step"],
                          "seconds": round(earlier["seconds"], 1)})
        source = earlier["config"].get("init_from")
    return stages


def ship(run: Path, dest: Path, lm: LM, texts_per_set: int = 128, log=print) -> Path:
    run, dest = Path(run), Path(dest)
    state = run / "state" / "state.json"
    if not state.is_file():
        raise ValueError(f"{run} holds no chunk pretraining (state/state.json): give the --out folder of "
                         "python -m ilcp.training.chunk_pretrain")
    meta = json.loads(state.read_text())
    settings = meta["writer"]
    cfg = ChunkPretrainConfig(**meta["config"])
    stages = earlier_stages(meta)
    weights = read_writer_state(run, settings)
    size = sum(t.numel() * t.element_size() for t in weights.values())
    if size > MAX_SHIPPED_BYTES:
        raise ValueError(f"the writer's weights take {size / 2**20:.1f} MiB, over the {MAX_SHIPPED_BYTES >> 20} MiB a "
                         "shipped writer may take")
    try:
        writer = new_writer(settings, lm.model).to(lm.device)
    except ValueError as e:
        raise ValueError(f"{run}'s writer {e}") from None
    writer.load_state_dict(weights)
    writer.eval()
    log(f"[ship] reading {run}'s writer (step {meta['step']}) back on held-out texts")
    rows = readback(writer, lm, cfg, texts_per_set, log)
    from ..provenance import provenance

    tmp = dest.parent / f".{dest.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        shutil.copyfile(run / "state" / WRITER_FILE, tmp / WRITER_FILE)
        shutil.copyfile(run / "curve.jsonl", tmp / "curve.jsonl")
        sessions = json.loads((run / "sessions.json").read_text()) if (run / "sessions.json").exists() else []
        config = shipped_writer_config(
            settings, lm.spec, str(lm.dtype).removeprefix("torch."), lm.fingerprint, tmp / WRITER_FILE,
            pretraining={"config": meta["config"], "steps": meta["step"], "seconds": round(meta["seconds"], 1),
                         "sessions": sessions, **({"earlier_stages": stages} if stages else {})},
            readback=rows, readback_provenance=provenance())
        atomic_write_json(tmp / "config.json", config)
        atomic_write_text(tmp / "README.md", card(config, rows, str(dest)))
        read_writer_state(tmp, settings, lm.fingerprint)  # it reads back as a run would read it
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"[ship] wrote {dest}")
    return dest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ilcp.training.chunk_ship", description=__doc__.split("\n")[0])
    p.add_argument("run", help="a chunk pretraining's --out folder")
    p.add_argument("--out", required=True, help="the shipped folder (pretrained/smollm2-chunk8)")
    p.add_argument("--lm", default="smollm2-135m-instruct", help="the LM the writer was trained for")
    p.add_argument("--texts", type=int, default=128, help="held-out texts per source and window (a quarter at 16 vectors)")
    args = p.parse_args(argv)
    if args.texts < 1:
        print("error: --texts must be >= 1", file=sys.stderr)
        return 2
    if not (Path(args.run) / "state" / "state.json").is_file():  # before the LM loads
        print(f"error: {args.run} holds no chunk pretraining (state/state.json): give the --out folder of "
              "python -m ilcp.training.chunk_pretrain", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    try:
        lm = load_lm(args.lm, dtype="float32")
        ship(Path(args.run), Path(args.out), lm, args.texts, log=lambda m: print(m, flush=True))
    except (ValueError, LMLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
