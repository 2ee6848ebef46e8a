"""The chunk kind with the LM itself as its writer (``compressor.memory.writer=sender``): a run
starts the writer from a sender pretraining, fine-tunes it on the answers, exports its adapters
and the LM modules they adapt; the export loads onto a fresh copy of the LM, binds the writer to
it and sends one vector per chunk, the same alone, after other text and in a batch."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ilcp.config import load_config
from ilcp.handoff import ILCPHandoff
from ilcp.training.chunk_pretrain import ChunkPretrainConfig, pretrain

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
SENDER = ["compressor.memory.kind=chunk", "compressor.memory.chunk_tokens=4", "compressor.memory.writer=sender",
          "compressor.memory.sender_layers=1", "compressor.memory.sender_rank=4", "data.pool_layers=[0]",
          "compressor.answer_head_weight=0", "handoff.memory_placement=in_prompt", "handoff.format_vectors=2",
          "handoff.variants=[ilcp]", "handoff.finetune_encoder=true", "handoff.encoder_lr=0.01"]
CONTEXT = "Mary moved to the bathroom. John went to the hallway."
BEFORE = "Sandra left.\n"  # 8 tokens of the tiny tokenizer (two chunks), the context's tokens after it unchanged


@pytest.fixture(scope="module")
def sender_run(tmp_path_factory, tiny_lm):
    from ilcp.training import train

    out = tmp_path_factory.mktemp("sender-run")
    pretrain(out / "pretrained", tiny_lm, ChunkPretrainConfig(chunk_tokens=4, batch_chunks=8, steps=3, eval_every=3,
                                                              heldout_chunks=4, babi_stories=10, sender_layers=1,
                                                              sender_rank=4), log=lambda _m: None)
    cfg = load_config(TINY_CONFIG, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", *SENDER,
                                    f"compressor.memory.writer_from={out / 'pretrained'}"])
    result = train(cfg, lm=tiny_lm)
    return out, result.run_dir


def test_the_export_records_the_writer_and_the_lm_modules_it_adapts(sender_run, tiny_lm):
    out, run = sender_run
    pooling = json.loads((run / "config.json").read_text())["pooling"]
    assert pooling["writer"] == "sender" and pooling["sender_layers"] == 1 and pooling["sender_rank"] == 4
    top = len(tiny_lm.model.model.layers) - 1
    names = [name for name, _, _ in pooling["adapters"]]
    assert len(names) == 7 and all(f"layers.{top}." in name for name in names)  # the top layer's linear maps
    weights = load_file(str(run / "model.safetensors"))
    writer = {k.split("pooler.writer.", 1)[1]: v for k, v in weights.items() if k.startswith("pooler.writer.")}
    pretrained = load_file(str(out / "pretrained" / "state" / "writer.safetensors"))
    assert writer.keys() == pretrained.keys() and "memory_embedding" in writer
    assert any(not torch.equal(writer[k], pretrained[k]) for k in writer)  # fine-tuned on the answers
    assert not any(k.startswith("model") for k in writer)  # the LM is never part of the export


def test_the_export_loads_onto_a_fresh_lm_and_sends_per_chunk_vectors_independent_of_the_rest(sender_run, tiny_lm):
    _, run = sender_run
    fresh = copy.deepcopy(tiny_lm)  # another LM object with the same weights: the writer binds to it
    hooks = {name: len(m._forward_hooks) for name, m in fresh.model.named_modules()}
    handoff = ILCPHandoff.from_pretrained(run, lm=fresh)
    assert handoff.encoder.writer.model is fresh.model
    tok = fresh.tokenizer
    before, context = (tok(t, add_special_tokens=False)["input_ids"] for t in (BEFORE, CONTEXT))
    assert len(before) == 8
    alone = handoff.send(CONTEXT).latent
    assert tuple(alone.shape) == (-(-len(context) // 4), fresh.hidden_size)
    torch.testing.assert_close(handoff.send(BEFORE + CONTEXT).latent[2:], alone, atol=1e-5, rtol=1e-4)
    batched = handoff.send_each(["A long other context about the garden and the office, " * 3, CONTEXT])[1].latent
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-4)
    first = fresh.model.get_input_embeddings().weight[context[0]].float()
    assert not torch.allclose(alone[0], first)  # a trained writer: not the first token handed over
    memory = handoff.open(handoff.send(CONTEXT).to_bytes())
    assert isinstance(memory.ask("Where is Mary?", max_new_tokens=3), str)
    assert {name: len(m._forward_hooks) for name, m in fresh.model.named_modules()} == hooks  # only while it writes


def test_a_sender_writer_must_be_bound_and_fit_its_lm(sender_run, tiny_lm):
    from ilcp.encoder.chunk_sender import SenderChunkWriter
    from ilcp.export import read_export

    _, run = sender_run
    writer = read_export(run).encoder.writer
    assert isinstance(writer, SenderChunkWriter)
    table = tiny_lm.model.get_input_embeddings().weight
    with pytest.raises(ValueError, match=r"bind it to its LM first"):
        writer(table[torch.tensor([[3, 4, 5, 6]])])
    other = SenderChunkWriter(writer.hidden_size, 4, [("model.layers.9.mlp.up_proj", 64, 128)], layers=1, rank=4)
    with pytest.raises(ValueError, match="do not fit this LM's top 1 decoder layers"):
        other.bind(tiny_lm.model)
    with pytest.raises(ValueError, match="it needs the whole LM"):
        writer.bind(torch.nn.Sequential(tiny_lm.model.get_input_embeddings()))


def test_writer_settings_are_checked_in_one_line(tmp_path):
    from ilcp.encoder.chunk_memory import ChunkMemory
    from ilcp.encoder.kinds import memory_kind_for

    base = [f"out_dir={tmp_path}", *SENDER]
    with pytest.raises(ValueError, match="compressor.memory.writer must be one of"):
        load_config(TINY_CONFIG, [*base, "compressor.memory.writer=lstm"])
    with pytest.raises(ValueError, match="compressor.memory.sender_rank must be >= 1"):
        load_config(TINY_CONFIG, [*base, "compressor.memory.sender_rank=0"])
    assert "writer" not in ChunkMemory().entries() and "sender_layers" not in ChunkMemory().entries()
    with pytest.raises(ValueError, match="'pooling.adapters' belong to 'pooling.writer' sender"):
        memory_kind_for({"kind": "chunk", "chunk_tokens": 4, "width": 8, "inner": 16,
                         "adapters": [["model.layers.1.mlp.up_proj", 64, 128]]})
    with pytest.raises(ValueError, match="none are recorded"):
        ChunkMemory(writer="sender").pooler(64, hidden_size=64)


def test_an_untrained_sender_writer_starts_at_the_first_tokens_with_the_end_of_text_memory_token(tiny_lm):
    from ilcp.encoder.chunk_memory import ChunkMemory
    from ilcp.encoder.chunk_sender import memory_token_id

    cfg = load_config(TINY_CONFIG, ["out_dir=/tmp/unused", *SENDER])
    encoder = cfg.compressor.memory.start(cfg, tiny_lm, None)
    table = tiny_lm.model.get_input_embeddings().weight
    writer = encoder.writer
    torch.testing.assert_close(writer.memory_embedding, table[memory_token_id(tiny_lm.tokenizer)].float())
    chunks = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(writer(table[chunks]), table[chunks[:, 0]].float())
    kind = ChunkMemory.from_encoder(encoder)
    assert kind.writer == "sender" and len(kind.adapters) == 7 and kind == encoder.memory_kind
    deep = load_config(TINY_CONFIG, ["out_dir=/tmp/unused", *SENDER, "compressor.memory.sender_layers=3"])
    with pytest.raises(ValueError, match=r"compressor.memory.sender_layers=3: .*the LM has 2 decoder layers"):
        deep.compressor.memory.start(deep, tiny_lm, None)


@pytest.mark.parametrize("linear", [False, True], ids=["mlp-vae", "linear-vae"])
def test_a_latent_over_the_sender_writer_crosses_the_wire_and_loads_onto_a_fresh_lm(sender_run, tiny_lm, linear):
    """compressor.memory.latent with writer sender: the VAE fitted over the sender pretraining
    (ilcp.training.chunk_latent) narrows each chunk's vector; the export binds the writer to a
    fresh LM and sends `latent` floats a chunk. A linear VAE's form is recorded from its run
    (config.json's latent_linear) and rebuilt so on load."""
    from ilcp.encoder.chunk import ChunkVAE
    from ilcp.training import train
    from ilcp.training.chunk_latent import ChunkLatentConfig, train_latent

    out, _ = sender_run
    fit = out / f"z8-{'linear' if linear else 'mlp'}"
    train_latent(fit, tiny_lm, out / "pretrained",
                 ChunkLatentConfig(latent=8, hidden=32, steps=2, batch_chunks=8, eval_every=2, heldout_chunks=4, linear=linear,
                                   babi_stories=10), log=lambda _m: None)
    cfg = load_config(TINY_CONFIG, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", *SENDER, f"run_name=latent-{fit.name}",
                                    f"compressor.memory.writer_from={out / 'pretrained'}",
                                    "compressor.memory.latent=8", f"compressor.memory.latent_from={fit}"])
    run = train(cfg, lm=tiny_lm).run_dir
    config = json.loads((run / "config.json").read_text())
    assert config["pooling"]["writer"] == "sender" and config["pooling"]["latent"] == 8
    assert config["pooling"].get("latent_linear", False) is linear
    fresh = copy.deepcopy(tiny_lm)
    handoff = ILCPHandoff.from_pretrained(run, lm=fresh)
    assert isinstance(handoff.encoder.vae, ChunkVAE) and handoff.encoder.writer.model is fresh.model
    assert handoff.encoder.vae.linear is linear
    n_tokens = len(fresh.tokenizer(CONTEXT, add_special_tokens=False)["input_ids"])
    payload = handoff.send(CONTEXT)
    assert tuple(payload.latent.shape) == (-(-n_tokens // 4), 8)
    torch.testing.assert_close(handoff.send(BEFORE + CONTEXT).latent[2:], payload.latent, atol=1e-5, rtol=1e-4)
    assert isinstance(handoff.open(payload.to_bytes()).ask("Where is Mary?", max_new_tokens=3), str)
