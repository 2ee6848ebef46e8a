"""The spec's lower-level examples, run as written (``rclc.`` read as ``ilcp.rclc.``) on the tiny
Qwen3 and on the embedded SmolLM2: "Lower-level Hugging Face helpers", "Relative and bounded budgets", "Reasoning",
"Low-level sender state" and "Receiver continuation"."""

import asyncio
from functools import partial

import pytest
import torch

from ilcp import compat, rclc


@pytest.fixture
def sender_messages(story):
    return [{"role": "user", "content": " ".join([story] * 4)}]


@pytest.fixture
def receiver_history():
    return [{"role": "system", "content": "Answer the question with one word."}]


def test_lower_level_hugging_face_helpers(spec_lm, sender_messages, receiver_history):
    model, tokenizer = spec_lm.model, spec_lm.tokenizer
    from ilcp.rclc import HFReceiver, sender_from_hf, transfer

    async def main():
        sender = sender_from_hf(model, tokenizer, sender_messages)
        receiver = HFReceiver(model, tokenizer, messages=receiver_history,
                              max_new_tokens=128, context_limit=4096)
        await transfer(sender, receiver, "Who owns Cedar?")
        tokens = model.generate(**receiver.pop(), do_sample=False)
        return sender, receiver, tokens

    sender, receiver, tokens = asyncio.run(main())
    assert tokens.shape[0] == 1 and 1 <= tokens.shape[1] <= 128
    assert len(receiver) == 0

    prompt = tokenizer("Who owns Cedar?", return_tensors="pt").input_ids
    output = model.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    sender = sender_from_hf(model, tokenizer, generation=output)  # After model.generate
    assert sender.positions == output.sequences.shape[1]
    exact_ids, cache = output.sequences, compat.output_cache(output)
    before = compat.cache_length(cache)
    sender = sender_from_hf(model, tokenizer, exact_ids, past_key_values=cache)
    assert sender.positions == exact_ids.shape[1] and compat.cache_length(cache) == before


def test_relative_and_bounded_budgets(spec_lm, sender_messages, receiver_history):
    model, tokenizer = spec_lm.model, spec_lm.tokenizer
    senders = [rclc.sender_from_hf(model, tokenizer, sender_messages),
               rclc.sender_from_hf(model, tokenizer, "Cedar is owned by Alice.")]
    inbox = []
    receivers = [rclc.HFReceiver(model, tokenizer, messages=receiver_history), inbox.append]
    requests = ["Who owns Cedar?", "Where is John?"]
    transfer = rclc.transfer

    async def main():
        await transfer(senders, receivers, requests)               # Relative r4 (default).
        await transfer(senders, receivers, requests, ratio=16)     # Relative r16.
        await transfer(senders, receivers, requests, budget=1024)  # Bounded at 1,024 positions.

    asyncio.run(main())
    assert len(receivers[0]) == 6 and len(inbox) == 6
    sizes = [[m.positions for m in d.messages] for d in inbox[::2]]
    totals = [s.positions for s in senders]
    assert sizes == [
        [rclc.budget.position_budget(t, ratio=4) for t in totals],
        [rclc.budget.position_budget(t, ratio=16) for t in totals],
        totals,
    ]


def test_reasoning(spec_lm, sender_messages, receiver_history):
    model, tokenizer = spec_lm.model, spec_lm.tokenizer
    senders = [rclc.sender_from_hf(model, tokenizer, sender_messages)]
    inbox = []
    receivers = [inbox.append]
    requests = ["Who owns Cedar?"]
    assert senders[0].positions >= 125  # room for r4 after 40 reserved rows

    async def main():
        await rclc.transfer(senders, receivers, requests,
                            reasoning=partial(rclc.latent_mass, steps=40), budget=128)
        await rclc.transfer(senders, receivers, requests,
                            reasoning=partial(rclc.latent_mass, steps=40),
                            reasoning_context="selected_with_request", reasoning_budget=40)
        return await rclc.latent_mass(senders[0], steps=50)

    extended = asyncio.run(main())
    t = senders[0].positions
    assert inbox[0].messages[0].positions == min(128, t + 40)
    total, selected = rclc.budget.split_post_selection(t, 0, rclc.budget.BudgetMode("ratio", 4), 40)
    assert inbox[1].messages[0].positions == selected + 40 == total
    assert extended.latent_steps == 50 and senders[0].latent_steps == 0
    assert rclc.latent_mass_sync(senders[0], steps=0) is senders[0]


def test_low_level_sender_state_and_receiver_continuation(spec_lm, story):
    sender_model = receiver_model = spec_lm.model
    sender_tokenizer = spec_lm.tokenizer
    ids = sender_tokenizer(story, return_tensors="pt").input_ids
    sender_input_rows = sender_model.get_input_embeddings()(ids)[0].detach()
    with torch.no_grad():
        out = sender_model(inputs_embeds=sender_input_rows.unsqueeze(0), use_cache=True)
    sender_cache = compat.output_cache(out)
    receiver_inbox = []
    from ilcp.rclc import SenderState, transfer

    async def send():
        sender = SenderState(
            model=sender_model,
            past_key_values=sender_cache,
            input_embeds=sender_input_rows,
            tokenizer=sender_tokenizer,
        )
        await transfer(sender, receiver_inbox.append, "Find the owner and launch date.")

    asyncio.run(send())
    assert len(receiver_inbox) == 1

    delivery = receiver_inbox.pop(0)
    inputs = delivery.for_hf(receiver_model.get_input_embeddings().weight)
    with torch.inference_mode():
        received = receiver_model.model(**inputs, use_cache=True)
    matching_embedding_weight = receiver_model.get_input_embeddings().weight
    prompt = delivery.for_vllm(matching_embedding_weight)  # {"prompt_embeds": cpu_rows}

    positions = rclc.budget.position_budget(ids.shape[1], ratio=4)
    assert received.last_hidden_state.shape == (1, positions, receiver_model.config.hidden_size)
    assert prompt["prompt_embeds"].device.type == "cpu"
    assert torch.equal(prompt["prompt_embeds"], inputs["inputs_embeds"][0])
    assert delivery.request == "Find the owner and launch date."

    # On a receiver: prefill the handoff into a SenderState and reason over it.
    receiver_state = rclc.SenderState(model=receiver_model, past_key_values=compat.output_cache(received),
                                      input_embeds=inputs["inputs_embeds"][0], tokenizer=sender_tokenizer)
    reasoned = asyncio.run(rclc.latent_mass(receiver_state, steps=4, request=delivery.request))
    assert reasoned.positions == positions + 4 and reasoned.latent_steps == 4
