"""The chunk memory shipped in the repository: the pretrained writers (pretrained/smollm2-chunk8, one
chunk at a time; pretrained/smollm2-chunk8-window, then 4 chunks in a row) and the general handoff
fine-tuned from the second by one config (pretrained/smollm2-general-chunk8), each under 20 MiB, read
with every digest checked, for the embedded SmolLM2, with cards that say how they were made and measured."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ilcp.config import load_config
from ilcp.encoder.chunk_files import read_writer_state
from ilcp.export import read_export

REPO = Path(__file__).resolve().parent.parent
WRITER = REPO / "pretrained" / "smollm2-chunk8"
WINDOW = REPO / "pretrained" / "smollm2-chunk8-window"
GENERAL = REPO / "pretrained" / "smollm2-general-chunk8"


def test_the_three_are_checked_folders_under_20_mib_with_their_cards():
    for folder in (WRITER, WINDOW, GENERAL):
        assert sum(p.stat().st_size for p in folder.iterdir()) < 20 << 20
        assert "## How it was made" in (folder / "README.md").read_text()
    config = json.loads((WRITER / "config.json").read_text())
    assert config["pretraining"]["steps"] >= 1500 and {r["vectors"] for r in config["readback"]} == {1, 4, 16}
    card = (WRITER / "README.md").read_text()
    assert f"{config['pretraining']['steps']} steps of 32 chunks" in card and "hours trained" in card
    window = json.loads((WINDOW / "config.json").read_text())["pretraining"]
    assert window["steps"] >= 1500 and window["config"]["window_chunks"] == 4
    assert [e["steps"] for e in window["earlier_stages"]] == [config["pretraining"]["steps"]]
    assert "hours in all" in (WINDOW / "README.md").read_text()
    run = read_export(GENERAL)  # schema, config.json's digest, the weights' sha256
    assert run.encoder is not None
    card = (GENERAL / "README.md").read_text()
    assert "| babi:11 (held out) |" in card and "configs/general-chunk-recipe.yaml" in card
    assert "prompt_tuned is from `results/general-chunk/results.json`" in card


def test_the_general_handoff_fine_tuned_the_window_writer():
    settings = json.loads((WINDOW / "config.json").read_text())["writer"]
    writer = read_writer_state(WINDOW, settings)
    weights = load_file(str(GENERAL / "model.safetensors"))
    assert {f"pooler.writer.{name}" for name in writer} <= set(weights)
    assert not torch.allclose(weights["pooler.writer.mlp.4.weight"], writer["mlp.4.weight"])  # trained on answers


def test_the_general_recipes_start_from_the_shipped_window_writer(tmp_path):
    shipped = json.loads((GENERAL / "config.json").read_text())
    assert shipped["pooling"]["kind"] == "chunk" and "latent" not in shipped["pooling"]  # the writer's full width
    for name in ("general-chunk-recipe.yaml", "general-chunk-latent.yaml"):
        cfg = load_config(REPO / "configs" / name, [f"out_dir={tmp_path}"])
        assert (REPO / cfg.compressor.memory.writer_from).resolve() == WINDOW.resolve()
        assert cfg.data.heldout_tasks == ["babi:2", "babi:11", "babi:16"] and cfg.handoff.finetune_encoder
        assert cfg.handoff.format_from == "cold_read_tuned" and cfg.handoff.cold_read_tuned_steps == 120
    latent = load_config(REPO / "configs" / "general-chunk-latent.yaml", [f"out_dir={tmp_path}"]).compressor.memory
    assert latent.latent == 32 and latent.latent_from == "checkpoints/chunk-c8w-z32"
    first = load_config(REPO / "configs" / "general-chunk.yaml", [f"out_dir={tmp_path}"])
    assert (REPO / first.compressor.memory.writer_from).resolve() == WRITER.resolve()


@pytest.mark.slow
def test_both_are_for_the_embedded_smollm2(smollm2):
    assert json.loads((WRITER / "config.json").read_text())["lm"]["fingerprint"] == smollm2.fingerprint
    assert json.loads((GENERAL / "config.json").read_text())["lm"]["fingerprint"] == smollm2.fingerprint
    assert json.loads((WINDOW / "config.json").read_text())["lm"]["fingerprint"] == smollm2.fingerprint


def test_the_shipped_sender_writer_is_the_lm_with_adapters_on_its_top_8_layers():
    folder = REPO / "pretrained" / "smollm2-chunk8-sender"
    assert sum(p.stat().st_size for p in folder.iterdir()) < 20 << 20
    config = json.loads((folder / "config.json").read_text())
    settings = config["writer"]
    assert settings == {"kind": "sender", "hidden_size": 576, "chunk_tokens": 8, "layers": 8, "rank": 16}
    weights = read_writer_state(folder, settings)  # the weights' sha256 and config.json's digest
    layers = {int(k.split(".")[1].split("_")[0]) for k in weights if k.startswith("adapters.")}
    assert layers == set(range(22, 30))  # SmolLM2-135M has 30 decoder layers
    assert weights["memory_embedding"].shape == (576,) and weights["head.weight"].abs().sum() > 0
    assert config["pretraining"]["steps"] >= 1500
    one = {r["source"]: r for r in config["readback"] if r["vectors"] == 1 and r["memory"] == "chunk writer"}
    none = {r["source"]: r for r in config["readback"] if r["vectors"] == 1 and r["memory"] == "no memory"}
    assert all(one[s]["interval"][0] > none[s]["interval"][1] for s in one)  # one chunk: far above no memory
    card = (folder / "README.md").read_text()
    assert "the LM itself" in card and "compressor.memory.writer=sender" in card and "hours trained" in card


SENDER_WINDOW = REPO / "pretrained" / "smollm2-chunk8-sender-window"
GENERAL_SENDER = REPO / "pretrained" / "smollm2-general-chunk8-sender"


def test_the_sender_window_writer_counts_both_stages_and_the_general_sender_handoff_is_a_checked_export():
    config = json.loads((SENDER_WINDOW / "config.json").read_text())
    assert sum(p.stat().st_size for p in SENDER_WINDOW.iterdir()) < 20 << 20
    read_writer_state(SENDER_WINDOW, config["writer"])
    pre = config["pretraining"]
    assert pre["steps"] >= 1500 and pre["config"]["window_chunks"] == 4 and pre["earlier_stages"][0]["steps"] >= 1500
    assert sum(p.stat().st_size for p in GENERAL_SENDER.iterdir()) < 20 << 20
    run = read_export(GENERAL_SENDER)  # schema, config.json's digest, the weights' sha256
    pooling = run.config["pooling"]
    assert pooling["kind"] == "chunk" and pooling["writer"] == "sender" and len(pooling["adapters"]) == 8 * 7
    card = (GENERAL_SENDER / "README.md").read_text()
    assert "pretrained/smollm2-chunk8-sender" in card and "| babi:16 (held out) |" in card
    assert "the export holds ilcp at step" in card


GENERAL_SENDER_WINDOW = REPO / "pretrained" / "smollm2-general-chunk8-sender-window"


def _sender_handoff(folder: Path) -> tuple[dict, str]:
    """A shipped general handoff on the LM writer: under 20 MiB, a checked export (schema, config.json's
    digest, the weights' sha256) whose writer is the LM with adapters on 8 layers; its pooling and card."""
    assert sum(p.stat().st_size for p in folder.iterdir()) < 20 << 20
    pooling = read_export(folder).config["pooling"]
    assert pooling["kind"] == "chunk" and pooling["writer"] == "sender" and len(pooling["adapters"]) == 8 * 7
    return pooling, (folder / "README.md").read_text()


def test_the_general_handoff_on_the_window_stage_sender_writer_is_a_checked_export_with_its_card():
    _, card = _sender_handoff(GENERAL_SENDER_WINDOW)
    assert "compressor.memory.writer_from=pretrained/smollm2-chunk8-sender-window" in card
    assert "| babi:11 (held out) |" in card and "prompt_tuned -" not in card  # every baseline row measured


def test_the_sender_latent_recipe_narrows_the_shipped_sender_writer(tmp_path):
    cfg = load_config(REPO / "configs" / "general-chunk-sender-latent.yaml", [f"out_dir={tmp_path}"])
    memory = cfg.compressor.memory
    assert memory.writer == "sender" and memory.sender_layers == 8 and memory.sender_rank == 16
    assert (REPO / memory.writer_from).resolve() == (REPO / "pretrained" / "smollm2-chunk8-sender").resolve()
    assert memory.latent == 128 and memory.latent_from == "checkpoints/chunk-c8s-l128"
    assert cfg.data.heldout_tasks == ["babi:2", "babi:11", "babi:16"] and cfg.handoff.finetune_encoder


GENERAL_SENDER_LATENT = REPO / "pretrained" / "smollm2-general-chunk8-sender-latent"


def test_the_latent_handoff_is_a_checked_export_of_a_linear_128_float_vae_with_its_card():
    """The general handoff whose wire carries 128 floats a chunk (a linear beta-VAE over the LM writer)."""
    pooling, card = _sender_handoff(GENERAL_SENDER_LATENT)
    assert pooling["latent"] == 128 and pooling["latent_linear"] is True
    weights = load_file(str(GENERAL_SENDER_LATENT / "model.safetensors"))
    assert weights["compressor.mu_head.weight"].shape == (128, 576)
    assert not any(k.startswith("compressor.body.") and k.endswith(".weight") for k in weights)  # no MLP body
    assert "chunk-c8s-l128" in card and "| babi:16 (held out) |" in card and "prompt_tuned -" not in card


@pytest.mark.slow
@pytest.mark.parametrize("folder, floats", [(GENERAL_SENDER, 576), (GENERAL_SENDER_LATENT, 128)],
                         ids=["full-width", "latent-128"])
def test_the_sender_handoffs_answer_with_no_training(smollm2, folder, floats):
    """The LM writer's shipped handoffs bind the writer to the LM they are given and send one row of
    `floats` a chunk of 8 tokens (the LM's width, or the linear VAE's latent)."""
    from ilcp.handoff import ILCPHandoff

    handoff = ILCPHandoff.from_pretrained(folder, lm=smollm2)
    assert handoff.encoder.writer.model is smollm2.model  # the writer is the LM the handoff was given
    story = "Mary moved to the bathroom. John went to the hallway. Mary travelled to the office."
    payload = handoff.send(story)
    ids = smollm2.tokenizer(story, add_special_tokens=False)["input_ids"]
    assert tuple(payload.latent.shape) == (-(-len(ids) // 8), floats)
    answer = handoff.open(payload.to_bytes()).ask("Where is John?")
    assert isinstance(answer, str) and answer.strip()
