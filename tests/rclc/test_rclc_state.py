"""SenderState validation and sender_from_hf's sources, caches and generations."""

import pytest
import torch

from ilcp import compat, rclc
from ilcp.rclc import hf


def _keys(cache):
    return [layer.keys.clone() for layer in cache.layers]


def test_messages_are_templated_without_assistant_prefix(model, tokenizer, story_messages):
    sender = rclc.sender_from_hf(model, tokenizer, story_messages)
    text = tokenizer.decode(sender.token_ids)
    assert text.startswith("<|im_start|>user\nJohn travelled")
    assert "assistant" not in text
    assert sender.positions == compat.cache_length(sender.past_key_values)
    assert torch.equal(sender.input_embeds, model.get_input_embeddings()(sender.token_ids))


def test_text_and_ids_give_the_same_state(model, tokenizer):
    by_text = rclc.sender_from_hf(model, tokenizer, "Cedar is owned by Alice.")
    ids = tokenizer("Cedar is owned by Alice.", add_special_tokens=False, return_tensors="pt").input_ids
    by_ids = rclc.sender_from_hf(model, tokenizer, ids)
    assert torch.equal(by_text.token_ids, ids[0])
    assert torch.equal(by_text.input_embeds, by_ids.input_embeds)


def test_prefix_cache_is_cloned_and_extended_and_caller_cache_unchanged(model, tokenizer):
    ids = tokenizer("Cedar is owned by Alice. Who owns Cedar?", return_tensors="pt").input_ids
    full = rclc.sender_from_hf(model, tokenizer, ids)
    prefix = rclc.sender_from_hf(model, tokenizer, ids[:, :4]).past_key_values
    before = _keys(prefix)
    extended = rclc.sender_from_hf(model, tokenizer, ids, past_key_values=prefix)
    assert compat.cache_length(prefix) == 4
    assert all(torch.equal(a, b) for a, b in zip(before, _keys(prefix)))
    assert extended.past_key_values is not prefix
    for a, b in zip(_keys(extended.past_key_values), _keys(full.past_key_values)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_complete_cache_is_reused_and_longer_cache_rejected(model, tokenizer):
    ids = tokenizer("Birch was launched in 1994.", return_tensors="pt").input_ids
    state = rclc.sender_from_hf(model, tokenizer, ids)
    again = rclc.sender_from_hf(model, tokenizer, ids, past_key_values=state.past_key_values)
    assert again.past_key_values is state.past_key_values
    with pytest.raises(ValueError, match="more than"):
        rclc.sender_from_hf(model, tokenizer, ids[:, :3], past_key_values=state.past_key_values)


def test_generation_outputs(model, tokenizer):
    ids = tokenizer("Who owns Cedar?", return_tensors="pt").input_ids
    greedy = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    state = rclc.sender_from_hf(model, tokenizer, generation=greedy)
    assert state.positions == greedy.sequences.shape[1]
    assert torch.equal(state.token_ids, greedy.sequences[0])
    torch.manual_seed(0)
    sampled = model.generate(ids, max_new_tokens=2, do_sample=True, return_dict_in_generate=True)
    assert rclc.sender_from_hf(model, tokenizer, generation=sampled).positions == sampled.sequences.shape[1]
    with pytest.raises(ValueError, match="either"):
        rclc.sender_from_hf(model, tokenizer, ids, generation=greedy)
    embeds = model.get_input_embeddings()(ids)
    by_embeds = model.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                               do_sample=False, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="inputs_embeds"):
        rclc.sender_from_hf(model, tokenizer, generation=by_embeds)
    beams = model.generate(ids, max_new_tokens=2, num_beams=2, do_sample=False, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="beam"):
        rclc.sender_from_hf(model, tokenizer, generation=beams)


def test_sender_state_validation(model, tokenizer, sender):
    base = dict(model=model, past_key_values=sender.past_key_values, input_embeds=sender.input_embeds,
                tokenizer=tokenizer)
    rclc.SenderState(**base, token_ids=sender.token_ids)
    with pytest.raises(ValueError, match="float64|dtype|torch.float"):
        rclc.SenderState(**{**base, "input_embeds": sender.input_embeds.double()})
    with pytest.raises(ValueError, match="positions"):
        rclc.SenderState(**{**base, "input_embeds": sender.input_embeds[:-1]})
    bad = sender.input_embeds.clone()
    bad[2, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        rclc.SenderState(**{**base, "input_embeds": bad})
    with pytest.raises(ValueError, match="token_ids"):
        rclc.SenderState(**base, token_ids=sender.token_ids[:-1])
    with pytest.raises(ValueError, match="do not match"):
        rclc.SenderState(**base, token_ids=sender.token_ids.roll(1))
    with pytest.raises(ValueError, match="latent tail"):
        rclc.SenderState(**base, token_ids=sender.token_ids, latent_steps=2)
    with pytest.raises(ValueError, match="overlaps"):
        rclc.SenderState(**base, inherited_positions=sender.positions - 1, latent_steps=2)
    with pytest.raises(TypeError):
        rclc.SenderState(**base, latent_steps=True)
    model.train()
    try:
        with pytest.raises(ValueError, match="eval"):
            rclc.SenderState(**base)
    finally:
        model.eval()


def test_private_copy_shares_nothing(sender):
    copy_ = sender.private_copy()
    assert copy_.input_embeds.data_ptr() != sender.input_embeds.data_ptr()
    assert copy_.past_key_values.layers[0].keys.data_ptr() != sender.past_key_values.layers[0].keys.data_ptr()
    assert torch.equal(copy_.input_embeds, sender.input_embeds)


def test_rows_match_ids_compares_known_rows_only(model, sender):
    from ilcp.rclc.state import rows_match_ids

    def embed(ids):
        return hf.embed_ids(model, ids)

    rows, ids = sender.input_embeds, sender.token_ids
    assert rows_match_ids(rows, ids, embed)
    assert not rows_match_ids(rows, ids.roll(1), embed)
    continuous = ids.clone()
    continuous[3:6] = -1
    changed = rows.clone()
    changed[3:6] += 1.0  # continuous rows are not compared
    assert rows_match_ids(changed, continuous, embed)
    assert not rows_match_ids(changed, ids, embed)
    assert rows_match_ids(changed, torch.full_like(ids, -1), embed)
