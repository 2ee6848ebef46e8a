"""The spec's bound-agent examples, run as written (``rclc.`` read as ``ilcp.rclc.``) on the tiny
Qwen3 and on the embedded SmolLM2: "Bind an existing agent", "Continue, append and resume", "Save and restore" and
"Inspect, check and view selection"."""

import asyncio
import json

import pytest
import torch

from ilcp import rclc


@pytest.fixture
def model(spec_lm):
    return spec_lm.model


@pytest.fixture
def tokenizer(spec_lm):
    return spec_lm.tokenizer


@pytest.fixture
def question():
    return "Who owns Cedar?"


@pytest.fixture
def follow_up():
    return "When was Birch launched?"


def test_bind_an_existing_agent(model, tokenizer, history_x, history_y, question, follow_up):
    history_x_before = [dict(m) for m in history_x]
    history_y_before = [dict(m) for m in history_y]

    async def main():
        agent_x = rclc.bind(model, tokenizer, messages=history_x, backend="hf")
        agent_y = rclc.bind(model, tokenizer, messages=history_y, backend="hf")
        await rclc.transfer(agent_x, agent_y, question)
        inputs = agent_y.pop()
        output = model.generate(**inputs, return_dict_in_generate=True)
        agent_y.update(inputs=inputs, generation=output)
        await rclc.transfer(agent_y, agent_x, follow_up)  # Send the continuation back.
        return agent_x, agent_y, inputs, output

    agent_x, agent_y, inputs, output = asyncio.run(main())
    assert isinstance(agent_x, rclc.Agent) and rclc.bind is rclc.Agent
    state = agent_y.sender_state()
    received = int(inputs["inputs_embeds"].shape[1]) - int(
        agent_y._receiver.render(question).positions)
    assert state.positions == inputs["inputs_embeds"].shape[1] + output.sequences.shape[1]
    assert state.inherited_positions == received
    assert bool((state.token_ids[:received] == -1).all()) and bool((state.token_ids[received:] >= 0).all())
    assert len(agent_x) == 1 and len(agent_y) == 0
    # RCLC never appends answers to the caller's history.
    assert history_x == history_x_before and history_y == history_y_before


def test_continue_append_and_resume(model, tokenizer, history_x, history_y, question, follow_up):
    rendered_tool_result = "<|im_start|>user\nTool result: Alice<|im_end|>\n"

    async def main():
        agent_x = rclc.bind(model, tokenizer, messages=history_x)
        agent_y = rclc.bind(model, tokenizer, messages=history_y)
        await rclc.transfer(agent_x, agent_y, question)
        inputs = agent_y.pop(max_new_tokens=8)
        output = model.generate(**inputs, return_dict_in_generate=True)
        agent_y.update(inputs=inputs, generation=output)
        before = agent_y.sender_state()

        await agent_y.append(rendered_tool_result)
        await rclc.transfer(agent_y, agent_x, follow_up)       # Or continue locally:
        inputs = await agent_y.inputs(max_new_tokens=64)
        return agent_x, agent_y, before, inputs

    agent_x, agent_y, before, inputs = asyncio.run(main())
    tool_ids = tokenizer(rendered_tool_result, add_special_tokens=False)["input_ids"]
    after = agent_y.sender_state() if agent_y._pending is None else agent_y._explicit
    assert after.positions == before.positions + len(tool_ids)
    assert after.inherited_positions == before.inherited_positions
    assert torch.equal(after.input_embeds[: before.positions], before.input_embeds)
    assert inputs["max_new_tokens"] == 64 and inputs["inputs_embeds"].shape[1] == after.positions
    assert len(agent_x) == 1
    with pytest.raises(RuntimeError, match="pending"):
        agent_y.sender_state()


def test_save_and_restore(model, tokenizer, history_y, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    async def main():
        agent_y = rclc.bind(model, tokenizer, messages=history_y)
        await agent_y.append("<|im_start|>user\nCedar is owned by Alice.<|im_end|>\n")
        await agent_y.save("agent.safetensors")
        restored = rclc.bind(model, tokenizer, max_new_tokens=64)
        await restored.load("agent.safetensors")
        return agent_y, restored

    agent_y, restored = asyncio.run(main())
    a, b = agent_y.sender_state(), restored.sender_state()
    assert torch.equal(a.input_embeds, b.input_embeds) and torch.equal(a.token_ids, b.token_ids)
    assert restored.max_new_tokens == 64


def test_inspect_check_and_view_selection(model, tokenizer, history_x, history_y, question):
    async def main():
        agent_x = rclc.bind(model, tokenizer, messages=history_x)
        agent_y = rclc.bind(model, tokenizer, messages=history_y)
        await rclc.transfer(agent_x, agent_y, question)
        plain = agent_y.inspect()       # Queue, per-sender positions, payload bytes and remaining space.
        checked = rclc.check(agent_y)      # Signature: check(agent=None, *, backend=None, allow_unstable=None)
        await rclc.transfer(agent_x, agent_y, question, record_selection=True)
        report = agent_y.inspect(selection=True)
        html = agent_y.selection_html(request_index=1)   # display(HTML(html)) in a notebook, or write to a file.
        return plain, checked, report, html

    plain, checked, report, html = asyncio.run(main())
    json.dumps(plain), json.dumps(checked), json.dumps(report)
    assert plain["queued"] == 1 and plain["deliveries"][0]["senders"][0]["positions"] > 0
    assert checked["ok"] and checked["backend"] == "hf" and checked["agent"]["backend"] == "hf"
    assert report["deliveries"][0]["selection"] == [None]  # the first transfer recorded nothing
    entry = report["deliveries"][1]["selection"][0]
    assert set(entry) >= {"indices", "source_positions", "budget", "spans", "added_latent_positions"}
    assert entry["indices"][0] == 0 and "rclc-kept" in html and "#b9f6b0" in html
