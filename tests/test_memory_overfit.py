"""benchmarks/memory_overfit.py on the tiny LM: each trained memory lowers its texts' loss, the
frozen LM never changes, and the command writes its JSON and table with the three memories at
the encoder's K."""

import json

from tests._benchmarks import REPO, load_benchmark
from tests.conftest import raw_weight_digest

mo = load_benchmark("memory_overfit")

SLOTS = ["compressor.memory.kind=slots", "compressor.answer_head_weight=0",
         "compressor.memory.tokens_per_slot=4", "compressor.memory.adapter_rank=2", "handoff.num_memory_tokens=2"]


def tiny_setup(tiny_lm, overrides=()):
    cfg = mo.load_config(REPO / "configs" / "tiny.yaml", [*SLOTS, *overrides])
    tok = tiny_lm.tokenizer
    ids = [tok("Mary moved to the hallway. John went to the garden.", add_special_tokens=False)["input_ids"][:8],
           tok("The kitchen is north of the office.", add_special_tokens=False)["input_ids"][:8]]
    contexts = [tok.decode(i) for i in ids]
    return cfg, ids, contexts, mo.mc.instruction_ids(tok)


def test_training_the_latents_or_the_sender_lowers_the_loss_and_leaves_the_lm_alone(tiny_lm):
    cfg, ids, contexts, instruction = tiny_setup(tiny_lm, ["reconstruct.lr=1e-2", "reconstruct.encoder_lr=1e-2"])
    before = raw_weight_digest(tiny_lm.model)
    for kind in ("latent", "encoder"):
        encoder = mo.slot_encoder(cfg, tiny_lm, contexts)
        memory, curve = mo.train_memory(kind, encoder, tiny_lm, contexts, ids, instruction, cfg, steps=30, log_every=1)
        assert curve[-1]["loss"] < curve[0]["loss"], kind
        assert [m.shape[0] for m in memory] == [4, 4]  # 2 slots of 4 tokens, 2 vectors a slot
        trained = mo.mc.read_back(tiny_lm, memory, ids, instruction)
        assert all(0 <= t["prefix"] <= 8 for t in trained)
    assert raw_weight_digest(tiny_lm.model) == before


def test_the_command_writes_every_memory_at_the_encoders_k(tiny_lm, tmp_path, capsys):
    out = tmp_path / "overfit"
    rc = mo.main(["--lm", "tiny-qwen3", "--config", str(REPO / "configs" / "tiny.yaml"), "--length", "8",
                  "--texts", "1", "--sources", "babi", "--steps", "3", "--out", str(out), *SLOTS], lm=tiny_lm)
    assert rc == 0
    report = json.loads((out / mo.JSON_NAME).read_text())
    assert [r["memory"] for r in report["summary"]] == list(mo.MEMORIES)
    assert {tuple(m["vectors"]) for m in report["memories"].values()} == {(4,)}
    assert report["settings"]["steps"] == 3 and "| ceiling | 3 |" in (out / mo.TABLE_NAME).read_text()
    printed = capsys.readouterr().out
    assert all(f"{kind}: step 3/3, loss" in printed for kind in mo.MEMORIES)  # each memory says how far it is
    assert (out / "README.md").is_file()


def test_a_config_without_slots_is_refused_in_one_line(tiny_lm, tmp_path, capsys):
    rc = mo.main(["--config", str(REPO / "configs" / "tiny.yaml"), "--length", "8", "--texts", "1", "--steps", "1",
                  "--memories", "encoder", "--out", str(tmp_path)], lm=tiny_lm)
    assert rc == 2 and "memory_overfit: compressor.memory.kind is" in capsys.readouterr().err
