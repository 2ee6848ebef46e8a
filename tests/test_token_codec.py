"""Concat pooling, the token loss of the reconstruction stage and random-word texts, on the tiny LM."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from ilcp.encoder.compressor import BetaVAE
from ilcp.config import load_config
from ilcp.encoder.model import ILCPEncoder
from ilcp.export import ExportError, build_encoder, encoder_state, read_config
from ilcp.handoff import ILCPHandoff
from ilcp.encoder.pooling import ConcatPooler, first_state_is_embedding, sender_token_states
from ilcp.tasks import fact_values
from ilcp.training import ReconstructionModule, train
from ilcp.training.data import HandoffRows, collate_rows, heldout_values, word_tokens
from ilcp.training.extraction import token_states
from ilcp.training.handoff_stage import attach_projector
from ilcp.export_integrity import redigest

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
CONTEXTS = ["Cedar is owned by Alice.", "Maple is owned by Bruno.", "Willow is owned by Chen.",
            "John went to the garden. Mary is in the hall."]
CODEC = ["compressor.memory.chunk_tokens=4", "compressor.memory.kind=concat", "compressor.answer_head_weight=0",
         "handoff.num_memory_tokens=4"]


def test_concat_pooler_keeps_each_token_in_its_place_and_zeros_padding():
    pooler = ConcatPooler(dim=3, chunk_tokens=4)
    states = torch.arange(2 * 3 * 3, dtype=torch.float32).view(2, 3, 3)  # chunks shorter than 4
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = pooler(states, mask)
    assert out.shape == (2, 12)
    assert torch.equal(out[0, :9], states[0].reshape(-1)) and torch.equal(out[0, 9:], torch.zeros(3))
    assert torch.equal(out[1, :3], states[1, 0]) and torch.equal(out[1, 3:], torch.zeros(9))
    swapped = pooler(states[:, [1, 0, 2]], torch.ones(2, 3))
    assert not torch.equal(swapped[0], pooler(states, torch.ones(2, 3))[0])  # order is kept, unlike a mean
    with pytest.raises(ValueError, match="chunk states"):
        pooler(torch.zeros(1, 5, 3), torch.ones(1, 5))


def test_concat_pooling_needs_chunks_of_its_size():
    with pytest.raises(ValueError, match="concat pooling reads chunks of 4"):
        ILCPEncoder(BetaVAE(12, 8, 16), pooler=ConcatPooler(3, 4), chunk_tokens=2)
    with pytest.raises(ValueError, match="compressor.memory.chunk_tokens must be >= 1"):
        load_config(TINY_CONFIG, ["compressor.memory.kind=concat", "compressor.memory.chunk_tokens=0",
                                  "compressor.answer_head_weight=0"])


def test_the_token_loss_needs_one_memory_vector_per_chunk_token():
    with pytest.raises(ValueError, match="num_memory_tokens equal to it"):
        load_config(TINY_CONFIG, CODEC[:-1] + ["handoff.num_memory_tokens=2", "reconstruct.token_steps=5"])
    with pytest.raises(ValueError, match="num_memory_tokens equal to it"):
        load_config(TINY_CONFIG, ["reconstruct.token_weight=1"])
    cfg = load_config(TINY_CONFIG, CODEC + ["reconstruct.token_steps=5"])
    assert cfg.reconstruct.enabled and cfg.reconstruct.steps == 0


def _codec(tiny_lm, cfg):
    pooler = ConcatPooler(tiny_lm.hidden_size, 4)
    return attach_projector(ILCPEncoder(BetaVAE(pooler.output_dim, 16, 64), pooler=pooler, chunk_tokens=4),
                            cfg.handoff, tiny_lm)


def test_the_token_loss_teaches_memory_vectors_to_read_as_the_context_tokens(tiny_lm):
    torch.manual_seed(0)
    cfg = load_config(TINY_CONFIG, CODEC + ["reconstruct.token_steps=1", "reconstruct.token_candidates=64"])
    encoder = _codec(tiny_lm, cfg)
    module = ReconstructionModule(encoder, tiny_lm, cfg)
    rows = HandoffRows([{"context": c, "question": "", "answer": ""} for c in CONTEXTS],
                       token_states(tiny_lm, CONTEXTS, progress=False))
    batch = collate_rows([rows[i] for i in range(len(rows))])
    module.eval()  # scores against the whole vocabulary
    memory, _ = module.memory(batch)
    ids = module.context_token_ids(CONTEXTS)
    assert [m.shape[0] for m in memory] == [-(-len(i) // 4) * 4 for i in ids]  # K = C vectors per chunk
    loss0, acc0 = (x.detach() if torch.is_tensor(x) else x for x in module._token_loss(memory, ids))
    module.train()
    opt = torch.optim.AdamW(encoder.parameters(), lr=1e-2)
    for _ in range(60):
        loss, _ = module._token_loss(module.memory(batch)[0], ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
    module.eval()
    with torch.no_grad():
        loss1, acc1 = module._token_loss(module.memory(batch)[0], ids)
    assert float(loss1) < float(loss0) - 1.0 and float(acc1) > 0.9 > float(acc0), (loss0, loss1, acc0, acc1)
    assert not any(p.grad is not None for p in tiny_lm.model.parameters())


def test_random_texts_are_whole_words_drawn_per_step_and_never_a_heldout_value(tiny_lm):
    tok = tiny_lm.tokenizer
    pool = set(word_tokens(tok))
    assert len(pool) >= 16 and all(tok.decode([i])[0] == " " for i in pool)
    word = tok.decode([sorted(pool)[0]]).strip()  # excluding a word removes the tokens that spell it
    kept = set(word_tokens(tok, [word]))
    assert sorted(pool)[0] not in kept and kept < pool
    held = heldout_values()
    assert set(fact_values("person", "heldout")) <= set(held) and not set(fact_values("person", "train")) & set(held)
    cfg = load_config(TINY_CONFIG, CODEC + ["reconstruct.token_steps=2", "reconstruct.random_texts=3",
                                            "reconstruct.random_words=5"])
    module = ReconstructionModule(_codec(tiny_lm, cfg), tiny_lm, cfg)
    memory, ids = module._random_texts()
    assert len(ids) == 3 and all(len(i) == 5 for i in ids) and [m.shape[0] for m in memory] == [8, 8, 8]
    assert set(sum(ids, [])) <= set(word_tokens(tok, held))
    assert module._random_texts()[1] == ids  # seeded by the step: a resumed stage draws the same texts


def test_layer_zero_states_are_the_embedding_lookup_without_a_forward(tiny_lm):
    ids = torch.tensor([[5, 6, 7, 8]])
    full = tiny_lm.model(input_ids=ids, output_hidden_states=True).hidden_states[0]
    assert first_state_is_embedding(tiny_lm.model)
    torch.testing.assert_close(sender_token_states(tiny_lm.model, ids, torch.ones_like(ids), layers=(0,)), full)


def test_a_concat_codec_run_exports_reloads_and_sends_one_latent_per_chunk(tmp_path, tiny_lm):
    result = train(load_config(TINY_CONFIG, CODEC + [
        f"out_dir={tmp_path}", "run_name=codec", "trainer.progress=false", "reconstruct.token_steps=3",
        "reconstruct.steps=2", "reconstruct.token_weight=0.5", "reconstruct.random_texts=4",
        "reconstruct.val_every_steps=5", "handoff.variants=[ilcp]"]), lm=tiny_lm)
    config = read_config(result.run_dir)
    assert config["pooling"]["kind"] == "concat" and config["pooling"]["chunk_tokens"] == 4
    metrics = result.metrics["reconstruct"]
    assert metrics["steps"] == 5 and metrics["last_val_token_acc"] is not None
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    context = "Mary moved to the bathroom. John went to the hallway."
    n_tokens = len(tiny_lm.tokenizer(context, add_special_tokens=False)["input_ids"])
    sent = handoff.send(context)
    assert tuple(sent.latent.shape) == (-(-n_tokens // 4), config["latent_dim"])
    assert isinstance(handoff.receive(sent.to_bytes(), "Where is John?"), str)
    rebuilt = build_encoder(config, encoder_state(handoff.encoder))
    assert rebuilt.pooling == "concat" and not any(k.startswith("pooler.") for k in encoder_state(rebuilt))
    tampered = tmp_path / "tampered"
    shutil.copytree(result.run_dir, tampered)
    bad = dict(config, pooling={k: v for k, v in config["pooling"].items() if k != "chunk_tokens"})
    (tampered / "config.json").write_text(json.dumps(redigest(bad)))
    with pytest.raises(ExportError, match="chunk_tokens"):
        read_config(tampered)


def test_in_prompt_memory_stands_where_the_context_text_stands(tmp_path, tiny_lm):
    from ilcp.receiver.decoding import embed_text
    from ilcp.receiver.prompts import cold_read_prompt, memory_prompt

    with pytest.raises(ValueError, match="memory_placement"):
        load_config(TINY_CONFIG, ["handoff.memory_placement=middle"])
    before, after = memory_prompt(tiny_lm.tokenizer, "Where is John?", "in_prompt")
    assert before + "CONTEXT" + after == cold_read_prompt(tiny_lm.tokenizer, "CONTEXT", "Where is John?")
    with pytest.raises(ValueError, match="format_vectors"):
        load_config(TINY_CONFIG, ["handoff.format_vectors=2"])
    result = train(load_config(TINY_CONFIG, [f"out_dir={tmp_path}", "run_name=inprompt", "trainer.progress=false",
                                             "handoff.variants=[ilcp]", "handoff.memory_placement=in_prompt",
                                             "handoff.format_vectors=2"]), lm=tiny_lm)
    config = read_config(result.run_dir)
    assert config["memory_placement"] == "in_prompt" and config["format_vectors"] == 2
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    sent = handoff.send("Mary moved to the bathroom.")
    prefix = handoff.prefixes(sent.to_bytes(), ["Where is John?"])[0]
    memory = handoff.memory_vectors(sent.to_bytes())[0]
    head, tail = embed_text(tiny_lm.model, tiny_lm.tokenizer, before), embed_text(tiny_lm.model, tiny_lm.tokenizer, after)
    fmt = handoff.encoder.format_prompt.vectors.detach()
    assert fmt.shape == (2, tiny_lm.hidden_size) and fmt.abs().sum() > 0  # trained, exported and reloaded
    torch.testing.assert_close(prefix, torch.cat([fmt, head, memory.to(head.dtype), tail]))
    # the answer stage trained on the same layout: its labels sit after [before ; memory ; after]
    module_cfg = load_config(TINY_CONFIG, ["handoff.memory_placement=in_prompt", "handoff.format_vectors=2"])
    from ilcp.training.handoff_stage import HandoffModule
    module = HandoffModule(handoff.encoder, tiny_lm, module_cfg.handoff)
    seqs, labels = module._answer_sequences(memory.unsqueeze(0), {"context": ["x"], "question": ["Where is John?"],
                                                                   "answer": ["hall"]}, with_context=False)
    n_prompt = 2 + head.shape[0] + memory.shape[0] + tail.shape[0]
    torch.testing.assert_close(seqs[0][:n_prompt], torch.cat([fmt, head, memory.to(head.dtype), tail]))
    assert (labels[0][:n_prompt] == -100).all() and (labels[0][n_prompt:] != -100).all()


def test_a_token_only_codec_stage_keeps_its_best_token_accuracy(tmp_path, tiny_lm):
    result = train(load_config(TINY_CONFIG, CODEC + [
        f"out_dir={tmp_path}", "run_name=tokens", "trainer.progress=false", "reconstruct.token_steps=4",
        "reconstruct.steps=0", "reconstruct.val_every_steps=1", "reconstruct.token_logits=dot",
        "reconstruct.token_shape_weight=0", "handoff.variants=[ilcp]", "handoff.max_steps=1"]), lm=tiny_lm)
    metrics = result.metrics["reconstruct"]
    assert metrics["monitor"] == "val/token_acc"
    accuracies = [row["val/token_acc"] for row in metrics["curve"]]
    assert len(accuracies) == 4 and metrics["best_val_token_acc"] == max(accuracies)
    assert metrics["best_step"] == metrics["curve"][accuracies.index(max(accuracies))]["step"]
