"""Blocked causal attention (`ilcp.attention`): the same attention as SDPA, taken only for long
causal prefills without gradients in bfloat16 on CPU, and used by an LM held in bfloat16; masked
calls over grouped key/value heads go to SDPA without repeating the heads."""

import copy

import pytest
import torch
import torch.nn.functional as F

from ilcp import attention
from ilcp.attention import (ATTENTION_NAME, MIN_QUERIES, attention_forward, blocked_causal_attention,
                            takes_blocked_path, takes_grouped_path)
from ilcp.lm import LM, TINY_LM, load_lm
from ilcp.precision import hold


def sdpa(q, k, v, scale):
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("batch,heads,kv_heads,n,block", [(1, 9, 3, 130, 64), (2, 4, 2, 64, 64),
                                                          (1, 4, 4, 1, 64), (2, 6, 2, 200, 17)])
def test_blocked_attention_equals_sdpa_in_float32(batch, heads, kv_heads, n, block):
    torch.manual_seed(0)
    q = torch.randn(batch, heads, n, 16)
    k, v = torch.randn(batch, kv_heads, n, 16), torch.randn(batch, kv_heads, n, 16)
    out = blocked_causal_attention(q, k, v, 0.25, block=block)
    assert out.shape == (batch, n, heads, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out, sdpa(q, k, v, 0.25), rtol=1e-5, atol=1e-5)


def test_blocked_attention_in_bfloat16_stays_near_float32():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 9, 300, 64), torch.randn(1, 3, 300, 64), torch.randn(1, 3, 300, 64)
    expected = sdpa(q, k, v, 0.125)
    out = blocked_causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125)
    assert out.dtype == torch.bfloat16
    reference_error = (sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125) - expected).abs().mean()
    assert (out.float() - expected).abs().mean() < 4 * reference_error


def test_queries_never_see_later_keys():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 150, 8), torch.randn(1, 2, 150, 8), torch.randn(1, 2, 150, 8)
    before = blocked_causal_attention(q, k, v, 0.3, block=32)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 100:] += 5.0
    v2[:, :, 100:] -= 3.0
    after = blocked_causal_attention(q, k2, v2, 0.3, block=32)
    torch.testing.assert_close(after[:, :100], before[:, :100])
    assert not torch.allclose(after[:, 100:], before[:, 100:])


def test_a_bad_head_layout_is_a_clear_error():
    with pytest.raises(ValueError, match="divisible"):
        blocked_causal_attention(torch.randn(1, 4, 8, 8), torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8), 1.0)


class Module(torch.nn.Module):
    is_causal = True


def test_only_long_causal_bfloat16_prefills_without_gradients_take_the_blocked_path():
    n = MIN_QUERIES
    q, k = torch.randn(1, 4, n, 8, dtype=torch.bfloat16), torch.randn(1, 2, n, 8, dtype=torch.bfloat16)
    m = Module()
    with torch.no_grad():
        assert takes_blocked_path(m, q, k, None)
        assert not takes_blocked_path(m, q[:, :, : n - 1], k[:, :, : n - 1], None)  # short
        assert not takes_blocked_path(m, q, k, torch.ones(1, 1, n, n, dtype=torch.bool))  # padding
        assert not takes_blocked_path(m, q[:, :, -1:], k, None)  # a decoding step over a cache
        assert not takes_blocked_path(m, q, k, None, dropout=0.1)
        assert not takes_blocked_path(m, q, k, None, is_causal=False)
        assert not takes_blocked_path(m, q, k, None, sliding_window=128)
        assert not takes_blocked_path(m, q.float(), k.float(), None)  # float32 compute
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert takes_blocked_path(m, q.float(), k.float(), None)  # float32 inputs under bf16 autocast
    assert not takes_blocked_path(m, q, k, None)  # gradients on: training forwards keep SDPA


@pytest.fixture
def held_and_plain():
    lm = load_lm(TINY_LM)
    plain = LM(model=copy.deepcopy(lm.model), tokenizer=lm.tokenizer, spec=TINY_LM)
    hold(lm, "bf16-mixed")
    return lm, plain


def count_blocked(monkeypatch) -> list:
    calls = []
    real = attention.blocked_causal_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "blocked_causal_attention", counted)
    return calls


def test_a_held_lm_uses_blocked_attention_for_long_prefills(held_and_plain, monkeypatch):
    lm, plain = held_and_plain
    assert lm.model.config._attn_implementation == ATTENTION_NAME
    assert plain.model.config._attn_implementation == "sdpa"
    calls = count_blocked(monkeypatch)
    ids = torch.randint(10, 500, (1, MIN_QUERIES + 40))
    with torch.no_grad():
        held = lm.model(ids).logits.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            reference = plain.model(ids).logits.float()
    assert len(calls) == lm.model.config.num_hidden_layers  # one per layer
    # The two bfloat16 paths agree as closely as bfloat16 allows, and on the next token.
    assert (held - reference).abs().mean() < 0.02
    assert (held.argmax(-1) == reference.argmax(-1)).float().mean() > 0.95


def test_short_padded_cached_and_training_forwards_of_a_held_lm_stay_on_sdpa(held_and_plain, monkeypatch):
    lm, plain = held_and_plain
    calls = count_blocked(monkeypatch)
    ids = torch.randint(10, 500, (2, MIN_QUERIES + 8))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    with torch.no_grad():
        short = lm.model(ids[:, :40]).logits
        padded = lm.model(ids, attention_mask=mask).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(short, plain.model(ids[:, :40]).logits)
            assert torch.equal(padded, plain.model(ids, attention_mask=mask).logits)
    embeds = lm.model.get_input_embeddings()(ids[:1]).detach().requires_grad_(True)
    lm.model(inputs_embeds=embeds).logits.sum().backward()  # a training forward: gradients reach the prefix
    assert embeds.grad is not None and calls == []


def test_generation_over_a_blocked_prefill_matches_sdpa(held_and_plain, monkeypatch):
    lm, _ = held_and_plain
    calls = count_blocked(monkeypatch)
    ids = torch.randint(10, 500, (1, MIN_QUERIES + 3))
    with torch.no_grad():
        blocked = lm.model.generate(ids, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids))
        lm.model.config._attn_implementation = "sdpa"
        plain = lm.model.generate(ids, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids))
    assert len(calls) == lm.model.config.num_hidden_layers  # the prefill only; each new token is a cached step
    assert blocked.shape == plain.shape == (1, MIN_QUERIES + 7)
    assert (blocked == plain).float().mean() > 0.99


def test_attention_forward_hands_other_calls_to_sdpa():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    module = Module()
    module.num_key_value_groups = 2
    out, weights = attention_forward(module, q, k, v, None, scaling=0.5)
    assert weights is None
    torch.testing.assert_close(out, sdpa(q, k, v, 0.5), rtol=1e-5, atol=1e-5)


def test_only_masked_cpu_calls_of_several_queries_over_grouped_heads_take_the_grouped_path():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 9, 8)
    mask = torch.ones(2, 1, 5, 9, dtype=torch.bool)
    m = Module()
    assert takes_grouped_path(m, q, k, mask)
    assert not takes_grouped_path(m, q, k, None)  # unmasked: transformers' SDPA keeps the heads as they are
    assert not takes_grouped_path(m, q[:, :, -1:], k, mask[:, :, -1:])  # one query: transformers packs it
    assert not takes_grouped_path(m, q, torch.randn(2, 4, 9, 8), mask)  # as many key/value heads as query heads
    assert not takes_grouped_path(m, q, k, mask, position_bias=torch.zeros(1))
    assert not takes_grouped_path(m, q, k, mask, output_attentions=True)


def saved_bytes(run) -> int:
    """The bytes of the distinct storages autograd keeps for the backward pass of ``run()``."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def test_a_masked_training_forward_keeps_no_repeated_keys_and_values(held_and_plain):
    # Slots reading a cached context (memory slots' sender) and left-padded rows both carry a mask.
    lm, plain = held_and_plain
    torch.manual_seed(0)
    ids = torch.randint(10, 500, (4, 200))
    mask = torch.ones_like(ids)
    mask[0, :50] = 0  # left padding
    embeds = lm.model.get_input_embeddings()(ids).detach()

    def forward(model):
        x = embeds.clone().requires_grad_(True)
        return x, model(inputs_embeds=x, attention_mask=mask).logits.float()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        (x_held, held), held_saved = saved_bytes(lambda: forward(lm.model))
        (x_plain, reference), plain_saved = saved_bytes(lambda: forward(plain.model))
    assert torch.equal(held, reference)  # the same kernel: equal outputs
    config = lm.model.config
    repeated = (config.num_attention_heads - config.num_key_value_heads) * config.head_dim * ids.numel() * 2 * 2
    assert plain_saved - held_saved >= config.num_hidden_layers * repeated * 0.9  # bf16 keys and values, per layer
    held.pow(2).mean().backward()
    reference.pow(2).mean().backward()
    torch.testing.assert_close(x_held.grad, x_plain.grad, rtol=0.05, atol=1e-4)  # summed in another order
