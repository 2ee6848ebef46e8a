"""Stage 1 + stage 2 on the tiny LM: export, reload, frozen LM untouched, resume, configs."""

from pathlib import Path

import pytest
import torch
import yaml

from ilcp import training
from ilcp.config import TrainConfig, load_config
from ilcp.export import ExportError, check_fingerprint, read_export
from ilcp.encoder.model import ILCPEncoder
from ilcp.encoder.kinds import AttentionMemory
from ilcp.training import HandoffModule, make_memory_source, train

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def tiny_run(tiny_run):
    """(config, result, LM digest before, after) of the session's tiny run."""
    return tiny_run.cfg, tiny_run.result, tiny_run.lm_digest_before, tiny_run.lm_digest_after


def test_tiny_run_exports_every_variant(tiny_run):
    cfg, result, _, _ = tiny_run
    run_dir = result.run_dir
    for name in ("config.json", "model.safetensors", "prompt_tuned.safetensors", "cold_read_tuned.safetensors",
                 "train_config.yaml", "metrics.json"):
        assert (run_dir / name).is_file(), name
    text = (run_dir / "config.json").read_text()
    keys = [line.split(":")[0].strip() for line in text.splitlines() if line.startswith('  "')]
    assert keys == sorted(keys)
    for variant in ("ilcp", "prompt_tuned", "cold_read_tuned"):
        m = result.metrics["variants"][variant]
        assert m["steps"] == cfg.handoff.max_steps
        assert m["curve"], "validation ran"
        assert 0.0 <= m["best_val_exact_match"] <= 1.0
    saved = yaml.safe_load((run_dir / "train_config.yaml").read_text())
    assert saved["handoff"]["max_steps"] == cfg.handoff.max_steps


def test_export_holds_no_lm_weights(tiny_run, tiny_lm):
    _, result, _, _ = tiny_run
    from safetensors.torch import load_file

    lm_shapes = {tuple(p.shape) for p in tiny_lm.model.parameters()}
    state = load_file(str(result.run_dir / "model.safetensors"))
    assert all(k.startswith(("compressor.", "projector.", "pooler.")) for k in state)
    assert "compressor.input_mean" in state and "compressor.input_std" in state
    embed_shape = tuple(tiny_lm.model.get_input_embeddings().weight.shape)
    assert all(tuple(v.shape) != embed_shape for v in state.values())
    assert lm_shapes  # the LM has weights; none of them were written
    for ckpt in result.run_dir.rglob("*.ckpt"):
        sd = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
        assert not any(k.startswith("lm.") for k in sd), ckpt


def test_frozen_lm_is_bit_identical(tiny_run, tiny_lm):
    _, _, before, after = tiny_run
    assert before == after
    assert not any(p.requires_grad for p in tiny_lm.model.parameters())
    assert not tiny_lm.model.training


def test_reloaded_export_gives_the_same_memory_vectors(tiny_run, tiny_lm):
    _, result, _, _ = tiny_run
    run = read_export(result.run_dir)
    check_fingerprint(run.config, tiny_lm.fingerprint)
    trained = result.sources["ilcp"].eval()
    states, mask = torch.randn(3, 5, run.encoder.state_dim), torch.ones(3, 5, dtype=torch.long)
    with torch.no_grad():
        expected = trained.memory(trained.latent(states, mask), torch.float32)
        got = run.encoder.memory(run.encoder.latent(states, mask), torch.float32)
    assert got.shape == (3, run.config["num_memory_tokens"], tiny_lm.hidden_size)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for name in ("prompt_tuned", "cold_read_tuned"):
        torch.testing.assert_close(run.soft_prompts[name], result.sources[name].soft_prompt.detach().float())


def test_export_for_another_lm_is_refused(tiny_run):
    _, result, _, _ = tiny_run
    run = read_export(result.run_dir)
    with pytest.raises(ExportError, match="fingerprint"):
        check_fingerprint(run.config, "0123456789abcdef")


def test_existing_run_is_not_overwritten_silently(tiny_run, tiny_lm):
    cfg, _, _, _ = tiny_run
    with pytest.raises(FileExistsError, match="--resume"):
        train(cfg, lm=tiny_lm)


def test_resume_continues_the_step_count(tmp_path, tiny_lm, monkeypatch):
    base = [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "handoff.variants=[prompt_tuned]",
            "handoff.val_every_steps=2"]
    first = train(load_config(TINY, base + ["handoff.max_steps=4"]), lm=tiny_lm)
    assert first.metrics["variants"]["prompt_tuned"]["steps"] == 4
    stage = first.run_dir / "stages" / "prompt_tuned"
    assert (stage / "checkpoints" / "last.ckpt").is_file()
    (stage / "prompt_tuned.safetensors").unlink()  # as if interrupted before the stage finished

    calls = []
    original = HandoffModule.training_step

    def counting(self, batch, batch_idx):
        calls.append(self.global_step)
        return original(self, batch, batch_idx)

    monkeypatch.setattr(HandoffModule, "training_step", counting)
    resumed = train(load_config(TINY, base + ["handoff.max_steps=6"]), lm=tiny_lm, resume=True)
    assert resumed.metrics["variants"]["prompt_tuned"]["steps"] == 6
    assert calls == [4, 5], "resumed at step 4 and ran only the missing steps"


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    from ilcp.config import is_chunk_recipe

    if is_chunk_recipe(str(path)):  # a chunk pretraining recipe (configs/pretrain-gpu.yaml): its own settings
        from ilcp.training.chunk_pretrain import ChunkPretrainConfig, load_settings

        assert isinstance(load_settings(str(path), {})[0], ChunkPretrainConfig)
        return
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)


@pytest.mark.parametrize(
    "override, field",
    [
        ("handoff.max_steps=0", "handoff.max_steps"),
        ("handoff.num_memory_tokens=-1", "handoff.num_memory_tokens"),
        ("handoff.variants=[ilcp,text]", "handoff.variants"),
        ("compressor.latent_dim=0", "compressor.latent_dim"),
        ("compressor.beta=-1", "compressor.beta"),
        ("data.task=trivia", "data.task"),
        ("lm.dtype=int8", "lm.dtype"),
        ("handoff.lr=fast", "handoff.lr"),
        ("handoff.unknown=1", "handoff.unknown"),
        ("data.val_decode_size=500", "data.val_decode_size"),
        ("compressor.memory.kind=max", "compressor.memory.kind"),
        ("compressor.memory.pool_queries=0", "compressor.memory.pool_queries"),
        ("compressor.answer_head_weight=-1", "compressor.answer_head_weight"),
        ("compressor.answer_head_weight=nan", "compressor.answer_head_weight"),
        ("handoff.lr=inf", "handoff.lr"),
    ],
)
def test_bad_config_is_a_value_error_naming_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_float_fields_accept_exponents_without_a_dot():
    assert load_config(None, ["handoff.encoder_lr=3e-3"]).handoff.encoder_lr == 0.003


def test_a_text_field_set_to_nothing_is_the_empty_string(tmp_path):
    """``compressor.init_from=`` clears a recipe's pretrained encoder (YAML reads the bare value as null)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("compressor:\n  init_from: pretrained/smollm2-memory\n")
    assert load_config(recipe, []).compressor.init_from == "pretrained/smollm2-memory"
    assert load_config(recipe, ["compressor.init_from="]).compressor.init_from == ""


def test_attention_pooling_needs_the_answer_loss_to_reach_the_encoder():
    with pytest.raises(ValueError, match=r"compressor\.memory\.kind=attention needs handoff\.finetune_encoder"):
        load_config(None, ["compressor.memory.kind=attention", "handoff.finetune_encoder=false", "compressor.answer_head_weight=0"])


def test_bad_config_fails_before_any_model_loads(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the LM must not load for an invalid config")

    monkeypatch.setattr(training.pipeline, "load_lm", boom)
    with pytest.raises(ValueError):
        load_config(None, ["handoff.batch_size=0"])


def _padded_answer_loss(tiny_lm, source, batch):
    """The answer loss of one left-padded forward over a cold_read_tuned batch, as HF computes it
    with -100 labels (the reference the answer stage must equal)."""
    from ilcp.receiver import prompts
    from ilcp.receiver.decoding import left_pad

    embed = tiny_lm.model.get_input_embeddings()
    seqs, labs = [], []
    for c, q, a in zip(batch["context"], batch["question"], batch["answer"]):
        p = tiny_lm.tokenizer(prompts.cold_read_prompt(tiny_lm.tokenizer, c, q), add_special_tokens=False).input_ids
        t = tiny_lm.tokenizer(prompts.answer_text(a, tiny_lm.tokenizer), add_special_tokens=False).input_ids
        seqs.append(torch.cat([source.soft_prompt, embed(torch.tensor(p + t))]))
        labs.append([-100] * (source.soft_prompt.shape[0] + len(p)) + t)
    x, mask, pos = left_pad(seqs)
    labels = torch.full(mask.shape, -100)
    for i, lab in enumerate(labs):
        labels[i, -len(lab):] = torch.tensor(lab)
    return tiny_lm.model(inputs_embeds=x, attention_mask=mask, position_ids=pos, labels=labels).loss


def test_answer_loss_equals_the_full_sequence_labels_loss(tiny_lm):
    """Only the answer's logits are computed; the loss must equal HF's loss with -100 labels."""
    from ilcp.config_sections import HandoffConfig

    source = make_memory_source("cold_read_tuned", HandoffConfig(num_memory_tokens=2), tiny_lm)
    module = HandoffModule(source, tiny_lm, HandoffConfig(num_memory_tokens=2))
    batch = {"pooled": torch.zeros(2, 4), "context": ["John went home.", "Mary is in the big kitchen now."],
             "question": ["Where is John?", "Where is Mary?"], "answer": ["home", "kitchen,garden"]}
    loss, _ = module._teacher_forced(batch)
    with torch.no_grad():
        expected = _padded_answer_loss(tiny_lm, source, batch)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)


def test_rows_of_very_different_lengths_run_apart_with_the_loss_and_gradients_of_one_forward(tiny_lm):
    """A batch mixing a long context with short ones runs as several forwards (`length_groups`):
    its answer loss, the soft prompt's gradient and the validation loss and answers are those of
    one padded forward over the batch."""
    from ilcp.config_sections import HandoffConfig
    from ilcp.encoder.pooling import length_groups

    source = make_memory_source("cold_read_tuned", HandoffConfig(num_memory_tokens=2), tiny_lm)
    module = HandoffModule(source, tiny_lm, HandoffConfig(num_memory_tokens=2, max_new_tokens=3))
    long_story = " ".join(["Daniel went back to the office and picked up the apple there."] * 25)
    batch = {"context": ["John went home.", long_story, "Mary is in the big kitchen now.", long_story + " Bill left."],
             "question": ["Where is John?", "Where is Daniel?", "Where is Mary?", "Where is Bill?"],
             "answer": ["home", "office", "kitchen,garden", "away"]}
    lengths = [len(tiny_lm.tokenizer(c)["input_ids"]) for c in batch["context"]]
    assert len(length_groups(lengths)) > 1
    loss, _ = module._teacher_forced(batch)
    loss.backward()
    grouped_grad, source.soft_prompt.grad = source.soft_prompt.grad.clone(), None
    expected = _padded_answer_loss(tiny_lm, source, batch)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped_grad, source.soft_prompt.grad, rtol=1e-4, atol=1e-6)
    val_loss, answers, row_ce = module._loss_and_answers(batch)
    torch.testing.assert_close(val_loss, expected.detach(), rtol=1e-5, atol=1e-5)
    assert sum(ce for ce, _ in row_ce) / sum(n for _, n in row_ce) == pytest.approx(float(val_loss), rel=1e-5)
    _, some, some_ce = module._loss_and_answers(batch, [1, 3])  # a batch's decoded rows alone
    assert some == [answers[1], answers[3]] and [n for _, n in some_ce] == [row_ce[1][1], row_ce[3][1]]
    assert [ce for ce, _ in some_ce] == pytest.approx([row_ce[1][0], row_ce[3][0]], rel=1e-4)
    assert answers == [module.answer({k: [v[i]] for k, v in batch.items()})[0] for i in range(4)]


def test_length_groups_off_runs_a_mixed_batch_as_one_padded_forward(tiny_lm):
    """``trainer.length_groups: false`` (``grouped=False``): the answer loss and the validation pass
    run a batch of very different lengths as one forward through the LM, with the same loss."""
    from ilcp.config_sections import HandoffConfig

    source = make_memory_source("cold_read_tuned", HandoffConfig(num_memory_tokens=2), tiny_lm)
    long_story = " ".join(["Daniel went back to the office and picked up the apple there."] * 25)
    batch = {"context": ["John went home.", long_story], "question": ["Where is John?", "Where is Daniel?"],
             "answer": ["home", "office"]}
    forwards = []
    hook = tiny_lm.model.register_forward_hook(lambda *args: forwards.append(1))
    try:
        losses = {}
        for grouped in (True, False):
            module = HandoffModule(source, tiny_lm, HandoffConfig(num_memory_tokens=2, max_new_tokens=1),
                                   grouped=grouped)
            forwards.clear()
            with torch.no_grad():
                losses[grouped] = module._teacher_forced(batch)[0]
            assert len(forwards) == (2 if grouped else 1)
            forwards.clear()
            module._loss_and_answers(batch)
            assert len(forwards) == (2 if grouped else 1)  # one prefill a forward group gives the one new token
    finally:
        hook.remove()
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-5)


def test_a_row_shorter_than_the_longest_answer_runs_apart_with_the_same_loss(tiny_lm):
    """A short row in its own forward, narrower than the positions the loss reads (another row's
    answer is longer than it): its logits are padded where it has no labels; the loss and logits
    equal one padded forward's."""
    from ilcp.config_sections import HandoffConfig
    from ilcp.training import handoff_stage

    source = make_memory_source("prompt_tuned", HandoffConfig(num_memory_tokens=2), tiny_lm)
    module = HandoffModule(source, tiny_lm, HandoffConfig(num_memory_tokens=2))
    embed = tiny_lm.model.get_input_embeddings()
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 200, (3,), generator=gen), torch.randint(0, 200, (110,), generator=gen)]
    sequences = [embed(i).detach() for i in ids]
    labels = [torch.tensor([-100, -100] + ids[0][2:].tolist()), torch.tensor([-100] * 10 + ids[1][10:].tolist())]
    assert len(handoff_stage.forward_groups([3, 110])) == 2
    with torch.no_grad():
        loss, logits, targets = module._loss_on_tail(sequences, labels)
        module.grouped = False  # trainer.length_groups: false
        one_loss, one_logits, one_targets = module._loss_on_tail(sequences, labels)
    assert torch.equal(targets, one_targets)
    torch.testing.assert_close(loss, one_loss, rtol=1e-5, atol=1e-5)
    known = targets != -100
    torch.testing.assert_close(logits[known], one_logits[known], rtol=1e-4, atol=1e-4)


def test_default_yaml_mirrors_the_built_in_defaults():
    assert load_config(REPO / "configs" / "default.yaml") == load_config(None)


# --------------------------------------------------------------------------------------------
# attention pooling


@pytest.fixture(scope="module")
def attention_run(tmp_path_factory, tiny_lm):
    out = tmp_path_factory.mktemp("attention-runs")
    cfg = load_config(TINY, [f"out_dir={out}", f"lm.cache_dir={out / 'cache'}", "compressor.memory.kind=attention",
                             "compressor.memory.pool_queries=3", "compressor.answer_head_weight=0", "handoff.variants=[ilcp]",
                             "handoff.encoder_lr=0.01"])
    return cfg, train(cfg, lm=tiny_lm)


def test_attention_run_trains_and_exports_its_pooler(attention_run, tiny_lm):
    from safetensors.torch import load_file

    cfg, result = attention_run
    run = read_export(result.run_dir)
    assert run.config["pooling"]["kind"] == "attention" and run.config["pooling"]["pool_queries"] == 3
    assert run.spec.memory == AttentionMemory(pool_queries=3) and run.encoder.pooler.num_queries == 3
    assert run.encoder.vae.input_dim == 3 * tiny_lm.hidden_size == run.spec.input_dim
    state = load_file(str(result.run_dir / "model.safetensors"))
    assert "pooler.score.weight" in state
    # the queries start at zero (the mean pool) and the answer loss moved them
    assert state["pooler.score.weight"].abs().sum() > 0
    torch.testing.assert_close(run.encoder.pooler.score.weight, result.sources["ilcp"].pooler.score.weight.detach())
    assert result.metrics["variants"]["ilcp"]["steps"] == cfg.handoff.max_steps


def test_attention_run_reloads_to_the_same_memory_vectors(attention_run, tiny_lm):
    from ilcp.encoder.pooling import pad_token_states
    from ilcp.training.extraction import token_states

    _, result = attention_run
    run = read_export(result.run_dir)
    trained = result.sources["ilcp"].eval()
    rows = token_states(tiny_lm, ["John went home. Mary is in the kitchen.", "Sandra moved to the garden."],
                        progress=False)
    states, mask = pad_token_states([rows[0], rows[1]])
    with torch.no_grad():
        expected, _ = trained.memory_for_batch({"tokens": states, "token_mask": mask}, torch.float32)
        got = run.encoder.memory(run.encoder.latent(states, mask), torch.float32)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_stage_one_without_the_answer_head_leaves_the_pooler_at_the_mean(attention_run):
    from safetensors.torch import load_file

    _, result = attention_run
    stage_one = load_file(str(result.run_dir / "stages" / "compressor" / "compressor.safetensors"))
    assert torch.equal(stage_one["pooler.score.weight"], torch.zeros_like(stage_one["pooler.score.weight"]))
    assert "val/answer_accuracy" not in result.metrics["compressor"]


def test_answer_head_trains_the_pooler_in_stage_one_and_is_not_exported(tmp_path, tiny_lm):
    from safetensors.torch import load_file

    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "compressor.memory.kind=attention",
                             "compressor.answer_head_weight=1.0", "handoff.finetune_encoder=false", "handoff.variants=[ilcp]"])
    result = train(cfg, lm=tiny_lm)
    assert 0.0 <= result.metrics["compressor"]["val/answer_accuracy"] <= 1.0
    stage_one = load_file(str(result.run_dir / "stages" / "compressor" / "compressor.safetensors"))
    assert stage_one["pooler.score.weight"].abs().sum() > 0, "the answer head's loss reached the pooler"
    exported = load_file(str(result.run_dir / "model.safetensors"))
    # the encoder is frozen in stage 2 (finetune_encoder=false): the export holds stage 1's pooler
    torch.testing.assert_close(exported["pooler.score.weight"], stage_one["pooler.score.weight"])


def test_question_features_are_standardised_on_train_and_unseen_answers_ignored(tiny_lm):
    rows = [{"context": "John went home.", "question": q, "answer": a}
            for q, a in [("Where is John?", "home"), ("Where is Mary?", "garden"), ("Where is Sandra?", "home")]]
    train_rows = training.HandoffRows(rows, torch.zeros(3, 4))
    val_rows = training.HandoffRows([{**rows[0], "answer": "moon"}], torch.zeros(1, 4))
    tr, va, n = training.stage_one_rows(tiny_lm, train_rows, val_rows)
    assert n == 2 and tr.labels.tolist() == [1, 0, 1] and va.labels.tolist() == [-100]
    torch.testing.assert_close(tr.features.mean(0), torch.zeros(tiny_lm.hidden_size), atol=1e-5, rtol=0)


def test_resume_reloads_a_finished_stage_one_with_its_pooler(tmp_path, tiny_lm, monkeypatch):
    import shutil

    from safetensors.torch import load_file

    base = [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "handoff.variants=[ilcp]",
            "compressor.memory.kind=attention", "compressor.answer_head_weight=1.0"]
    first = train(load_config(TINY, base), lm=tiny_lm)
    stage_one = load_file(str(first.run_dir / "stages" / "compressor" / "compressor.safetensors"))
    assert stage_one["pooler.score.weight"].abs().sum() > 0
    # interrupted before stage 2 saved anything: stage 2 starts again from stage 1's weights
    shutil.rmtree(first.run_dir / "stages" / "ilcp")

    seen = {}
    original = training.pipeline.train_variant

    def recording(cfg, variant, lm, data, encoder, resume, trained=None):
        seen["pooler"] = encoder.pooler.score.weight.detach().clone()
        seen["mu_head"] = encoder.vae.mu_head.weight.detach().clone()
        return original(cfg, variant, lm, data, encoder, resume, trained)

    monkeypatch.setattr(training.pipeline, "train_variant", recording)
    resumed = train(load_config(TINY, base), lm=tiny_lm, resume=True)
    assert torch.equal(seen["pooler"], stage_one["pooler.score.weight"])
    assert torch.equal(seen["mu_head"], stage_one["compressor.mu_head.weight"])
    assert resumed.metrics["compressor"] == first.metrics["compressor"]
    assert resumed.metrics["variants"]["ilcp"]["steps"] == 4


def test_stage_one_scores_nothing_rather_than_nan_when_no_answer_is_known(tiny_lm):
    from ilcp.encoder.compressor import BetaVAE
    from ilcp.config_sections import CompressorConfig

    module = training.CompressorModule(ILCPEncoder(BetaVAE(8, 4, 16)),
                                       CompressorConfig(hidden_dim=16, answer_head_weight=1.0),
                                       question_dim=3, num_answers=5)
    batch = {"pooled": torch.randn(2, 8), "features": torch.randn(2, 3), "label": torch.tensor([-100, -100])}
    out = module._losses(batch)
    assert torch.isfinite(out["answer_ce"]) and float(out["answer_ce"].detach()) == 0.0
    batch["label"] = torch.tensor([-100, 2])
    assert float(module._losses(batch)["answer_ce"].detach()) > 0


def test_baselines_alone_extract_no_sender_states(tmp_path, tiny_lm):
    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}",
                             "handoff.variants=[prompt_tuned,cold_read_tuned]", "handoff.finetune_encoder=false",
                             "compressor.answer_head_weight=0"])
    result = train(cfg, lm=tiny_lm)
    assert not list((tmp_path / "cache").glob("pooled/*"))
    assert set(result.sources) == {"prompt_tuned", "cold_read_tuned"}
    assert "compressor" not in result.metrics["stage_seconds"]
    export = read_export(cfg.run_dir)
    assert export.encoder is None and set(export.soft_prompts) == {"prompt_tuned", "cold_read_tuned"}


def test_frozen_encoder_freezes_the_pooler_in_stage_two(tiny_lm):
    from ilcp.encoder.compressor import BetaVAE
    from ilcp.config_sections import HandoffConfig
    from ilcp.encoder.pooling import AttentionPooler

    pooler = AttentionPooler(tiny_lm.hidden_size, 2)
    encoder = ILCPEncoder(BetaVAE(2 * tiny_lm.hidden_size, 4, 16), pooler=pooler)
    make_memory_source("ilcp", HandoffConfig(finetune_encoder=False), tiny_lm, encoder)
    assert not any(p.requires_grad for p in pooler.parameters())
    assert not any(p.requires_grad for p in encoder.vae.parameters())
    assert all(p.requires_grad for p in encoder.projector.parameters())
    encoder.train()
    assert not encoder.vae.training and not pooler.training and encoder.projector.training


def test_stage_one_does_not_depend_on_random_numbers_drawn_before_it(tmp_path, tiny_lm):
    from safetensors.torch import load_file

    base = [f"lm.cache_dir={tmp_path / 'cache'}", "handoff.variants=[ilcp]", "handoff.max_steps=1",
            "handoff.val_every_steps=1"]
    weights = []
    for i in range(2):
        torch.manual_seed(100 + i)
        torch.rand(1000 * (i + 1))  # what an LM load or conversion might draw
        result = train(load_config(TINY, base + [f"out_dir={tmp_path / str(i)}"]), lm=tiny_lm)
        weights.append(load_file(str(result.run_dir / "stages" / "compressor" / "compressor.safetensors")))
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k


def test_train_py_reports_a_foreign_stage_file_as_an_error_not_a_traceback(tmp_path, capsys):
    import importlib.util

    from safetensors.torch import load_file, save_file

    spec = importlib.util.spec_from_file_location("train_script", REPO / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["--config", str(TINY), f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "handoff.variants=[ilcp]"]
    assert script.main(args) == 0
    marker = tmp_path / "tiny" / "stages" / "compressor" / "compressor.safetensors"
    old = {k[len("compressor."):]: v for k, v in load_file(str(marker)).items() if k.startswith("compressor.")}
    save_file(old, str(marker))  # tensors without this package's names
    assert script.main(args + ["--resume"]) == 2
    assert "hold no compressor.* tensors" in capsys.readouterr().err


def test_distillation_adds_the_kl_to_the_text_reading_teacher_in_training_only(tiny_lm):
    import torch.nn.functional as F

    from ilcp.receiver import prompts
    from ilcp.encoder.compressor import BetaVAE
    from ilcp.config_sections import HandoffConfig

    torch.manual_seed(0)
    cfg = HandoffConfig(num_memory_tokens=2, projector_hidden=16, distill_weight=0.5)
    source = make_memory_source("ilcp", cfg, tiny_lm, ILCPEncoder(BetaVAE(tiny_lm.hidden_size, 4, 16)))
    module = HandoffModule(source, tiny_lm, cfg)
    batch = {"tokens": torch.randn(2, 3, tiny_lm.hidden_size), "token_mask": torch.ones(2, 3, dtype=torch.long),
             "context": ["John went home.", "Mary is in the big kitchen now."],
             "question": ["Where is John?", "Where is Mary?"], "answer": ["home", "kitchen"]}
    module.eval()
    plain, _ = module._teacher_forced(batch)
    module.train()
    with_teacher, _ = module._teacher_forced(batch)
    # the teacher by hand: the frozen LM on the cold-read prompt, at each answer token
    embed, kls = tiny_lm.model.get_input_embeddings(), []
    memory, _ = source.memory_for_batch(batch, torch.float32)
    for i, (c, q, a) in enumerate(zip(batch["context"], batch["question"], batch["answer"])):
        t = tiny_lm.tokenizer(prompts.answer_text(a, tiny_lm.tokenizer), add_special_tokens=False).input_ids
        teacher_ids = tiny_lm.tokenizer(prompts.cold_read_prompt(tiny_lm.tokenizer, c, q), add_special_tokens=False).input_ids
        student_ids = tiny_lm.tokenizer(prompts.question_prompt(tiny_lm.tokenizer, q), add_special_tokens=False).input_ids
        with torch.no_grad():
            teacher = tiny_lm.model(input_ids=torch.tensor([teacher_ids + t])).logits[0, -len(t) - 1:-1]
            student = tiny_lm.model(inputs_embeds=torch.cat([memory[i], embed(torch.tensor(student_ids + t))])[None]
                                    ).logits[0, -len(t) - 1:-1]
        kls.append(F.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="sum"))
    expected = sum(kls) / sum(len(tiny_lm.tokenizer(prompts.answer_text(a, tiny_lm.tokenizer),
                                                    add_special_tokens=False).input_ids) for a in batch["answer"])
    torch.testing.assert_close((with_teacher - plain).detach(), 0.5 * expected, rtol=1e-3, atol=1e-4)


def test_a_run_with_distillation_trains(tmp_path, tiny_lm):
    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "handoff.variants=[ilcp]",
                             "handoff.distill_weight=1.0", "handoff.max_steps=2", "handoff.val_every_steps=2"])
    result = train(cfg, lm=tiny_lm)
    assert result.metrics["variants"]["ilcp"]["steps"] == 2


def test_training_on_a_mix_of_babi_tasks(tmp_path, tiny_lm):
    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "data.task=babi:1+2",
                             "handoff.variants=[prompt_tuned]", "handoff.max_steps=1", "handoff.val_every_steps=1",
                             "compressor.answer_head_weight=0", "handoff.finetune_encoder=false"])
    result = train(cfg, lm=tiny_lm)
    assert result.metrics["train_rows"] == cfg.data.train_size
    assert read_export(result.run_dir).config["task"] == "babi:1+2"
    from ilcp.training.data import load_rows

    rows, key = load_rows(cfg, "train", cfg.data.train_size)
    assert {r["task"] for r in rows} == {"babi-qa1", "babi-qa2"} and "qa2" in str(key)


def test_every_export_carries_a_model_card(tiny_run, tiny_lm, tmp_path):
    from ilcp.handoff import ILCPHandoff

    _, result, _, _ = tiny_run
    card = (result.run_dir / "README.md").read_text()
    assert tiny_lm.fingerprint in card and "ILCPHandoff.from_pretrained" in card and "| ilcp |" in card
    saved = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm).save_pretrained(tmp_path / "saved")
    assert tiny_lm.fingerprint in (saved / "README.md").read_text()


def test_command_lines_train_and_evaluate_through_the_package(tmp_path):
    import subprocess
    import sys

    env_args = [f"out_dir={tmp_path}", f"lm.cache_dir={tmp_path / 'cache'}", "handoff.variants=[prompt_tuned]",
                "handoff.max_steps=1", "handoff.val_every_steps=1"]
    done = subprocess.run([sys.executable, "-m", "ilcp", "train", "--config", str(TINY), *env_args],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[ilcp] exported to" in done.stderr and "GPU available" not in done.stderr + done.stdout
    done = subprocess.run([sys.executable, "-m", "ilcp", "eval", "--ckpt", str(tmp_path / "tiny"), "--limit", "2",
                           "--latency-n", "0", "--lengths", "", "--no-progress", "--out", str(tmp_path / "ev")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ev" / "results.json").is_file()
    assert subprocess.run([sys.executable, "-m", "ilcp"], capture_output=True).returncode == 2
