"""How much of a token's identity a chunk codec keeps, for tokens it never saw in training.

The codec is the shape ILCP's concat-pooled chunks take (C token states side by side -> Z floats
-> C vectors), trained alone with the reconstruction stage's token loss (cross-entropy through
the LM's input-embedding rows by cosine similarity, against the batch's tokens and 4,096 sampled
rows, plus the cosine distance and a norm term towards the token's row). Training: one-fact facts contexts with training values
(`value_split="train"`) plus texts of random whole-word tokens that never spell a token of the
test contexts; test: one-fact contexts whose values are all held out. It prints the token
accuracy (argmax over the whole vocabulary) on the test chunks and on the test tokens that never
occur in the training facts (the held-out values' tokens, mostly).

    python benchmarks/codec_probe.py --layer -1 --random-texts 3000      # last layer, fixed texts
    python benchmarks/codec_probe.py --layer 0 --random-texts 3000       # input layer, fixed texts
    python benchmarks/codec_probe.py --layer 0 --fresh                   # input layer, new texts each step

``--fresh`` (layer 0 only: the states are the embedding rows) draws 96 new random chunks at every
step besides 32 facts chunks, as ``reconstruct.random_texts`` does in training.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from ilcp.lm import load_lm
from ilcp.encoder.pooling import pad_id_of, pad_right, sender_token_states
from ilcp.tasks import make_facts
from ilcp.training.data import word_tokens
from ilcp.training.reconstruction_stage import TOKEN_TEMPERATURE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--chunk", type=int, default=4, help="C, tokens per latent")
    p.add_argument("--latent", type=int, default=64, help="Z, floats per latent")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--random-texts", type=int, default=3000, help="fixed random texts (12 words each)")
    p.add_argument("--fresh", action="store_true", help="new random chunks every step (layer 0 only)")
    p.add_argument("--shape-weight", type=float, default=1.0,
                   help="weight of the cosine and norm terms beside the cross-entropy (reconstruct.token_shape_weight)")
    args = p.parse_args()
    if args.fresh and args.layer != 0:
        p.error("--fresh needs --layer 0 (other layers need an LM forward per text)")
    torch.manual_seed(0)
    lm = load_lm()
    tok, C, t0 = lm.tokenizer, args.chunk, time.time()
    table = lm.model.get_input_embeddings().weight.detach().float()
    test = list(make_facts(300, n_facts=1, split="test", value_split="heldout")["context"])
    train = list(make_facts(3000, n_facts=1, split="train", value_split="train")["context"])
    test_words = sorted({w.strip(".") for t in test for w in t.split()})
    pool = torch.tensor(word_tokens(tok, test_words))
    g = torch.Generator().manual_seed(1)
    random_ids = pool[torch.randint(0, len(pool), (args.random_texts, 12), generator=g)].tolist()

    def chunks(id_rows):
        """(states (U, C * D), ids (U, C) with -100 for padding) of every chunk of every row."""
        xs, ys = [], []
        for start in range(0, len(id_rows), 32):
            part = id_rows[start:start + 32]
            ids, mask = pad_right(part, pad_id_of(tok))
            with torch.no_grad():
                states = sender_token_states(lm.model, ids, mask, layers=(args.layer,)).float()
            for i, row in enumerate(part):
                n = -(-len(row) // C)
                s = torch.cat([states[i, : len(row)], states.new_zeros(n * C - len(row), states.shape[-1])])
                xs.append(s.reshape(n, -1))
                ys.append(torch.tensor(row + [-100] * (n * C - len(row))).view(n, C))
        return torch.cat(xs), torch.cat(ys)

    ids_of = [tok(t, add_special_tokens=False)["input_ids"] for t in train]
    x_facts, y_facts = chunks(ids_of)
    x_test, y_test = chunks([tok(t, add_special_tokens=False)["input_ids"] for t in test])
    x_rand, y_rand = chunks(random_ids) if random_ids and not args.fresh else (x_facts[:0], y_facts[:0])
    x_train, y_train = torch.cat([x_facts, x_rand]), torch.cat([y_facts, y_rand])
    seen = set(y_facts[y_facts >= 0].tolist())
    print(f"layer {args.layer}: {len(x_train)} training chunks ({'fresh random chunks' if args.fresh else f'{len(x_rand)} random'}), "
          f"{len(x_test)} test chunks; states in {time.time() - t0:.0f}s", flush=True)
    mean, std = x_train.mean(0), x_train.std(0).clamp(min=1e-4)
    d = table.shape[1]
    codec = nn.Sequential(nn.Linear(C * d, 1024), nn.SiLU(), nn.Linear(1024, args.latent),
                          nn.Linear(args.latent, 1024), nn.SiLU(), nn.Linear(1024, C * d))
    opt = torch.optim.AdamW(codec.parameters(), lr=1e-3, weight_decay=0.01)

    def token_loss(x, y, sampled: bool):
        m = codec((x - mean) / std).view(-1, d)
        y = y.reshape(-1)
        m, y = m[y >= 0], y[y >= 0]
        cosine = F.cosine_similarity(m, table[y]).mean()
        norm_ratio = m.norm(dim=-1) / table[y].norm(dim=-1)
        cand = (torch.unique(torch.cat([y, torch.randint(0, table.shape[0], (4096,))])) if sampled
                else torch.arange(table.shape[0]))
        logits = F.normalize(m, dim=-1) @ F.normalize(table[cand], dim=-1).T / TOKEN_TEMPERATURE
        index = torch.searchsorted(cand, y)
        shape = 1 - cosine + (norm_ratio - 1).pow(2).mean()
        loss = F.cross_entropy(logits, index) + args.shape_weight * shape
        return loss, logits.argmax(-1) == index, y

    for step in range(args.steps + 1):
        if args.fresh:
            y_r = pool[torch.randint(0, len(pool), (96, C))]
            pick = torch.randint(0, len(x_facts), (32,))
            x = torch.cat([table[y_r].reshape(96, -1), x_facts[pick]])
            y = torch.cat([y_r, y_facts[pick]])
        else:
            pick = torch.randint(0, len(x_train), (128,))
            x, y = x_train[pick], y_train[pick]
        loss = token_loss(x, y, sampled=True)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(1, args.steps // 4) == 0:
            with torch.no_grad():
                _, hit, y_all = token_loss(x_test, y_test, sampled=False)
            unseen = torch.tensor([int(t) not in seen for t in y_all.tolist()])
            print(f"step {step}: train loss {loss.item():.3f}; test token accuracy {hit.float().mean():.3f}, "
                  f"on tokens unseen in training {hit[unseen].float().mean():.3f} (n={int(unseen.sum())}); "
                  f"{time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
