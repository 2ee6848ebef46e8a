"""Can the slot sender learn to write a readable memory at all? Train it on a few texts and read them back.

A pretraining run measures what an encoder learned from many texts in few steps; this measures
whether the recipe can carry a text to the frozen receiver when the texts are few and the steps
many: the training texts are the texts read back (an overfit test, by design). Three memories
are trained on the same held-out texts (`memory_capacity.held_out_texts`), in the layout the
reconstruction stage reads ([memory ; instruction ; text]), with the same K vectors a text:

- ``ceiling``: the K vectors themselves, optimized per text (`memory_capacity.optimized_memory`);
- ``latent``: a free latent per slot (Z floats, started at the sender's own) through the
  projector, both trained: the bottleneck and the projector without the sender;
- ``encoder``: the whole sender as the config builds it (slot tokens and adapters on the frozen
  LM, the VAE's mean, the projector), fresh or from ``compressor.init_from``.

If the latent memory learns what the ceiling does and the encoder does not, the sender is what
holds the memory back; if neither does, the bottleneck or the projector is. Everything runs in
float32, as `memory_capacity.py` does (the stage may compute in bfloat16).

    python benchmarks/memory_overfit.py --texts 3 --steps 300 --out /tmp/overfit
    python benchmarks/memory_overfit.py --texts 3 --steps 300 reconstruct.lr=1e-2 reconstruct.encoder_lr=1e-2
    python benchmarks/memory_overfit.py --lm tiny-qwen3 --config configs/tiny.yaml --length 8 --texts 1 --steps 5 \
        compressor.memory.kind=slots compressor.answer_head_weight=0 compressor.memory.tokens_per_slot=4

It writes memory_overfit.json (settings, each memory's loss curve and per-text figures),
memory_overfit.md (the summary table) and the folder's README.md (with the folder's notes.md).
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the capacity benchmark beside this one

import memory_capacity as mc  # noqa: E402

from ilcp.config import load_config  # noqa: E402
from ilcp.encoder.slots import SlotEncoder, slot_counts  # noqa: E402
from ilcp.io import atomic_write_json, atomic_write_text  # noqa: E402
from ilcp.lm import DEFAULT_LM, LM, LMLoadError, load_lm  # noqa: E402
from ilcp.provenance import command_line, provenance  # noqa: E402
from ilcp.training.data import HandoffRows, sender_max_length  # noqa: E402
from ilcp.training.handoff_stage import attach_projector, warmup_cosine  # noqa: E402
from ilcp.training.init_from import pretrained_encoder  # noqa: E402

MEMORIES = ("ceiling", "latent", "encoder")
JSON_NAME, TABLE_NAME = "memory_overfit.json", "memory_overfit.md"


def slot_encoder(cfg, lm: LM, contexts: list[str]) -> SlotEncoder:
    """The config's slot encoder with its projector, fresh (standardised on `contexts`) or from
    ``compressor.init_from``."""
    if cfg.compressor.init_from:
        return pretrained_encoder(cfg, lm, sender_max_length(cfg, lm))
    rows = HandoffRows([{"context": c, "question": "", "answer": ""} for c in contexts], None)
    return attach_projector(cfg.compressor.memory.start(cfg, lm, rows), cfg.handoff, lm)


def vector_norm(memories) -> float:
    return float(torch.cat([m.detach().float().reshape(-1, m.shape[-1]) for m in memories]).norm(dim=-1).mean())


def train_memory(kind: str, encoder: SlotEncoder, lm: LM, contexts, ids, instruction, cfg, steps: int,
                 log_every: int, constant_lr: bool = False) -> tuple[list[torch.Tensor], list[dict]]:
    """Train memory `kind` ('latent' or 'encoder') on the texts for `steps` AdamW steps as the
    reconstruction stage trains (projector at ``reconstruct.lr``, latents or sender at
    ``reconstruct.encoder_lr``, its warm-up and cosine decay); (each text's memory after
    training, the loss curve). With `constant_lr` the rates stay as they are set."""
    dtype = lm.model.get_input_embeddings().weight.dtype
    projector = list(encoder.projector.parameters())
    if kind == "latent":
        with torch.no_grad():
            states, mask = encoder.sender_states(contexts)
            start = encoder.encode(states, mask)[0]
        latent = start.clone().requires_grad_(True)
        counts = mask.sum(1).tolist()
        k = encoder.num_memory_tokens

        def memories():
            out = encoder.memory(latent, dtype)
            return [out[i, : counts[i] * k] for i in range(len(contexts))]
        sender = [latent]
    else:
        def memories():
            return encoder.memory_for_batch({"context": contexts}, dtype)[0]
        sender = list(encoder.vae.parameters()) + list(encoder.slots.parameters())
    opt = torch.optim.AdamW([{"params": projector, "lr": cfg.reconstruct.lr},
                             {"params": sender, "lr": cfg.reconstruct.encoder_lr}], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, (lambda step: 1.0) if constant_lr else functools.partial(warmup_cosine, total=steps,
                                                                     warmup=cfg.reconstruct.warmup_steps))
    encoder.train()
    curve, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        loss, accuracy = mc.text_losses(lm, memories(), ids, instruction)
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
        schedule.step()
        if step % log_every == 0 or step == steps:
            curve.append({"step": step, "loss": round(float(loss.detach().mean()), 4),
                          "token_accuracy": round(float(accuracy.detach().mean()), 4)})
            print(f"{kind}: step {step}/{steps}, loss {curve[-1]['loss']:.3f}, token accuracy "
                  f"{curve[-1]['token_accuracy']:.3f}, {time.perf_counter() - start:.0f}s", flush=True)
    encoder.eval()
    with torch.no_grad():
        return [m.detach() for m in memories()], curve


def progress_lines(name: str, args):
    """A ``progress(step, loss)`` that prints a line every ``--log-every`` steps and at the last."""
    began = time.perf_counter()

    def say(step: int, loss: float) -> None:
        if step % args.log_every == 0 or step == args.steps:
            print(f"{name}: step {step}/{args.steps}, loss {loss:.3f}, {time.perf_counter() - began:.0f}s", flush=True)
    return say


def summary_rows(results: dict) -> list[dict]:
    """A row per memory: its steps, the means over its texts (`memory_capacity.text_means`), the
    vectors' mean norm and its seconds."""
    return [{"memory": kind, "steps": r["steps"], **mc.text_means(r["texts"]), "vector_norm": r["vector_norm"],
             "seconds": r["seconds"]} for kind, r in results.items()]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| memory | steps | texts | token accuracy | exact % | prefix | loss | CE without memory | vector norm "
             "| seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['memory']} | {r['steps']} | {r['texts']} | {r['token_accuracy']:.3f} | {r['exact_pct']:.0f} "
              f"| {r['prefix']:.1f} | {r['loss']:.3f} | {r['ce_without_memory']:.3f} | {r['vector_norm']:.2f} "
              f"| {r['seconds']:.0f} |" for r in rows]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", metavar="key=value", help="settings over the config's")
    p.add_argument("--config", default="configs/pretrain.yaml", help="the run config whose encoder is trained")
    p.add_argument("--lm", default=DEFAULT_LM, help="the LM spec (tiny-qwen3 to try)")
    p.add_argument("--length", type=mc.positive(int), default=32, help="L, tokens of each text")
    p.add_argument("--texts", type=mc.positive(int), default=3, help="texts per source")
    p.add_argument("--sources", nargs="+", choices=mc.SOURCES, default=list(mc.SOURCES))
    p.add_argument("--steps", type=mc.positive(int), default=300, help="training steps of each memory")
    p.add_argument("--ceiling-lr", type=mc.positive(float), default=3e-2, help="Adam's learning rate for the ceiling")
    p.add_argument("--memories", nargs="+", choices=MEMORIES, default=list(MEMORIES))
    p.add_argument("--constant-lr", action="store_true", help="no warm-up or decay of the learning rates")
    p.add_argument("--log-every", type=mc.positive(int), default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/results/memory-overfit", help="the folder written")
    return p


def main(argv: list[str] | None = None, *, lm: LM | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.compressor.memory.kind != "slots":
            raise ValueError(f"compressor.memory.kind is {cfg.compressor.memory.kind!r}: this benchmark trains memory "
                             "slots")
        lm = load_lm(args.lm) if lm is None else lm
    except (OSError, ValueError, LMLoadError) as e:
        print(f"memory_overfit: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    instruction = mc.instruction_ids(lm.tokenizer)
    texts = mc.held_out_texts(lm.tokenizer, [args.length], args.texts, args.seed, args.sources)[args.length]
    if not texts:
        print(f"memory_overfit: no held-out text has {args.length} tokens", file=sys.stderr)
        return 2
    ids = [t["ids"] for t in texts]
    contexts = [lm.tokenizer.decode(i) for i in ids]
    ce = mc.memory_without_text(lm, ids, instruction)
    results, start = {}, time.perf_counter()
    print(f"memory overfit: {lm.spec}, {len(ids)} texts of {args.length} tokens, {args.steps} steps, "
          f"{torch.get_num_threads()} threads", flush=True)
    c = cfg.compressor
    k = int(slot_counts(torch.tensor([args.length]), c.memory.tokens_per_slot, c.memory.min_slots, c.memory.max_slots)) \
        * cfg.handoff.num_memory_tokens  # the encoder's vectors for a text of L tokens
    for kind in args.memories:
        began = time.perf_counter()
        if kind == "ceiling":
            memory = list(mc.optimized_memory(lm, ids, k, instruction, steps=args.steps, lr=args.ceiling_lr,
                                              seed=args.seed, progress=progress_lines("ceiling", args)))
            curve = []
        else:
            torch.manual_seed(args.seed)
            try:
                encoder = slot_encoder(cfg, lm, contexts)
            except ValueError as e:
                print(f"memory_overfit: {e}", file=sys.stderr)
                return 2
            memory, curve = train_memory(kind, encoder, lm, contexts, ids, instruction, cfg, args.steps,
                                         args.log_every, args.constant_lr)
        figures = mc.read_back(lm, memory, ids, instruction)
        results[kind] = {"steps": args.steps, "seconds": round(time.perf_counter() - began, 1),
                         "vector_norm": round(vector_norm(memory), 3), "curve": curve,
                         "vectors": [int(m.shape[0]) for m in memory],
                         "texts": mc.text_records(texts, figures, ce, lm.tokenizer)}
        row = summary_rows({kind: results[kind]})[0]
        print(f"{kind}: token accuracy {row['token_accuracy']:.3f}, exact {row['exact_pct']:.0f}%, "
              f"{results[kind]['seconds']:.0f}s", flush=True)
    rows = summary_rows(results)
    command = command_line([__file__, *(sys.argv[1:] if argv is None else argv)])
    report = {"provenance": provenance(command), "lm": lm.spec, "platform": platform.platform(),
              "seconds": round(time.perf_counter() - start, 1),
              "settings": {"config": args.config, "overrides": args.overrides, "length": args.length,
                           "texts_per_source": args.texts, "sources": args.sources, "steps": args.steps,
                           "ceiling_lr": args.ceiling_lr, "lr": cfg.reconstruct.lr,
                           "encoder_lr": cfg.reconstruct.encoder_lr, "constant_lr": args.constant_lr,
                           "init_from": cfg.compressor.init_from,
                           "seed": args.seed, "threads": torch.get_num_threads()},
              "summary": rows, "memories": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / JSON_NAME, report)
    atomic_write_text(out / TABLE_NAME, f"# Memory overfit: {lm.spec}\n\n```bash\n{command}\n```\n\n"
                      f"{markdown_table(rows)}\n")
    readme = mc.write_readme(out)
    print(markdown_table(rows), flush=True)
    print(f"wrote {out / JSON_NAME}, {out / TABLE_NAME} and {readme}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
