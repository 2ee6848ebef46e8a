"""Where a method's answers to bAbI location questions come from, read from eval's predictions.

Exact match says how often an answer is right, not what the receiver read. For each task and
method of a ``predictions.jsonl`` (written by eval.py) this counts, over the same questions, how
often the answer (first line, normalised as exact match does) is:

- the gold location;
- a location the bAbI story names (``... to the kitchen``, ``... in the garden``);
- the last location the story gives some person (the answer to "Where is <person>?" for someone);
- a single word at all (the one-word answer form the tuned prompts ask for);
- the answer another method gave to the same question (``--against``, default prompt_tuned).

A handoff that carries the story but not the link a question needs (task 2: which person holds
the object) answers with the story's locations and people's locations, right only by chance; a
handoff that carries nothing answers like prompt_tuned. Stories come from the bAbI files behind the
row ids (BABILong rows: the story inside the haystack).

    python benchmarks/answer_sources.py results/babilong-story-heldout/predictions.jsonl
    python benchmarks/answer_sources.py results/x/predictions.jsonl --tasks babilong:2:2k --json /tmp/sources.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from ilcp.names import is_babilong_name, parse_babilong_name
from ilcp.tasks.babilong_context import story_sentences
from ilcp.io import atomic_write_json
from ilcp.metrics import first_line, normalize_answer
from ilcp.tasks import load_babi

_PLACE = re.compile(r"\b(?:to|in|into) the (\w+)")
_MOVE = re.compile(r"^(\w+) (?:went|moved|journeyed|travell?ed)(?: back)? to the (\w+)")
_BABI_ID = re.compile(r"babi-qa(\d+)-(train|test)-")


def story_of(row_id: str, task: str, cache: dict) -> list[str]:
    """The bAbI story (sentences) behind an eval row id: a bAbI id, or a BABILong id (the task's
    canonical name followed by the bAbI id's tail)."""
    if is_babilong_name(task):
        parsed = parse_babilong_name(task)
        if not row_id.startswith(parsed.name):
            raise ValueError(f"row {row_id!r} is not a row of {task!r}")
        row_id = f"babi-qa{parsed.number}" + row_id[len(parsed.name):]
    match = _BABI_ID.match(row_id)
    if match is None:
        raise ValueError(f"row {row_id!r}: not a bAbI or BABILong row id")
    number, split = int(match.group(1)), match.group(2)
    if (number, split) not in cache:
        cache[number, split] = {r["id"]: r["context"] for r in load_babi(number, split).to_list()}
    return story_sentences(cache[number, split][row_id])


def sources(story: list[str], prediction: str, answer: str) -> dict[str, bool]:
    """What one answer is (the counts' keys) against its story."""
    said = normalize_answer(first_line(prediction))
    places = {m.lower() for s in story for m in _PLACE.findall(s)}
    last = {}
    for sentence in story:
        move = _MOVE.match(sentence)
        if move:
            last[move.group(1)] = move.group(2).lower()
    return {"gold": said == normalize_answer(answer), "story location": said in places,
            "some person's last location": said in set(last.values()), "one word": len(said.split()) == 1}


def summarise(rows: list[dict], against: str) -> dict[str, dict[str, dict]]:
    """{task: {method: {n, and a percentage per source}}}."""
    cache: dict = {}
    by_question: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for row in rows:
        by_question[row["task"], row["id"]][row["method"]] = row
    counts: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for (task, row_id), methods in by_question.items():
        story = story_of(row_id, task, cache)
        for method, row in methods.items():
            c = counts[task][method]
            c["n"] += 1
            for key, hit in sources(story, row["prediction"], row["answer"]).items():
                c[key] += hit
            if against in methods:
                c[f"same as {against}"] += (normalize_answer(first_line(row["prediction"]))
                                            == normalize_answer(first_line(methods[against]["prediction"])))
    return {task: {method: {"n": c["n"], **{k: 100 * v / c["n"] for k, v in c.items() if k != "n"}}
                   for method, c in sorted(by_method.items())}
            for task, by_method in counts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("predictions", help="eval.py's predictions.jsonl")
    parser.add_argument("--tasks", default=None, help="comma-separated task names (default: every bAbI-based task)")
    parser.add_argument("--against", default="prompt_tuned", help="the method answers are compared with")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    path = Path(args.predictions)
    if not path.is_file():
        parser.error(f"{path}: no such file (eval.py writes predictions.jsonl into its --out folder)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    wanted = None if args.tasks is None else {t.strip() for t in args.tasks.split(",") if t.strip()}
    rows = [r for r in rows if (wanted is None or r["task"] in wanted)
            and (is_babilong_name(r["task"]) or r["id"].startswith("babi-qa"))]
    if not rows:
        parser.error("no bAbI or BABILong rows" + (f" of {sorted(wanted)}" if wanted else "") + f" in {path}")
    try:
        table = summarise(rows, args.against)
    except (ValueError, KeyError) as e:  # a row id that names no bAbI row, or a bAbI file without it
        parser.error(f"{path}: {e}")
    keys = ["gold", "story location", "some person's last location", "one word", f"same as {args.against}"]
    print("| task | method | n | " + " | ".join(f"{k} %" for k in keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for task, methods in table.items():
        for method, c in methods.items():
            print(f"| {task} | `{method}` | {c['n']} | "
                  + " | ".join("-" if k not in c else f"{c[k]:.0f}" for k in keys) + " |")
    if args.json:
        atomic_write_json(Path(args.json), {"predictions": str(path), "against": args.against, "tasks": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
