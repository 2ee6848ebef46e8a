"""Masked mean pooling, batched extraction and the pooled-state cache."""

from pathlib import Path

import pytest
import torch

from ilcp.encoder import pooling
from ilcp.encoder.pooling import layer_states, masked_mean_pool
from ilcp.training import extraction
from ilcp.training.extraction import cached_pooled_states, pooled_states

TEXTS = ["John travelled to the hallway.",
         "Mary journeyed to the bathroom. Daniel went back to the bathroom. John moved to the bedroom.",
         "Sandra is in the kitchen."]


def test_masked_mean_by_hand():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(masked_mean_pool(hidden, mask), torch.tensor([[2.0, 3.0]]))


def test_masked_mean_of_an_empty_row_is_zero_not_nan():
    out = masked_mean_pool(torch.ones(1, 3, 4), torch.zeros(1, 3, dtype=torch.long))
    assert torch.equal(out, torch.zeros(1, 4))


@pytest.mark.parametrize("hidden, mask", [
    (torch.zeros(2, 3), torch.ones(2, 3)),            # hidden not rank 3
    (torch.zeros(2, 3, 4), torch.ones(2, 3, 1)),      # mask not rank 2
    (torch.zeros(2, 3, 4), torch.ones(2, 4)),         # seq mismatch
    (torch.zeros(2, 3, 4), torch.ones(3, 3)),         # batch mismatch
])
def test_masked_mean_shape_errors(hidden, mask):
    with pytest.raises(ValueError):
        masked_mean_pool(hidden, mask)


def test_padding_does_not_change_a_texts_pooled_vector(tiny_lm):
    alone = [pooled_states(tiny_lm, [t], batch_size=1, progress=False)[0] for t in TEXTS]
    batched = pooled_states(tiny_lm, TEXTS, batch_size=3, progress=False)
    for i in range(len(TEXTS)):
        torch.testing.assert_close(batched[i], alone[i], rtol=1e-5, atol=1e-5)


def test_pooled_equals_a_direct_forward_mean(tiny_lm):
    ids = tiny_lm.tokenizer(TEXTS[1], add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = tiny_lm.model(ids, output_hidden_states=True)
    expected = out.hidden_states[-1].mean(dim=1)[0]
    torch.testing.assert_close(pooled_states(tiny_lm, [TEXTS[1]], progress=False)[0], expected, rtol=1e-5, atol=1e-5)
    from_outputs = masked_mean_pool(layer_states(out, (-1, 0)), torch.ones_like(ids))
    assert from_outputs.shape == (1, 2 * tiny_lm.hidden_size)
    torch.testing.assert_close(from_outputs[0, : tiny_lm.hidden_size], expected)


def test_several_layers_are_concatenated_in_order(tiny_lm):
    both = pooled_states(tiny_lm, TEXTS, layers=(-1, 1), progress=False)
    last = pooled_states(tiny_lm, TEXTS, layers=(-1,), progress=False)
    assert both.shape == (3, 2 * tiny_lm.hidden_size)
    torch.testing.assert_close(both[:, : tiny_lm.hidden_size], last)


def test_long_contexts_keep_their_last_tokens(tiny_lm):
    long_text = " ".join(TEXTS * 5)
    ids = tiny_lm.tokenizer(long_text, add_special_tokens=False).input_ids
    kept = tiny_lm.tokenizer.decode(ids[-8:])
    torch.testing.assert_close(pooled_states(tiny_lm, [long_text], max_length=8, progress=False),
                               pooled_states(tiny_lm, [kept], max_length=8, progress=False), rtol=1e-5, atol=1e-5)


def test_empty_context_is_a_clear_error(tiny_lm):
    with pytest.raises(ValueError, match="empty"):
        pooled_states(tiny_lm, ["John went home.", ""], progress=False)


def test_cache_is_reused_without_any_forward(tiny_lm, tmp_path):
    key = {"task": "unit", "n": 3}
    ids = ["a", "b", "c"]
    first, path, hit = cached_pooled_states(tiny_lm, TEXTS, ids, key, cache_dir=tmp_path, progress=False)
    assert not hit and path.is_file() and path.parent == tmp_path / "pooled"
    calls = []
    handle = tiny_lm.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        second, path2, hit2 = cached_pooled_states(tiny_lm, TEXTS, ids, key, cache_dir=tmp_path, progress=False)
    finally:
        handle.remove()
    assert hit2 and path2 == path and calls == []
    assert torch.equal(first, second)


def test_cache_key_covers_task_length_layers_and_rows(tiny_lm, tmp_path):
    ids = ["a", "b", "c"]
    _, base, _ = cached_pooled_states(tiny_lm, TEXTS, ids, {"task": "x"}, cache_dir=tmp_path, progress=False)
    _, other_task, _ = cached_pooled_states(tiny_lm, TEXTS, ids, {"task": "y"}, cache_dir=tmp_path, progress=False)
    _, other_len, _ = cached_pooled_states(tiny_lm, TEXTS, ids, {"task": "x"}, cache_dir=tmp_path, max_length=4, progress=False)
    _, other_layers, _ = cached_pooled_states(tiny_lm, TEXTS, ids, {"task": "x"}, cache_dir=tmp_path, layers=(0,), progress=False)
    assert len({base, other_task, other_len, other_layers}) == 4
    _, same, hit = cached_pooled_states(tiny_lm, TEXTS, ["a", "b", "z"], {"task": "x"}, cache_dir=tmp_path, progress=False)
    assert same == base and not hit, "different rows under the same key are recomputed, never served stale"


def test_a_failed_write_leaves_nothing_behind(tiny_lm, tmp_path, monkeypatch):
    def failing_save(path, *a, **k):
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(extraction, "write_safetensors", failing_save)
    with pytest.raises(OSError, match="disk full"):
        cached_pooled_states(tiny_lm, TEXTS, ["a", "b", "c"], {"task": "x"}, cache_dir=tmp_path, progress=False)
    assert list((tmp_path / "pooled").iterdir()) == []


@pytest.mark.slow
def test_embedded_smollm2_pools_a_text(smollm2):
    assert smollm2.hidden_size == 576
    assert smollm2.model.config.num_hidden_layers == 30
    pooled = pooled_states(smollm2, ["John travelled to the hallway. Mary went to the garden."], progress=False)
    assert pooled.shape == (1, 576)
    assert torch.isfinite(pooled).all() and pooled.abs().sum() > 0
    assert pooling.masked_mean_pool is masked_mean_pool


# --------------------------------------------------------------------------------------------
# attention pooling and token states


def test_untrained_attention_pooler_returns_copies_of_the_masked_mean():
    torch.manual_seed(0)
    states = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    pooler = pooling.AttentionPooler(8, num_queries=3)
    out = pooler(states, mask)
    assert out.shape == (2, 3 * 8) and pooler.output_dim == 24
    mean = masked_mean_pool(states, mask)
    torch.testing.assert_close(out, mean.repeat(1, 3))


def test_attention_pooler_ignores_padding_and_learns_where_to_look():
    torch.manual_seed(0)
    states = torch.randn(2, 4, 8)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    pooler = pooling.AttentionPooler(8, num_queries=2)
    with torch.no_grad():
        pooler.score.weight.normal_()
    w = pooler.weights(states, mask)
    assert torch.equal(w[0, 2:], torch.zeros(2, 2))
    torch.testing.assert_close(w.sum(dim=1), torch.ones(2, 2))
    # what sits under the padding does not matter
    changed = states.clone()
    changed[0, 2:] = 1e4
    torch.testing.assert_close(pooler(changed, mask), pooler(states, mask))
    # the zero-initialised scores receive a gradient from a loss on the output
    fresh = pooling.AttentionPooler(8, num_queries=2)
    (fresh(states, mask) * torch.randn(2, 16)).sum().backward()
    assert fresh.score.weight.grad is not None and fresh.score.weight.grad.abs().sum() > 0


def test_attention_pooler_row_without_tokens_is_zero_not_nan():
    out = pooling.AttentionPooler(4, 2)(torch.ones(1, 3, 4), torch.zeros(1, 3, dtype=torch.long))
    assert torch.equal(out, torch.zeros(1, 8))


@pytest.mark.parametrize("states, mask", [
    (torch.zeros(2, 3, 5), torch.ones(2, 3)),   # wrong width
    (torch.zeros(2, 4), torch.ones(2, 4)),      # not rank 3
    (torch.zeros(2, 3, 4), torch.ones(2, 4)),   # mask mismatch
])
def test_attention_pooler_shape_errors(states, mask):
    with pytest.raises(ValueError):
        pooling.AttentionPooler(4, 2)(states, mask)


def test_token_states_match_a_direct_forward_and_the_mean_pool(tiny_lm):
    rows = extraction.token_states(tiny_lm, TEXTS, batch_size=2, layers=(-1, 1), progress=False)
    assert len(rows) == len(TEXTS) and rows.dim == 2 * tiny_lm.hidden_size
    for i, text in enumerate(TEXTS):
        ids = tiny_lm.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = tiny_lm.model(ids, output_hidden_states=True)
        expected = torch.cat([out.hidden_states[-1][0], out.hidden_states[1][0]], dim=-1)
        assert rows[i].shape == expected.shape
        torch.testing.assert_close(rows[i], expected, rtol=1e-5, atol=1e-5)
    pooled = pooled_states(tiny_lm, TEXTS, layers=(-1, 1), progress=False)
    torch.testing.assert_close(rows.mean(), pooled, rtol=1e-5, atol=1e-5)


def test_token_states_padded_batch_and_mean_agree():
    flat = torch.arange(12.0).reshape(6, 2)
    rows = pooling.TokenStates(flat, torch.tensor([0, 2, 6]))
    states, mask = pooling.pad_token_states([rows[0], rows[1]])
    assert states.shape == (2, 4, 2) and mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    torch.testing.assert_close(rows.mean(), masked_mean_pool(states, mask))
    with pytest.raises(ValueError):
        pooling.TokenStates(flat, torch.tensor([0, 7]))


def test_token_state_cache_round_trip(tiny_lm, tmp_path):
    ids = [f"r{i}" for i in range(len(TEXTS))]
    first, path, hit = extraction.cached_token_states(tiny_lm, TEXTS, ids, {"task": "t"}, cache_dir=tmp_path, progress=False)
    assert not hit and path.is_file()
    second, path2, hit2 = extraction.cached_token_states(tiny_lm, TEXTS, ids, {"task": "t"}, cache_dir=tmp_path, progress=False)
    assert hit2 and path2 == path
    assert torch.equal(first.flat, second.flat) and torch.equal(first.offsets, second.offsets)
    # the pooled cache of the same rows is a different file
    _, pooled_path, pooled_hit = cached_pooled_states(tiny_lm, TEXTS, ids, {"task": "t"}, cache_dir=tmp_path, progress=False)
    assert not pooled_hit and pooled_path != path


def test_attention_pooler_computes_in_float32_under_bf16_weights_and_autocast():
    torch.manual_seed(0)
    states = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    pooler = pooling.AttentionPooler(8, 2)
    with torch.no_grad():
        pooler.score.weight.normal_()
    expected = pooler(states, mask)
    half = pooling.AttentionPooler(8, 2)
    half.load_state_dict(pooler.state_dict())
    half = half.to(torch.bfloat16)
    got = half(states.to(torch.bfloat16), mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = pooler(states, mask)
    assert under.dtype == torch.float32
    torch.testing.assert_close(under, expected)


def test_length_groups_split_a_mixed_batch_at_the_least_padded_cost():
    """Every row in exactly one group, shortest first; rows of one length share one forward; a
    row far longer than the rest goes alone; a huge per-forward cost keeps the batch whole."""
    lengths = [41, 60, 200, 1400, 90, 95, 210, 70]
    groups = pooling.length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [3] in groups and all(lengths[g[0]] <= lengths[g[-1]] for g in groups)
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat)

    def cost(gs, overhead=pooling.FORWARD_OVERHEAD_POSITIONS):
        return sum(len(g) * max(lengths[i] for i in g) + overhead for g in gs)

    assert cost(groups) < cost([list(range(len(lengths)))])
    # brute force over every split of the sorted rows into consecutive runs: none is cheaper
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for cuts in range(1 << (len(order) - 1)):
        runs, run = [], [order[0]]
        for k, i in enumerate(order[1:]):
            if cuts >> k & 1:
                runs.append(run)
                run = []
            run.append(i)
        assert cost(groups) <= cost(runs + [run])
    assert pooling.length_groups([100] * 8) == [list(range(8))]
    assert pooling.length_groups(lengths, overhead=10**6) == [sorted(range(8), key=lambda i: lengths[i])]
    assert pooling.length_groups([]) == []


def test_forward_groups_keep_a_batch_whole_when_length_groups_are_off():
    lengths = [40, 900, 45, 880]
    assert pooling.forward_groups(lengths) == pooling.length_groups(lengths)
    assert len(pooling.forward_groups(lengths)) > 1
    assert pooling.forward_groups(lengths, grouped=False) == [[0, 1, 2, 3]]
    assert pooling.forward_groups([], grouped=False) == [] and pooling.forward_groups([]) == []
