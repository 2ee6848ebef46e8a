"""ilcp.encoder.slots: learned slot tokens the sender's LM reads after the context, one latent per
slot. The two-part forward equals one forward over [context ; slots]; the slot count grows with
the context; a trained run sends, crosses the wire and receives as in process; a sender that kept
its forward's cache pays only the slots; bad settings are refused in one line."""

import json
from pathlib import Path

import pytest
import torch

from ilcp.encoder.compressor import BetaVAE
from ilcp.config import load_config
from ilcp.encoder.spec import EncoderSpec, ExportError
from ilcp.handoff import ILCPHandoff
from ilcp.encoder.kinds import memory_kind_for
from ilcp.encoder.slot_memory import SlotMemory
from ilcp.encoder.slots import (
    SlotEncoder,
    SlotTokens,
    slot_counts,
    slot_states,
)
from ilcp.encoder.pooling import length_groups, pad_id_of, pad_right
from ilcp.encoder.projector import GatedLatentToMemoryProjector

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"

REPO = TINY_CONFIG.parent.parent

SLOTS = ["compressor.memory.kind=slots", "compressor.answer_head_weight=0", "compressor.memory.tokens_per_slot=8",
         "compressor.memory.min_slots=2", "compressor.memory.max_slots=12", "handoff.variants=[ilcp]"]
SHORT = "Mary went to the kitchen."
LONG = " ".join(["John moved to the garden."] * 12)


def _slots(lm, tokens_per_slot=4, min_slots=1, max_slots=8, layers=1) -> SlotTokens:
    slots = SlotTokens(lm.hidden_size * layers, lm.hidden_size, tokens_per_slot, min_slots, max_slots)
    slots.init_from_embeddings(lm.model.get_input_embeddings().weight, seed=0)
    return slots


def _ids(lm, texts):
    ids = lm.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return pad_right(ids, pad_id_of(lm.tokenizer))


def test_the_slot_count_grows_with_the_context_within_its_bounds():
    lengths = torch.tensor([1, 8, 9, 40, 1000])
    assert slot_counts(lengths, 8, 2, 12).tolist() == [2, 2, 2, 5, 12]
    assert slot_counts(lengths, 8, 1, 200).tolist() == [1, 1, 2, 5, 125]


def test_the_two_part_forward_equals_one_forward_over_context_and_slots(tiny_lm):
    """Batched and right-padded, each row's slot states are those of one unpadded forward over
    its context followed by its own slots."""
    model, slots = tiny_lm.model, _slots(tiny_lm)
    texts = [SHORT, LONG]
    ids, mask = _ids(tiny_lm, texts)
    with torch.no_grad():
        states, slot_mask = slot_states(model, slots, mask, (-1, 0), input_ids=ids)
        assert slot_mask.sum(-1).tolist() == slots.counts(mask.sum(-1)).tolist()
        assert states.shape == (2, int(slot_mask.sum(-1).max()), 2 * tiny_lm.hidden_size)
        for row in range(2):
            length, n = int(mask[row].sum()), int(slot_mask[row].sum())
            context = model.get_input_embeddings()(ids[row:row + 1, :length])
            whole = torch.cat([context, slots.embeddings[:n].unsqueeze(0)], dim=1)
            out = model(inputs_embeds=whole, output_hidden_states=True, use_cache=False)
            expected = torch.cat([out.hidden_states[-1], out.hidden_states[0]], dim=-1)[0, length:]
            torch.testing.assert_close(states[row, :n], expected, atol=1e-5, rtol=1e-4)


def test_gradients_reach_the_slots_and_not_the_lm(tiny_lm):
    slots = _slots(tiny_lm)
    encoder = SlotEncoder(BetaVAE(slots.output_dim, 8, 32), GatedLatentToMemoryProjector(8, 2, tiny_lm.hidden_size, 16),
                          slots)
    encoder.bind_sender(tiny_lm.model, tiny_lm.tokenizer, 64, (-1,))
    rows, kl = encoder.memory_for_batch({"context": [SHORT, LONG]}, torch.float32)
    lengths = torch.tensor([len(i) for i in tiny_lm.tokenizer([SHORT, LONG], add_special_tokens=False)["input_ids"]])
    assert [r.shape[0] for r in rows] == [2 * n for n in slots.counts(lengths).tolist()]  # K = 2 vectors per slot
    (sum(r.pow(2).sum() for r in rows) + kl).backward()
    assert slots.embeddings.grad is not None and slots.embeddings.grad.abs().sum() > 0
    assert all(p.grad is None for p in tiny_lm.model.parameters())
    unbound = SlotEncoder(BetaVAE(slots.output_dim, 8, 32), None, _slots(tiny_lm))
    with pytest.raises(ValueError, match="bind_sender"):
        unbound.sender_states([SHORT])


def test_the_sender_groups_contexts_by_length_and_gives_what_one_padded_forward_gives(tiny_lm):
    """`SlotEncoder.sender_states` runs contexts of very different lengths as separate forwards
    (less padding); each row's states, its slot mask and the gradients reaching the slots are those
    of one right-padded forward over the whole batch, in the batch's order."""
    slots = _slots(tiny_lm)
    encoder = SlotEncoder(BetaVAE(slots.output_dim, 8, 32), None, slots)
    encoder.bind_sender(tiny_lm.model, tiny_lm.tokenizer, 512, (-1,))
    huge = " ".join(["Sandra journeyed to the office and then to the garden."] * 30)
    texts = [huge, SHORT, LONG, "Bill is here."]
    tokens = tiny_lm.tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert len(length_groups([len(t) for t in tokens])) > 1  # really split
    states, slot_mask = encoder.sender_states(texts)
    (states.pow(2) * slot_mask.unsqueeze(-1)).sum().backward()
    grouped_grad, slots.embeddings.grad = slots.embeddings.grad.clone(), None
    ids, mask = _ids(tiny_lm, texts)
    expected, expected_mask = slot_states(tiny_lm.model, slots, mask, (-1,), input_ids=ids)
    (expected.pow(2) * expected_mask.unsqueeze(-1)).sum().backward()
    assert torch.equal(slot_mask, expected_mask)
    torch.testing.assert_close(states * slot_mask.unsqueeze(-1), expected * expected_mask.unsqueeze(-1),
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grouped_grad, slots.embeddings.grad, atol=1e-4, rtol=1e-4)


def test_the_settings_round_trip_and_bad_ones_are_refused():
    kind = memory_kind_for({"kind": "slots", "tokens_per_slot": 16, "min_slots": 2, "max_slots": 32})
    assert kind == SlotMemory(16, 2, 32)
    assert memory_kind_for(kind.entries()) == kind
    with pytest.raises(ValueError, match="'pooling.max_slots'"):
        memory_kind_for({"kind": "slots", "tokens_per_slot": 16, "min_slots": 4, "max_slots": 2})
    with pytest.raises(ValueError, match="missing 'pooling.min_slots'"):
        memory_kind_for({"kind": "slots", "tokens_per_slot": 16, "max_slots": 2})
    with pytest.raises(ValueError, match="answer_head_weight=0"):
        load_config(TINY_CONFIG, ["compressor.memory.kind=slots"])
    with pytest.raises(ValueError, match="finetune_encoder=true"):
        load_config(TINY_CONFIG, SLOTS + ["handoff.finetune_encoder=false"])
    # slots trained before the answer stage may stay frozen in it
    assert not load_config(TINY_CONFIG, SLOTS + ["handoff.finetune_encoder=false", "reconstruct.steps=2"]
                           ).handoff.finetune_encoder
    with pytest.raises(ValueError, match="a chunk of tokens"):
        load_config(TINY_CONFIG, SLOTS + ["reconstruct.steps=2", "reconstruct.token_weight=1"])
    with pytest.raises(ValueError, match="reads the sender's LM \\(compressor.memory.kind=slots\\)"):
        load_config(TINY_CONFIG, ["reconstruct.steps=2", "reconstruct.texts=[task,prose]"])
    with pytest.raises(ValueError, match="reconstruct.texts: .*'nonsense'"):
        load_config(TINY_CONFIG, SLOTS + ["reconstruct.steps=2", "reconstruct.texts=[task,nonsense]"])
    with pytest.raises(ValueError, match="reconstruct.continuation"):
        load_config(TINY_CONFIG, SLOTS + ["reconstruct.continuation=1.5"])
    with pytest.raises(ValueError, match="max_slots"):
        load_config(TINY_CONFIG, SLOTS + ["compressor.memory.min_slots=20"])


@pytest.fixture(scope="module")
def slot_run(tmp_path_factory, tiny_lm):
    from ilcp.training import train

    out = tmp_path_factory.mktemp("slot-run")
    cfg = load_config(TINY_CONFIG, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", "run_name=slots", *SLOTS])
    return train(cfg, lm=tiny_lm)


def test_a_slot_run_exports_sends_and_receives_as_in_process(slot_run, tiny_lm):
    config = json.loads((slot_run.run_dir / "config.json").read_text())
    assert {k: config["pooling"][k] for k in ("kind", "tokens_per_slot", "min_slots", "max_slots")} == {
        "kind": "slots", "tokens_per_slot": 8, "min_slots": 2, "max_slots": 12}
    spec = EncoderSpec.from_config(config)
    assert spec.memory == SlotMemory(8, 2, 12) and EncoderSpec.from_config(config | spec.to_config()) == spec
    handoff = ILCPHandoff.from_pretrained(slot_run.run_dir, lm=tiny_lm)
    assert isinstance(handoff.encoder, SlotEncoder)
    short, long = handoff.send(SHORT), handoff.send(LONG)
    n_short, n_long = (int(slot_counts(torch.tensor([len(handoff.sender_inputs([t])["input_ids"][0])]), 8, 2, 12))
                       for t in (SHORT, LONG))
    assert tuple(short.latent.shape) == (n_short, 8) and tuple(long.latent.shape) == (n_long, 8)
    assert n_long > n_short
    wire = handoff.to_wire(long)
    assert handoff.receive(wire, "Where is John?") == handoff.receive(long, "Where is John?")
    assert handoff.max_chunks == 12  # the export's max_length gives the most slots
    # the trained slots are what the export holds, not their starting rows
    assert not torch.equal(handoff.encoder.slots.embeddings, torch.zeros_like(handoff.encoder.slots.embeddings))


def test_a_sender_that_kept_its_cache_pays_only_the_slots(slot_run, tiny_lm):
    from ilcp.compat import output_cache

    handoff = ILCPHandoff.from_pretrained(slot_run.run_dir, lm=tiny_lm)
    inputs = handoff.sender_inputs([LONG])
    with torch.no_grad():
        out = tiny_lm.model(**inputs, output_hidden_states=True, use_cache=True)
    cache = output_cache(out)
    before = cache.get_seq_length()
    reused = handoff.send_from_hidden_states(out, inputs["attention_mask"])
    torch.testing.assert_close(reused.latent[0], handoff.send(LONG).latent)  # (B, N, Z): one context
    assert cache.get_seq_length() == before  # the sender's own cache is left as it was
    with torch.no_grad():
        no_cache = tiny_lm.model(**inputs, output_hidden_states=True, use_cache=False)
    with pytest.raises(ValueError, match="use_cache=True"):
        handoff.send_from_hidden_states(no_cache, inputs["attention_mask"])


def test_changed_slot_weights_are_refused(slot_run, tiny_lm, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    copy = tmp_path / "run"
    shutil.copytree(slot_run.run_dir, copy)
    state = load_file(str(copy / "model.safetensors"))
    assert "pooler.embeddings" in state
    state["pooler.embeddings"] = state["pooler.embeddings"] + 1.0
    save_file(state, str(copy / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ExportError, match="model.safetensors"):
        ILCPHandoff.from_pretrained(copy, lm=tiny_lm)


def test_eval_reads_a_slot_run_and_times_the_reused_sender(slot_run, tiny_lm):
    from ilcp.evaluation.run import evaluate

    results = evaluate(slot_run.run_dir, methods=["ilcp", "cold_read"], limit=3, latency_n=1, lengths=(),
                       lm=tiny_lm, log=lambda _: None, max_new_tokens=2, batch_size=4)
    ilcp = results["tasks"]["babi:1"]["methods"]["ilcp"]
    assert ilcp["n"] == 3 and ilcp["wire_bytes"] > 0
    assert ilcp["latency"]["sender_reusing_forward_s"]["n"] == 1


# --------------------------------------------------------------------------------------------
# pretraining on text alone: reconstruction and continuation, before any question


def test_prose_passages_stay_within_a_book_and_near_their_length(tiny_lm):
    from ilcp.tasks.background import background_sentences
    from ilcp.training.reconstruction_stage import prose_passages

    passages = prose_passages(tiny_lm.tokenizer, "validation", 64)
    assert len(passages) > 10
    sentences = {s.text: s.source for s in background_sentences("validation")}
    lengths = [len(tiny_lm.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in passages]
    assert sorted(lengths)[len(lengths) // 2] <= 64 + 8  # about the asked length (a long sentence stands alone)
    first_sentence = next(iter(sentences))
    assert passages[0].startswith(first_sentence)
    assert set(prose_passages(tiny_lm.tokenizer, "train", 64)).isdisjoint(passages)  # the books' splits


def test_a_text_is_a_continuation_or_not_for_good():
    from ilcp.training.reconstruction_stage import reads_as_continuation

    texts = [f"text number {i}" for i in range(2000)]
    chosen = [reads_as_continuation(t, 0.3) for t in texts]
    assert chosen == [reads_as_continuation(t, 0.3) for t in texts]
    assert 0.25 < sum(chosen) / len(texts) < 0.35
    assert not any(reads_as_continuation(t, 0.0) for t in texts)
    assert all(reads_as_continuation(t, 1.0) for t in texts)


def test_pretraining_reads_prose_and_other_tasks_then_continues_and_its_loss_falls(tmp_path, tiny_lm):
    from ilcp.training import train
    from ilcp.training.reconstruction_stage import ReconstructionModule

    cfg = load_config(TINY_CONFIG, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "run_name=pre",
                                    *SLOTS, "reconstruct.steps=12", "reconstruct.val_every_steps=4",
                                    "reconstruct.texts=[task,prose,babi:2]", "reconstruct.texts_per_source=20",
                                    "reconstruct.continuation=0.5", "reconstruct.max_target_tokens=24",
                                    "reconstruct.lr=0.01", "reconstruct.encoder_lr=0.01"])
    seen = []
    original = ReconstructionModule.tasks

    def spy(self, batch):
        out = original(self, batch)
        seen.append(out)
        return out

    ReconstructionModule.tasks = spy
    try:
        result = train(cfg, lm=tiny_lm)
    finally:
        ReconstructionModule.tasks = original
    metrics = result.metrics["reconstruct"]
    assert metrics["contexts"] > 40  # the task's distinct contexts, 20 prose passages and 20 babi:2 contexts
    curve = metrics["curve"]
    assert len(curve) >= 3 and curve[-1]["val/loss"] < curve[0]["val/loss"]
    asked = {tuple(p) for _, _, prompts in seen for p in prompts}
    assert len(asked) == 2  # texts were said back and continued
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    assert handoff.send(LONG).latent.shape[0] > handoff.send(SHORT).latent.shape[0]


def test_pretraining_stops_when_the_validation_loss_stops_falling(tmp_path, tiny_lm):
    from ilcp.training import train

    cfg = load_config(TINY_CONFIG, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "run_name=stop",
                                    *SLOTS, "reconstruct.steps=400", "reconstruct.val_every_steps=1",
                                    "reconstruct.patience=1", "reconstruct.lr=1e-9", "reconstruct.encoder_lr=1e-9",
                                    "reconstruct.warmup_steps=0", "reconstruct.max_target_tokens=8"])
    metrics = train(cfg, lm=tiny_lm).metrics["reconstruct"]
    assert metrics["steps"] < 400  # a learning rate of 1e-9 cannot keep lowering the loss for 400 steps


# --------------------------------------------------------------------------------------------
# low-rank adapters on the sender's LM, for the slot positions only


def test_adapters_act_on_the_slots_only_and_leave_the_lm_as_it_was(tiny_lm):
    from ilcp.encoder.slots import adaptable_modules

    model = tiny_lm.model
    modules = adaptable_modules(model, ["q_proj", "v_proj"])
    assert len(modules) == 2 * model.config.num_hidden_layers
    plain = _slots(tiny_lm)
    adapted = SlotTokens(plain.dim, tiny_lm.hidden_size, 4, 1, 8, adapter_rank=2, adapter_modules=modules)
    adapted.embeddings.data.copy_(plain.embeddings.data)
    ids, mask = _ids(tiny_lm, [SHORT, LONG])
    hooks = {name: dict(m._forward_hooks) for name, m in model.named_modules()}
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        reference, _ = slot_states(model, plain, mask, input_ids=ids)
        torch.testing.assert_close(slot_states(model, adapted, mask, input_ids=ids)[0], reference)  # B = 0: no change
        for adapter in adapted.adapters.values():
            adapter.b.normal_(0, 0.5)
        changed, _ = slot_states(model, adapted, mask, input_ids=ids)
        after = model(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(changed, reference, atol=1e-4)
    torch.testing.assert_close(after, before)  # the sender's own forward is what it was
    assert {name: dict(m._forward_hooks) for name, m in model.named_modules()} == hooks  # none left behind
    with pytest.raises(ValueError, match="lacks"):
        broken = SlotTokens(plain.dim, tiny_lm.hidden_size, 4, 1, 8, adapter_rank=2,
                            adapter_modules=[("model.layers.9.self_attn.q_proj", 64, 64)])
        slot_states(model, broken, mask, input_ids=ids)


def test_a_run_with_adapters_exports_them_under_its_digests(tmp_path, tiny_lm):
    from safetensors.torch import load_file, save_file

    from ilcp.training import train

    cfg = load_config(TINY_CONFIG, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "run_name=lora",
                                    *SLOTS, "compressor.memory.adapter_rank=2"])
    result = train(cfg, lm=tiny_lm)
    config = json.loads((result.run_dir / "config.json").read_text())
    assert config["pooling"]["adapter_rank"] == 2
    assert len(config["pooling"]["adapters"]) == 2 * tiny_lm.model.config.num_hidden_layers
    state = load_file(str(result.run_dir / "model.safetensors"))
    trained_b = [v for k, v in state.items() if k.startswith("pooler.adapters.") and k.endswith(".b")]
    assert trained_b and any(bool(b.abs().sum() > 0) for b in trained_b)  # the adapters learned
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    assert handoff.encoder.slots.adapter_rank == 2
    wire = handoff.send(LONG).to_bytes()
    assert handoff.receive(wire, "Where is John?") == handoff.receive(handoff.send(LONG), "Where is John?")
    key = next(k for k in state if k.startswith("pooler.adapters."))
    state[key] = state[key] + 0.01
    save_file(state, str(result.run_dir / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ExportError, match="model.safetensors"):
        ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    with pytest.raises(ValueError, match="adapter_rank is not a setting of memory kind 'attention'"):
        load_config(TINY_CONFIG, ["compressor.memory.adapter_rank=2"])


def test_the_sender_benchmark_times_both_routes_and_they_agree(tmp_path, capsys):
    from _benchmarks import load_benchmark

    bench = load_benchmark("slot_sender")
    out = tmp_path / "slots.json"
    assert bench.main(["--lm", "tiny-qwen3", "--lengths", "16,48", "--tokens-per-slot", "8", "--repeats", "1",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context_tokens"], r["slots"]) for r in rows] == [(16, 2), (48, 6)]
    assert all(r["max_state_difference"] < 1e-4 and r["slot_part_s"] > 0 for r in rows)
    assert "| 48 | 6 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--lm", "tiny-qwen3", "--lengths", "x"])


def test_the_general_recipe_runs_end_to_end_on_the_tiny_lm(tmp_path, tiny_lm):
    """configs/general.yaml at tiny sizes: a mix of SQuAD and bAbI with three tasks held out, slots
    with adapters, the tuned teacher; the export sends and eval reports the held-out tasks. The
    shipped encoder it starts from belongs to SmolLM2 (the tiny LM refuses it): the tiny run
    pretrains its own slots for two steps instead."""
    from ilcp.evaluation.run import evaluate
    from ilcp.training import train

    cfg = load_config(REPO / "configs" / "general.yaml", [
        f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "lm.spec=tiny-qwen3", "data.train_size=26",
        "data.val_size=13", "data.val_decode_size=4", "compressor.hidden_dim=32", "compressor.latent_dim=8",
        "compressor.init_from=", "reconstruct.steps=2", "reconstruct.val_every_steps=2", "reconstruct.texts_per_source=8",
        "handoff.max_steps=2", "handoff.val_every_steps=2", "handoff.projector_hidden=32", "handoff.max_new_tokens=3",
        "trainer.precision=32-true", "trainer.progress=false"])
    result = train(cfg, lm=tiny_lm)
    config = json.loads((result.run_dir / "config.json").read_text())
    assert config["heldout_tasks"] == ["babi:2", "babi:11", "babi:16"]
    assert config["task"].startswith("mix:squad|babi:1|babi:3|") and "babi:2|" not in config["task"]
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    assert isinstance(handoff.encoder, SlotEncoder)
    results = evaluate(result.run_dir, methods=["ilcp"], limit=2, latency_n=0, lengths=(), lm=tiny_lm,
                       log=lambda _: None, max_new_tokens=2, batch_size=4)
    held = {t for t, v in results["tasks"].items() if not v["seen_in_training"]}
    assert held == {"babi:2", "babi:11", "babi:16"} and "squad" in results["tasks"]


def test_a_sender_bound_without_length_groups_runs_the_batch_as_one_padded_forward(tiny_lm):
    """``trainer.length_groups: false`` binds the sender with ``grouped=False``: contexts of very
    different lengths run as one context forward and one slot forward, with the same states."""
    slots = _slots(tiny_lm)
    encoder = SlotEncoder(BetaVAE(slots.output_dim, 8, 32), None, slots)
    huge = " ".join(["Sandra journeyed to the office and then to the garden."] * 30)
    texts = [huge, SHORT, LONG, "Bill is here."]
    forwards, found = [], {}
    hook = tiny_lm.model.register_forward_hook(lambda *args: forwards.append(1))
    try:
        for grouped in (True, False):
            encoder.bind_sender(tiny_lm.model, tiny_lm.tokenizer, 512, (-1,), grouped=grouped)
            forwards.clear()
            with torch.no_grad():
                found[grouped] = encoder.sender_states(texts)
            assert (len(forwards) > 2) if grouped else (len(forwards) == 2)  # a context and a slot forward per group
    finally:
        hook.remove()
    (states, mask), (one, one_mask) = found[True], found[False]
    assert torch.equal(mask, one_mask)
    torch.testing.assert_close(states * mask.unsqueeze(-1), one * one_mask.unsqueeze(-1), atol=1e-5, rtol=1e-4)
