"""The memory pretraining: `configs/pretrain.yaml` trains memory slots on text alone and exports
the encoder without an answer stage (``handoff.max_steps: 0``), a file `compressor.init_from`
starts a run from; its latent-bound pass says how far it is; its memory does not grow with the
corpus; `configs/pretrain-slots-gpu.yaml` is the same recipe at 50 times the steps and runs."""

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ilcp import progress
from ilcp.config import load_config
from ilcp.handoff import ILCPHandoff
from ilcp.training import train
from ilcp.training import data as training_data
from ilcp.training.data import latent_bound

REPO = Path(__file__).resolve().parent.parent
PRETRAIN, GPU = REPO / "configs" / "pretrain.yaml", REPO / "configs" / "pretrain-slots-gpu.yaml"
TINY = ["lm.spec=tiny-qwen3", "data.train_size=26", "data.val_size=13", "compressor.hidden_dim=32",
        "compressor.latent_dim=8", "compressor.memory.adapter_rank=2", "reconstruct.steps=4",
        "reconstruct.val_every_steps=2", "reconstruct.texts_per_source=8", "reconstruct.max_target_tokens=16",
        "handoff.projector_hidden=32", "trainer.precision=32-true", "trainer.progress=false"]
TEXT = "Mary went to the kitchen. John took the apple there. " * 3


def _tiny(tmp_path, config=PRETRAIN, extra=()):
    return load_config(config, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", *TINY, *extra])


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tiny_lm):
    return train(_tiny(tmp_path_factory.mktemp("pretrain")), lm=tiny_lm)


def test_the_pretraining_exports_the_encoder_as_its_reconstruction_stage_left_it(pretrained, tiny_lm):
    run = pretrained.run_dir
    assert not (run / "stages" / "ilcp").exists()  # no answer stage ran
    assert pretrained.metrics["variants"]["ilcp"]["steps"] == 0
    assert pretrained.metrics["reconstruct"]["steps"] == 4
    stage = load_file(str(run / "stages" / "reconstruct" / "reconstruct.safetensors"))
    exported = load_file(str(run / "model.safetensors"))
    assert stage.keys() == exported.keys() - {"compressor.latent_bound"}  # the bound is set at export
    assert all(torch.equal(stage[k], exported[k]) for k in stage)
    assert float(exported["compressor.latent_bound"]) > 0
    assert json.loads((run / "config.json").read_text())["pooling"]["adapter_rank"] == 2
    card = (run / "README.md").read_text()
    assert "one per slot: a slot per 16 context tokens, 1 to 32, rank-2 adapters" in card
    assert "| ilcp | no answer stage: pretrained on text (4 steps" in card
    handoff = ILCPHandoff.from_pretrained(run, lm=tiny_lm)
    assert handoff.receive(handoff.send(TEXT).to_bytes(), "Where is Mary?") is not None


def test_compressor_beta_changes_nothing_the_pretraining_learns(pretrained, tiny_lm, tmp_path):
    """The slots' latent crosses as the posterior's mean and the reconstruction loss has a KL term
    only with reconstruct.beta > 0, so compressor.beta (stage 1's weight) pretrains the same
    weights: 0.1 against the recipe's 0.01, every trained tensor equal."""
    other = train(_tiny(tmp_path, extra=["compressor.beta=0.1"]), lm=tiny_lm)
    ours = load_file(str(pretrained.run_dir / "stages" / "reconstruct" / "reconstruct.safetensors"))
    theirs = load_file(str(other.run_dir / "stages" / "reconstruct" / "reconstruct.safetensors"))
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    assert pretrained.metrics["reconstruct"]["best_val_loss"] == other.metrics["reconstruct"]["best_val_loss"]


def test_reconstruct_beta_trains_a_noisy_channel_whose_mean_still_crosses(pretrained, tiny_lm, tmp_path):
    """reconstruct.beta > 0: the training memory is read from latents drawn from the posterior and
    the loss adds beta x KL, so the posterior's spread (the logvar head, frozen at beta 0) learns
    and the weights differ from the same seed's at beta 0; the export sends the mean."""
    other = train(_tiny(tmp_path, extra=["reconstruct.beta=0.1"]), lm=tiny_lm)
    ours = load_file(str(pretrained.run_dir / "stages" / "reconstruct" / "reconstruct.safetensors"))
    theirs = load_file(str(other.run_dir / "stages" / "reconstruct" / "reconstruct.safetensors"))
    logvar = [k for k in ours if "logvar_head" in k]
    assert logvar and ours.keys() == theirs.keys()
    assert all(not torch.equal(ours[k], theirs[k]) for k in logvar)
    mu = [k for k in ours if "mu_head" in k]
    assert all(not torch.equal(ours[k], theirs[k]) for k in mu)
    handoff = ILCPHandoff.from_pretrained(other.run_dir, lm=tiny_lm)
    assert torch.equal(handoff.send(TEXT).latent, handoff.send(TEXT).latent)  # the mean crosses: no draw


def test_a_sampled_memory_is_drawn_around_the_mean(pretrained, tiny_lm):
    from ilcp.training.init_from import pretrained_encoder

    run = _tiny(pretrained.run_dir.parent, extra=[f"compressor.init_from={pretrained.run_dir}"])
    encoder = pretrained_encoder(run, tiny_lm, 4096)
    batch = {"context": [TEXT]}
    with torch.no_grad():
        mean, kl = encoder.memory_for_batch(batch, torch.float32)
        again, _ = encoder.memory_for_batch(batch, torch.float32)
        torch.manual_seed(0)
        drawn, kl_drawn = encoder.memory_for_batch(batch, torch.float32, sample=True)
    assert torch.equal(mean[0], again[0]) and torch.equal(kl, kl_drawn)
    assert mean[0].shape == drawn[0].shape and not torch.equal(mean[0], drawn[0])


def test_recomputed_layers_pretrain_the_same_weights(pretrained, tiny_lm, tmp_path):
    """trainer.recompute_layers changes what the backward pass keeps, not what it computes."""
    other = train(_tiny(tmp_path, extra=["trainer.recompute_layers=true"]), lm=tiny_lm)
    ours = load_file(str(pretrained.run_dir / "stages" / "reconstruct" / "reconstruct.safetensors"))
    theirs = load_file(str(other.run_dir / "stages" / "reconstruct" / "reconstruct.safetensors"))
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.allclose(ours[k], theirs[k], atol=1e-5)] == []


def test_a_run_started_from_the_pretrained_encoder_reads_its_latents(pretrained, tiny_lm, tmp_path):
    run = _tiny(tmp_path, extra=["reconstruct.steps=0", "handoff.max_steps=1", "handoff.val_every_steps=1",
                                 f"compressor.init_from={pretrained.run_dir}"])
    from ilcp.training.init_from import pretrained_encoder

    encoder = pretrained_encoder(run, tiny_lm, 4096)
    source = ILCPHandoff.from_pretrained(pretrained.run_dir, lm=tiny_lm)
    with torch.no_grad():
        assert torch.equal(encoder.latent(*encoder.sender_states([TEXT]))[0], source.send(TEXT).latent)


def test_an_answer_stage_may_keep_the_pretrained_sender_frozen(pretrained, tiny_lm, tmp_path):
    """handoff.finetune_encoder=false from compressor.init_from: the answer stage trains the
    projector alone; the slots, adapters and VAE are exported as pretrained."""
    run = train(_tiny(tmp_path, extra=["reconstruct.steps=0", "handoff.max_steps=2", "handoff.val_every_steps=2",
                                       "handoff.finetune_encoder=false", f"compressor.init_from={pretrained.run_dir}"]),
                lm=tiny_lm)
    before = load_file(str(pretrained.run_dir / "model.safetensors"))
    after = load_file(str(run.run_dir / "model.safetensors"))
    sender = [k for k in before if not k.startswith("projector.") and k != "compressor.latent_bound"]
    assert sender and all(torch.equal(before[k], after[k]) for k in sender)
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("projector."))


@pytest.mark.parametrize("bad, message", [
    (["handoff.variants=[ilcp,prompt_tuned]"], "0 only with handoff.variants=\\[ilcp\\]"),
    (["handoff.max_steps=-1"], "handoff.max_steps must be >= 1"),
    (["reconstruct.steps=0"], "needs a pretraining stage"),
])
def test_no_answer_stage_is_refused_where_nothing_would_train_the_encoder(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        _tiny(tmp_path, extra=bad)


def test_the_latent_bound_pass_says_how_far_it_is(pretrained, tiny_lm, monkeypatch, capture_log):
    from ilcp.training.data import HandoffRows

    class Clock:
        now = 0.0

        def __call__(self):
            self.now += 31.0
            return self.now

    monkeypatch.setattr(progress, "monotonic", Clock())
    monkeypatch.setattr(progress, "on_terminal", lambda stream=None: False)
    monkeypatch.setattr(progress, "_last_line", [None])
    heard = capture_log("ilcp.progress")
    encoder = ILCPHandoff.from_pretrained(pretrained.run_dir, lm=tiny_lm).encoder
    encoder.bind_sender(tiny_lm.model, tiny_lm.tokenizer, 4096, [-1])
    rows = HandoffRows([{"context": f"{TEXT} {i}", "question": "", "answer": ""} for i in range(10)], None)
    quiet = latent_bound(encoder, [rows], batch_size=4)
    assert heard == []
    assert latent_bound(encoder, [rows], batch_size=4, progress=True) == quiet
    assert [line.split(",")[0] for line in heard] == ["latent bound: 4 of 10 rows", "latent bound: 8 of 10 rows",
                                                      "latent bound: 10 of 10 rows"], heard
    # a slot encoder runs the sender over each row: it reads SENDER_BOUND_ROWS of them
    monkeypatch.setattr(training_data, "SENDER_BOUND_ROWS", 6)
    heard.clear()
    latent_bound(encoder, [rows], batch_size=4, progress=True)
    assert [line.split(",")[0] for line in heard][-1] == "latent bound: 6 of 6 rows", heard
    # ... and SENDER_BOUND_BATCH contexts per forward at most, whatever batch it is given
    monkeypatch.setattr(training_data, "SENDER_BOUND_BATCH", 2)
    heard.clear()
    assert latent_bound(encoder, [rows], batch_size=4, progress=True) > 0
    assert [line.split(",")[0] for line in heard] == [f"latent bound: {n} of 6 rows" for n in (2, 4, 6)], heard


def test_pretraining_memory_does_not_grow_with_the_corpus(tmp_path):
    """The recipe's peak anonymous memory per stage (benchmarks/cache_memory.py, a fresh process per
    size) at 600 and 2,400 training rows: past the bounded passes (the slot statistics' 256
    contexts, the latent bound's 512 rows) four times the corpus costs no more memory."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from cache_memory import main as memory_main

    out = tmp_path / "memory.json"
    settings = [s for s in TINY if not s.startswith(("lm.spec", "data.train_size", "reconstruct.steps",
                                                     "reconstruct.val_every_steps"))]
    assert memory_main(["--config", str(PRETRAIN), "--rows", "600", "--factor", "4", "--json", str(out), *settings,
                        "reconstruct.steps=20", "reconstruct.val_every_steps=10", "data.val_size=20"]) == 0
    small, large = json.loads(out.read_text())
    assert large["train_rows"] == 4 * small["train_rows"] == 2400
    mb = 1 << 20
    assert large["run_peak"] - small["run_peak"] < 50 * mb, (small, large)
    for stage in ("reconstruct", "ilcp", "export"):
        assert large["peaks"][stage] - small["peaks"][stage] < 50 * mb, (stage, small, large)


def test_the_gpu_recipe_is_the_cpu_recipe_at_50_times_the_steps(tmp_path, tiny_lm):
    cpu, gpu = (yaml.safe_load(p.read_text()) for p in (PRETRAIN, GPU))
    assert gpu["reconstruct"]["steps"] == 50 * cpu["reconstruct"]["steps"]
    assert gpu["trainer"]["accelerator"] == "gpu" and gpu["trainer"]["precision"] == "bf16-mixed"
    differ = {(section, key) for section in cpu.keys() | gpu.keys() if isinstance(gpu.get(section, cpu.get(section)), dict)
              for key in cpu.get(section, {}).keys() | gpu.get(section, {}).keys()
              if cpu.get(section, {}).get(key) != gpu.get(section, {}).get(key)}
    assert differ <= {("reconstruct", "steps"), ("reconstruct", "val_every_steps"), ("reconstruct", "patience"),
                      ("trainer", "accelerator"), ("trainer", "devices"), ("trainer", "precision"),
                      ("trainer", "recompute_layers")}, differ
    result = train(_tiny(tmp_path, GPU, ["trainer.accelerator=cpu", "trainer.devices=1"]), lm=tiny_lm)
    assert result.metrics["reconstruct"]["steps"] == 4 and (result.run_dir / "model.safetensors").is_file()


def _ship_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ship_pretrained", REPO / "scripts" / "ship_pretrained.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_shipped_encoder_is_the_checked_export_with_its_card(pretrained, tiny_lm, tmp_path, capsys):
    from tests._benchmarks import load_benchmark

    ship = _ship_module()
    capacity = tmp_path / "capacity"
    assert load_benchmark("memory_capacity").main(
        ["--lm", "tiny-qwen3", "--lengths", "8", "--ks", "2", "--texts", "1", "--steps", "2", "--encoder",
         str(pretrained.run_dir), "--out", str(capacity)], lm=tiny_lm) == 0
    out = tmp_path / "shipped"
    assert ship.main([str(pretrained.run_dir), "--out", str(out), "--capacity",
                      str(capacity / "memory_capacity.json")]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([*ship.SHIPPED, "README.md"])
    for name in ship.SHIPPED:
        assert (out / name).read_bytes() == (pretrained.run_dir / name).read_bytes()
    card = (out / "README.md").read_text()
    assert "## How it was made" in card and "python train.py --config configs/pretrain.yaml" in card
    assert "## Reading it back" in card and f"| squad | 8 | {pretrained.run_dir.name} |" in card
    assert "| squad | 8 | ceiling | 2 |" in card  # the ceiling at the encoder's K (2 vectors of one slot)
    run = _tiny(tmp_path, extra=["reconstruct.steps=0", "handoff.max_steps=1", "handoff.val_every_steps=1",
                                 f"compressor.init_from={out}", "run_name=from-shipped"])
    assert train(run, lm=tiny_lm).metrics["compressor"] == {"init_from": str(out)}
    # again without --overwrite: refused, the folder untouched
    assert ship.main([str(pretrained.run_dir), "--out", str(out)]) == 2
    assert "exists: pass --overwrite" in capsys.readouterr().err


def test_shipping_refuses_a_run_too_large_or_with_answer_stages(pretrained, tiny_run, tmp_path, monkeypatch, capsys):
    ship = _ship_module()
    assert ship.main([str(tiny_run.run_dir), "--out", str(tmp_path / "a")]) == 2
    assert "ship a pretraining run" in capsys.readouterr().err
    monkeypatch.setattr(ship, "MAX_SHIPPED_BYTES", 1000)
    assert ship.main([str(pretrained.run_dir), "--out", str(tmp_path / "b")]) == 2
    assert "over the 1,000 a shipped encoder may weigh" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_text_windows_cut_each_text_into_consecutive_windows(tiny_lm):
    from ilcp.training.reconstruction_stage import text_windows

    tok = tiny_lm.tokenizer
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    windows = text_windows(tok, [TEXT, TEXT], 8)  # the same text twice gives its windows once
    expected = [tok.decode(ids[s:s + 8]).strip() for s in range(0, len(ids), 8) if s == 0 or 2 * len(ids[s:s + 8]) >= 8]
    assert windows == list(dict.fromkeys(expected)) and len(windows) >= len(ids) // 8 - 1
    assert text_windows(tok, ["Mary"], 8) == ["Mary"]  # a text shorter than a window is kept whole


def test_task_texts_alone_are_cut_into_windows_and_the_log_says_so(tiny_lm, tmp_path, monkeypatch):
    from ilcp.training import reconstruction_stage
    from ilcp.training.data import HandoffRows

    lines = []
    monkeypatch.setattr(reconstruction_stage, "say", lines.append)
    cfg = _tiny(tmp_path, extra=["reconstruct.texts=[task]", "reconstruct.text_tokens=8"])
    rows = HandoffRows([{"context": c, "question": "q", "answer": "a"} for c in (TEXT, TEXT, "Mary")], None)
    got = reconstruction_stage.pretraining_rows(cfg, tiny_lm, rows, "train")
    expected = reconstruction_stage.text_windows(tiny_lm.tokenizer, [TEXT, "Mary"], 8)
    assert [r["context"] for r in got.rows] == expected and got.states is None
    assert lines == [f"reconstruction: {len(expected)} distinct train texts (windows of 8 tokens) from 2 task contexts"]


def test_text_windows_need_memory_slots(tmp_path):
    with pytest.raises(ValueError, match="reconstruct.text_tokens read texts whose sender states are not cached"):
        load_config(REPO / "configs" / "tiny.yaml", ["reconstruct.text_tokens=8", "reconstruct.steps=2"])
    with pytest.raises(ValueError, match="reconstruct.text_tokens must be >= 0"):
        _tiny(tmp_path, extra=["reconstruct.text_tokens=-1"])


def test_a_negative_reconstruct_beta_is_refused(tmp_path):
    with pytest.raises(ValueError, match="reconstruct.beta must be >= 0, got -0.1"):
        _tiny(tmp_path, extra=["reconstruct.beta=-0.1"])


def test_the_recipe_runs_each_batch_as_one_padded_forward(pretrained, tiny_lm, tmp_path):
    """configs/pretrain.yaml sets ``trainer.length_groups: false``: its reconstruction loss and the
    sender its encoder is bound to run a batch of very different lengths as one forward each."""
    from ilcp.training.init_from import pretrained_encoder
    from ilcp.training.reconstruction_stage import ReconstructionModule

    cfg = _tiny(tmp_path, extra=[f"compressor.init_from={pretrained.run_dir}"])
    assert cfg.trainer.length_groups is False
    encoder = pretrained_encoder(cfg, tiny_lm, 512)
    assert ReconstructionModule(encoder, tiny_lm, cfg).grouped is False
    forwards = []
    hook = tiny_lm.model.register_forward_hook(lambda *args: forwards.append(1))
    try:
        with torch.no_grad():
            encoder.sender_states([" ".join([TEXT] * 12), "Bill is here."])
    finally:
        hook.remove()
    assert len(forwards) == 2  # one context forward, one slot forward
