"""What stage 1 learns on a BABILong task, per lever, on the validation split (no LM forward).

    python benchmarks/stage1_levers.py --config configs/babilong-1k.yaml
    python benchmarks/stage1_levers.py --config configs/babilong-1k.yaml --story-weight 0.1 --pooler-lr 1e-2
    python benchmarks/stage1_levers.py --config configs/babilong-1k.yaml --oracle --epochs 30
    python benchmarks/stage1_levers.py --config configs/tiny.yaml data.task=babilong:1:0.5k \
        data.babi_variant=en --story-weight 0.1 --epochs 2             # a quick check

Stage 1 (`ilcp.training.compressor_stage`) trains the attention pooler and the VAE through a
small answer head that reads [mu ; question features]; its validation accuracy is a cheap
forecast of what the latent carries (on bAbI task 1 the default run's head reaches 36% and its
ilcp row 41%). This script runs the same losses on the run's cached sender states (built once by
`train.py` with the same config and cache) with one lever changed at a time, and prints the
head's validation accuracy every few epochs:

- ``--pooler-lr``: the pooler's own learning rate (`compressor.pooler_lr`);
- ``--story-weight W``: story attention (`compressor.story_attention_weight`): W x the
  cross-entropy of each query's attention against the uniform distribution over the story's
  tokens (`ilcp.training.compressor_stage.story_attention_loss`);
- ``--story-mass``: the same weight on -log(attention mass on the story) instead (any story
  token will do: the queries settle on a few tokens of every fact);
- ``--oracle``: the pooler reads the story's tokens only (an upper bound for finding them);
- ``--recency``: each query adds a learned slope times the distance from the end of the
  context (per 128 tokens) to its scores, so it can prefer the latest mention.

Validation rows only: the test split is never read.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Pooler(nn.Module):
    """`ilcp.encoder.pooling.AttentionPooler` with the optional recency slope and story-only reading."""

    def __init__(self, dim: int, queries: int, recency: bool):
        super().__init__()
        self.dim, self.recency = dim, recency
        self.score = nn.Linear(dim, queries, bias=False)
        nn.init.zeros_(self.score.weight)
        self.slope = nn.Parameter(torch.zeros(queries))

    def weights(self, states: Tensor, mask: Tensor, only: Tensor | None = None) -> Tensor:
        real = mask.bool() if only is None else mask.bool() & only
        logits = F.linear(F.layer_norm(states.float(), (self.dim,)), self.score.weight)
        if self.recency:
            end = mask.long().sum(1, keepdim=True)
            distance = (torch.arange(states.shape[1]).unsqueeze(0) - end).float() / 128.0
            logits = logits + distance.unsqueeze(-1) * self.slope
        return torch.nan_to_num(logits.masked_fill(~real.unsqueeze(-1), float("-inf")).softmax(1))

    def forward(self, states: Tensor, weights: Tensor) -> Tensor:
        return torch.einsum("bsq,bsd->bqd", weights, states.float()).reshape(states.shape[0], -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/babilong-1k.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value, as train.py takes them")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--pooler-lr", type=float, default=1e-3)
    p.add_argument("--story-weight", type=float, default=0.0)
    p.add_argument("--story-mass", action="store_true")
    p.add_argument("--oracle", action="store_true")
    p.add_argument("--recency", action="store_true")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args()

    from ilcp.encoder.compressor import BetaVAE
    from ilcp.config import load_config
    from ilcp.lm import load_lm
    from ilcp.encoder.pooling import pad_token_states
    from ilcp.training.compressor_stage import stage_one_rows
    from ilcp.training.data import prepare_data, sender_max_length

    needs_story = args.oracle or args.story_weight > 0
    overrides = ["compressor.story_attention_weight=1"] if needs_story else []
    cfg = load_config(args.config, [*args.overrides, *overrides])
    lm = load_lm(cfg.lm.spec, dtype=cfg.lm.dtype, cache_dir=cfg.lm.cache_dir)
    cfg.data.max_length = sender_max_length(cfg, lm)
    train, val = prepare_data(cfg, lm)  # cached sender states (and story masks when asked)
    train_1, val_1, n_answers = stage_one_rows(lm, train, val)
    torch.manual_seed(args.seed)
    c = cfg.compressor
    pooler = Pooler(train.state_dim, c.memory.pool_queries, args.recency)
    vae = BetaVAE(c.memory.pool_queries * train.state_dim, c.latent_dim, c.hidden_dim, c.beta)
    head = nn.Sequential(nn.Linear(c.latent_dim + train_1.features.shape[1], c.hidden_dim), nn.SiLU(),
                         nn.Linear(c.hidden_dim, n_answers))

    def batch(rows, index: Tensor):
        states, mask = pad_token_states([rows.rows.states[i] for i in index.tolist()])
        story = None
        if needs_story:
            story = torch.zeros(mask.shape, dtype=torch.bool)
            for k, i in enumerate(index.tolist()):
                m = rows.rows.story_masks[i]
                story[k, : len(m)] = m
        return states, mask, story, rows.features[index], rows.labels[index]

    with torch.no_grad():  # the VAE's standardisation from the untrained pooler, as stage 1 does
        first = []
        for start in range(0, len(train_1), 64):
            s, m, story, _, _ = batch(train_1, torch.arange(start, min(start + 64, len(train_1))))
            first.append(pooler(s, pooler.weights(s, m, story if args.oracle else None)))
        vae.set_standardisation(torch.cat(first))
    optimizer = torch.optim.AdamW([{"params": pooler.parameters(), "lr": args.pooler_lr},
                                   {"params": [*vae.parameters(), *head.parameters()], "lr": args.lr}])

    def losses(rows, index: Tensor) -> dict:
        s, m, story, features, labels = batch(rows, index)
        w = pooler.weights(s, m, story if args.oracle else None)
        out = vae(pooler(s, w))
        logits = head(torch.cat([out.mu, features], -1))
        known = labels != -100
        result = {"ce": F.cross_entropy(logits[known], labels[known]), "out": out,
                  "correct": int((logits.argmax(-1)[known] == labels[known]).sum()), "n": int(known.sum())}
        if args.story_weight > 0:
            on = (story & m.bool()).unsqueeze(-1).float()
            mass = (w * on).sum(1)
            result["story_mass"] = float(mass.detach().mean())
            if args.story_mass:
                result["story"] = -(mass + 1e-6).log().mean()
            else:
                result["story"] = (-(w.clamp_min(1e-12).log() * on).sum(1) / on.sum(1).clamp_min(1)).mean()
        return result

    step, history, t0 = 0, [], time.perf_counter()
    every = max(1, args.epochs // 6)
    for epoch in range(1, args.epochs + 1):
        for module in (pooler, vae, head):
            module.train()
        correct = seen = 0
        for index in torch.randperm(len(train_1)).split(args.batch_size):
            r = losses(train_1, index)
            recon = torch.mean((r["out"].reconstruction - r["out"].target.detach()) ** 2)
            kl_weight = c.beta * min(1.0, step / c.kl_warmup_steps) if c.kl_warmup_steps else c.beta
            loss = recon + kl_weight * r["out"].kl + r["ce"] + args.story_weight * r.get("story", 0.0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step, correct, seen = step + 1, correct + r["correct"], seen + r["n"]
        if epoch % every == 0 or epoch == args.epochs:
            for module in (pooler, vae, head):
                module.eval()
            with torch.no_grad():
                parts = [losses(val_1, index) for index in torch.arange(len(val_1)).split(128)]
            accuracy = sum(r["correct"] for r in parts) / max(1, sum(r["n"] for r in parts))
            mass = [r["story_mass"] for r in parts if "story_mass" in r]
            history.append({"epoch": epoch, "train_accuracy": round(correct / max(1, seen), 3),
                            "val_accuracy": round(accuracy, 3),
                            **({"val_story_mass": round(sum(mass) / len(mass), 3)} if mass else {})})
            print(json.dumps(history[-1]), f"{time.perf_counter() - t0:.0f}s", flush=True)
    result = {"config": args.config, "settings": vars(args), "val_rows": len(val_1), "history": history,
              "best_val_accuracy": max(h["val_accuracy"] for h in history)}
    print(json.dumps({"best_val_accuracy": result["best_val_accuracy"]}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
