"""The vLLM receiver and sender give what the HF path gives: same answers (float32), same states."""

import torch

from ilcp.receiver.decoding import assemble_prefix, greedy_decode, greedy_decode_ids
from ilcp.engines.vllm import VLLMReceiver, VLLMSender
from ilcp.encoder.pooling import sender_token_states
from ilcp.receiver.prompts import question_prompt

CONTEXTS = [
    "John travelled to the hallway. Mary journeyed to the bathroom.",
    "Daniel went back to the bathroom. Sandra moved to the kitchen. John went to the garden.",
    "Mary went to the office.",
    "Sandra moved to the kitchen. Daniel went back to the bathroom. Mary journeyed to the bathroom. "
    "John travelled to the hallway. Mary went to the office.",
]
QUESTIONS = ["Where is John?", "Where is Sandra?", "Where is Mary?", "Where is Mary?"]
OPEN_QUESTIONS = [
    "Where is John?",
    "What is the capital of France?",
    "Who wrote Hamlet?",
    "Name three colours.",
    "What is two plus two?",
    "Write a haiku about the sea.",
]


def _random_prefixes(lm, questions, seed):
    """Question prompts followed by a random row: the random tiny LM echoes the token nearest its
    last input, so these reach different tokens where a prompt alone gives newlines."""
    g = torch.Generator().manual_seed(seed)
    scale = float(lm.model.get_input_embeddings().weight.norm(dim=-1).mean()) / lm.hidden_size ** 0.5
    return [assemble_prefix(lm.model, lm.tokenizer, [question_prompt(lm.tokenizer, q),
                                                     torch.randn(1, lm.hidden_size, generator=g) * scale])
            for q in questions]


def test_tiny_receiver_answers_as_the_hf_decoder(tiny_handoff, tiny_engine):
    receiver = VLLMReceiver(tiny_handoff, tiny_engine)
    payload = tiny_handoff.send(CONTEXTS)
    for stop_at_newline in (False, True):
        hf = tiny_handoff.receive(payload, QUESTIONS, max_new_tokens=8, stop_at_newline=stop_at_newline)
        assert receiver.receive(payload, QUESTIONS, max_new_tokens=8, stop_at_newline=stop_at_newline) == hf
    one = tiny_handoff.send(CONTEXTS[0])
    assert receiver.receive(one, QUESTIONS[0]) == tiny_handoff.receive(one, QUESTIONS[0])


def test_tiny_token_ids_equal_hf_greedy_on_varied_prefixes(tiny_handoff, tiny_engine):
    lm = tiny_handoff.lm
    receiver = VLLMReceiver(tiny_handoff, tiny_engine)
    prefixes = _random_prefixes(lm, QUESTIONS + QUESTIONS, seed=1)
    hf = greedy_decode_ids(lm.model, lm.tokenizer, prefixes, max_new_tokens=12)
    ours = receiver.decode_ids(prefixes, max_new_tokens=12)
    assert ours == hf
    assert len({tuple(row) for row in hf}) > 1, "the prefixes should reach different answers"
    for stop_at_newline in (False, True):
        hf_ids = greedy_decode_ids(lm.model, lm.tokenizer, prefixes, max_new_tokens=12, stop_at_newline=stop_at_newline)
        assert receiver.decode_ids(prefixes, max_new_tokens=12, stop_at_newline=stop_at_newline) == hf_ids


def test_smollm2_receiver_answers_as_the_hf_decoder(smollm2_handoff, smollm2_engine):
    receiver = VLLMReceiver(smollm2_handoff, smollm2_engine)
    contexts = [c for c in CONTEXTS for _ in range(2)][: len(OPEN_QUESTIONS)]
    payload = smollm2_handoff.send(contexts)
    for stop_at_newline in (False, True):
        hf = smollm2_handoff.receive(payload, OPEN_QUESTIONS, max_new_tokens=24, stop_at_newline=stop_at_newline)
        ours = receiver.receive(payload, OPEN_QUESTIONS, max_new_tokens=24, stop_at_newline=stop_at_newline)
        assert ours == hf
    assert any(hf), "SmolLM2 should answer something"


def test_smollm2_chat_prompts_stop_as_hf_does(smollm2_handoff, smollm2_engine):
    lm = smollm2_handoff.lm
    receiver = VLLMReceiver(smollm2_handoff, smollm2_engine)
    chats = ["List three fruits, one per line.", "Write a short poem about the sea.", "What is the capital of France?"]
    texts = [lm.tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
             for c in chats]
    texts += [question_prompt(lm.tokenizer, q) for q in OPEN_QUESTIONS]
    prefixes = [assemble_prefix(lm.model, lm.tokenizer, [t]) for t in texts]
    hf = greedy_decode_ids(lm.model, lm.tokenizer, prefixes, max_new_tokens=32)
    assert receiver.decode_ids(prefixes, max_new_tokens=32) == hf
    assert any(len(row) < 32 for row in hf), "some answers should end with the end token"
    full = receiver.decode(prefixes, max_new_tokens=32)
    first_lines = receiver.decode(prefixes, max_new_tokens=32, stop_at_newline=True)
    assert first_lines == greedy_decode(lm.model, lm.tokenizer, prefixes, max_new_tokens=32, stop_at_newline=True)
    assert any("\n" in a for a in full), "some answer should run over several lines"
    assert first_lines != full and all("\n" not in a for a in first_lines)


def test_receive_many_is_one_generate_call(tiny_handoff, tiny_engine, monkeypatch):
    receiver = VLLMReceiver(tiny_handoff, tiny_engine)
    batch = tiny_handoff.send(CONTEXTS[:2])
    single = tiny_handoff.send(CONTEXTS[2])
    requests = [(batch, QUESTIONS[:2]), (single.to_bytes(), QUESTIONS[2]), (single, [QUESTIONS[3]])]
    expected = [receiver.receive(p, q, 6, stop_at_newline=True) for p, q in requests]
    calls = []
    generate = tiny_engine.generate

    def counting(*args, **kwargs):
        calls.append(len(args[0]))
        return generate(*args, **kwargs)

    monkeypatch.setattr(tiny_engine, "generate", counting)
    got = receiver.receive_many(requests, 6, stop_at_newline=True)
    assert calls == [4]
    assert got == expected
    assert isinstance(got[1], str) and isinstance(got[2], list)
    assert got == [tiny_handoff.receive(p, q, 6, stop_at_newline=True) for p, q in requests]


def test_tiny_sender_states_and_latents_match_hf(tiny_handoff, tiny_pool_engine):
    sender = VLLMSender(tiny_handoff, tiny_pool_engine)
    states = sender.token_states(CONTEXTS)
    inputs = tiny_handoff.sender_inputs(CONTEXTS)
    with torch.no_grad():
        hf = sender_token_states(tiny_handoff.lm.model, inputs["input_ids"], inputs["attention_mask"], (-1,))
    for i, s in enumerate(states):
        n = int(inputs["attention_mask"][i].sum())
        assert s.shape == (n, tiny_handoff.lm.hidden_size)
        torch.testing.assert_close(s, hf[i, :n], atol=1e-4, rtol=1e-4)
    for ours, ref in zip(sender.latents(CONTEXTS, batch_size=3), tiny_handoff.latents(CONTEXTS, batch_size=3)):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_smollm2_sender_states_match_hf(smollm2_handoff, smollm2_pool_engine):
    sender = VLLMSender(smollm2_handoff, smollm2_pool_engine)
    inputs = smollm2_handoff.sender_inputs(CONTEXTS)
    with torch.no_grad():
        hf = sender_token_states(smollm2_handoff.lm.model, inputs["input_ids"], inputs["attention_mask"], (-1,))
    for i, s in enumerate(sender.token_states(CONTEXTS)):
        n = int(inputs["attention_mask"][i].sum())
        torch.testing.assert_close(s, hf[i, :n], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(torch.stack(sender.latents(CONTEXTS)), torch.stack(smollm2_handoff.latents(CONTEXTS)),
                               atol=1e-4, rtol=1e-4)


def test_both_sides_on_vllm_answer_as_hf(tiny_handoff, tiny_engine, tiny_pool_engine):
    sender = VLLMSender(tiny_handoff, tiny_pool_engine)
    receiver = VLLMReceiver(tiny_handoff, tiny_engine)
    wire = sender.send(CONTEXTS).to_bytes()
    assert len(wire) == len(tiny_handoff.send(CONTEXTS).to_bytes())
    hf = tiny_handoff.receive(tiny_handoff.send(CONTEXTS), QUESTIONS)
    assert receiver.receive(wire, QUESTIONS) == hf
    each = sender.send_each(CONTEXTS)
    assert [receiver.receive(p, q) for p, q in zip(each, QUESTIONS)] == hf


def test_vllm_files_stay_in_the_test_folder(vllm_folder, tiny_engine, smollm2_engine):
    import os
    import tempfile

    assert tempfile.gettempdir() == str(vllm_folder / "tmp")
    assert os.environ["VLLM_CACHE_ROOT"].startswith(str(vllm_folder))
    assert any((vllm_folder / "tmp").iterdir()), "vLLM wrote no temporary files where TMPDIR points"
