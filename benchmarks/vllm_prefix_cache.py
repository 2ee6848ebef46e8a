"""A served receiver asked many questions on one memory: vLLM's prefix caching of the shared part.

    .venv-vllm/bin/python benchmarks/vllm_prefix_cache.py                      # the shipped SmolLM2 encoder
    .venv-vllm/bin/python benchmarks/vllm_prefix_cache.py --ckpt pretrained/smollm2-general-chunk8 --long
    .venv-vllm/bin/python benchmarks/vllm_prefix_cache.py --questions 10 --rounds 3 --json /tmp/cache.json

The Hugging Face receiver keeps the key/value cache of the prefix every question shares
(`benchmarks/ask_many.py`). A vLLM receiver gets prompt embeddings, not a cache object; with
``enable_prefix_caching`` vLLM hashes each full block of prompt embeddings and reuses the blocks a
later request starts with (prompt embeddings are cached since vLLM 0.11.1, vllm#27219). So the
question after the first on one opened memory prefills only from the first block that differs.

Each mode (caching off, on) runs in a process of its own: one in-process engine, eager, float32,
``block_size`` tokens a block. Per round a new context is sent and opened once (a sealed wire);
then each question's whole prefix (`ReceivedMemory.prefix`) is one ``generate`` call of one new
token (the time to first token, after one warm-up on another context). The median over rounds per
question is printed per mode, the mean of questions 2..N and the ratio off / on, and whether both
modes gave the same first token for every question.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from ask_many import CONTEXT, QUESTIONS  # noqa: E402  (the same context and questions as the HF benchmark)

DEFAULT_CKPT = REPO / "pretrained" / "smollm2-memory"
KEY = b"vllm-prefix-cache-benchmark-key-01"


def contexts(rounds: int, long: bool) -> list[str]:
    """A context per round (plus the warm-up's): the benchmark's story, told from another first sentence
    each round, so no round starts on blocks an earlier round left; --long: SQuAD paragraphs."""
    if long:
        from ilcp.tasks import load_task

        seen: list[str] = []
        for row in load_task("squad", "test", limit=400).to_list():
            if row["context"] not in seen:
                seen.append(row["context"])
            if len(seen) == rounds + 1:
                return seen
        raise SystemExit(f"vllm_prefix_cache.py: fewer than {rounds + 1} SQuAD contexts in the first 400 rows")
    names = ["Fred", "Bill", "Julie", "Emily", "Gertrude", "Lily", "Bernhard", "Greg", "Brian", "Jason", "Yann"]
    return [f"{names[i % len(names)]} went to the office {i + 1} times. {CONTEXT}" for i in range(rounds + 1)]


def child(ckpt: str, caching: bool, questions: int, rounds: int, block_size: int, long: bool,
          max_model_len: int = 4096) -> dict:
    """Times and first tokens of one mode's engine, in this process."""
    import torch

    from ilcp.engines.build import create_engine
    from ilcp.engines.vllm import VLLMDecoder, model_directory
    from ilcp.evaluation.decoders import vllm_environment
    from ilcp.handoff import ILCPHandoff

    handoff = ILCPHandoff.from_pretrained(ckpt, auth_key=KEY, precision="32-true")
    asked = QUESTIONS[:questions]
    texts = contexts(rounds, long)
    with tempfile.TemporaryDirectory(prefix="ilcp-vllm-cache-") as folder, vllm_environment(Path(folder)):
        llm = create_engine(model_directory(handoff.lm), max_model_len=max_model_len, enable_prefix_caching=caching,
                            block_size=block_size)
        decoder = VLLMDecoder(handoff.lm, llm)
        seconds, firsts, positions = [[] for _ in asked], [], []
        for r, text in enumerate(texts):
            memory = handoff.open(handoff.to_wire(handoff.send(text)))  # sealed, opened once
            with torch.no_grad():
                prefixes = [memory.prefix(q) for q in asked]
            for i, prefix in enumerate(prefixes):
                start = time.perf_counter()
                first = decoder.decode_ids([prefix], max_new_tokens=1)[0]
                if r:  # round 0 warms the engine up
                    seconds[i].append(time.perf_counter() - start)
                    firsts.append(first)
            if r:
                positions = [p.shape[0] for p in prefixes]
    return {"caching": caching, "ttft_s": [statistics.median(s) for s in seconds], "firsts": firsts,
            "positions": positions}


def shared_positions(ckpt: str, questions: int, long: bool) -> int:
    """The positions every question's prefix shares (the memory and the prompt before the question)."""
    from ilcp.handoff import ILCPHandoff
    from ilcp.receiver.prefix import question_stem

    handoff = ILCPHandoff.from_pretrained(ckpt)
    memory = handoff.open(handoff.to_wire(handoff.send(contexts(1, long)[1])))
    stem = question_stem(handoff.lm.tokenizer, source=handoff.encoder, memory=memory.vectors[0])
    return 0 if stem is None else len(stem)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT), help="an export (default: the shipped SmolLM2 encoder)")
    p.add_argument("--questions", type=int, default=10, help=f"questions per context, 2..{len(QUESTIONS)}")
    p.add_argument("--rounds", type=int, default=3, help="contexts; the median per question is printed")
    p.add_argument("--block-size", type=int, default=32,
                   help="tokens a KV-cache block (vLLM caches whole blocks; its CPU attention takes multiples of 32)")
    p.add_argument("--long", action="store_true", help="SQuAD paragraphs instead of the short story")
    p.add_argument("--max-model-len", type=int, default=4096, help="the engines' context length")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--child", choices=["off", "on"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 2 <= args.questions <= len(QUESTIONS):
        p.error(f"--questions must be 2..{len(QUESTIONS)}, got {args.questions}")
    if args.rounds < 1 or args.block_size < 1:
        p.error("--rounds and --block-size must be >= 1")
    if args.child:
        print(json.dumps(child(args.ckpt, args.child == "on", args.questions, args.rounds, args.block_size, args.long,
                               args.max_model_len)))
        return 0
    from ilcp.engines.build import require_vllm
    from ilcp.export import ExportError, read_export

    try:
        if read_export(args.ckpt).encoder is None:
            p.error(f"{args.ckpt} has no ilcp weights")
        require_vllm()
    except (ExportError, ImportError, ValueError) as e:
        p.error(str(e))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    found = {}
    for mode in ("off", "on"):
        print(f"prefix caching {mode}: starting an engine ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--ckpt", args.ckpt, "--child", mode, "--questions", str(args.questions),
               "--rounds", str(args.rounds), "--block-size", str(args.block_size), "--max-model-len",
               str(args.max_model_len)] + (["--long"] if args.long else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        found[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    off, on = found["off"], found["on"]
    stem = shared_positions(args.ckpt, args.questions, args.long)
    same = sum(a == b for a, b in zip(off["firsts"], on["firsts"]))
    print(f"{args.ckpt}: vLLM receiver, time to first token (ms, median of {args.rounds} context(s)); shared part "
          f"{stem} positions, blocks of {args.block_size}")
    print("| question | positions | caching off ms | caching on ms | off / on |")
    print("|---|---:|---:|---:|---:|")
    for i in range(args.questions):
        a, b = off["ttft_s"][i], on["ttft_s"][i]
        print(f"| {i + 1} | {off['positions'][i]} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f} |")
    later_off, later_on = statistics.mean(off["ttft_s"][1:]), statistics.mean(on["ttft_s"][1:])
    print(f"questions 2..{args.questions}: caching off {later_off * 1e3:.1f} ms, on {later_on * 1e3:.1f} ms, "
          f"off / on {later_off / later_on:.2f}; the same first token in {same} of {len(off['firsts'])} requests")
    if args.json:
        from ilcp.io import atomic_write_json
        from ilcp.provenance import provenance

        atomic_write_json(Path(args.json), {"provenance": provenance(), "ckpt": str(args.ckpt), "long": args.long,
                                            "block_size": args.block_size, "shared_positions": stem,
                                            "later_off_s": later_off, "later_on_s": later_on,
                                            "same_first_tokens": same, "modes": found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
