"""RCLC, receive once and ask many: the time to first token of questions 2..N asked of one delivered
handoff (`Agent.ask`), against pop + generate per question (the Hugging Face backend).

    python benchmarks/rclc_ask_many.py                                   # the embedded SmolLM2
    python benchmarks/rclc_ask_many.py --questions 10 --rounds 5 --json /tmp/rclc_ask_many.json
    OMP_NUM_THREADS=1 python benchmarks/rclc_ask_many.py --lm tiny-qwen3 --questions 3 --rounds 1

Agent X holds a short story; agent Y (in_prompt placement) receives a question-blind selection of
it (`rclc.selectors.reread`, whose rows do not depend on the request). Per round, in one process on
one LM:
- pop + generate: Y holds one queued handoff per question (delivered beforehand, untimed; the
  same rows every time) and each question is ``pop(prompt=question, max_new_tokens=1)`` then
  ``model.generate`` (greedy): the whole input [prompt before the rows ; rows ; prompt with the
  question] is prefilled per question;
- ask: a second receiver holds one delivered handoff and each question is
  ``await agent.ask(question, max_new_tokens=1)``: question 1 also prefills the part every
  question shares (the prompt before the rows, the rows, the prompt before the question) and
  keeps its key/value cache; questions 2..N prefill only their own positions on a copy of it.
The two take turns question by question, so a change in machine load hits both alike; the median
over rounds is printed per question with the positions each path prefilled (counted by a hook on
the decoder), then the mean of questions 2..N and the ratio. The transfer's own time (the sender's
selection, which a transfer per question would add) is printed once beside them. A one-token
answer's time is its time to first token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

CONTEXT = ("Mary moved to the bathroom. John went to the hallway. Daniel travelled to the office. Sandra "
           "journeyed to the garden. Mary picked up the milk. John went back to the kitchen. Daniel grabbed the "
           "apple there. Sandra went to the bedroom.")
QUESTIONS = ["Where is Mary?", "Where is John?", "Where is Daniel?", "Where is Sandra?", "Where is the milk?",
             "Where is the apple?", "Who has the milk?", "Who went to the kitchen?", "Where was Sandra before the "
             "bedroom?", "Who travelled to the office?", "What did Mary pick up?", "What did Daniel grab?"]
REQUEST = "What happened in the story?"
HISTORY_Y = [{"role": "system", "content": "Answer the question with one word."}]
SLOT = "Context:\n{context}\nQuestion: {request}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lm", default="smollm2-135m-instruct", help="the LM (`ilcp.lm.load_lm` spec)")
    p.add_argument("--questions", type=int, default=10, help=f"questions per round, 2..{len(QUESTIONS)}")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the median per question is printed")
    p.add_argument("--ratio", type=int, default=2, help="the transfer's relative budget (rX)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    if not 2 <= args.questions <= len(QUESTIONS):
        p.error(f"--questions must be 2..{len(QUESTIONS)}, got {args.questions}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.ratio < 1:
        p.error(f"--ratio must be at least 1, got {args.ratio}")
    return args


class Forwards:
    """The positions each forward of the decoder takes, while installed."""

    def __init__(self, model):
        self.positions: list[int] = []
        self._handle = model.base_model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        rows = kwargs.get("inputs_embeds")
        self.positions.append(int((rows if rows is not None else kwargs["input_ids"]).shape[1]))

    def remove(self) -> None:
        self._handle.remove()


def timed(forwards: Forwards, call) -> tuple[float, list[int]]:
    """Seconds of ``call()`` and the positions of each forward it ran."""
    forwards.positions.clear()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start, list(forwards.positions)


def one_round(rclc, model, tokenizer, sender, questions: list[str], ratio: int, loop, forwards: Forwards) -> dict:
    """Seconds and prefilled positions of each question both ways, and of the transfer."""
    settings = {"messages": HISTORY_Y, "max_new_tokens": 1, "placement": "in_prompt", "slot_template": SLOT}
    per_question = rclc.bind(model, tokenizer, **settings)
    for _ in questions:
        loop.run_until_complete(rclc.transfer(sender, per_question, REQUEST, ratio=ratio,
                                              selector=rclc.selectors.reread))
    asking = rclc.bind(model, tokenizer, **settings)
    transfer_s, _ = timed(forwards, lambda: loop.run_until_complete(
        rclc.transfer(sender, asking, REQUEST, ratio=ratio, selector=rclc.selectors.reread)))
    received = asking.queued()[0][0].positions

    def pop_and_generate(q):
        inputs = per_question.pop(prompt=q, max_new_tokens=1, discard_pending=True)
        model.generate(**inputs, do_sample=False)

    pop_s, pop_positions, ask_s, ask_positions = [], [], [], []
    for q in questions:
        seconds, positions = timed(forwards, lambda: pop_and_generate(q))
        pop_s.append(seconds)
        pop_positions.append(positions)
        seconds, positions = timed(forwards, lambda: loop.run_until_complete(asking.ask(q, max_new_tokens=1)))
        ask_s.append(seconds)
        ask_positions.append(positions)
    return {"transfer_s": transfer_s, "received": received, "pop_s": pop_s, "pop_positions": pop_positions,
            "ask_s": ask_s, "ask_positions": ask_positions}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import asyncio

    from ilcp import rclc
    from ilcp.io import atomic_write_json
    from ilcp.lm import LMLoadError, load_lm

    start = time.perf_counter()
    try:
        lm = load_lm(args.lm)
    except (LMLoadError, ValueError, OSError) as e:
        print(f"rclc_ask_many.py: error: {e}", file=sys.stderr)
        return 2
    model, tokenizer = lm.model, lm.tokenizer
    print(f"loaded {lm.spec} in {time.perf_counter() - start:.1f} s")
    questions = QUESTIONS[:args.questions]
    sender = rclc.bind(model, tokenizer, messages=[{"role": "user", "content": CONTEXT}])
    loop = asyncio.new_event_loop()
    forwards = Forwards(model)
    try:
        one_round(rclc, model, tokenizer, sender, questions[:2], args.ratio, loop, forwards)  # warm-up
        rounds = [one_round(rclc, model, tokenizer, sender, questions, args.ratio, loop, forwards)
                  for _ in range(args.rounds)]
    finally:
        forwards.remove()
        loop.close()
    last = rounds[-1]
    shared = last["ask_positions"][0][0]  # question 1's first forward: the shared part
    pop_positions = [sum(p) for p in last["pop_positions"]]
    ask_positions = [sum(p) for p in last["ask_positions"]]
    pop = [statistics.median(r["pop_s"][i] for r in rounds) for i in range(len(questions))]
    ask = [statistics.median(r["ask_s"][i] for r in rounds) for i in range(len(questions))]
    transfer_s = statistics.median(r["transfer_s"] for r in rounds)
    print(f"time to first token, ms (median of {args.rounds} round(s)); one transfer (r{args.ratio}, reread): "
          f"{transfer_s * 1000:.1f} ms, {last['received']} rows received; the shared part: {shared} positions")
    print("| question | pop + generate ms | positions | ask ms | positions | pop / ask |")
    print("|---|---|---|---|---|---|")
    rows = []
    for i, q in enumerate(questions):
        first = " (+ shared part)" if i == 0 else ""
        rows.append({"question": q, "pop_s": pop[i], "ask_s": ask[i], "pop_positions": pop_positions[i],
                     "ask_positions": ask_positions[i]})
        print(f"| {i + 1} | {pop[i] * 1000:.1f} | {pop_positions[i]} | {ask[i] * 1000:.1f}{first} | "
              f"{ask_positions[i]} | {pop[i] / ask[i]:.2f} |")
    later_pop, later_ask = statistics.mean(pop[1:]), statistics.mean(ask[1:])
    print(f"questions 2..{len(questions)}: pop + generate {later_pop * 1000:.1f} ms, ask {later_ask * 1000:.1f} ms "
          f"on one delivered handoff, pop / ask {later_pop / later_ask:.2f}")
    if args.json:
        from ilcp.provenance import provenance

        report = {"provenance": provenance(), "lm": lm.spec, "ratio": args.ratio, "selector": "reread",
                  "rounds": args.rounds, "transfer_s": transfer_s, "received_positions": last["received"],
                  "shared_positions": shared, "rows": rows, "later_pop_s": later_pop, "later_ask_s": later_ask}
        atomic_write_json(Path(args.json), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
