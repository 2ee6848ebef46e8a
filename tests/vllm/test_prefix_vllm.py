"""The vLLM receiver hands the engine the rows training computed its loss on, in every layout
(`ilcp.receiver.prefix.receiver_prefix`): prefix and in-prompt memory, with and without format vectors."""

import copy

import pytest
import torch

from ilcp.encoder.model import FormatPrompt
from ilcp.engines.vllm import VLLMReceiver
from ilcp.training.handoff_stage import HandoffModule

CONTEXT = "John travelled to the hallway. Mary journeyed to the bathroom."
QUESTION = "Where is John?"


@pytest.mark.parametrize("placement", ["prefix", "in_prompt"])
@pytest.mark.parametrize("with_format", [False, True])
def test_the_engine_reads_the_rows_training_read(tiny_handoff, tiny_engine, tiny_vllm_run, placement, with_format,
                                                 monkeypatch):
    from ilcp.config import load_config

    handoff = copy.copy(tiny_handoff)
    handoff.encoder = copy.deepcopy(tiny_handoff.encoder)
    handoff.encoder.placement = placement
    if with_format:
        torch.manual_seed(0)
        handoff.encoder.format_prompt = FormatPrompt(torch.randn(2, handoff.lm.hidden_size), trainable=False)
    receiver = VLLMReceiver(handoff, tiny_engine)
    sent = []
    real = receiver.decoder.decode

    def recording(prefixes, **kwargs):
        sent.extend(p.detach().clone() for p in prefixes)
        return real(prefixes, **kwargs)

    monkeypatch.setattr(receiver.decoder, "decode", recording)
    payload = handoff.send(CONTEXT)
    receiver.receive(payload, QUESTION)

    cfg = load_config(None, ["lm.spec=tiny-qwen3"])
    module = HandoffModule(handoff.encoder, handoff.lm, cfg.handoff)
    memory = handoff.memory_vectors(payload)
    sequences, labels = module._answer_sequences(memory, {"context": [CONTEXT], "question": [QUESTION],
                                                          "answer": ["hallway"]}, False)
    trained = sequences[0][: int((labels[0] == -100).sum())]
    assert len(sent) == 1 and torch.equal(sent[0], trained)
