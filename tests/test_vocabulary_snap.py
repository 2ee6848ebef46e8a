"""Memory snapped to the LM's vocabulary, and ilcp reading cold_read_tuned's vectors, on the tiny LM."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from ilcp.encoder.compressor import BetaVAE
from ilcp.config import load_config
from ilcp.encoder.model import ILCPEncoder, snap_to_vocabulary
from ilcp.export import ExportError, read_config
from ilcp.handoff import ILCPHandoff
from ilcp.training import train
from ilcp.training.handoff_stage import attach_projector, variant_steps
from ilcp.training.pipeline import training_order
from ilcp.export_integrity import redigest

TINY_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def _table(v=50, h=16, seed=0):
    table = torch.randn(v, h, generator=torch.Generator().manual_seed(seed))
    return table, 1.0 / table.norm(dim=-1)


def test_hard_snap_reads_the_closest_embedding_row_and_passes_the_soft_gradient():
    table, inv = _table()
    vectors = (table[[3, 17, 41]] * 2.5 + 0.05 * torch.randn(3, 16)).requires_grad_(True)  # scaled, noisy rows
    with torch.no_grad():
        assert torch.equal(snap_to_vocabulary(vectors, table, inv, "hard", 0.02), table[[3, 17, 41]])
    snapped = snap_to_vocabulary(vectors, table, inv, "hard", 0.5)
    torch.testing.assert_close(snapped, table[[3, 17, 41]])  # forward: the rows themselves
    (snapped * torch.randn(3, 16)).sum().backward()
    assert vectors.grad is not None and vectors.grad.abs().sum() > 0  # backward: the soft mixture's gradient


def test_soft_snap_is_a_mixture_of_rows_that_sharpens_with_the_temperature():
    table, inv = _table()
    vectors = torch.randn(4, 16)
    cold = snap_to_vocabulary(vectors, table, inv, "soft", 1e-4)
    hard = snap_to_vocabulary(vectors, table, inv, "hard", 1e-4)
    torch.testing.assert_close(cold, hard)
    warm = snap_to_vocabulary(vectors, table, inv, "soft", 10.0)
    weights = torch.softmax((F.normalize(vectors, dim=-1) @ F.normalize(table, dim=-1).T) / 10.0, dim=-1)
    torch.testing.assert_close(warm, weights @ table)


def test_a_snapping_encoder_needs_the_vocabulary_and_a_valid_mode(tiny_lm):
    cfg = load_config(TINY_CONFIG)
    encoder = attach_projector(ILCPEncoder(BetaVAE(tiny_lm.hidden_size, 8, 16)), cfg.handoff, tiny_lm)
    z = torch.randn(2, 8)
    encoder.set_vocabulary_snap("hard")
    with pytest.raises(ValueError, match="bind_vocabulary"):
        encoder.memory(z)
    with pytest.raises(ValueError, match="this projector writes vectors of"):
        encoder.bind_vocabulary(torch.zeros(10, tiny_lm.hidden_size + 1))
    table = tiny_lm.model.get_input_embeddings().weight
    encoder.bind_vocabulary(table)
    with torch.no_grad():
        memory = encoder.memory(z)
    rows = table.detach()[(F.normalize(memory, dim=-1) @ F.normalize(table.detach(), dim=-1).T).argmax(-1)]
    assert memory.shape == (2, cfg.handoff.num_memory_tokens, tiny_lm.hidden_size)
    assert torch.equal(memory, rows.float())  # every memory vector is a token embedding
    assert "_vocabulary" not in "".join(encoder.state_dict())  # never part of the weights
    with pytest.raises(ValueError, match="vocabulary snap must be one of"):
        encoder.set_vocabulary_snap("round")
    with pytest.raises(ValueError, match="vocabulary_snap"):
        load_config(TINY_CONFIG, ["handoff.vocabulary_snap=round"])
    with pytest.raises(ValueError, match="snap_temperature"):
        load_config(TINY_CONFIG, ["handoff.snap_temperature=0"])


def test_format_from_needs_in_prompt_memory_and_a_cold_read_tuned_to_read():
    base = ["handoff.memory_placement=in_prompt", "handoff.format_from=cold_read_tuned"]
    with pytest.raises(ValueError, match="add it to handoff.variants"):
        load_config(TINY_CONFIG, base + ["handoff.variants=[ilcp]"])
    with pytest.raises(ValueError, match="format_from needs"):
        load_config(TINY_CONFIG, ["handoff.format_from=cold_read_tuned"])  # prefix memory
    with pytest.raises(ValueError, match="format_from needs"):
        load_config(TINY_CONFIG, base + ["handoff.format_vectors=2"])
    with pytest.raises(ValueError, match="format_from needs"):
        load_config(TINY_CONFIG, base + ["handoff.variants=[cold_read_tuned]"])
    cfg = load_config(TINY_CONFIG, base + ["handoff.variants=[ilcp, prompt_tuned, cold_read_tuned]"])
    assert training_order(cfg) == ["cold_read_tuned", "ilcp", "prompt_tuned"]
    assert training_order(load_config(TINY_CONFIG)) == list(load_config(TINY_CONFIG).handoff.variants)
    # another run's directory: read when training starts, not when the config is checked
    other = load_config(TINY_CONFIG, ["handoff.memory_placement=in_prompt", "handoff.format_from=runs/ref",
                                      "handoff.variants=[ilcp]"])
    assert training_order(other) == ["ilcp"]


def test_format_from_another_run_reads_its_cold_read_tuned_and_refuses_what_it_cannot_read(tmp_path, tiny_lm):
    common = [f"out_dir={tmp_path}", "trainer.progress=false", "handoff.max_steps=2", "handoff.val_every_steps=2"]
    ref = train(load_config(TINY_CONFIG, common + ["run_name=ref", "handoff.variants=[cold_read_tuned]"]), lm=tiny_lm)
    reader = common + ["handoff.memory_placement=in_prompt", "handoff.variants=[ilcp]"]
    result = train(load_config(TINY_CONFIG, reader + ["run_name=reader", f"handoff.format_from={ref.run_dir}"]),
                   lm=tiny_lm)
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    torch.testing.assert_close(handoff.encoder.format_prompt.vectors.detach(),
                               ref.sources["cold_read_tuned"].soft_prompt.detach())
    with pytest.raises(ValueError, match="not a run directory"):
        train(load_config(TINY_CONFIG, reader + ["run_name=r2", f"handoff.format_from={tmp_path / 'missing'}"]),
              lm=tiny_lm)
    assert not (tmp_path / "r2" / "stages").exists()  # refused before any stage
    with pytest.raises(ValueError, match="trained no cold_read_tuned"):
        train(load_config(TINY_CONFIG, reader + ["run_name=r3", f"handoff.format_from={result.run_dir}"]),
              lm=tiny_lm)


def test_a_snapping_run_reads_cold_read_tuned_vectors_exports_and_reloads(tmp_path, tiny_lm):
    result = train(load_config(TINY_CONFIG, [
        f"out_dir={tmp_path}", "run_name=snap", "trainer.progress=false", "handoff.memory_placement=in_prompt",
        "handoff.format_from=cold_read_tuned", "handoff.vocabulary_snap=hard", "handoff.snap_temperature=0.1",
        "handoff.variants=[ilcp, cold_read_tuned]"]), lm=tiny_lm)
    config = read_config(result.run_dir)
    assert config["vocabulary_snap"] == {"mode": "hard", "temperature": 0.1, "metric": "cosine"}
    assert config["format_vectors"] == config["num_memory_tokens"]
    trained_prompt = load_file(str(result.run_dir / "cold_read_tuned.safetensors"))
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    # ilcp read cold_read_tuned's trained vectors, frozen: the export holds them unchanged
    torch.testing.assert_close(handoff.encoder.format_prompt.vectors.detach(), next(iter(trained_prompt.values())))
    assert result.metrics["variants"]["ilcp"]["steps"] > 0
    wire = handoff.to_wire(handoff.send("Mary moved to the bathroom."))
    memory = handoff.memory_vectors(wire)[0]
    table = tiny_lm.model.get_input_embeddings().weight.detach().float()
    assert all(any(torch.equal(row, t) for t in table) for row in memory)  # rows of the vocabulary
    assert isinstance(handoff.receive(wire, "Where is Mary?"), str)
    tampered = tmp_path / "tampered"
    shutil.copytree(result.run_dir, tampered)
    (tampered / "config.json").write_text(json.dumps(redigest(dict(config, vocabulary_snap={"mode": "round",
                                                                                   "temperature": 0.1}))))
    with pytest.raises(ExportError, match="vocabulary_snap.mode"):
        read_config(tampered)
    (tampered / "config.json").write_text(json.dumps(redigest(dict(config, vocabulary_snap={"mode": "hard", "temperature": 0.1,
                                                                                   "metric": "l2"}))))
    with pytest.raises(ExportError, match="vocabulary_snap.metric"):
        read_config(tampered)
    # an export written before the metric existed snapped by cosine
    (tampered / "config.json").write_text(json.dumps(redigest(dict(config, vocabulary_snap={"mode": "hard", "temperature": 0.1}))))
    assert ILCPHandoff.from_pretrained(tampered, lm=tiny_lm).encoder.snap_metric == "cosine"


def test_a_dot_snap_reads_the_row_of_the_largest_inner_product_and_round_trips(tmp_path, tiny_lm):
    table = torch.tensor([[1.0, 0.0], [0.6, 0.8], [3.0, 3.0]])
    inv = 1.0 / table.norm(dim=-1)
    vector = torch.tensor([[1.0, 0.1]])  # closest in angle to row 0, largest inner product with row 2
    with torch.no_grad():
        assert torch.equal(snap_to_vocabulary(vector, table, inv, "hard", 1.0, "cosine"), table[[0]])
        assert torch.equal(snap_to_vocabulary(vector, table, inv, "hard", 1.0, "dot"), table[[2]])
    torch.testing.assert_close(snap_to_vocabulary(vector, table, inv, "soft", 1.0, "dot"),
                               torch.softmax(vector @ table.T, dim=-1) @ table)
    with pytest.raises(ValueError, match="snap metric"):
        ILCPEncoder(BetaVAE(8, 4, 16)).set_vocabulary_snap("hard", 1.0, "l2")
    with pytest.raises(ValueError, match="snap_metric"):
        load_config(TINY_CONFIG, ["handoff.snap_metric=l2"])
    result = train(load_config(TINY_CONFIG, [
        f"out_dir={tmp_path}", "run_name=dot", "trainer.progress=false", "handoff.variants=[ilcp]",
        "handoff.max_steps=2", "handoff.val_every_steps=2", "handoff.vocabulary_snap=hard",
        "handoff.snap_metric=dot", "handoff.snap_temperature=1"]), lm=tiny_lm)
    assert read_config(result.run_dir)["vocabulary_snap"] == {"mode": "hard", "temperature": 1.0, "metric": "dot"}
    handoff = ILCPHandoff.from_pretrained(result.run_dir, lm=tiny_lm)
    assert handoff.encoder.snap_metric == "dot"
    wire = handoff.to_wire(handoff.send("Mary moved to the bathroom."))
    memory = handoff.memory_vectors(wire)[0]
    handoff.encoder.set_vocabulary_snap("none")
    projected = handoff.memory_vectors(wire)[0].float()  # the same latent, read unsnapped
    embeddings = tiny_lm.model.get_input_embeddings().weight.detach().float()
    torch.testing.assert_close(memory.float(), embeddings[(projected @ embeddings.T).argmax(-1)])


def test_validate_start_measures_the_starting_weights_and_keeps_them_unless_beaten(tmp_path, tiny_lm):
    result = train(load_config(TINY_CONFIG, [
        f"out_dir={tmp_path}", "run_name=start", "trainer.progress=false", "handoff.variants=[prompt_tuned]",
        "handoff.validate_start=true", "handoff.max_steps=4", "handoff.val_every_steps=2"]), lm=tiny_lm)
    metrics = result.metrics["variants"]["prompt_tuned"]
    assert [row["step"] for row in metrics["curve"]] == [0, 2, 4]
    start = load_file(str(result.run_dir / "stages" / "prompt_tuned" / "start.safetensors"))
    kept = result.sources["prompt_tuned"].soft_prompt.detach()
    started = next(iter(start.values()))
    if metrics["best_step"] == 0:  # no step beat the start: its weights are the ones exported
        torch.testing.assert_close(kept, started)
    else:
        assert not torch.equal(kept, started)
    exported = load_file(str(result.run_dir / "prompt_tuned.safetensors"))
    torch.testing.assert_close(next(iter(exported.values())), kept)


def test_the_token_loss_without_its_shape_terms_is_the_cross_entropy_alone(tiny_lm):
    from ilcp.encoder.pooling import ConcatPooler
    from ilcp.training.extraction import token_states
    from ilcp.training import ReconstructionModule
    from ilcp.training.data import HandoffRows, collate_rows
    from ilcp.training.reconstruction_stage import TOKEN_TEMPERATURE

    codec = ["compressor.memory.chunk_tokens=4", "compressor.memory.kind=concat", "compressor.answer_head_weight=0",
             "handoff.num_memory_tokens=4", "reconstruct.token_steps=1"]
    contexts = ["Cedar is owned by Alice.", "Maple is owned by Bruno."]
    rows = HandoffRows([{"context": c, "question": "", "answer": ""} for c in contexts],
                       token_states(tiny_lm, contexts, progress=False))
    batch = collate_rows([rows[i] for i in range(len(rows))])
    losses = {}
    for weight in (1.0, 0.0):
        cfg = load_config(TINY_CONFIG, codec + [f"reconstruct.token_shape_weight={weight}"])
        torch.manual_seed(0)
        pooler = ConcatPooler(tiny_lm.hidden_size, 4)
        encoder = attach_projector(ILCPEncoder(BetaVAE(pooler.output_dim, 16, 64), pooler=pooler, chunk_tokens=4),
                                   cfg.handoff, tiny_lm)
        module = ReconstructionModule(encoder, tiny_lm, cfg).eval()  # every vocabulary row a candidate
        memory, _ = module.memory(batch)
        ids = module.context_token_ids(contexts)
        losses[weight] = module._token_loss(memory, ids)[0]
    vectors = torch.cat([m[: len(i)] for m, i in zip(memory, ids)]).float()
    table = tiny_lm.model.get_input_embeddings().weight.float()
    logits = F.normalize(vectors, dim=-1) @ F.normalize(table, dim=-1).T / TOKEN_TEMPERATURE
    ce = F.cross_entropy(logits, torch.tensor([t for i in ids for t in i]))
    torch.testing.assert_close(losses[0.0], ce)
    assert losses[1.0] > losses[0.0]
    cfg = load_config(TINY_CONFIG, codec + ["reconstruct.token_shape_weight=0", "reconstruct.token_logits=dot"])
    module = ReconstructionModule(encoder, tiny_lm, cfg).eval()
    dot = F.cross_entropy(vectors @ table.T, torch.tensor([t for i in ids for t in i]))
    torch.testing.assert_close(module._token_loss(memory, ids)[0], dot)
    with pytest.raises(ValueError, match="token_logits"):
        load_config(TINY_CONFIG, codec + ["reconstruct.token_logits=l2"])
    with pytest.raises(ValueError, match="token_shape_weight"):
        load_config(TINY_CONFIG, codec + ["reconstruct.token_shape_weight=-1"])


def test_cold_read_tuned_steps_sets_that_variants_budget_alone(tmp_path, tiny_lm):
    with pytest.raises(ValueError, match="cold_read_tuned_steps sets the budget"):
        load_config(TINY_CONFIG, ["handoff.variants=[ilcp]", "handoff.cold_read_tuned_steps=2"])
    cfg = load_config(TINY_CONFIG, [
        f"out_dir={tmp_path}", "run_name=budget", "trainer.progress=false", "handoff.memory_placement=in_prompt",
        "handoff.format_from=cold_read_tuned", "handoff.variants=[ilcp, cold_read_tuned]", "handoff.max_steps=3",
        "handoff.cold_read_tuned_steps=2", "handoff.val_every_steps=1"])
    assert (variant_steps(cfg.handoff, "cold_read_tuned"), variant_steps(cfg.handoff, "ilcp")) == (2, 3)
    result = train(cfg, lm=tiny_lm)
    variants = result.metrics["variants"]
    assert (variants["cold_read_tuned"]["steps"], variants["ilcp"]["steps"]) == (2, 3)
    assert [row["step"] for row in variants["cold_read_tuned"]["curve"]] == [1, 2]
