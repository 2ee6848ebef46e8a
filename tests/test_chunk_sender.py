"""The LM as chunk writer (`SenderChunkWriter`): adapters act only while it writes, a vector
depends on its chunk alone, the receiver's loss trains the adapters and head only, and a
pretraining run with it resumes on the same curve."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ilcp.encoder.chunk_sender import SenderChunkWriter
from ilcp.lm import lm_fingerprint, load_lm
from ilcp.training.chunk_pretrain import ChunkPretrainConfig, ChunkReader, pretrain, write


@pytest.fixture(scope="module")
def tiny():
    return load_lm("tiny-qwen3")


def _writer(tiny, **kw) -> SenderChunkWriter:
    table = tiny.model.get_input_embeddings().weight
    return SenderChunkWriter.for_model(tiny.model, 4, table[1], **{"layers": 1, "rank": 4, **kw})


def test_an_untrained_writer_hands_over_the_first_token_and_leaves_the_lm_as_it_was(tiny):
    table = tiny.model.get_input_embeddings().weight
    before = lm_fingerprint(tiny.model, tiny.tokenizer)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        plain = tiny.model(input_ids=ids).logits
    writer = _writer(tiny)
    chunks = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(writer(table[chunks]), table[chunks[:, 0]].float())
        writer.head.weight.normal_(std=0.1)
        plain_writer = writer(table[chunks])
        for adapter in writer.adapters.values():  # adapters that have learned something
            adapter.b.normal_(std=0.5)
        adapted_writer = writer(table[chunks])
        torch.testing.assert_close(tiny.model(input_ids=ids).logits, plain)  # not while the receiver reads
    assert not torch.allclose(adapted_writer, plain_writer)  # while the writer runs, they act
    assert lm_fingerprint(tiny.model, tiny.tokenizer) == before
    assert not any(k.startswith("model") for k in writer.state_dict())  # the LM is not the writer's weight
    assert len(writer.adapters) == 7  # q, k, v, o, gate, up, down of the top layer
    assert not [m for m in tiny.model.modules() if m._forward_hooks]  # hooks only while the writer runs


def test_a_chunk_vector_depends_on_its_chunk_alone_and_not_on_padding(tiny):
    table = tiny.model.get_input_embeddings().weight
    torch.manual_seed(0)
    writer = _writer(tiny)
    torch.nn.init.normal_(writer.head.weight, std=0.1)
    for adapter in writer.adapters.values():
        adapter.b.data.normal_(std=0.5)
    chunk = torch.tensor([[11, 12, 13, 14]])
    others = torch.tensor([[21, 22, 23, 24], [31, 32, 33, 34]])
    with torch.no_grad():
        alone = writer(table[chunk])
        batched = writer(table[torch.cat([others, chunk])])[-1:]
        short = writer(table[torch.tensor([[11, 12, 0, 0], [11, 12, 9, 9]])], torch.tensor([2, 2]))
        whole = writer(table[torch.tensor([[11, 12, 9, 9]])])
    torch.testing.assert_close(alone, batched, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(short[0], short[1], atol=1e-5, rtol=1e-4)  # padding is not read
    assert not torch.allclose(short[1], whole[0])  # the real tokens are


def test_the_receivers_loss_trains_the_adapters_and_head_alone(tiny):
    reader = ChunkReader(tiny)
    torch.manual_seed(0)
    writer = _writer(tiny, layers=2)
    opt = torch.optim.AdamW(writer.parameters(), lr=1e-2)
    texts = torch.randint(5, 200, (8, 4))
    losses = []
    for step in range(25):
        loss = reader.score(write(writer, reader, texts), texts)["loss"]
        opt.zero_grad()
        loss.backward()
        if step == 2:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in writer.parameters())
        opt.step()
        losses.append(float(loss.detach()))
    assert all(p.grad is None for p in tiny.model.parameters())
    assert losses[-1] < losses[0] - 0.02


def test_bad_sender_settings_are_refused(tiny):
    table = tiny.model.get_input_embeddings().weight
    with pytest.raises(ValueError, match="the LM has 2 decoder layers"):
        SenderChunkWriter.for_model(tiny.model, 4, table[1], layers=3)
    with pytest.raises(ValueError, match="memory_embedding"):
        SenderChunkWriter.for_model(tiny.model, 4, table[1, :3], layers=1)
    with pytest.raises(ValueError, match="no such path"):
        ChunkPretrainConfig(sender_layers=2, direct=True)
    with pytest.raises(ValueError, match="sender_rank"):
        ChunkPretrainConfig(sender_layers=2, sender_rank=0)


def test_a_sender_pretraining_resumes_on_the_same_curve_and_leaves_no_hooks(tiny, tmp_path):
    cfg = dict(chunk_tokens=4, batch_chunks=8, lr=3e-3, warmup_steps=2, eval_every=3, heldout_chunks=8,
               babi_stories=20, sender_layers=1, sender_rank=4)
    quiet = lambda _m: None  # noqa: E731
    whole = pretrain(tmp_path / "whole", tiny, ChunkPretrainConfig(steps=6, **cfg), log=quiet)
    pretrain(tmp_path / "split", tiny, ChunkPretrainConfig(steps=3, **cfg), log=quiet)
    resumed = pretrain(tmp_path / "split", tiny, ChunkPretrainConfig(steps=6, **cfg), resume=True, log=quiet)
    assert [r["step"] for r in resumed] == [0, 3, 6]
    for a, b in zip(whole, resumed):
        assert a["squad"] == b["squad"] and a["train_loss"] == b["train_loss"]
    assert whole[-1]["squad"]["loss"] != whole[0]["squad"]["loss"]
    hooks = [m for m in tiny.model.modules() if m._forward_hooks]
    assert not hooks


def test_a_sender_writer_ships_with_its_card_and_a_vae_fits_over_it(tiny, tmp_path):
    from ilcp.encoder.chunk_files import read_writer_state
    from ilcp.training.chunk_latent import load_writer
    from ilcp.training.chunk_ship import ship

    quiet = lambda _m: None  # noqa: E731
    cfg = ChunkPretrainConfig(chunk_tokens=4, batch_chunks=8, steps=2, eval_every=2, heldout_chunks=4, babi_stories=10,
                              sender_layers=1, sender_rank=4)
    pretrain(tmp_path / "run", tiny, cfg, log=quiet)
    dest = ship(tmp_path / "run", tmp_path / "shipped", tiny, texts_per_set=4, log=quiet)
    config = json.loads((dest / "config.json").read_text())
    assert config["writer"] == {"kind": "sender", "hidden_size": 64, "chunk_tokens": 4, "layers": 1, "rank": 4}
    card = (dest / "README.md").read_text()
    assert "the LM itself" in card and "compressor.memory.writer=sender compressor.memory.sender_layers=1" in card
    shipped = read_writer_state(dest, config["writer"], tiny.fingerprint)
    for name, tensor in load_file(str(tmp_path / "run" / "state" / "writer.safetensors")).items():
        torch.testing.assert_close(shipped[name], tensor)
    writer = load_writer(dest, tiny)  # what chunk_latent fits its VAE over
    table = tiny.model.get_input_embeddings().weight
    chunks = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        again = SenderChunkWriter.for_model(tiny.model, 4, table[1], layers=1, rank=4)
        again.load_state_dict(shipped)
        torch.testing.assert_close(writer(table[chunks]), again(table[chunks]))
