"""Prefix assembly and the batched greedy decoder (ilcp.receiver.decoding), plus ilcp.compat."""

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ilcp import compat
from ilcp.receiver.decoding import (
    DecodeResult,
    answer_loss_and_greedy,
    assemble_prefix,
    decode_one,
    embed_text,
    greedy_decode,
    greedy_decode_ids,
    left_pad,
    stop_token_ids,
)
from ilcp.lm import build_tiny_qwen3, freeze
from ilcp.receiver.prompts import question_prompt

H = 64


@pytest.fixture(scope="module")
def sharp():
    """The tiny Qwen3 with larger random weights: its greedy outputs vary from token to token
    (the shared tiny model's near-uniform logits repeat one token), so equality tests bite."""
    model, tok = build_tiny_qwen3()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                scale = 3.0 if "embed" in name else 1.5
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)
    return freeze(model.eval()), tok


def make_prefixes(model, tok):
    g = torch.Generator().manual_seed(1)
    story = "Cedar is owned by Alice. Birch was launched in 1994. " * 6
    return [
        assemble_prefix(model, tok, [torch.randn(4, H, generator=g), question_prompt(tok, "Where is John?")]),
        assemble_prefix(model, tok, [question_prompt(tok, story + "Who owns Cedar?")]),
        assemble_prefix(model, tok, ["a"]),
        assemble_prefix(model, tok, [torch.randn(2, H, generator=g), "Mary", torch.randn(1, H, generator=g)]),
        assemble_prefix(model, tok, [torch.randn(7, H, generator=g)]),
    ]


def naive_greedy(model, tok, prefix, max_new_tokens):
    """Reference: the full forward recomputed over the growing sequence at every step, no cache."""
    stops = stop_token_ids(model, tok)
    x, ids = prefix[None], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            t = int(model(inputs_embeds=x, use_cache=False).logits[0, -1].argmax())
            if t in stops:
                break
            ids.append(t)
            x = torch.cat([x, model.get_input_embeddings()(torch.tensor([[t]]))], dim=1)
    return ids


# ---------------------------------------------------------------------------- the decoder


def test_batched_equals_unbatched(sharp):
    model, tok = sharp
    prefixes = make_prefixes(model, tok)
    lengths = [p.shape[0] for p in prefixes]
    assert max(lengths) > 20 * min(lengths)
    single = [greedy_decode_ids(model, tok, [p], max_new_tokens=10)[0] for p in prefixes]
    assert len({tuple(s) for s in single}) == len(single)  # distinct answers: a real comparison
    assert all(len(s) >= 3 for s in single)
    for bs in (1, 2, 3, 8):
        assert greedy_decode_ids(model, tok, prefixes, max_new_tokens=10, batch_size=bs) == single
    texts = [tok.decode(s, skip_special_tokens=True).strip() for s in single]
    for bs in (1, 2, 3):
        assert greedy_decode(model, tok, prefixes, max_new_tokens=10, batch_size=bs) == texts


def test_cache_decode_equals_naive_loop(sharp):
    model, tok = sharp
    prefixes = make_prefixes(model, tok)
    for p in (prefixes[0], prefixes[1], prefixes[3]):
        assert greedy_decode_ids(model, tok, [p], max_new_tokens=10)[0] == naive_greedy(model, tok, p, 10)
    assert greedy_decode_ids(model, tok, prefixes[:2], max_new_tokens=10, batch_size=2) == [
        naive_greedy(model, tok, p, 10) for p in prefixes[:2]
    ]


def test_one_prefill_gives_the_teacher_forced_loss_and_the_greedy_answers(sharp):
    model, tok = sharp
    prefixes = make_prefixes(model, tok)
    targets = [[5, 6, 7], [9], [11, 12], [3, 4, 5, 6], [8]]
    loss, answers = answer_loss_and_greedy(model, tok, prefixes, targets, max_new_tokens=6)
    assert answers == greedy_decode(model, tok, prefixes, max_new_tokens=6, batch_size=5)
    # the reference loss: each row alone, its whole sequence, no padding, no cache
    table = model.get_input_embeddings()
    rows, n = [], 0
    with torch.no_grad():
        for prefix, target in zip(prefixes, targets):
            x = torch.cat([prefix, table(torch.tensor(target))])[None]
            logits = model(inputs_embeds=x, use_cache=False).logits[0, prefix.shape[0] - 1:-1]
            rows.append(float(torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="sum")))
            n += len(target)
    assert float(loss) == pytest.approx(sum(rows) / n, rel=1e-4)
    per_row, same = answer_loss_and_greedy(model, tok, prefixes, targets, max_new_tokens=6, per_row=True)
    assert same == answers and per_row.tolist() == pytest.approx(rows, rel=1e-4)  # each row's summed loss
    with pytest.raises(ValueError, match="one non-empty list of target ids per prefix"):
        answer_loss_and_greedy(model, tok, prefixes, targets[:2])


def test_max_new_tokens(sharp):
    model, tok = sharp
    prefixes = make_prefixes(model, tok)
    full = greedy_decode_ids(model, tok, prefixes, max_new_tokens=10)
    for n in (1, 3):
        ids = greedy_decode_ids(model, tok, prefixes, max_new_tokens=n)
        assert ids == [row[:n] for row in full]
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="max_new_tokens"):
            greedy_decode(model, tok, prefixes, max_new_tokens=bad)
    with pytest.raises(ValueError, match="batch_size"):
        greedy_decode(model, tok, prefixes, batch_size=0)


class Scripted(nn.Module):
    """A stand-in causal LM that emits a fixed token script after any prefix, whatever the
    prefix: the k-th generated token is ``script[k]``. Row i of a batch follows ``scripts[i]``."""

    def __init__(self, scripts, vocab_size, eos):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, H)
        self.scripts, self.vocab_size = scripts, vocab_size
        self.config = SimpleNamespace(eos_token_id=eos)
        self.calls = 0

    def get_input_embeddings(self):
        return self.embed

    def forward(self, inputs_embeds=None, attention_mask=None, position_ids=None, cache=None, use_cache=None, **kw):
        k = self.calls
        self.calls += 1
        logits = torch.zeros(inputs_embeds.shape[0], inputs_embeds.shape[1], self.vocab_size)
        for i, script in enumerate(self.scripts):
            logits[i, -1, script[min(k, len(script) - 1)]] = 1.0
        return ScriptedOutput(logits=logits, cache=cache)


@dataclass
class ScriptedOutput:
    logits: torch.Tensor
    cache: object


def scripted(tok, *texts):
    eos = tok.eos_token_id
    scripts = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    return Scripted(scripts, len(tok), eos), [len(s) for s in scripts]


def test_stops_at_eos_per_row(tiny_lm):
    tok = tiny_lm.tokenizer
    model, lengths = scripted(tok, "hallway", "Alice owns Cedar", "no")
    prefixes = [torch.randn(n, H) for n in (3, 9, 1)]
    assert greedy_decode(model, tok, prefixes, max_new_tokens=20, batch_size=3) == ["hallway", "Alice owns Cedar", "no"]
    assert model.calls == max(lengths)  # stops once every row is done, not at max_new_tokens
    model.calls = 0
    assert greedy_decode(model, tok, prefixes, max_new_tokens=2, batch_size=3)[1] == tok.decode(
        tok("Alice owns Cedar", add_special_tokens=False)["input_ids"][:2]
    ).strip()
    one, _ = scripted(tok, "hallway")
    r = decode_one(one, tok, torch.randn(4, H), max_new_tokens=20)
    assert r.text == "hallway" and r.new_tokens == lengths[0] and r.prefill_positions == 4


def test_stop_at_newline(tiny_lm):
    tok = tiny_lm.tokenizer
    texts = ["hallway\nnorth south", "\n\nkitchen\nmilk", "Alice"]
    model, _ = scripted(tok, *texts)
    prefixes = [torch.randn(2, H) for _ in texts]
    assert greedy_decode(model, tok, prefixes, max_new_tokens=20, batch_size=3, stop_at_newline=True) == [
        "hallway", "kitchen", "Alice"
    ]
    model.calls = 0
    assert greedy_decode(model, tok, prefixes, max_new_tokens=20, batch_size=3) == [t.strip() for t in texts]
    one, _ = scripted(tok, texts[0])
    r = decode_one(one, tok, prefixes[0], max_new_tokens=20, stop_at_newline=True)
    assert r.text == "hallway"
    assert r.new_tokens == len(tok("hallway\n", add_special_tokens=False)["input_ids"])


def test_decode_one(sharp):
    model, tok = sharp
    p = make_prefixes(model, tok)[1]
    r = decode_one(model, tok, p, max_new_tokens=6)
    assert isinstance(r, DecodeResult)
    assert r.text == greedy_decode(model, tok, [p], max_new_tokens=6)[0]
    assert r.prefill_positions == p.shape[0]
    assert 1 <= r.new_tokens <= 6
    assert 0 < r.prefill_s <= r.total_s


def test_weights_unchanged_after_decoding(tiny_lm):
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fingerprint = tiny_lm.fingerprint
    training = model.training
    out = greedy_decode(model, tok, make_prefixes(model, tok), max_new_tokens=4, batch_size=2)
    assert len(out) == 5 and all(isinstance(s, str) for s in out)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.training == training and tiny_lm.fingerprint == fingerprint
    assert not any(p.requires_grad for p in model.parameters())


def test_bf16_model(sharp):
    model32, tok = sharp
    model = copy.deepcopy(model32).to(torch.bfloat16)
    prefixes = make_prefixes(model, tok)
    assert all(p.dtype == torch.bfloat16 for p in prefixes)
    ids = greedy_decode_ids(model, tok, prefixes, max_new_tokens=6, batch_size=1)
    assert all(1 <= len(r) <= 6 for r in ids)
    assert greedy_decode_ids(model, tok, prefixes, max_new_tokens=6, batch_size=5) == ids
    # bf16 follows the float32 model's first greedy token on these prefixes
    ids32 = greedy_decode_ids(model32, tok, [p.float() for p in prefixes], max_new_tokens=1)
    assert sum(a[:1] == b for a, b in zip(ids, ids32)) >= 4
    assert next(model32.parameters()).dtype == torch.float32
    # float32 parts are cast by assemble_prefix, so mixed inputs work in bf16 too.
    p = assemble_prefix(model, tok, [torch.randn(3, H), "Where is John?"])
    assert p.dtype == torch.bfloat16
    r = decode_one(model, tok, p, max_new_tokens=3)
    assert r.text == greedy_decode(model, tok, [p], max_new_tokens=3)[0]
    assert greedy_decode_ids(model, tok, [q.float() for q in prefixes], max_new_tokens=6) == ids


# ---------------------------------------------------------------------------- prefixes


def test_embed_text(tiny_lm):
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    text = question_prompt(tok, "Where is John?")
    e = embed_text(model, tok, text)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert e.shape == (len(ids), H)
    assert torch.equal(e, model.get_input_embeddings().weight[ids])
    assert embed_text(model, tok, "").shape == (0, H)


def test_assemble_prefix_order_and_grad(tiny_lm):
    model, tok = tiny_lm.model, tiny_lm.tokenizer
    soft = torch.randn(3, H, dtype=torch.float64, requires_grad=True)
    p = assemble_prefix(model, tok, [soft, "Where is John?", torch.ones(2, H)])
    q = embed_text(model, tok, "Where is John?")
    assert p.shape == (3 + q.shape[0] + 2, H) and p.dtype == torch.float32
    assert torch.allclose(p[:3], soft.float()) and torch.equal(p[3:-2], q) and torch.equal(p[-2:], torch.ones(2, H))
    p.sum().backward()  # soft prompts train through the prefix
    assert torch.equal(soft.grad, torch.ones(3, H, dtype=torch.float64))


@pytest.mark.parametrize(
    "parts, match",
    [
        ([torch.zeros(3, H + 1)], "shape"),
        ([torch.zeros(H)], "shape"),
        ([torch.zeros(1, 3, H)], "shape"),
        ([torch.zeros(2, H, dtype=torch.long)], "dtype"),
        ([3], "int"),
        ([], "no prefix parts"),
        ("text", "sequence"),
    ],
)
def test_assemble_prefix_errors(tiny_lm, parts, match):
    with pytest.raises(ValueError, match=match):
        assemble_prefix(tiny_lm.model, tiny_lm.tokenizer, parts)


def test_left_pad():
    a, b, c = torch.randn(2, H), torch.randn(5, H), torch.randn(1, H)
    x, mask, pos = left_pad([a, b, c])
    assert x.shape == (3, 5, H) and mask.shape == pos.shape == (3, 5)
    assert mask.dtype == pos.dtype == torch.long
    assert mask.tolist() == [[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]
    assert pos[0, 3:].tolist() == [0, 1] and pos[1].tolist() == [0, 1, 2, 3, 4] and pos[2, 4] == 0
    assert torch.equal(x[0, 3:], a) and torch.equal(x[1], b) and torch.equal(x[2, 4], c[0])
    assert torch.equal(x[0, :3], torch.zeros(3, H))
    soft = torch.randn(2, H, requires_grad=True)
    left_pad([soft, b])[0].sum().backward()  # teacher-forced batches keep gradients
    assert torch.equal(soft.grad, torch.ones(2, H))
    for bad in ([], [torch.zeros(0, H)], [torch.zeros(H)], [a, torch.zeros(2, H + 1)]):
        with pytest.raises(ValueError):
            left_pad(bad)


def test_stop_token_ids(tiny_lm):
    tok = tiny_lm.tokenizer
    stops = stop_token_ids(tiny_lm.model, tok)
    assert tok.eos_token_id in stops and tok.convert_tokens_to_ids("<|im_end|>") in stops


# ---------------------------------------------------------------------------- compat


def test_compat_cache_helpers(tiny_lm):
    model = tiny_lm.model
    name = compat.cache_argument_name(type(model))
    assert name in ("cache", "past_key_values")
    cache = compat.new_dynamic_cache(model)
    assert compat.cache_kwargs(model, cache) == {name: cache}
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, **compat.cache_kwargs(model, cache))
        returned = compat.output_cache(out)
        assert returned.get_seq_length() == 3
        out2 = model(input_ids=torch.tensor([[8]]), use_cache=True, **compat.cache_kwargs(model, returned))
        full = model(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=False)
    assert compat.output_cache(out2).get_seq_length() == 4
    assert torch.allclose(out2.logits[0, -1], full.logits[0, -1], atol=1e-5)
    assert compat.logits_to_keep_kwargs(model, 1) in ({"logits_to_keep": 1}, {"num_logits_to_keep": 1})
