"""float32 against bfloat16 autocast on this machine's CPU, for the work the project does most.

    python benchmarks/precision_speed.py
    python benchmarks/precision_speed.py --threads 2 --repeats 5 --json /tmp/precision_speed.json
    OMP_NUM_THREADS=1 python benchmarks/precision_speed.py --lm tiny-qwen3 --repeats 1   # a quick check

`precision: auto` (`ilcp.precision.resolve`) picks "bf16-mixed" on a CPU that reports AVX512-BF16
or AMX and "32-true" elsewhere; this measures whether that choice pays on the machine it runs on.
Each row runs once untimed in each precision, then `--repeats` times in each, the precisions
taking turns so that a change in machine load hits both alike; the median is printed. bf16 is
`ilcp.precision.autocast("bf16-mixed", "cpu")`, torch's bfloat16 autocast as Lightning's
"bf16-mixed" enters it: the weights stay float32 and are cast at every forward. The rows:

- train step: one step of the answer stage (`ilcp.training.handoff_stage`,
  `HandoffModule._loss_on_tail`) without the optimizer: 8 soft-prompt vectors (8, H) with
  requires_grad before the question prompts and answers of 8 bAbI task 1 rows, left padded,
  the logits of the last positions only, cross-entropy on the answer tokens, backward (outside
  autocast, as Lightning runs it) to the soft prompt;
- prefill 512 / 2048: the receiver's prefill (`ilcp.receiver.decoding.decode_one`, one new token) of one
  context of that many tokens of BABILong text (babilong:1:2k, repeated where it is shorter);
- decode: `ilcp.receiver.decoding.greedy_decode` of the same 8 prefixes (soft prompt + question prompt),
  at most 8 new tokens, one batch. Rows stop at the end token, so the decode steps each
  precision ran are printed beside it.

ratio = float32 seconds / bf16 seconds: above 1, bf16-mixed is faster.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

TIMED = {"float32": "32-true", "bf16": "bf16-mixed"}  # column -> ilcp precision
SOFT_PROMPT_VECTORS = 8  # K of configs/default.yaml
BATCH_ROWS = 8  # handoff.batch_size of configs/default.yaml
PREFILL_TOKENS = (512, 2048)
DECODE_NEW_TOKENS = 8


def cpu_model(cpuinfo: str | None = None) -> str:
    """The "model name" /proc/cpuinfo reports (platform's guess elsewhere)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name") and ":" in line:
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def time_both(run: Callable[[str], object], repeats: int) -> tuple[dict[str, float], dict[str, object]]:
    """(median seconds, what the warm-up run returned) per column of `TIMED`; ``run(precision)``
    enters the precision itself."""
    warm = {column: run(precision) for column, precision in TIMED.items()}
    seconds: dict[str, list[float]] = {column: [] for column in TIMED}
    for _ in range(repeats):
        for column, precision in TIMED.items():
            start = time.perf_counter()
            run(precision)
            seconds[column].append(time.perf_counter() - start)
    return {column: statistics.median(s) for column, s in seconds.items()}, warm


def answer_batch(lm, rows: list[dict], soft_prompt):
    """The answer stage's inputs for ``rows``: per row the receiver prefix (soft prompt + question
    prompt, tokenized once here) and the answer token ids (answer + end token)."""
    from ilcp.receiver import prompts
    from ilcp.receiver.prefix import MemoryLayout, receiver_prefix

    prefixes = [receiver_prefix(lm.tokenizer, r["question"], source=MemoryLayout(), memory=soft_prompt) for r in rows]
    answers = [lm.tokenizer(prompts.answer_text(r["answer"], lm.tokenizer), add_special_tokens=False)["input_ids"]
               for r in rows]
    return prefixes, answers


def train_step(model, prefixes, answers, precision: str) -> float:
    """Forward (under ``precision``) and backward of the answer-stage loss; returns the loss."""
    import torch
    import torch.nn.functional as F

    from ilcp.compat import logits_to_keep_kwargs
    from ilcp.receiver.decoding import left_pad
    from ilcp.precision import autocast

    with autocast(precision, "cpu"):
        sequences = [p.embeds(model, a) for p, a in zip(prefixes, answers)]
        inputs_embeds, attention_mask, position_ids = left_pad(sequences)
        n_keep = max(len(a) for a in answers) + 1  # position t predicts token t + 1
        targets = torch.full((len(answers), n_keep - 1), -100, dtype=torch.long)
        for i, a in enumerate(answers):
            targets[i, n_keep - 1 - len(a):] = torch.tensor(a)
        out = model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False, **logits_to_keep_kwargs(model, n_keep))
        logits = out.logits[:, -n_keep:-1].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    return float(loss.detach())


def context_embeddings(lm, tokens: int, text: str):
    """Embeddings (tokens, H) of the first ``tokens`` tokens of ``text``, repeated as needed."""
    import torch

    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = (ids * (tokens // len(ids) + 1))[:tokens]
    with torch.no_grad():
        return lm.model.get_input_embeddings()(torch.tensor(ids))


def prefill(model, tokenizer, embeds, precision: str):
    """The receiver's prefill of ``embeds`` (L, H) under ``precision`` (one new token)."""
    from ilcp.receiver.decoding import decode_one
    from ilcp.precision import autocast

    with autocast(precision, "cpu"):
        return decode_one(model, tokenizer, embeds, max_new_tokens=1)


def decode(model, tokenizer, prefixes, precision: str, ids: bool = False):
    """`greedy_decode` of ``prefixes`` in one batch under ``precision``; with ``ids`` the token ids
    (`greedy_decode_ids`, the same decoder without the detokenization)."""
    from ilcp.receiver.decoding import greedy_decode, greedy_decode_ids
    from ilcp.precision import autocast

    with autocast(precision, "cpu"):
        return (greedy_decode_ids if ids else greedy_decode)(model, tokenizer, prefixes, batch_size=len(prefixes),
                                                             max_new_tokens=DECODE_NEW_TOKENS)


def decode_steps(answer_ids: list[list[int]]) -> int:
    """Forwards one greedy batch ran: a row shorter than the budget also produced its end token."""
    return max(min(len(ids) + 1, DECODE_NEW_TOKENS) for ids in answer_ids)


def measure(lm, repeats: int, progress: Callable[[dict], None] = lambda result: None) -> list[dict]:
    """One dict per row: name, what it ran, float32_s, bf16_s, ratio (float32 / bf16) and notes."""
    import torch

    from ilcp.tasks import load_babi, load_task

    model, tok = lm.model, lm.tokenizer
    rows = load_babi(1, "test", limit=BATCH_ROWS).to_list()
    # ConstantMemory's start: rows of the LM's own embedding table, trained from there
    soft_prompt = model.get_input_embeddings().weight[:SOFT_PROMPT_VECTORS].detach().clone().requires_grad_(True)
    prefixes, answers = answer_batch(lm, rows, soft_prompt)
    context = load_task("babilong:1:2k", "test", tokenizer=tok, limit=1)[0]["context"]
    results = []

    def row(name: str, what: str, run: Callable[[str], object], note: Callable[[dict], dict] = lambda warm: {}):
        seconds, warm = time_both(run, repeats)
        results.append({"name": name, "what": what, "float32_s": seconds["float32"], "bf16_s": seconds["bf16"],
                        "ratio": seconds["float32"] / seconds["bf16"], **note(warm)})
        progress(results[-1])

    positions = [len(p) + len(a) for p, a in zip(prefixes, answers)]
    row("train_step", f"forward + backward, {len(rows)} x {max(positions)} positions",
        lambda precision: train_step(model, prefixes, answers, precision),
        lambda warm: {"loss_float32": warm["float32"], "loss_bf16": warm["bf16"]})
    for tokens in PREFILL_TOKENS:
        embeds = context_embeddings(lm, tokens, context)
        row(f"prefill_{tokens}", f"1 x {tokens} tokens, no grad",
            lambda precision, embeds=embeds: prefill(model, tok, embeds, precision))
    with torch.no_grad():
        question_prefixes = [p.embeds(model) for p in prefixes]  # the soft prompt, detached
    row("decode", f"{len(rows)} x {max(len(p) for p in prefixes)} positions, <= {DECODE_NEW_TOKENS} new tokens",
        lambda precision: decode(model, tok, question_prefixes, precision),
        lambda warm: {f"steps_{column}": decode_steps(decode(model, tok, question_prefixes, precision, ids=True))
                      for column, precision in TIMED.items()})
    return results


def table(results: list[dict]) -> str:
    """The results as a Markdown table."""
    lines = ["| row | what runs | float32 s | bf16 s | ratio | notes |", "|---|---|---:|---:|---:|---|"]
    for r in results:
        notes = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in r.items() if k not in ("name", "what", "float32_s", "bf16_s", "ratio"))
        lines.append(f"| {r['name']} | {r['what']} | {r['float32_s']:.4f} | {r['bf16_s']:.4f} | "
                     f"{r['ratio']:.2f}x | {notes} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm", default="smollm2-135m-instruct", help="LM spec (tiny-qwen3 for a quick check)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row and precision (median; default 3)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")

    import torch

    from ilcp.lm import LMLoadError, load_lm
    from ilcp.precision import cpu_flags, resolve

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        lm = load_lm(args.lm)
    except LMLoadError as e:
        p.error(str(e))
    flags = cpu_flags()
    machine = {"cpu": cpu_model(), "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
               "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
               "auto_precision": resolve("auto", "cpu")}
    print(f"{machine['cpu']}: avx512_bf16 {'yes' if machine['avx512_bf16'] else 'no'}, "
          f"amx_bf16 {'yes' if machine['amx_bf16'] else 'no'}; torch {machine['torch']} with "
          f"{machine['torch_threads']} thread(s); precision auto on cpu -> {machine['auto_precision']}")
    print(f"LM {args.lm} (hidden {lm.hidden_size}); seconds are the median of {args.repeats} run(s) after one warm-up; "
          "ratio = float32 / bf16 (above 1: bf16-mixed is faster)", flush=True)
    done = 0

    def progress(result):
        nonlocal done
        done += 1
        print(f"  [{done}/{2 + len(PREFILL_TOKENS)}] {result['name']}: {result['ratio']:.2f}x", file=sys.stderr,
              flush=True)

    results = measure(lm, args.repeats, progress)
    print()
    print(table(results))
    if args.json:
        from ilcp.io import atomic_write_json

        atomic_write_json(Path(args.json), {"lm": args.lm, "repeats": args.repeats, **machine, "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
