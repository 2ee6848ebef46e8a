"""The RCLC path on the embedded SmolLM2-135M-Instruct (LlamaForCausalLM): no Qwen internals."""

import pytest
import torch

from ilcp import rclc
from ilcp.rclc import hf

STORY = "Mary moved to the bathroom. John went to the hallway. Sandra journeyed to the kitchen."
HISTORY = [{"role": "system", "content": "Answer the question with one word."}]
SLOT = "Context:\n{context}\nQuestion: {request}"


@pytest.mark.slow
def test_smollm2_in_prompt_r1_is_the_cold_read_and_r4_selects(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    implementation = model.config._attn_implementation
    sender = rclc.sender_from_hf(model, tokenizer, STORY)
    receiver = rclc.HFReceiver(model, tokenizer, messages=HISTORY, max_new_tokens=4,
                               placement="in_prompt", slot_template=SLOT)
    rclc.transfer_sync(sender, receiver, "Where is John?", ratio=1)
    rclc.transfer_sync(sender, receiver, "Where is John?", ratio=4, record_selection=True)

    # r1 with rows at a newline-delimited slot is token for token the cold read.
    cold_text = hf.render_chat(tokenizer, HISTORY + [{"role": "user", "content": SLOT.replace(
        "{context}", STORY).replace("{request}", "Where is John?")}], add_generation_prompt=True)
    cold = hf.embed_ids(model, hf.encode_text(tokenizer, cold_text)[0]).unsqueeze(0)
    r1 = receiver.pop()
    assert torch.equal(r1["inputs_embeds"], cold)

    delivery = receiver.peek()
    record = delivery.messages[0].selection
    assert len(record.indices) == -(-sender.positions // 4) and record.indices[0] == 0
    assert "".join(s["text"] for s in record.spans) == tokenizer.decode(sender.token_ids)
    r4 = receiver.pop()
    assert r4["inputs_embeds"].shape[1] == cold.shape[1] - sender.positions + len(record.indices)
    tokens = model.generate(**r4, do_sample=False)
    assert tokens.shape[0] == 1 and 1 <= tokens.shape[1] <= 4
    assert model.config._attn_implementation == implementation
