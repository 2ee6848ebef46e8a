"""How often a selector keeps the rows the answer is read from, per selector and budget.

A receiver can only answer from the rows it is sent. For every question this builds the sender's
state once (as eval's RCLC rows do: the context as the cold-read prompt holds it), runs every
selector at every budget with the question as the request, and checks whether the kept rows hold
the whole gold sentence and the answer's own tokens. Exact match mixes what the selector dropped
with what the receiver failed to read; this measures the first alone, on a validation split.

Gold sentence (one per question; questions where it cannot be found are skipped and counted):
- bAbI task 1 ("Where is Mary?"): the last sentence naming the person;
- facts: the sentence naming the asked entity (the question's capitalised word) and holding the answer.
Other tasks have no single gold sentence (task 2 needs two) and are refused.

    python benchmarks/selection_recall.py --task facts --limit 100
    python benchmarks/selection_recall.py --task babi:1 --limit 100 --budgets r16,r4,b16
    python benchmarks/selection_recall.py --task facts --selectors qsnap,sentences --json /tmp/recall.json

With a context of S sentences, a selector that picks sentences at random keeps the gold one at a
budget of one sentence with probability 1/S (1/4 on the 4-fact task). About 0.2 s per question and
selector-budget pair on one CPU thread with SmolLM2-135M (one attention pass each).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ilcp import rclc
from ilcp.rclc import hf
from ilcp.rclc.budget import position_budget
from ilcp.rclc.selectors.sentences import Sentences
from ilcp.receiver.rclc_prompts import receiver_framing
from ilcp.selection_prompts import SELECTORS

TASKS = ("babi:1", "facts")
BUDGETS = ("r16", "r8", "r4", "r2", "b16", "b32")
_BUDGET = re.compile(r"([rb])([1-9][0-9]*)\Z")


@dataclass
class Gold:
    sentence: list[int]  # token positions of the gold sentence
    answer: list[int]  # token positions overlapping the answer inside it


def token_offsets(tokenizer, ids: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) character offsets of each token in the decoded text of ``ids``."""
    offsets, text = [], ""
    for i in range(len(ids)):
        decoded = tokenizer.decode(list(ids[: i + 1]))
        offsets.append((len(text), len(decoded)))
        text = decoded
    return offsets


def entity_of(question: str, task: str) -> str | None:
    """The name the gold sentence must hold: bAbI task 1's person, the facts task's entity."""
    words = [w.strip("?.,!") for w in question.split()]
    if task == "babi:1":
        return words[-1] if len(words) == 3 and words[0] == "Where" else None
    named = [w for w in words[1:] if w[:1].isupper()]
    return named[0] if len(named) == 1 else None


def find_gold(tokenizer, ids: Sequence[int], spans: Sequence[tuple[int, int]], question: str, answer: str,
              task: str) -> Gold | None:
    """The gold sentence among ``spans`` (token [start, stop) sentences of ``ids``), or None."""
    entity = entity_of(question, task)
    if entity is None:
        return None
    offsets = token_offsets(tokenizer, ids)
    text = tokenizer.decode(list(ids))
    candidates = []
    for start, stop in spans:
        sentence = text[offsets[start][0]:offsets[stop - 1][1]]
        if re.search(rf"\b{re.escape(entity)}\b", sentence) and (task == "babi:1" or answer in sentence):
            candidates.append((start, stop, sentence))
    if not candidates:
        return None
    start, stop, sentence = candidates[-1]  # bAbI: the person's latest move; facts: the only one
    at = sentence.rfind(answer)
    if at < 0:
        return None
    first = offsets[start][0] + at
    last = first + len(answer)
    answer_rows = [p for p in range(start, stop) if offsets[p][0] < last and offsets[p][1] > first]
    return Gold(sentence=list(range(start, stop)), answer=answer_rows)


def parse_budget(text: str) -> dict:
    match = _BUDGET.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"a budget is r<N> (ceil(T / N) rows) or b<N> (at most N rows), got {text!r}")
    kind, n = match.group(1), int(match.group(2))
    return {"ratio": n} if kind == "r" else {"budget": n}


def measure(lm, rows: Sequence[dict], task: str, selectors: Sequence[str], budgets: Sequence[str],
            progress: bool = False) -> dict:
    """{"questions", "skipped", "results": {selector: {budget: {"sentence", "answer", "rows"}}}}:
    the share of questions whose whole gold sentence / answer tokens were kept, and the mean rows kept."""
    tokenizer = lm.tokenizer
    framing = receiver_framing(tokenizer)
    splitter = Sentences()
    counts = {s: {b: {"sentence": 0, "answer": 0, "rows": 0} for b in budgets} for s in selectors}
    used = skipped = 0
    for i, row in enumerate(rows):
        state = rclc.sender_from_hf(lm.model, tokenizer, framing.lead + row["context"].strip())
        ids = state.token_ids.tolist()
        gold = find_gold(tokenizer, ids, splitter.spans(state), row["question"], row["answer"], task)
        if gold is None:
            skipped += 1
            continue
        used += 1
        request = hf.encode_text(tokenizer, row["question"].strip())
        for name in selectors:
            for b in budgets:
                kept = set(SELECTORS[name](state, request, position_budget(state.positions, **parse_budget(b))).tolist())
                c = counts[name][b]
                c["sentence"] += all(p in kept for p in gold.sentence)
                c["answer"] += all(p in kept for p in gold.answer)
                c["rows"] += len(kept)
        if progress:
            print(f"\r{i + 1}/{len(rows)} questions", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    results = {s: {b: {k: (v / used if used else None) for k, v in c.items()} for b, c in per.items()}
               for s, per in counts.items()}
    return {"questions": used, "skipped": skipped, "results": results}


def markdown(report: dict, budgets: Sequence[str]) -> str:
    lines = [f"Gold sentence kept % / answer tokens kept % (mean rows kept), {report['questions']} questions "
             f"({report['skipped']} without a gold sentence skipped):", "",
             "| selector | " + " | ".join(budgets) + " |", "|---|" + "---|" * len(budgets)]
    for name, per in report["results"].items():
        cells = [f"{100 * per[b]['sentence']:.0f} / {100 * per[b]['answer']:.0f} ({per[b]['rows']:.1f})"
                 if per[b]["sentence"] is not None else "-" for b in budgets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=TASKS, default="facts")
    p.add_argument("--split", default="validation", choices=("train", "validation", "test"))
    p.add_argument("--limit", type=int, default=100, help="questions (default 100)")
    p.add_argument("--selectors", default=",".join(SELECTORS), help="comma-separated (default: every selector)")
    p.add_argument("--budgets", default=",".join(BUDGETS), help="comma-separated r<N> / b<N> (default: %(default)s)")
    p.add_argument("--lm", default="smollm2-135m-instruct", help="the sender's LM spec")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    selectors = [s.strip() for s in args.selectors.split(",") if s.strip()]
    unknown = [s for s in selectors if s not in SELECTORS]
    if unknown or not selectors:
        p.error(f"unknown selector(s) {unknown}; known: {', '.join(SELECTORS)}")
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    for b in budgets:
        try:
            parse_budget(b)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))

    from ilcp.lm import load_lm
    from ilcp.tasks import load_task

    kwargs = {"n_examples": args.limit, "value_split": "train"} if args.task == "facts" else {"limit": args.limit}
    rows = load_task(args.task, args.split, **kwargs).to_list()
    lm = load_lm(args.lm)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    report = measure(lm, rows, args.task, selectors, budgets, progress=True)
    report.update(task=args.task, split=args.split, lm=args.lm, seconds=round(time.perf_counter() - t0, 1))
    print(f"{args.task} ({args.split} split), {args.lm}, {report['seconds']:.0f} s")
    print(markdown(report, budgets))
    if args.json:
        from ilcp.io import atomic_write_json

        atomic_write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
