"""Engines that cannot serve a handoff are refused with a message that says what to do."""

import copy

import pytest
import torch

from ilcp.engines.vllm import VLLMReceiver, VLLMSender, model_directory
from ilcp.handoff import ILCPHandoff



def test_engine_without_prompt_embeds_is_refused(tiny_handoff, tiny_engine_without_prompt_embeds):
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        VLLMReceiver(tiny_handoff, tiny_engine_without_prompt_embeds)


def test_engine_of_another_hidden_size_is_refused(smollm2_handoff, tiny_engine, tiny_handoff, smollm2_pool_engine):
    with pytest.raises(ValueError, match="hidden size 64.*hidden size 576"):
        VLLMReceiver(smollm2_handoff, tiny_engine)
    with pytest.raises(ValueError, match="hidden size 576.*hidden size 64"):
        VLLMSender(tiny_handoff, smollm2_pool_engine)


def test_engine_with_other_weights_is_refused(tiny_handoff, tiny_engine, tiny_pool_engine, vllm_folder,
                                             tiny_lm_builder):
    other = tiny_lm_builder(vllm_folder / "tiny-lm-seed1", seed=1)
    config = copy.deepcopy(tiny_handoff.config)
    config["lm"]["fingerprint"] = other.fingerprint
    handoff = ILCPHandoff(other, copy.deepcopy(tiny_handoff.encoder), config)
    with pytest.raises(ValueError, match="input embeddings differ"):
        VLLMReceiver(handoff, tiny_engine)
    with pytest.raises(ValueError, match="input embeddings differ"):
        VLLMSender(handoff, tiny_pool_engine)
    VLLMReceiver(handoff, tiny_engine, check_weights=False)


def test_engines_of_the_wrong_kind_are_refused(tiny_handoff, tiny_engine, tiny_pool_engine):
    with pytest.raises(ValueError, match="runs 'pooling'"):
        VLLMReceiver(tiny_handoff, tiny_pool_engine)
    with pytest.raises(ValueError, match="runs 'generate'"):
        VLLMSender(tiny_handoff, tiny_engine)
    with pytest.raises(ValueError, match="vllm.LLM"):
        VLLMReceiver(tiny_handoff, object())
    with pytest.raises(ValueError, match="ILCPHandoff"):
        VLLMReceiver("checkpoints/default", tiny_engine)


def test_sender_refuses_runs_that_pool_other_layers(tiny_handoff, tiny_pool_engine):
    for layers in ([0], [1], [-2]):
        config = copy.deepcopy(tiny_handoff.config)
        config["pooling"]["layers"] = layers
        handoff = ILCPHandoff(tiny_handoff.lm, copy.deepcopy(tiny_handoff.encoder), config)
        with pytest.raises(ValueError, match="last layer"):
            VLLMSender(handoff, tiny_pool_engine)
    config = copy.deepcopy(tiny_handoff.config)
    config["pooling"]["layers"] = [2]  # the tiny LM has 2 layers: hidden_states[2] is the last
    VLLMSender(ILCPHandoff(tiny_handoff.lm, copy.deepcopy(tiny_handoff.encoder), config), tiny_pool_engine)


def test_bad_decode_inputs_are_value_errors(tiny_handoff, tiny_engine):
    receiver = VLLMReceiver(tiny_handoff, tiny_engine)
    h = tiny_handoff.lm.hidden_size
    with pytest.raises(ValueError, match="non-empty list"):
        receiver.decode([])
    with pytest.raises(ValueError, match="prefix 0"):
        receiver.decode([torch.zeros(3, h + 1)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        receiver.decode([torch.zeros(3, h)], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_model_len"):
        receiver.decode([torch.zeros(1020, h)], max_new_tokens=8)
    payload = tiny_handoff.send(["John went to the garden.", "Mary went to the office."])
    with pytest.raises(ValueError, match="2 latent"):
        receiver.receive(payload, ["Where is John?"])
    with pytest.raises(ValueError, match="question"):
        receiver.receive(payload, [])
    with pytest.raises(ValueError, match="pairs"):
        receiver.receive_many([])


def test_model_directory_needs_a_folder_for_a_model_built_in_memory(tiny_lm_dir, tiny_vllm_lm, tmp_path):
    from ilcp.lm import load_lm

    assert model_directory(tiny_vllm_lm) == tiny_lm_dir
    built = load_lm("tiny-qwen3")
    with pytest.raises(ValueError, match="directory="):
        model_directory(built)
    saved = model_directory(built, tmp_path / "tiny")
    assert (saved / "config.json").is_file() and (saved / "tokenizer.json").is_file()
