"""What one payload may make a receiver do: its latent count is bounded (``max_payload_latents``)
before anything is read or projected, its values by the export's ``latent_bound``, and memory
that projects to NaN or infinity is refused; each refusal is one PayloadError line."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ilcp.wire import payload as transport
from ilcp.encoder.compressor import BetaVAE
from ilcp.encoder.model import ILCPEncoder
from ilcp.encoder.spec import EncoderSpec
from ilcp.engines.served import ServedDecoder, ServedReceiver
from ilcp.engines.vllm import VLLMReceiver
from ilcp.export import ExportError, encoder_state, read_config, read_export, sign_export
from ilcp.export_integrity import file_digest
from ilcp.handoff import ILCPHandoff
from ilcp.encoder.kinds import AttentionMemory
from ilcp.encoder.slot_memory import SlotMemory
from ilcp.encoder.projector import GatedLatentToMemoryProjector
from ilcp.training import data as training_data
from ilcp.training.data import HandoffRows, latent_bound
from ilcp.wire.payload import PayloadError, pack
from ilcp.export_integrity import redigest

KEY = b"k" * 32
CONTEXT, QUESTION = "Mary moved to the hallway. John went to the garden.", "Where is John?"
LEGACY = Path(__file__).resolve().parent / "data" / "exports" / "legacy-num-queries"
HUGE = 3.4e38  # finite in float32 and bfloat16


@pytest.fixture
def handoff(tiny_run, tiny_lm):
    return ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)


def wire_of(h: ILCPHandoff, z: torch.Tensor, dtype="float32", key=None) -> bytes:
    return pack(z, lm_fingerprint=h.fingerprint, dtype=dtype).to_bytes(key)


def built(tiny_run, tiny_lm, memory, **options) -> ILCPHandoff:
    """A handoff of another memory kind on the tiny LM, with untrained weights (the tiny run's
    config with `memory` in place of its own)."""
    config = read_config(tiny_run.run_dir)
    hidden = config["lm"]["hidden_size"]
    spec = EncoderSpec.from_config(config)
    pooler = memory.pooler(hidden * len(spec.layers), hidden_size=hidden)
    spec = dataclasses.replace(spec, memory=memory, input_dim=pooler.output_dim)
    config.update(spec.to_config())
    return ILCPHandoff(tiny_lm, spec.build(hidden), config, **options)


def never_projected(monkeypatch, h: ILCPHandoff) -> None:
    """Projecting a latent, or reading a payload's values, fails the test."""
    def projected(*args, **kwargs):
        raise AssertionError("a latent was projected")

    def read(*args, **kwargs):
        raise AssertionError("the payload's values were read")

    monkeypatch.setattr(h.encoder, "memory", projected)
    monkeypatch.setattr(transport, "_read_array", read)


def served(h: ILCPHandoff) -> ServedReceiver:
    """A served receiver whose server is never asked: decoding fails the test."""
    decoder = object.__new__(ServedDecoder)
    decoder.lm = h.lm
    decoder.decode = lambda *a, **k: pytest.fail("a request reached the server")
    return ServedReceiver(h, decoder)


def vllm(h: ILCPHandoff) -> VLLMReceiver:
    """A vLLM receiver without an engine: decoding fails the test."""
    receiver = object.__new__(VLLMReceiver)
    receiver.handoff = h
    receiver.decode = lambda *a, **k: pytest.fail("a prefix reached the engine")
    return receiver


# ------------------------------------------------------------------------------ latent count

NO_COUNT = {
    "parse": lambda h, w: h.parse(w),
    "memory_vectors": lambda h, w: h.memory_vectors(w),
    "reconstruct": lambda h, w: h.reconstruct(w, max_new_tokens=2),
}
ONE_QUESTION = {
    "receive": lambda h, w: h.receive(w, QUESTION),
    "prefixes": lambda h, w: h.prefixes(w, [QUESTION]),
    "served receive": lambda h, w: served(h).receive(w, QUESTION),
    "served receive_many": lambda h, w: served(h).receive_many([(w, QUESTION)]),
    "vllm receive": lambda h, w: vllm(h).receive(w, QUESTION),
    "vllm receive_many": lambda h, w: vllm(h).receive_many([(w, QUESTION)]),
}


def test_the_default_limit_is_what_one_context_gives(handoff, tiny_run, tiny_lm):
    assert handoff.max_payload_latents == handoff.max_chunks == 1  # one latent per context
    chunked = built(tiny_run, tiny_lm, AttentionMemory(pool_queries=4, chunk_tokens=4))
    assert chunked.max_payload_latents == chunked.max_chunks == -(-chunked.max_length // 4)
    slots = built(tiny_run, tiny_lm, SlotMemory(8, 2, 12))
    assert slots.max_payload_latents == slots.max_chunks == 12  # max_slots


@pytest.mark.parametrize("sealed", [False, True], ids=["bytes", "sealed"])
@pytest.mark.parametrize("entry", list(NO_COUNT))
def test_100000_latents_without_a_question_count_are_refused_before_they_are_read(
        entry, sealed, tiny_run, tiny_lm, monkeypatch):
    h = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, auth_key=KEY if sealed else None)
    wire = wire_of(h, torch.zeros(100_000, h.latent_dim), key=h.auth_key)
    never_projected(monkeypatch, h)
    with pytest.raises(PayloadError) as info:
        NO_COUNT[entry](h, wire)
    message = str(info.value)
    assert "\n" not in message
    assert "100000 latents" in message and "at most 1" in message and "max_payload_latents=" in message


@pytest.mark.parametrize("entry", list(NO_COUNT))
def test_a_payload_object_over_the_limit_is_refused_before_projection(entry, handoff, monkeypatch):
    payload = pack(torch.zeros(3, handoff.latent_dim), lm_fingerprint=handoff.fingerprint)
    never_projected(monkeypatch, handoff)
    with pytest.raises(PayloadError, match="3 latents; without a question count this receiver reads at most 1"):
        NO_COUNT[entry](handoff, payload)


@pytest.mark.parametrize("entry", list(ONE_QUESTION))
def test_a_payload_of_100000_latents_for_one_question_never_reaches_projection_or_a_decoder(
        entry, handoff, monkeypatch):
    wire = wire_of(handoff, torch.zeros(100_000, handoff.latent_dim))
    never_projected(monkeypatch, handoff)
    with pytest.raises(PayloadError, match="holds 100000 latent"):
        ONE_QUESTION[entry](handoff, wire)


@pytest.mark.parametrize("entry", list(ONE_QUESTION))
def test_every_receiver_counts_latents_per_question(entry, tiny_run, tiny_lm, monkeypatch):
    h = built(tiny_run, tiny_lm, AttentionMemory(pool_queries=4, chunk_tokens=4), max_payload_latents=8)
    wire = wire_of(h, torch.zeros(1, 9, h.latent_dim))  # 9 chunks: within max_chunks, over the setting
    never_projected(monkeypatch, h)
    with pytest.raises(PayloadError) as info:
        ONE_QUESTION[entry](h, wire)
    message = str(info.value)
    assert "9 latents for 1 question(s)" in message and "at most 8 per question" in message
    assert "max_payload_latents=9" in message  # what would let it through


def test_a_chunked_payload_of_many_contexts_is_bounded_in_all(tiny_run, tiny_lm, monkeypatch):
    h = built(tiny_run, tiny_lm, AttentionMemory(pool_queries=4, chunk_tokens=4))
    wire = wire_of(h, torch.zeros(3, 1000, h.latent_dim))  # each context within max_chunks
    with pytest.raises(PayloadError, match=f"3000 latents; .* at most {h.max_chunks} "):
        h.memory_vectors(wire)
    assert h.memory_vectors(wire, contexts=3).shape[:2] == (3, 1000 * h.num_memory_tokens)


def test_memory_slots_are_bounded_by_max_slots(tiny_run, tiny_lm):
    h = built(tiny_run, tiny_lm, SlotMemory(8, 2, 12))
    wire = wire_of(h, torch.zeros(2, 12, h.latent_dim))
    with pytest.raises(PayloadError, match="24 latents; .* at most 12 "):
        h.memory_vectors(wire)
    assert h.memory_vectors(wire, contexts=2).shape[:2] == (2, 12 * h.num_memory_tokens)
    raised = built(tiny_run, tiny_lm, SlotMemory(8, 2, 12), max_payload_latents=24)
    assert raised.memory_vectors(wire).shape[:2] == (2, 12 * h.num_memory_tokens)


def test_the_setting_raises_the_limit(handoff, tiny_run, tiny_lm):
    three = handoff.send([CONTEXT, CONTEXT, CONTEXT])
    with pytest.raises(PayloadError, match="3 latents"):
        handoff.memory_vectors(three.to_bytes())
    assert handoff.memory_vectors(three.to_bytes(), contexts=3).shape[0] == 3
    raised = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, max_payload_latents=3)
    assert raised.parse(three.to_bytes()).latent.shape == (3, raised.latent_dim)
    assert raised.memory_vectors(three).shape[0] == 3
    assert len(raised.reconstruct(three, max_new_tokens=1)) == 3
    with pytest.raises(PayloadError, match="4 latents; .* at most 3 "):
        raised.parse(handoff.send([CONTEXT] * 4).to_bytes())


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "3"])
def test_a_limit_that_is_not_a_positive_int_is_refused(value, tiny_run, tiny_lm):
    with pytest.raises(ValueError, match="max_payload_latents must be a positive int"):
        ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, max_payload_latents=value)


# ---------------------------------------------------------------------------- latent values

@pytest.mark.parametrize("dtype, value", [("float32", HUGE), ("bfloat16", 3.0e38), ("int8", 3.0e38)])
def test_an_extreme_latent_value_is_refused_before_projection(dtype, value, handoff, monkeypatch):
    assert handoff.encoder.latent_bound is not None
    wire = wire_of(handoff, torch.full((handoff.latent_dim,), value), dtype)
    monkeypatch.setattr(handoff.encoder, "memory", lambda *a, **k: pytest.fail("a latent was projected"))
    for call in (lambda: handoff.receive(wire, QUESTION), lambda: handoff.parse(wire),
                 lambda: handoff.reconstruct(wire), lambda: served(handoff).receive(wire, QUESTION)):
        with pytest.raises(PayloadError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and "latent_bound" in message and "e+38" in message


def test_values_within_the_bound_are_read_and_beyond_it_refused(handoff):
    bound = handoff.encoder.latent_bound
    z = torch.zeros(handoff.latent_dim)
    z[3] = -0.99 * bound
    assert handoff.memory_vectors(wire_of(handoff, z)).shape[0] == 1
    z[3] = -1.01 * bound
    with pytest.raises(PayloadError, match="beyond this export's latent_bound"):
        handoff.memory_vectors(wire_of(handoff, z))


def test_memory_that_projects_to_infinity_is_refused(handoff, monkeypatch):
    wire = handoff.to_wire(handoff.send(CONTEXT))
    real = handoff.encoder.memory
    monkeypatch.setattr(handoff.encoder, "memory", lambda z, dtype=None: torch.full_like(real(z, dtype), float("inf")))
    for call in (lambda: handoff.memory_vectors(wire), lambda: handoff.receive(wire, QUESTION),
                 lambda: handoff.reconstruct(wire)):
        with pytest.raises(PayloadError, match="project to non-finite memory vectors"):
            call()


def test_without_a_bound_an_extreme_value_is_refused_after_projection(handoff):
    handoff.encoder.latent_bound = None  # as an export written before the bound
    wire = wire_of(handoff, torch.full((handoff.latent_dim,), HUGE))
    assert handoff.parse(wire).latent.shape == (handoff.latent_dim,)
    with pytest.raises(PayloadError, match="non-finite memory vectors"):
        handoff.receive(wire, QUESTION)


# ------------------------------------------------------------------------------ the export

def test_the_export_records_its_bound_under_the_digest(tiny_run, tiny_lm, tmp_path):
    run = tiny_run.run_dir
    state = load_file(str(run / "model.safetensors"))
    bound = state["compressor.latent_bound"]
    assert bound.dtype == torch.float32 and bound.dim() == 0
    h = ILCPHandoff.from_pretrained(run, lm=tiny_lm)
    assert h.encoder.latent_bound == float(bound)
    sent = torch.stack([h.send(c).latent for c in [CONTEXT, "Daniel went back to the office.", "x"]])
    assert 0 < float(sent.abs().max()) < float(bound)
    # save_pretrained keeps it
    saved = h.save_pretrained(tmp_path / "saved")
    assert torch.equal(load_file(str(saved / "model.safetensors"))["compressor.latent_bound"], bound)
    assert ILCPHandoff.from_pretrained(saved, lm=tiny_lm).encoder.latent_bound == float(bound)


def _edit_bound(run: Path, value, recompute_digest: bool) -> None:
    state = load_file(str(run / "model.safetensors"))
    if value is None:
        del state["compressor.latent_bound"]
    else:
        state["compressor.latent_bound"] = value
    save_file(state, str(run / "model.safetensors"), metadata={"format": "pt"})
    if recompute_digest:
        config = json.loads((run / "config.json").read_text())
        config["digests"]["model.safetensors"] = file_digest(run / "model.safetensors")
        (run / "config.json").write_text(json.dumps(redigest(config)))


def test_an_edited_bound_is_refused_by_the_digest_and_with_a_key_by_the_signature(tiny_run, tmp_path):
    for name, value in (("raised", torch.tensor(1e30)), ("removed", None)):
        run = Path(shutil.copytree(tiny_run.run_dir, tmp_path / name))
        _edit_bound(run, value, recompute_digest=False)
        with pytest.raises(ExportError, match="model.safetensors changed after export: its sha256 differs"):
            read_export(run)
        signed = Path(shutil.copytree(tiny_run.run_dir, tmp_path / f"{name}-signed"))
        sign_export(signed, KEY)
        _edit_bound(signed, value, recompute_digest=True)
        with pytest.raises(ExportError, match="the signature does not verify"):
            read_export(signed, key=KEY)


@pytest.mark.parametrize("value", [torch.tensor(-1.0), torch.tensor(0.0), torch.tensor(float("nan")),
                                   torch.tensor([1.0, 2.0]), torch.tensor(2.0, dtype=torch.float64)],
                         ids=["negative", "zero", "nan", "two values", "float64"])
def test_a_bound_that_is_no_bound_is_refused(value, tiny_run, tmp_path):
    run = Path(shutil.copytree(tiny_run.run_dir, tmp_path / "run"))
    _edit_bound(run, value, recompute_digest=True)
    with pytest.raises(ExportError, match="compressor.latent_bound must be one finite float32 > 0"):
        read_export(run)


def test_an_export_without_the_bound_loads_and_bounds_no_value(tiny_lm, tmp_path):
    assert "compressor.latent_bound" not in load_file(str(LEGACY / "model.safetensors"))
    h = ILCPHandoff.from_pretrained(LEGACY, lm=tiny_lm)
    assert h.encoder.latent_bound is None
    assert isinstance(h.receive(h.to_wire(h.send(CONTEXT)), QUESTION), str)
    assert "compressor.latent_bound" not in encoder_state(h.encoder)
    saved = h.save_pretrained(tmp_path / "saved")  # and saves none
    assert "compressor.latent_bound" not in load_file(str(saved / "model.safetensors"))
    z = torch.full((h.latent_dim,), 1e6)  # no bound by value: read
    assert h.parse(wire_of(h, z)).latent.shape == (h.latent_dim,)
    with pytest.raises(PayloadError, match="non-finite memory vectors"):
        h.receive(wire_of(h, torch.full((h.latent_dim,), HUGE)), QUESTION)


# ------------------------------------------------------------------------------ training's bound

def test_the_bound_is_4x_the_largest_latent_of_the_first_rows(monkeypatch):
    torch.manual_seed(0)
    encoder = ILCPEncoder(BetaVAE(6, 3, 8), GatedLatentToMemoryProjector(3, 2, 4, 8))
    pooled = torch.randn(10, 6)
    pooled[7] *= 100  # a row past the cap: not read
    rows = [{"context": "c", "question": "q", "answer": "a"}] * 5
    val, train = HandoffRows(rows, pooled[:5]), HandoffRows(rows, pooled[5:])
    monkeypatch.setattr(training_data, "LATENT_BOUND_ROWS", 7)  # 5 validation rows, then 2 training rows
    expected = 4 * float(encoder.vae.latent(pooled[:7]).detach().abs().max())
    assert latent_bound(encoder, [val, train], batch_size=3) == pytest.approx(expected, rel=1e-6)
    monkeypatch.setattr(training_data, "LATENT_BOUND_ROWS", 10)
    assert latent_bound(encoder, [val, train], batch_size=3) == pytest.approx(
        4 * float(encoder.vae.latent(pooled).detach().abs().max()), rel=1e-6)
    assert encoder.training  # its mode is given back
