"""ILCPHandoff on a tiny trained run: bytes round trip, reuse of the sender's forward, refusals,
save/load, and the two-agent example."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ilcp.config import load_config
from ilcp.receiver.decoding import assemble_prefix, greedy_decode, greedy_decode_ids
from ilcp.encoder.model import ILCPEncoder
from ilcp.export import ExportError, read_export
from ilcp.handoff import ILCPHandoff
from ilcp.lm import LM, TINY_LM, build_tiny_qwen3, load_lm
from ilcp.encoder.kinds import MeanMemory
from ilcp.receiver.prompts import question_prompt
from ilcp.training import train
from ilcp.training.extraction import pooled_states, token_states
from ilcp.wire.payload import PayloadError, TransportPayload, pack

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"

CONTEXTS = ["John travelled to the hallway. Mary journeyed to the bathroom.",
            "Daniel went back to the bathroom. Sandra moved to the kitchen. John went to the garden."]
QUESTIONS = ["Where is John?", "Where is Sandra?"]


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    return tiny_run.run_dir


@pytest.fixture(scope="module")
def handoff(run_dir, tiny_lm):
    return ILCPHandoff.from_pretrained(run_dir, lm=tiny_lm)


def modules_directly(run_dir: Path, lm: LM, context: str, question: str):
    """z (1, Z) and the receiver prefix, by the training path: pooled (mean, or the pooler over the
    token states) -> encoder -> projector."""
    run = read_export(run_dir)
    spec = run.spec
    with torch.no_grad():
        if run.encoder.pooler is None:
            pooled = pooled_states(lm, [context], max_length=spec.max_length, layers=spec.layers, progress=False)
            z = run.encoder.latent(pooled)
        else:
            rows = token_states(lm, [context], max_length=spec.max_length, layers=spec.layers, progress=False)
            z = run.encoder.latent(rows[0].unsqueeze(0), torch.ones(1, rows[0].shape[0], dtype=torch.long))
        memory = run.encoder.memory(z, dtype=lm.dtype)
    prefix = assemble_prefix(lm.model, lm.tokenizer, [memory[0], question_prompt(lm.tokenizer, question)])
    return z, prefix


def test_round_trip_through_bytes_matches_the_modules(handoff, run_dir, tiny_lm):
    wire = handoff.send(CONTEXTS[0]).to_bytes()
    assert isinstance(wire, bytes) and len(wire) == handoff.wire_bytes
    received = TransportPayload.from_bytes(wire, expected_fingerprint=tiny_lm.fingerprint)
    assert received.latent.shape == (handoff.latent_dim,)
    assert received.byte_length() == handoff.tensor_bytes == 4 * handoff.latent_dim

    z, expected_prefix = modules_directly(run_dir, tiny_lm, CONTEXTS[0], QUESTIONS[0])
    torch.testing.assert_close(received.latent, z[0], rtol=1e-5, atol=1e-5)
    prefix = handoff.prefixes(wire, [QUESTIONS[0]])[0]
    assert prefix.shape == expected_prefix.shape
    torch.testing.assert_close(prefix, expected_prefix, rtol=1e-5, atol=1e-5)

    model, tok = tiny_lm.model, tiny_lm.tokenizer
    answer = handoff.receive(wire, QUESTIONS[0], max_new_tokens=4)
    assert isinstance(answer, str)
    assert answer == greedy_decode(model, tok, [expected_prefix], max_new_tokens=4)[0]
    # The same tokens, not just the same (possibly empty) text.
    assert greedy_decode_ids(model, tok, [prefix], max_new_tokens=4) == \
        greedy_decode_ids(model, tok, [expected_prefix], max_new_tokens=4)


def test_batched_send_equals_single_sends(handoff):
    batched = handoff.send(CONTEXTS)
    assert batched.latent.shape == (2, handoff.latent_dim)
    for i, context in enumerate(CONTEXTS):
        torch.testing.assert_close(batched.latent[i], handoff.send(context).latent, rtol=1e-5, atol=1e-5)
    answers = handoff.receive(batched.to_bytes(), QUESTIONS, max_new_tokens=3)
    assert isinstance(answers, list) and len(answers) == 2
    with pytest.raises(ValueError, match="2 latent"):
        handoff.receive(batched, QUESTIONS[:1])


def test_two_receivers_of_one_payload_do_not_alias(handoff, run_dir, tiny_lm):
    other = ILCPHandoff.from_pretrained(run_dir, lm=tiny_lm)
    payload = handoff.send(CONTEXTS)
    before = payload.latent.clone()
    first, second = handoff.memory_vectors(payload, contexts=2), other.memory_vectors(payload, contexts=2)
    assert first.shape == (2, handoff.num_memory_tokens, tiny_lm.hidden_size)
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    first.add_(1.0)  # one receiver edits its memory in place
    assert torch.equal(payload.latent, before)
    torch.testing.assert_close(other.memory_vectors(payload, contexts=2), second, rtol=0, atol=0)
    assert handoff.receive(payload, QUESTIONS, max_new_tokens=3) == other.receive(payload, QUESTIONS, max_new_tokens=3)


def test_send_from_hidden_states_equals_send_and_runs_no_forward(handoff, tiny_lm):
    model = tiny_lm.model
    inputs = handoff.sender_inputs(CONTEXTS)
    with torch.no_grad():  # the sender's own forward, done for its own reasons
        outputs = model(**inputs, output_hidden_states=True, use_cache=False)
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        reused = handoff.send_from_hidden_states(outputs, inputs["attention_mask"])
        assert forwards == [], "send_from_hidden_states ran a forward"
        fresh = handoff.send(CONTEXTS)
        assert forwards == [1], "the hook counts forwards: send runs one"
    finally:
        hook.remove()
    torch.testing.assert_close(reused.latent, fresh.latent, rtol=1e-5, atol=1e-5)
    assert reused.lm_fingerprint == fresh.lm_fingerprint == tiny_lm.fingerprint


def test_payload_from_another_lm_is_refused(handoff):
    foreign = pack(torch.zeros(handoff.latent_dim), lm_fingerprint="0123456789abcdef")
    with pytest.raises(PayloadError, match="made by LM 0123456789abcdef"):
        handoff.receive(foreign.to_bytes(), QUESTIONS[0])
    with pytest.raises(PayloadError, match="made by LM"):
        handoff.receive(foreign, QUESTIONS[0])
    wire = bytearray(handoff.send(CONTEXTS[0]).to_bytes())
    wire[-6] ^= 0x01
    with pytest.raises(PayloadError, match="CRC"):
        handoff.receive(bytes(wire), QUESTIONS[0])


def test_from_pretrained_with_another_lm_is_refused(run_dir, tiny_lm):
    model, tokenizer = build_tiny_qwen3(seed=1)  # same architecture, other weights
    with pytest.raises(ExportError, match="fingerprint"):
        ILCPHandoff.from_pretrained(run_dir, lm=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="tokenizer"):
        ILCPHandoff.from_pretrained(run_dir, lm=tiny_lm.model)
    with pytest.raises(ExportError, match="not a directory"):
        ILCPHandoff.from_pretrained(run_dir / "missing", lm=tiny_lm)


def test_save_pretrained_round_trip_writes_only_the_trained_modules(handoff, tiny_lm, tmp_path):
    out = handoff.save_pretrained(tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    state = load_file(str(out / "model.safetensors"))
    assert state and all(k.startswith(("compressor.", "projector.", "pooler.")) for k in state)
    embed_shape = tuple(tiny_lm.model.get_input_embeddings().weight.shape)
    assert all(tuple(v.shape) != embed_shape for v in state.values())
    assert sum(v.numel() for v in state.values()) < sum(p.numel() for p in tiny_lm.model.parameters())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}

    again = ILCPHandoff.from_pretrained(out, lm=tiny_lm)
    payload = handoff.send(CONTEXTS)
    assert torch.equal(again.memory_vectors(payload, contexts=2), handoff.memory_vectors(payload, contexts=2))
    assert torch.equal(again.send(CONTEXTS).latent, payload.latent)
    assert read_export(out).soft_prompts == {}


def test_two_agents_hand_over_bytes(run_dir):
    # Agent A loads the run's LM itself; agent B brings its own copy of the same model.
    sender = ILCPHandoff.from_pretrained(run_dir)
    model, tokenizer = build_tiny_qwen3()
    receiver = ILCPHandoff.from_pretrained(run_dir, lm=model, tokenizer=tokenizer)
    assert sender.lm.model is not receiver.lm.model
    wire = sender.send("Mary moved to the office. John went to the garden.").to_bytes()
    answer = receiver.receive(wire, "Where is John?", max_new_tokens=3)
    assert isinstance(answer, str)
    assert answer == sender.receive(wire, "Where is John?", max_new_tokens=3)


def test_bad_inputs_are_value_errors(handoff):
    with pytest.raises(ValueError, match="empty context"):
        handoff.send("")
    with pytest.raises(ValueError, match="non-empty list"):
        handoff.send([])
    with pytest.raises(ValueError, match="list of strings"):
        handoff.send(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="dtype"):
        ILCPHandoff(handoff.lm, handoff.encoder, handoff.config,
                    payload_dtype="int4")
    with pytest.raises(ValueError, match="question"):
        handoff.receive(handoff.send(CONTEXTS[0]), [])


def test_half_precision_payload_is_smaller(handoff):
    half = ILCPHandoff(handoff.lm, handoff.encoder, handoff.config,
                       payload_dtype="float16")
    payload = half.send(CONTEXTS[0])
    assert payload.dtype == "float16" and half.tensor_bytes == 2 * half.latent_dim
    assert len(payload.to_bytes()) == half.wire_bytes == handoff.wire_bytes - 2 * half.latent_dim
    assert isinstance(half.receive(payload.to_bytes(), QUESTIONS[0], max_new_tokens=2), str)


def test_int8_payload_carries_a_scale_and_answers_like_float32(handoff):
    small = ILCPHandoff(handoff.lm, handoff.encoder, handoff.config, payload_dtype="int8")
    payload = small.send(CONTEXTS)
    assert payload.dtype == "int8" and small.tensor_bytes == handoff.latent_dim + 4
    assert payload.byte_length() == 2 * small.tensor_bytes and small.wire_bytes < handoff.wire_bytes
    exact = handoff.send(CONTEXTS).latent
    received = small.parse(payload.to_bytes(), contexts=2)
    from ilcp.wire.payload import unpack

    step = exact.abs().amax(-1, keepdim=True) / 127
    assert bool(((unpack(received, "cpu") - exact).abs() <= step / 2 + 1e-6).all())
    assert len(small.receive(payload.to_bytes(), QUESTIONS, max_new_tokens=2)) == 2


def test_load_lm_spec_matches_the_fixture(tiny_lm):
    # The two-agent test relies on a fresh tiny LM having the fixture's fingerprint.
    assert load_lm(TINY_LM).fingerprint == tiny_lm.fingerprint


def test_attention_pooled_run_sends_what_training_computed(tmp_path, tiny_lm):
    from ilcp.encoder.pooling import pad_token_states

    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}",
                             "compressor.memory.kind=attention", "compressor.answer_head_weight=0", "handoff.variants=[ilcp]",
                             "handoff.encoder_lr=0.01"])
    result = train(cfg, lm=tiny_lm)
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    assert handoff.encoder.pooler is not None
    encoder = result.sources["ilcp"].eval()
    rows = token_states(tiny_lm, CONTEXTS, max_length=handoff.max_length, progress=False)
    states, mask = pad_token_states([rows[i] for i in range(len(CONTEXTS))])
    with torch.no_grad():
        expected = encoder.latent(states, mask)
    torch.testing.assert_close(handoff.send(CONTEXTS).latent, expected, rtol=1e-5, atol=1e-5)
    # a sender that already ran its forward gets the same payload
    inputs = handoff.sender_inputs(CONTEXTS)
    with torch.no_grad():
        out = tiny_lm.model(**inputs, output_hidden_states=True)
    torch.testing.assert_close(handoff.send_from_hidden_states(out, inputs["attention_mask"]).latent, expected,
                               rtol=1e-5, atol=1e-5)
    # save_pretrained keeps the pooler
    again = ILCPHandoff.from_pretrained(handoff.save_pretrained(tmp_path / "saved"), lm=tiny_lm)
    torch.testing.assert_close(again.send(CONTEXTS).latent, expected, rtol=1e-5, atol=1e-5)
    # the modules without their pooler do not fit the config
    with pytest.raises(ExportError, match="pool"):
        ILCPHandoff(tiny_lm, ILCPEncoder(handoff.encoder.vae, handoff.encoder.projector), handoff.config)


def test_mean_pooled_run_sends_what_training_computed(tmp_path, tiny_lm):
    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}",
                             "compressor.memory.kind=mean", "compressor.answer_head_weight=0", "handoff.variants=[ilcp]"])
    run_dir = train(cfg, lm=tiny_lm).run_dir
    handoff = ILCPHandoff.from_pretrained(run_dir, lm=tiny_lm)
    assert handoff.encoder.pooler is None and handoff.spec.memory == MeanMemory()
    z, expected_prefix = modules_directly(run_dir, tiny_lm, CONTEXTS[1], QUESTIONS[1])
    payload = handoff.send(CONTEXTS[1])
    torch.testing.assert_close(payload.latent, z[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(handoff.prefixes(payload, [QUESTIONS[1]])[0], expected_prefix, rtol=1e-5, atol=1e-5)


def test_unknown_pooling_kind_is_refused(handoff):
    import copy

    config = copy.deepcopy(handoff.config)
    config["pooling"]["kind"] = "max"
    with pytest.raises(ExportError, match="pooling kind"):
        ILCPHandoff(handoff.lm, handoff.encoder, config)


def test_empty_or_overlong_questions_are_value_errors(handoff):
    wire = handoff.send(CONTEXTS[0]).to_bytes()
    with pytest.raises(ValueError, match="empty"):
        handoff.receive(wire, "  ")
    with pytest.raises(ValueError, match="positions"):
        handoff.receive(wire, "why " * (handoff.lm.model.config.max_position_embeddings + 1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        handoff.receive(wire, QUESTIONS[0], max_new_tokens=0)
    for bad in (123, None, {"a": 1}, ["ok", 5]):
        with pytest.raises(ValueError):
            handoff.send(bad)
    with pytest.raises(ValueError, match="batch_size"):
        handoff.send(CONTEXTS[0], batch_size=-1)
