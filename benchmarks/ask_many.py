"""Receive once, ask many: the time to first token of questions 2..N on one opened memory, against
`receive` per question (the Hugging Face receiver; both sealed under a shared key).

    python benchmarks/ask_many.py                                     # the shipped SmolLM2 encoder
    python benchmarks/ask_many.py --ckpt checkpoints/default --questions 10 --rounds 5
    OMP_NUM_THREADS=1 python benchmarks/ask_many.py --ckpt checkpoints/tiny --questions 3 --rounds 1

One context is sent once. Per round, in one process on one LM:
- receive: each question gets its own sealed wire (sealed beforehand; a wire is received once) and
  one ``receive(wire, question, max_new_tokens=1)``: unseal, verify, project, build and prefill
  the whole prefix [memory ; prompt with the question], first token;
- open + ask: the same context's wire is opened once (``handoff.open``: unseal, verify, project),
  then ``memory.ask(question, max_new_tokens=1)`` per question: question 1 also prefills the
  part every question shares (the memory and the prompt before the question) and keeps its
  key/value cache; questions 2..N prefill only their own positions on a copy of it.
The two take turns question by question, so a change in machine load hits both alike; the
median over rounds is printed per question, with the positions each prefilled, then the mean of
questions 2..N and the ratio receive / ask. A one-token answer's time is its time to first token.

A served receiver on vLLM gets the same saving from its prefix caching, in whole blocks:
`benchmarks/vllm_prefix_cache.py`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CKPT = REPO / "pretrained" / "smollm2-memory"
KEY = b"ask-many-benchmark-key-0123456789"
CONTEXT = ("Mary moved to the bathroom. John went to the hallway. Daniel travelled to the office. Sandra "
           "journeyed to the garden. Mary picked up the milk. John went back to the kitchen. Daniel grabbed the "
           "apple there. Sandra went to the bedroom.")
QUESTIONS = ["Where is Mary?", "Where is John?", "Where is Daniel?", "Where is Sandra?", "Where is the milk?",
             "Where is the apple?", "Who has the milk?", "Who went to the kitchen?", "Where was Sandra before the "
             "bedroom?", "Who travelled to the office?", "What did Mary pick up?", "What did Daniel grab?"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT), help="an export (default: the shipped SmolLM2 encoder)")
    p.add_argument("--questions", type=int, default=10, help=f"questions per round, 2..{len(QUESTIONS)}")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the median per question is printed")
    p.add_argument("--precision", default=None, help="compute precision (default: the export's)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    if not 2 <= args.questions <= len(QUESTIONS):
        p.error(f"--questions must be 2..{len(QUESTIONS)}, got {args.questions}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    out = call()
    return time.perf_counter() - start, out


def one_round(handoff, questions: list[str]) -> dict:
    """Seconds of each question by `receive` and by `ask` on one opened memory, and the open."""
    payload = handoff.send(CONTEXT)
    wires = [handoff.to_wire(payload) for _ in questions]  # each received once
    open_s, memory = timed(lambda: handoff.open(handoff.to_wire(payload)))
    receive_s, ask_s = [], []
    for q, wire in zip(questions, wires):
        receive_s.append(timed(lambda: handoff.receive(wire, q, max_new_tokens=1))[0])
        ask_s.append(timed(lambda: memory.ask(q, max_new_tokens=1))[0])
    return {"open_s": open_s, "receive_s": receive_s, "ask_s": ask_s}


def positions(handoff, questions: list[str]) -> tuple[list[int], int]:
    """The whole prefix's positions per question, and the shared part's."""
    from ilcp.receiver.prefix import question_stem, receiver_prefix

    memory = handoff.open(handoff.to_wire(handoff.send(CONTEXT)))
    tok = handoff.lm.tokenizer
    whole = [len(receiver_prefix(tok, q, source=handoff.encoder, memory=memory.vectors[0])) for q in questions]
    stem = question_stem(tok, source=handoff.encoder, memory=memory.vectors[0])
    return whole, 0 if stem is None else len(stem)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from ilcp.export import ExportError
    from ilcp.handoff import ILCPHandoff
    from ilcp.io import atomic_write_json

    start = time.perf_counter()
    try:
        handoff = ILCPHandoff.from_pretrained(args.ckpt, auth_key=KEY, precision=args.precision)
    except (ExportError, ValueError) as e:
        print(f"ask_many.py: error: {e}", file=sys.stderr)
        return 2
    print(f"loaded {handoff.lm.spec} and {args.ckpt} in {time.perf_counter() - start:.1f} s "
          f"(precision {handoff.precision})")
    questions = QUESTIONS[:args.questions]
    handoff.receive(handoff.to_wire(handoff.send(CONTEXT)), questions[0], max_new_tokens=1)  # warm-up
    rounds = [one_round(handoff, questions) for _ in range(args.rounds)]
    whole, stem = positions(handoff, questions)
    receive = [statistics.median(r["receive_s"][i] for r in rounds) for i in range(len(questions))]
    ask = [statistics.median(r["ask_s"][i] for r in rounds) for i in range(len(questions))]
    open_s = statistics.median(r["open_s"] for r in rounds)
    print(f"time to first token, ms (median of {args.rounds} round(s)); open once: {open_s * 1000:.1f} ms; "
          f"the shared part: {stem} positions")
    print("| question | receive ms | positions | ask ms | positions | receive / ask |")
    print("|---|---|---|---|---|---|")
    rows = []
    for i, q in enumerate(questions):
        own = whole[i] if i == 0 or stem == 0 else whole[i] - stem
        first = " (+ shared part)" if i == 0 else ""
        rows.append({"question": q, "receive_s": receive[i], "ask_s": ask[i], "receive_positions": whole[i],
                     "ask_positions": whole[i] if i == 0 else own})
        print(f"| {i + 1} | {receive[i] * 1000:.1f} | {whole[i]} | {ask[i] * 1000:.1f}{first} | "
              f"{rows[-1]['ask_positions']} | {receive[i] / ask[i]:.2f} |")
    later_receive, later_ask = statistics.mean(receive[1:]), statistics.mean(ask[1:])
    print(f"questions 2..{len(questions)}: receive {later_receive * 1000:.1f} ms, ask {later_ask * 1000:.1f} ms "
          f"on one opened memory, receive / ask {later_receive / later_ask:.2f}")
    if args.json:
        from ilcp.provenance import provenance

        report = {"provenance": provenance(), "ckpt": str(args.ckpt), "lm": handoff.lm.spec, "precision": handoff.precision,
                  "rounds": args.rounds, "open_s": open_s, "shared_positions": stem, "rows": rows,
                  "later_receive_s": later_receive, "later_ask_s": later_ask}
        atomic_write_json(Path(args.json), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
