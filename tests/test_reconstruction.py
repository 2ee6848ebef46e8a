"""The reconstruction stage on the tiny LM: it lowers its loss, trains the whole encoder, and a run
with it exports, reloads and resumes."""

import pytest
import torch

from pathlib import Path
from ilcp.encoder.compressor import BetaVAE
from ilcp.config import load_config
from ilcp.encoder.model import ILCPEncoder
from ilcp.export import read_export
from ilcp.handoff import ILCPHandoff
from ilcp.encoder.pooling import AttentionPooler
from ilcp.training import ReconstructionModule, train
from ilcp.training.data import HandoffRows, collate_rows
from ilcp.training.extraction import token_states
from ilcp.training.handoff_stage import attach_projector
from ilcp.training.reconstruction_stage import distinct_contexts

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
CONTEXTS = ["Cedar is owned by Alice.", "Maple is owned by Bruno.", "Willow is owned by Chen.",
            "John went to the garden. Mary is in the hall."]


def test_reconstruction_lowers_its_loss_on_a_handful_of_texts(tiny_lm):
    torch.manual_seed(0)
    cfg = load_config(TINY_CONFIG, ["reconstruct.steps=1"])
    states = token_states(tiny_lm, CONTEXTS, progress=False)
    pooler = AttentionPooler(tiny_lm.hidden_size, 2)
    encoder = ILCPEncoder(BetaVAE(pooler.output_dim, 8, 32), pooler=pooler)
    attach_projector(encoder, cfg.handoff, tiny_lm)
    module = ReconstructionModule(encoder, tiny_lm, cfg)
    rows = HandoffRows([{"context": c, "question": "", "answer": ""} for c in CONTEXTS], states)
    batch = collate_rows([rows[i] for i in range(len(rows))])
    opt = torch.optim.AdamW(encoder.parameters(), lr=3e-2)
    before = {n: p.detach().clone() for n, p in encoder.named_parameters()}
    losses = []
    for _ in range(30):
        loss, _ = module._teacher_forced(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.02 and min(losses[-5:]) < min(losses[:5]), losses
    moved = {n for n, p in encoder.named_parameters() if not torch.equal(p, before[n])}
    assert any(n.startswith("pooler.") for n in moved) and any(n.startswith("projector.") for n in moved)
    assert any(n.startswith("vae.body") for n in moved)
    assert not any(p.grad is not None and p.grad.abs().sum() > 0 for p in tiny_lm.model.parameters())


def test_reconstruction_targets_are_the_context_tokens_then_the_end_token(tiny_lm):
    cfg = load_config(TINY_CONFIG, ["reconstruct.steps=1", "reconstruct.max_target_tokens=3"])
    encoder = attach_projector(ILCPEncoder(BetaVAE(tiny_lm.hidden_size, 8, 32)), cfg.handoff, tiny_lm)
    module = ReconstructionModule(encoder, tiny_lm, cfg)
    ids = tiny_lm.tokenizer(CONTEXTS[0], add_special_tokens=False)["input_ids"]
    assert module.target_ids(CONTEXTS[0]) == ids[:3]
    full = ReconstructionModule(encoder, tiny_lm, load_config(TINY_CONFIG, ["reconstruct.steps=1"]))
    assert full.target_ids(CONTEXTS[0])[: len(ids)] == ids


def test_distinct_contexts_keep_one_row_per_context_with_its_states(tiny_lm):
    texts = [CONTEXTS[0], CONTEXTS[1], CONTEXTS[0]]
    states = token_states(tiny_lm, texts, progress=False)
    rows = HandoffRows([{"context": c, "question": "q", "answer": "a"} for c in texts], states)
    out = distinct_contexts(rows)
    assert [r["context"] for r in out.rows] == CONTEXTS[:2]
    assert torch.equal(out.states[1], states[1])


@pytest.fixture(scope="module")
def reconstruct_run(tmp_path_factory, tiny_lm):
    out = tmp_path_factory.mktemp("reconstruct-run")
    cfg = load_config(TINY_CONFIG, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", "handoff.variants=[ilcp]",
                                    "reconstruct.steps=4", "reconstruct.val_every_steps=2", "reconstruct.batch_size=4"])
    return cfg, train(cfg, lm=tiny_lm)


def test_a_run_with_reconstruction_logs_it_and_exports_the_encoder(reconstruct_run, tiny_lm):
    cfg, result = reconstruct_run
    m = result.metrics["reconstruct"]
    assert m["steps"] == 4 and len(m["curve"]) == 2 and m["best_val_loss"] is not None
    assert (result.run_dir / "stages" / "reconstruct" / "reconstruct.safetensors").is_file()
    run = read_export(result.run_dir)
    handoff = ILCPHandoff.from_export(run, tiny_lm)
    assert isinstance(handoff.receive(handoff.send(CONTEXTS[0]), "Who owns Cedar?", max_new_tokens=2), str)


def test_the_answer_stage_starts_from_the_reconstruction_stage_projector(reconstruct_run, tiny_lm, monkeypatch):
    from safetensors.torch import load_file

    from ilcp import training

    cfg, result = reconstruct_run
    stage = load_file(str(result.run_dir / "stages" / "reconstruct" / "reconstruct.safetensors"))
    seen = {}
    original = training.pipeline.train_variant

    def recording(cfg, variant, lm, data, encoder, resume, trained=None):
        seen["projector"] = encoder.projector.value_head.weight.detach().clone()
        return original(cfg, variant, lm, data, encoder, resume, trained)

    import shutil

    shutil.rmtree(result.run_dir / "stages" / "ilcp")
    monkeypatch.setattr(training.pipeline, "train_variant", recording)
    resumed = train(cfg, lm=tiny_lm, resume=True)
    assert torch.equal(seen["projector"], stage["projector.value_head.weight"])
    assert resumed.metrics["reconstruct"] == result.metrics["reconstruct"]


def test_reconstruction_without_ilcp_is_a_config_error():
    with pytest.raises(ValueError, match="reconstruct.steps"):
        load_config(TINY_CONFIG, ["reconstruct.steps=2", "handoff.variants=[prompt_tuned]"])


def test_a_handoff_says_back_what_its_latent_carries(reconstruct_run, tiny_lm):
    _, result = reconstruct_run
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    said = handoff.reconstruct(handoff.send(CONTEXTS[:2]), max_new_tokens=3, contexts=2)
    assert len(said) == 2 and all(isinstance(s, str) for s in said)


def test_the_reconstruction_script_prints_contexts_and_what_was_said(reconstruct_run, capsys):
    import importlib.util

    _, result = reconstruct_run
    spec = importlib.util.spec_from_file_location("reconstruct_script", Path(__file__).resolve().parent.parent
                                                  / "scripts" / "reconstruct.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--ckpt", str(result.run_dir), "--stage", "reconstruct", "-n", "2", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("context: ") == 2 and out.count("said: ") == 2
    with pytest.raises(SystemExit):
        script.main(["--ckpt", str(result.run_dir), "--stage", "nothing"])
