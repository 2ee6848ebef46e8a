"""The chunk memory with a beta-VAE per chunk (``compressor.memory.latent``): a run starts from a
pretrained writer and a VAE fitted over it, trains the writer and the VAE on the answers, and
exports; the export sends ``latent`` floats a chunk and the receiver reads their decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ilcp.config import load_config
from ilcp.encoder.chunk import ChunkVAE, decode_vectors
from ilcp.handoff import ILCPHandoff
from ilcp.training.chunk_latent import ChunkLatentConfig, train_latent
from ilcp.training.chunk_pretrain import ChunkPretrainConfig, pretrain

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
CHUNK = ["compressor.memory.kind=chunk", "compressor.memory.chunk_tokens=4", "compressor.memory.width=8",
         "compressor.memory.inner=16", "data.pool_layers=[0]", "compressor.answer_head_weight=0",
         "handoff.memory_placement=in_prompt", "handoff.format_vectors=2", "handoff.variants=[ilcp]",
         "handoff.finetune_encoder=true", "handoff.max_steps=3", "handoff.val_every_steps=3"]
CONTEXT = "Mary moved to the bathroom. John went to the hallway."


@pytest.fixture(scope="module")
def latent_run(tmp_path_factory, tiny_lm):
    from ilcp.training import train

    out = tmp_path_factory.mktemp("chunk-latent-run")
    quiet = lambda _m: None  # noqa: E731
    pretrain(out / "writer", tiny_lm, ChunkPretrainConfig(chunk_tokens=4, batch_chunks=8, steps=3, eval_every=3,
                                                          heldout_chunks=4, width=8, inner=16, babi_stories=10),
             log=quiet)
    train_latent(out / "z8", tiny_lm, out / "writer",
                 ChunkLatentConfig(latent=8, hidden=32, steps=4, batch_chunks=16, eval_every=4, heldout_chunks=4,
                                   babi_stories=10), log=quiet)
    cfg = load_config(TINY_CONFIG, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", *CHUNK,
                                    f"compressor.memory.writer_from={out / 'writer'}", "compressor.memory.latent=8",
                                    f"compressor.memory.latent_from={out / 'z8'}"])
    return out, train(cfg, lm=tiny_lm).run_dir


def test_the_export_sends_the_latent_and_the_receiver_reads_its_decoding(latent_run, tiny_lm):
    out, run = latent_run
    config = json.loads((run / "config.json").read_text())
    assert config["pooling"]["latent"] == 8 and config["latent_dim"] == 8
    handoff = ILCPHandoff.from_pretrained(run, lm=tiny_lm)
    encoder = handoff.encoder
    assert isinstance(encoder.vae, ChunkVAE)
    payload = handoff.send(CONTEXT)
    n_tokens = len(tiny_lm.tokenizer(CONTEXT, add_special_tokens=False)["input_ids"])
    assert payload.latent.shape == (-(-n_tokens // 4), 8)  # 8 floats a chunk cross the wire
    with torch.no_grad():
        memory = encoder.memory(payload.latent.unsqueeze(0))[0]
        torch.testing.assert_close(memory, decode_vectors(encoder.vae, payload.latent).float())
    assert isinstance(handoff.receive(handoff.to_wire(payload), "Where is Mary?"), str)
    # the answer stage trained the writer and the VAE (its decoder too: the receiver reads it)
    fitted = load_file(str(out / "z8" / "state" / "vae.safetensors"))
    exported = load_file(str(run / "model.safetensors"))
    assert not torch.equal(exported["compressor.decoder.4.weight"], fitted["decoder.4.weight"])
    assert not any(k.startswith("projector.") for k in exported)  # the decoder is the compressor's, held once
    assert "8 floats on the wire" in (run / "README.md").read_text()


def test_a_latent_needs_its_fitted_vae_over_the_same_writer(latent_run, tiny_lm, tmp_path):
    from ilcp.training import train

    out, _ = latent_run
    base = [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", *CHUNK,
            f"compressor.memory.writer_from={out / 'writer'}"]
    with pytest.raises(ValueError, match="set both compressor.memory.latent and compressor.memory.latent_from"):
        load_config(TINY_CONFIG, [*base, "compressor.memory.latent=8"])
    with pytest.raises(ValueError, match="narrows vectors of 64 floats to 8; this run sets compressor.memory.latent=4"):
        train(load_config(TINY_CONFIG, [*base, "compressor.memory.latent=4",
                                        f"compressor.memory.latent_from={out / 'z8'}", "run_name=a"]), lm=tiny_lm)
    with pytest.raises(ValueError, match="holds no chunk latent run"):
        train(load_config(TINY_CONFIG, [*base, "compressor.memory.latent=8",
                                        f"compressor.memory.latent_from={tmp_path}", "run_name=b"]), lm=tiny_lm)
    other = [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", *CHUNK, "compressor.memory.latent=8",
             f"compressor.memory.latent_from={out / 'z8'}", "run_name=c"]
    with pytest.raises(ValueError, match="fit the VAE over that writer"):
        train(load_config(TINY_CONFIG, other), lm=tiny_lm)
