"""Latent capacity by config: one latent per chunk of tokens, wider latents, payload dtypes; the
payload's shape must match the export that reads it."""

from pathlib import Path

import pytest
import torch

from ilcp.encoder.compressor import BetaVAE
from ilcp.config import load_config
from ilcp.encoder.model import ILCPEncoder
from ilcp.export import read_export
from ilcp.handoff import ILCPHandoff
from ilcp.encoder.pooling import masked_mean_pool, pad_token_states, split_chunks
from ilcp.encoder.projector import GatedLatentToMemoryProjector
from ilcp.training import train
from ilcp.training.extraction import token_states
from ilcp.wire.payload import PayloadError, pack

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
CONTEXTS = ["Cedar is owned by Alice.", "John went to the garden. Mary moved to the hall. Sandra is in the office."]


def test_split_chunks_cuts_right_padded_rows_into_consecutive_chunks():
    states = torch.arange(2 * 5 * 1, dtype=torch.float32).view(2, 5, 1)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    chunks, chunk_mask, real = split_chunks(states, mask, 2)
    assert chunks.shape == (6, 2, 1) and real.tolist() == [[True, True, True], [True, False, False]]
    assert chunks[2, :, 0].tolist() == [4.0, 0.0] and chunk_mask[2].tolist() == [1, 0]
    encoder = ILCPEncoder(BetaVAE(1, 3, 8), chunk_tokens=2)
    assert encoder.latent_mask(mask).tolist() == real.tolist()


def test_chunked_encoder_gives_one_latent_and_k_vectors_per_chunk():
    torch.manual_seed(0)
    encoder = ILCPEncoder(BetaVAE(4, 3, 8), GatedLatentToMemoryProjector(3, 2, 6, 8), chunk_tokens=3).eval()
    states, mask = pad_token_states([torch.randn(7, 4), torch.randn(2, 4)])
    z = encoder.latent(states, mask)
    assert z.shape == (2, 3, 3)
    # each chunk's latent is the VAE's latent of that chunk's mean
    torch.testing.assert_close(z[0, 2], encoder.vae.latent(states[0, 6:7].mean(0, keepdim=True))[0])
    torch.testing.assert_close(z[1, 0], encoder.vae.latent(masked_mean_pool(states[1:2, :3], mask[1:2, :3]))[0])
    memory = encoder.memory(z)
    assert memory.shape == (2, 3 * 2, 6)
    rows, kl = encoder.memory_for_batch({"tokens": states, "token_mask": mask}, torch.float32)
    assert [r.shape[0] for r in rows] == [6, 2] and torch.isfinite(kl)
    torch.testing.assert_close(rows[1], memory[1, :2])


@pytest.fixture(scope="module")
def chunked_run(tmp_path_factory, tiny_lm):
    out = tmp_path_factory.mktemp("chunked-run")
    cfg = load_config(TINY, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", "handoff.variants=[ilcp]",
                             "compressor.memory.chunk_tokens=4", "compressor.answer_head_weight=0",
                             "compressor.latent_dim=16", "reconstruct.steps=2", "reconstruct.val_every_steps=2"])
    return cfg, train(cfg, lm=tiny_lm)


def test_a_chunked_run_exports_its_chunk_size_and_sends_what_training_computed(chunked_run, tiny_lm):
    cfg, result = chunked_run
    run = read_export(result.run_dir)
    assert run.config["pooling"]["chunk_tokens"] == 4 and run.config["latent_dim"] == 16
    handoff = ILCPHandoff.from_export(run, tiny_lm)
    trained = result.sources["ilcp"].eval()
    rows = token_states(tiny_lm, CONTEXTS, max_length=handoff.max_length, progress=False)
    for i, context in enumerate(CONTEXTS):
        n = -(-rows[i].shape[0] // 4)
        payload = handoff.send(context)
        assert payload.latent.shape == (n, 16)
        with torch.no_grad():
            expected = trained.latent(rows[i].unsqueeze(0), torch.ones(1, rows[i].shape[0], dtype=torch.long))[0]
        torch.testing.assert_close(payload.latent, expected, rtol=1e-5, atol=1e-5)
        assert handoff.memory_vectors(payload.to_bytes()).shape == (1, n * cfg.handoff.num_memory_tokens,
                                                                     tiny_lm.hidden_size)
    with pytest.raises(ValueError, match="send_each"):
        handoff.send(CONTEXTS)
    each = handoff.send_each(CONTEXTS)
    assert [p.latent.shape[0] for p in each] == [-(-rows[i].shape[0] // 4) for i in range(2)]
    assert isinstance(handoff.receive(each[1].to_bytes(), "Where is Mary?", max_new_tokens=2), str)
    # payloads grow with the context
    assert each[1].byte_length() > each[0].byte_length()


def test_payload_shapes_an_export_does_not_read_are_refused(chunked_run, tiny_run, tiny_lm):
    _, result = chunked_run
    chunked = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    single = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)
    fp = tiny_lm.fingerprint
    with pytest.raises(PayloadError, match="shape"):
        chunked.memory_vectors(pack(torch.zeros(16), lm_fingerprint=fp).to_bytes())  # (Z,): no chunk axis
    with pytest.raises(PayloadError, match="shape"):
        chunked.memory_vectors(pack(torch.zeros(3, 8), lm_fingerprint=fp).to_bytes())  # wrong width
    with pytest.raises(PayloadError, match="shape"):
        single.memory_vectors(pack(torch.zeros(2, 3, single.latent_dim), lm_fingerprint=fp).to_bytes())
    with pytest.raises(PayloadError, match="shape"):
        single.memory_vectors(pack(torch.zeros(single.latent_dim + 1), lm_fingerprint=fp).to_bytes())


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_a_wide_chunked_payload_round_trips_the_wire_format(chunked_run, tiny_lm, dtype):
    _, result = chunked_run
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm, payload_dtype=dtype)
    payload = handoff.send(CONTEXTS[1])
    received = handoff.parse(payload.to_bytes())
    assert received.dtype == dtype and received.latent.shape == payload.latent.shape
    assert handoff.memory_vectors(received).shape[1] == payload.latent.shape[0] * handoff.num_memory_tokens


def test_chunks_with_the_answer_head_are_a_config_error():
    with pytest.raises(ValueError, match="answer_head_weight > 0 reads one latent per context"):
        load_config(TINY, ["compressor.memory.chunk_tokens=8", "compressor.answer_head_weight=1"])
