"""Selector validity, protection of position 0 and the latent tail, the sink correction, and
that scoring leaves the sender and the model as they were."""

import pytest
import torch

from ilcp import compat, rclc
from ilcp.rclc import hf, selectors

BUILTINS = [selectors.cacheback, selectors.qsnap, selectors.chunkkv]


@pytest.fixture
def request_ids(tokenizer):
    return tokenizer("Who owns Cedar?", add_special_tokens=False, return_tensors="pt").input_ids


@pytest.fixture
def latent_sender(model, sender):
    """The story sender with three continuous rows appended (a latent tail)."""
    torch.manual_seed(1)
    extra = torch.randn(3, sender.hidden_size) * 0.05
    cache = hf.prefill(model, extra, compat.clone_cache(sender.past_key_values))
    return rclc.SenderState(
        model=model, past_key_values=cache, input_embeds=torch.cat([sender.input_embeds, extra]),
        tokenizer=sender.tokenizer, latent_steps=3,
        token_ids=torch.cat([sender.token_ids, torch.full((3,), -1)]),
    )


@pytest.mark.parametrize("selector", BUILTINS, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("budget", [4, 9, 17])
def test_builtin_selection_is_valid_and_protects(selector, budget, latent_sender, request_ids):
    positions = selector(latent_sender, request_ids, budget)
    total = latent_sender.positions
    checked = selectors.validate_positions(positions, total, budget)
    assert checked.numel() == budget
    kept = set(checked.tolist())
    assert 0 in kept
    assert {total - 3, total - 2, total - 1} <= kept


@pytest.mark.parametrize("selector", BUILTINS, ids=lambda s: type(s).__name__)
def test_everything_fits_and_too_small(selector, latent_sender, request_ids):
    total = latent_sender.positions
    assert selector(latent_sender, request_ids, total + 5).tolist() == list(range(total))
    assert selector(latent_sender, request_ids, 4).tolist() == [0, total - 3, total - 2, total - 1]
    with pytest.raises(ValueError, match="latent tail"):
        selector(latent_sender, request_ids, 3)


def test_sink_window_ranks_last(sender, request_ids):
    profile = selectors.attention_profile(sender, request_ids, tail_queries=16, sink_size=4)
    assert profile.request.shape == (sender.positions,)
    assert torch.all(profile.request[:4] == 0) and torch.all(profile.tail[:4] == 0)
    assert float(profile.request.sum()) == pytest.approx(1.0, abs=1e-4)
    kept = selectors.qsnap(sender, request_ids, 10).tolist()
    assert kept[0] == 0 and not {1, 2, 3} & set(kept)


def test_cacheback_keeps_spans(sender, request_ids):
    kept = selectors.cacheback(sender, request_ids, 13).tolist()
    spans = {p // 4 for p in kept if p != 0}
    # 12 free positions fill exactly three aligned spans of 4.
    assert len(spans) == 3 and len(kept) == 13


def test_scoring_leaves_sender_and_model_unchanged(model, sender, request_ids):
    rows = sender.input_embeds.clone()
    keys = [layer.keys.clone() for layer in sender.past_key_values.layers]
    implementation = model.config._attn_implementation
    for selector in BUILTINS:
        selector(sender, request_ids, 8)
    assert torch.equal(rows, sender.input_embeds)
    assert compat.cache_length(sender.past_key_values) == sender.positions
    assert all(torch.equal(a, layer.keys) for a, layer in zip(keys, sender.past_key_values.layers))
    assert model.config._attn_implementation == implementation


def test_attention_implementation_restored_on_failure(model, sender, monkeypatch):
    implementation = model.config._attn_implementation

    def boom(*args, **kwargs):
        raise RuntimeError("forward failed")

    monkeypatch.setattr(hf, "forward_rows", boom)
    with pytest.raises(RuntimeError, match="forward failed"):
        selectors.attention_profile(sender, None)
    assert model.config._attn_implementation == implementation


def test_validate_positions():
    assert selectors.validate_positions([0, 2, 5], 6, 3).tolist() == [0, 2, 5]
    assert selectors.validate_positions(torch.tensor([1, 3]), 6, 3).dtype == torch.long
    for bad, error in [([2, 1], ValueError), ([1, 1], ValueError), ([0, 6], ValueError), ([-1], ValueError),
                       ([0, 1, 2, 3], ValueError), ([0.5], TypeError), (torch.tensor([[0, 1]]), ValueError),
                       (3, TypeError)]:
        with pytest.raises(error):
            selectors.validate_positions(bad, 6, 3)


def test_select_groups_trims_last_group():
    scores = torch.tensor([0.0, 0.1, 0.1, 0.1, 0.9, 0.8, 0.7, 0.6, 0.5, 0.2, 0.2, 0.95])
    kept = selectors.select_groups(scores, 7, torch.tensor([0]), group_size=4, reduce="max")
    # Groups [8, 12) (max 0.95) and [4, 8) (0.9) fit in 6 free positions? 4 + 2: [8, 12) whole,
    # then the two best of [4, 8).
    assert kept.tolist() == [0, 4, 5, 8, 9, 10, 11]
    kept = selectors.select_groups(scores, 5, torch.tensor([0]), group_size=1)
    assert kept.tolist() == [0, 4, 5, 6, 11]


def test_selector_settings_are_checked():
    for make in (lambda: selectors.CacheBack(window=0), lambda: selectors.ChunkKV(chunk_size=0),
                 lambda: selectors.QSnap(kernel_size=0), lambda: selectors.CacheBack(window=2.0)):
        with pytest.raises(ValueError, match="must be a positive int"):
            make()
    with pytest.raises(ValueError, match="odd"):
        selectors.QSnap(kernel_size=4)
    with pytest.raises(ValueError, match="tail_queries"):
        selectors.CacheBack(tail_queries=-1)
