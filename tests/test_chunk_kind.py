"""The chunk memory kind (`ilcp.encoder.chunk_memory`) through the package: a run starts its writer
from a chunk pretraining, trains tuned vectors, exports; the export loads, sends one vector per chunk
of tokens and answers questions on one opened memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ilcp.config import load_config
from ilcp.handoff import ILCPHandoff
from ilcp.training.chunk_pretrain import ChunkPretrainConfig, pretrain

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
CHUNK = ["compressor.memory.kind=chunk", "compressor.memory.chunk_tokens=4", "compressor.memory.width=8",
         "compressor.memory.inner=16", "data.pool_layers=[0]", "compressor.answer_head_weight=0",
         "handoff.memory_placement=in_prompt", "handoff.format_vectors=2", "handoff.variants=[ilcp]",
         "handoff.finetune_encoder=false"]
CONTEXT = "Mary moved to the bathroom. John went to the hallway."
BEFORE = "Sandra left.\n"  # 8 tokens of the tiny tokenizer (two chunks), and the context's tokens follow it unchanged


@pytest.fixture(scope="module")
def chunk_run(tmp_path_factory, tiny_lm):
    from ilcp.training import train

    out = tmp_path_factory.mktemp("chunk-run")
    pretrain(out / "pretrained", tiny_lm, ChunkPretrainConfig(chunk_tokens=4, batch_chunks=8, steps=3, eval_every=3,
                                                              heldout_chunks=4, width=8, inner=16, babi_stories=10),
             log=lambda _m: None)
    cfg = load_config(TINY_CONFIG, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", *CHUNK,
                                    f"compressor.memory.writer_from={out / 'pretrained'}",
                                    "handoff.variants=[cold_read_tuned,ilcp]", "handoff.num_memory_tokens=3"])
    result = train(cfg, lm=tiny_lm)
    return out, result.run_dir


def test_a_chunk_run_exports_its_pretrained_writer_and_the_kind(chunk_run):
    out, run = chunk_run
    config = json.loads((run / "config.json").read_text())
    assert config["pooling"] == {"kind": "chunk", "chunk_tokens": 4, "width": 8, "inner": 16, "layers": [0],
                                 "max_length": config["pooling"]["max_length"]}
    weights = load_file(str(run / "model.safetensors"))
    pretrained = load_file(str(out / "pretrained" / "state" / "writer.safetensors"))
    writer = {k.split("pooler.writer.", 1)[1]: v for k, v in weights.items() if k.startswith("pooler.writer.")}
    assert writer.keys() == pretrained.keys()
    for name, tensor in pretrained.items():  # the writer stays as pretrained (handoff.finetune_encoder=false)
        torch.testing.assert_close(writer[name], tensor)
    assert not any(k.startswith(("vae.", "projector.")) for k in weights)  # the vector crosses as it is


def test_the_tuned_baselines_keep_their_own_k_beside_one_vector_a_chunk(chunk_run):
    from ilcp.export import read_export

    _, run = chunk_run
    config = json.loads((run / "config.json").read_text())
    assert config["num_memory_tokens"] == 1 and config["tuned_vectors"] == 3
    exported = read_export(run)
    assert tuple(exported.soft_prompts["cold_read_tuned"].shape) == (3, 64)
    assert "cold_read_tuned (cold_read_tuned.safetensors): 3 learned vectors." in (run / "README.md").read_text()


def test_a_chunk_export_sends_one_vector_per_chunk_and_answers_many_questions(chunk_run, tiny_lm):
    _, run = chunk_run
    handoff = ILCPHandoff.from_pretrained(run, lm=tiny_lm)
    ids = tiny_lm.tokenizer(CONTEXT, add_special_tokens=False)["input_ids"]
    payload = handoff.send(CONTEXT)
    assert tuple(payload.latent.shape) == (-(-len(ids) // 4), tiny_lm.hidden_size)
    memory = handoff.open(payload.to_bytes())
    answers = memory.ask(["Where is Mary?", "Where is John?"], max_new_tokens=3)
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    assert memory.ask("Where is Mary?", max_new_tokens=3) == answers[0]


def test_a_chunks_vector_is_the_same_alone_after_other_text_and_in_a_batch(chunk_run, tiny_lm):
    _, run = chunk_run
    handoff = ILCPHandoff.from_pretrained(run, lm=tiny_lm)
    tok = tiny_lm.tokenizer
    before, context = (tok(t, add_special_tokens=False)["input_ids"] for t in (BEFORE, CONTEXT))
    assert len(before) == 8 and tok(BEFORE + CONTEXT, add_special_tokens=False)["input_ids"] == before + context
    alone = handoff.send(CONTEXT).latent
    after = handoff.send(BEFORE + CONTEXT).latent
    torch.testing.assert_close(after[2:], alone)
    batched = handoff.send_each(["A long other context about the garden and the office, " * 3, CONTEXT])[1].latent
    torch.testing.assert_close(batched, alone)


def test_chunk_settings_that_cannot_train_are_refused_in_one_line(tmp_path):
    base = [f"out_dir={tmp_path}", *CHUNK]
    with pytest.raises(ValueError, match=r"data.pool_layers=\[0\]"):
        load_config(TINY_CONFIG, [*base, "data.pool_layers=[-1]"])
    with pytest.raises(ValueError, match="handoff.format_vectors > 0"):
        load_config(TINY_CONFIG, [*base, "handoff.format_vectors=0", "handoff.memory_placement=prefix"])
    with pytest.raises(ValueError, match="format_from's vectors are kept frozen"):  # nothing would train
        load_config(TINY_CONFIG, [*base, "handoff.format_vectors=0", "handoff.format_from=cold_read_tuned",
                                  "handoff.variants=[cold_read_tuned,ilcp]"])
    with pytest.raises(ValueError, match="compressor.memory.chunk_tokens must be >= 1"):
        load_config(TINY_CONFIG, [*base, "compressor.memory.chunk_tokens=0"])


def test_a_writer_from_elsewhere_is_refused_naming_the_setting(chunk_run, tiny_lm, tmp_path):
    from ilcp.training import train

    out, _ = chunk_run
    cfg = load_config(TINY_CONFIG, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", *CHUNK,
                                    "compressor.memory.inner=32", f"compressor.memory.writer_from={out / 'pretrained'}"])
    with pytest.raises(ValueError, match="compressor.memory.writer_from: .* set compressor.memory.chunk_tokens"):
        train(cfg, lm=tiny_lm)
    cfg = load_config(TINY_CONFIG, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", *CHUNK,
                                    f"compressor.memory.writer_from={tmp_path / 'nothing'}", "run_name=other"])
    with pytest.raises(ValueError, match="holds no chunk writer"):
        train(cfg, lm=tiny_lm)


def test_the_direct_path_is_a_setting_of_the_kind_written_only_when_on():
    from ilcp.encoder.chunk_memory import ChunkMemory
    from ilcp.encoder.kinds import memory_kind_for

    assert "direct" not in ChunkMemory().entries()
    on = ChunkMemory(direct=True)
    assert on.entries()["direct"] is True and memory_kind_for(on.entries()) == on
    encoder = on.encoder(None, None, on.pooler(64, hidden_size=64))
    assert encoder.writer.direct is not None and ChunkMemory.from_encoder(encoder) == on


def test_one_token_a_chunk_untrained_reads_as_the_cold_read_prompt(tmp_path, tiny_lm):
    """The placement check: an untrained writer at c = 1 hands over each token's own embedding, so
    the in-prompt memory's prefix is the cold-read prompt's rows (up to the cached states' bfloat16),
    its three parts tokenized apart (the context on its own, so the boundary tokens can differ from
    the whole prompt's by a position or two)."""
    from ilcp.receiver.prompts import cold_read_prompt, context_slot_prompt
    from ilcp.training import train

    cfg = load_config(TINY_CONFIG, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", *CHUNK,
                                    "compressor.memory.chunk_tokens=1", "handoff.format_vectors=0",
                                    "handoff.max_steps=0"])  # a chunk writer exports as it starts
    run = train(cfg, lm=tiny_lm).run_dir
    handoff = ILCPHandoff.from_pretrained(run, lm=tiny_lm)
    question = "Where is Mary?"
    got = handoff.open(handoff.send(CONTEXT).to_bytes()).prefix(question)
    tok = tiny_lm.tokenizer
    before, after = context_slot_prompt(tok, question)
    ids = [i for text in (before, CONTEXT, after) for i in tok(text, add_special_tokens=False)["input_ids"]]
    expected = tiny_lm.model.get_input_embeddings()(torch.tensor(ids))
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=0.02, rtol=0.01)
    whole = tok(cold_read_prompt(tok, CONTEXT, question), add_special_tokens=False)["input_ids"]
    assert 0 <= len(ids) - len(whole) <= 2


def test_the_identity_check_recipe_loads_as_it_stands():
    cfg = load_config(TINY_CONFIG.parent / "chunk" / "identity-check.yaml", [])
    assert cfg.compressor.memory.chunk_tokens == 1 and not cfg.compressor.memory.writer_from
    assert cfg.handoff.max_steps == 0 and cfg.handoff.memory_placement == "in_prompt" and not cfg.handoff.format_vectors
