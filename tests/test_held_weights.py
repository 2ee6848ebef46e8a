"""The frozen LM held once in bfloat16 (`ilcp.precision.hold`): the same outputs as autocast over
its float32 weights, without the recast; the fingerprint of the float32 weights; training and the
receiver computing the same logits for the same prefix; the entry points that load their own LM
hold it, one passed in is left as it is; exports stay float32."""

import copy
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from safetensors.torch import load_file
from torch import nn

from ilcp.config import load_config
from ilcp.evaluation.run import evaluate
from ilcp.handoff import ILCPHandoff
from ilcp.lm import LM, TINY_LM, load_lm
from ilcp.precision import autocast, held_dtype, hold
from ilcp.training import train
from ilcp.training.handoff_stage import HandoffModule

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def linear_dtypes(model) -> set[torch.dtype]:
    return {m.weight.dtype for m in model.modules() if isinstance(m, nn.Linear)}


@pytest.fixture
def pair():
    """A held tiny LM and an unheld copy of the same weights."""
    lm = load_lm(TINY_LM)
    plain = LM(model=copy.deepcopy(lm.model), tokenizer=lm.tokenizer, spec=TINY_LM)
    return lm, plain


def test_a_held_lm_computes_what_autocast_computes_over_its_float32_weights(pair):
    lm, plain = pair
    fingerprint = plain.fingerprint
    assert hold(lm, "bf16-mixed") > 0
    assert held_dtype(lm.model) == torch.bfloat16 and held_dtype(plain.model) is None
    assert linear_dtypes(lm.model) == {torch.bfloat16} and linear_dtypes(plain.model) == {torch.float32}
    assert lm.dtype == torch.float32  # the embedding table (and so every prefix) stays float32
    assert lm.fingerprint == fingerprint  # the float32 weights', taken before the cast
    assert hold(lm, "bf16-mixed") == 0  # once
    ids = torch.randint(10, 500, (2, 23))
    embeds = plain.model.get_input_embeddings()(ids)
    with torch.no_grad():
        with autocast("bf16-mixed"):
            expected = plain.model(inputs_embeds=embeds).logits
            inside = lm.model(inputs_embeds=embeds).logits
        outside = lm.model(inputs_embeds=embeds).logits  # a held LM enters autocast itself
    assert torch.equal(inside, expected) and torch.equal(outside, expected)


def test_nothing_is_held_at_float32_or_for_a_half_precision_lm(pair):
    lm, _ = pair
    assert hold(lm, "32-true") == 0 and held_dtype(lm.model) is None
    assert linear_dtypes(lm.model) == {torch.float32}
    half = load_lm(TINY_LM, dtype="bfloat16")
    assert hold(half, "bf16-mixed") == 0 and held_dtype(half.model) is None


def test_a_training_row_and_the_receiver_compute_the_same_logits_for_the_same_prefix(tiny_run):
    """The answer stage's forward (Lightning's bf16-mixed context, `HandoffModule._loss_on_tail`)
    and the receiver's (`ILCPHandoff.prefixes` under the handoff's own context) on one held LM
    give the same next-token logits for the same prefix, and the same as an unheld LM under
    autocast: training and serving see the same numerics."""
    lm = load_lm(TINY_LM)
    plain = LM(model=copy.deepcopy(lm.model), tokenizer=lm.tokenizer, spec=TINY_LM)
    hold(lm, "bf16-mixed")
    handoff = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=lm, precision="bf16-mixed")
    row = {"context": "Mary moved to the bathroom. John went to the hallway.", "question": "Where is Mary?",
           "answer": "bathroom"}
    payload = handoff.send(row["context"])
    prefix = handoff.prefixes(payload, [row["question"]])[0]
    with torch.no_grad():
        with handoff.compute():
            served = lm.model(inputs_embeds=prefix.unsqueeze(0)).logits[0, -1].float()
        with autocast("bf16-mixed"):
            unheld = plain.model(inputs_embeds=prefix.unsqueeze(0)).logits[0, -1].float()
        module = HandoffModule(handoff.encoder, lm, tiny_run.cfg.handoff)
        memory = handoff.memory_vectors(payload)
        batch = {k: [v] for k, v in row.items()}
        with MixedPrecision("bf16-mixed", "cpu").forward_context():
            sequences, labels = module._answer_sequences(memory, batch, with_context=False)
            _, logits, _ = module._loss_on_tail(sequences, labels)
    assert torch.equal(sequences[0][: len(prefix)], prefix)
    trained = logits[0, 0]  # the last prefix position, predicting the answer's first token
    assert torch.equal(served, unheld)
    assert torch.allclose(trained, served, atol=1e-2, rtol=0), (trained - served).abs().max()
    assert int(trained.argmax()) == int(served.argmax())


@pytest.fixture(scope="module")
def held_run(tmp_path_factory):
    """A tiny run at bf16-mixed whose LM train.py loads (and so holds) itself."""
    out = tmp_path_factory.mktemp("held-run")
    cfg = load_config(TINY, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", "trainer.precision=bf16-mixed"])
    return train(cfg)


def test_a_run_that_loads_its_lm_holds_it_and_exports_float32(held_run, tiny_lm):
    run_dir = held_run.run_dir
    config = json.loads((run_dir / "config.json").read_text())
    for name in config["files"].values():
        assert {t.dtype for t in load_file(str(run_dir / name)).values()} == {torch.float32}, name
    assert config["lm"]["fingerprint"] == tiny_lm.fingerprint  # the float32 weights'
    assert config["lm"]["precision"] == "bf16-mixed"


def test_from_pretrained_holds_the_lm_it_loads_and_leaves_one_passed_in(held_run, tiny_lm):
    own = ILCPHandoff.from_pretrained(held_run.run_dir)
    assert held_dtype(own.lm.model) == torch.bfloat16 and linear_dtypes(own.lm.model) == {torch.bfloat16}
    assert isinstance(own.receive(own.send("John went to the garden."), "Where is John?"), str)
    passed = ILCPHandoff.from_pretrained(held_run.run_dir, lm=tiny_lm)
    assert held_dtype(tiny_lm.model) is None and linear_dtypes(passed.lm.model) == {torch.float32}
    plain = ILCPHandoff.from_pretrained(held_run.run_dir, precision="32-true")
    assert held_dtype(plain.lm.model) is None


def test_eval_holds_the_lm_it_loads(held_run, tmp_path):
    lines: list[str] = []
    res = evaluate(held_run.run_dir, methods=["no_context", "ilcp"], limit=2, latency_n=0, lengths=[],
                   facts_counts=[], out=tmp_path / "eval", log=lines.append)
    assert res["settings"]["precision"] == "bf16-mixed"
    assert "compute precision bf16-mixed, the LM's linear weights held in bfloat16" in lines


def _file_resident_mb() -> float | None:
    """This process's resident pages backed by files (Linux), in MB; None elsewhere."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    return None


def test_a_held_lm_keeps_nothing_of_its_mapped_weights_file(tmp_path):
    # A model a few tens of MB large, saved as safetensors and loaded the way a local directory is:
    # the loader maps the file, so until hold copies the float32 tensors it keeps (the embedding
    # table, the norms) the whole file stays resident.
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ilcp.lm import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    file_mb = sum(f.stat().st_size for f in (tmp_path / "lm").glob("*.safetensors")) / 2**20
    lm = load_lm(str(tmp_path / "lm"))
    lm.fingerprint  # reads every weight, so every page of the file is resident
    loaded = {t.data_ptr() for t in (*lm.model.parameters(), *lm.model.buffers())}
    before = _file_resident_mb()
    assert hold(lm, "bf16-mixed") > 0
    left = [name for name, t in (*lm.model.named_parameters(), *lm.model.named_buffers())
            if t.data_ptr() in loaded]
    assert left == []  # no tensor of the loaded model survives: each was cast or copied
    if before is not None:
        import gc

        gc.collect()
        assert before - _file_resident_mb() > 0.8 * file_mb  # the file's pages left the process
