"""What memory slots cost the sender: its forward over the context, then the slot part alone.

A slot encoder (`ilcp.encoder.slots`) reads N = ceil(L / tokens_per_slot) learned tokens after a
context of L tokens. A sender that has not read the context pays the context forward and the slot
part; one that just read it (an agent that prefilled its own context) hands over the forward's
cache and pays the slot part alone (`ILCPHandoff.send_from_hidden_states` with ``use_cache=True``).
This prints both, per context length, with untrained slots (the cost does not depend on training),
and the largest difference between the slot states so computed and those of one forward over
[context ; slots] (what the two parts stand for).

    python benchmarks/slot_sender.py                            # SmolLM2, 128 to 2,048 tokens
    python benchmarks/slot_sender.py --lengths 256,1024 --tokens-per-slot 32 --json /tmp/slots.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from ilcp.tasks.background import background_sentences
from ilcp.compat import output_cache
from ilcp.io import atomic_write_json
from ilcp.lm import DEFAULT_LM, load_lm
from ilcp.encoder.slots import SlotTokens, slot_states
from ilcp.provenance import provenance


def context_ids(tokenizer, length: int) -> torch.Tensor:
    """The first `length` tokens of the background prose (validation split): (1, length)."""
    text = " ".join(s.text for s in background_sentences("validation")[: 4 * length])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:length]
    if len(ids) < length:
        raise ValueError(f"the background prose holds {len(ids)} tokens, fewer than {length}")
    return torch.tensor([ids])


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls (after one untimed call) and the last result."""
    fn()
    seconds, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="128,512,2048", help="context tokens, comma-separated")
    parser.add_argument("--tokens-per-slot", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--lm", default=DEFAULT_LM, help="the LM spec (default: the embedded SmolLM2)")
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--lengths must be integers separated by commas, got {args.lengths!r}")
    if not lengths or min(lengths) < 1 or args.tokens_per_slot < 1 or args.repeats < 1:
        parser.error("--lengths, --tokens-per-slot and --repeats must be at least 1")

    lm = load_lm(args.lm)
    model = lm.model
    slots = SlotTokens(lm.hidden_size, lm.hidden_size, args.tokens_per_slot, 1, max(lengths))
    slots.init_from_embeddings(model.get_input_embeddings().weight)
    rows = []
    print(f"memory-slot sender, {lm.spec}, {torch.get_num_threads()} threads, a slot per {args.tokens_per_slot} "
          f"tokens (median of {args.repeats} runs)")
    print("| context tokens | slots | context forward ms | slot part ms | slot part / context "
          "| max difference from one forward |")
    print("|---|---|---|---|---|---|")
    for length in lengths:
        ids = context_ids(lm.tokenizer, length)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            forward_s, out = timed(lambda: model(input_ids=ids, attention_mask=mask, use_cache=True), args.repeats)
            cache = output_cache(out)
            slot_s, (reused, slot_mask) = timed(lambda: slot_states(model, slots, mask, cache=cache), args.repeats)
            n = int(slot_mask.sum())
            joined = torch.cat([model.get_input_embeddings()(ids), slots.embeddings[:n].unsqueeze(0)], dim=1)
            whole = model(inputs_embeds=joined, output_hidden_states=True).hidden_states[-1][:, length:]
        diff = float((reused - whole).abs().max())
        rows.append({"context_tokens": length, "slots": n, "context_forward_s": forward_s, "slot_part_s": slot_s,
                     "max_state_difference": diff})
        print(f"| {length:,} | {n} | {1000 * forward_s:,.0f} | {1000 * slot_s:,.0f} | {slot_s / forward_s:.2f} "
              f"| {diff:.1e} |")
    if args.json:
        atomic_write_json(Path(args.json), {"provenance": provenance(), "threads": torch.get_num_threads(),
                                            "tokens_per_slot": args.tokens_per_slot, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
