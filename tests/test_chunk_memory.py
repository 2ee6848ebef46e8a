"""Chunk memory: the writer, the receiver's cached read and the resumable pretraining curve."""

from __future__ import annotations

import json

import pytest
import torch

from ilcp.encoder.chunk import ChunkWriter, chunk_ids
from ilcp.lm import load_lm
from ilcp.training.chunk_pretrain import ChunkPretrainConfig, ChunkReader, cut, epoch_offset, pretrain, write


@pytest.fixture(scope="module")
def tiny():
    return load_lm("tiny-qwen3")


def test_chunk_ids_cut_and_pad():
    chunks, lengths = chunk_ids([5, 6, 7, 8, 9], 2, pad_id=0)
    assert chunks.tolist() == [[5, 6], [7, 8], [9, 0]]
    assert lengths.tolist() == [2, 2, 1]
    empty, n = chunk_ids([], 4, pad_id=0)
    assert empty.shape == (0, 4) and n.numel() == 0
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_ids([1], 0, pad_id=0)


def test_untrained_writer_hands_over_the_first_token(tiny):
    table = tiny.model.get_input_embeddings().weight
    writer = ChunkWriter(tiny.hidden_size, 4, width=8, inner=16)
    chunks = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(writer(table[chunks]), table[chunks[:, 0]])


def test_a_chunk_vector_depends_on_its_chunk_alone(tiny):
    table = tiny.model.get_input_embeddings().weight
    torch.manual_seed(0)
    writer = ChunkWriter(tiny.hidden_size, 4, width=8, inner=16)
    torch.nn.init.normal_(writer.mlp[-1].weight, std=0.1)  # a trained-like writer, not the identity start
    context = [11, 12, 13, 14, 15, 16, 17, 18]
    before = [21, 22, 23, 24]
    with torch.no_grad():
        alone = writer(table[chunk_ids(context, 4, 0)[0]])
        after_text = writer(table[chunk_ids(before + context, 4, 0)[0]])[1:]
        other = chunk_ids([31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42], 4, 0)[0]
        batched = writer(table[torch.cat([other, chunk_ids(context, 4, 0)[0]])])[len(other):]
    torch.testing.assert_close(alone, after_text)
    torch.testing.assert_close(alone, batched)
    assert not torch.allclose(alone[0], alone[1])


def test_writer_reads_padding_as_past_the_end(tiny):
    table = tiny.model.get_input_embeddings().weight
    writer = ChunkWriter(tiny.hidden_size, 4, width=8, inner=16)
    torch.nn.init.normal_(writer.mlp[-1].weight, std=0.1)
    a = torch.tensor([[3, 4, 0, 0]])
    b = torch.tensor([[3, 4, 9, 9]])
    lengths = torch.tensor([2])
    with torch.no_grad():
        torch.testing.assert_close(writer(table[a], lengths), writer(table[b], lengths))


def test_writer_refuses_wrong_shapes(tiny):
    writer = ChunkWriter(tiny.hidden_size, 4, width=8, inner=16)
    with pytest.raises(ValueError, match=r"\(N, 4, 64\)"):
        writer(torch.zeros(2, 3, tiny.hidden_size))
    with pytest.raises(ValueError, match="chunk_tokens"):
        ChunkWriter(tiny.hidden_size, 0)


@pytest.mark.parametrize("chunks_per_text", [1, 3])
def test_cached_instruction_reads_as_the_whole_sequence(tiny, chunks_per_text):
    reader = ChunkReader(tiny)
    torch.manual_seed(1)
    writer = ChunkWriter(tiny.hidden_size, 4, width=8, inner=16)
    torch.nn.init.normal_(writer.mlp[-1].weight, std=0.1)
    texts = torch.randint(5, 200, (2, 4 * chunks_per_text))
    memory = write(writer, reader, texts)
    assert memory.shape == (2, chunks_per_text, tiny.hidden_size)
    prefix = reader.table[torch.tensor([reader.prefix_ids] * 2)]
    for mem in (memory, None):
        got = reader.logits(mem, texts)
        parts = [prefix] + ([] if mem is None else [mem]) + [reader.table[texts][:, :-1]]
        full = tiny.model(inputs_embeds=torch.cat(parts, dim=1)).logits.float()
        start = prefix.shape[1] - 1 + (0 if mem is None else mem.shape[1])
        torch.testing.assert_close(got, full[:, start:], atol=1e-4, rtol=1e-4)
        assert got.shape[:2] == texts.shape


def test_cut_and_offsets():
    assert cut([[1, 2, 3, 4, 5, 6, 7]], 3).tolist() == [[1, 2, 3], [4, 5, 6]]
    assert cut([[1, 2, 3, 4, 5, 6, 7]], 3, offset=1).tolist() == [[2, 3, 4], [5, 6, 7]]
    assert sorted(epoch_offset(e, 8) for e in range(8)) == list(range(8))
    assert sorted(epoch_offset(e, 4) for e in range(4)) == list(range(4))


def _tiny_cfg(steps: int) -> ChunkPretrainConfig:
    return ChunkPretrainConfig(chunk_tokens=4, batch_chunks=8, steps=steps, lr=3e-3, warmup_steps=2, eval_every=5,
                               heldout_chunks=8, width=8, inner=16, babi_stories=20)


def test_pretraining_lowers_the_loss_and_resumes_on_the_same_curve(tiny, tmp_path):
    quiet = lambda _m: None  # noqa: E731
    whole = pretrain(tmp_path / "whole", tiny, _tiny_cfg(10), log=quiet)
    assert [r["step"] for r in whole] == [0, 5, 10]
    first = pretrain(tmp_path / "split", tiny, _tiny_cfg(5), log=quiet)
    with pytest.raises(FileExistsError, match="--resume"):
        pretrain(tmp_path / "split", tiny, _tiny_cfg(10), log=quiet)
    with pytest.raises(ValueError, match="other settings"):
        pretrain(tmp_path / "split", tiny, ChunkPretrainConfig(**{**_tiny_cfg(10).__dict__, "lr": 1e-2}), resume=True,
                 log=quiet)
    resumed = pretrain(tmp_path / "split", tiny, _tiny_cfg(10), resume=True, log=quiet)
    assert [r["step"] for r in first] == [0, 5] and [r["step"] for r in resumed] == [0, 5, 10]
    for a, b in zip(whole, resumed):
        assert a["squad"] == b["squad"] and a["train_loss"] == b["train_loss"]
    state = json.loads((tmp_path / "split" / "state" / "state.json").read_text())
    assert state["step"] == 10 and state["seconds"] > 0
    lines = (tmp_path / "split" / "curve.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 5, 10]
    # the untrained writer reads as its chunks' first tokens; training moves the held-out loss
    assert whole[-1]["squad"]["loss"] != whole[0]["squad"]["loss"]
    # the curves command plots and tabulates the run
    from ilcp_experiments.chunk_curves import main as curves

    assert curves([str(tmp_path / "split"), "--out", str(tmp_path / "curves")]) == 0
    md = (tmp_path / "curves" / "curves.md").read_text()
    assert "| no memory |" in md and md.count("\n| 5 |") == 1 and (tmp_path / "curves" / "curves.png").stat().st_size > 0
    assert curves([str(tmp_path / "nothing"), "--out", str(tmp_path / "curves")]) == 2
    record = json.loads((tmp_path / "curves" / "chunk_curves.json").read_text())
    assert record["runs"][0]["steps"] == 10 and [s["from_step"] for s in record["runs"][0]["sessions"]] == [0, 5]
    assert record["provenance"]["machine"]


def test_the_receivers_loss_trains_the_writer_alone(tiny):
    """The frozen receiver passes its gradient to the writer (every parameter of it) and keeps none;
    steps on one batch lower its loss. (The tiny random LM barely reads its inputs, so the drop is small.)"""
    reader = ChunkReader(tiny)
    torch.manual_seed(0)
    writer = ChunkWriter(tiny.hidden_size, 4, width=16, inner=64)
    opt = torch.optim.AdamW(writer.parameters(), lr=1e-2)
    texts = torch.randint(5, 200, (8, 4))
    losses = []
    for step in range(30):
        loss = reader.score(write(writer, reader, texts), texts)["loss"]
        opt.zero_grad()
        loss.backward()
        if step == 1:  # the zero-initialised last layer has moved, so gradients reach every layer
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in writer.parameters())
        opt.step()
        losses.append(float(loss.detach()))
    assert all(p.grad is None for p in tiny.model.parameters())
    assert losses[-1] < losses[0] - 0.02


def test_the_chunk_encoder_sends_each_chunks_written_vector(tiny):
    """Through the encoder's own path (layer-0 states, chunks cut from right-padded contexts), a
    chunk's latent is its writer's vector: the same alone, after other text, or in a batch."""
    from ilcp.encoder.chunk import ChunkEncoder
    from ilcp.encoder.pooling import pad_right, sender_token_states

    torch.manual_seed(0)
    writer = ChunkWriter(tiny.hidden_size, 4, width=8, inner=16)
    torch.nn.init.normal_(writer.mlp[-1].weight, std=0.1)
    encoder = ChunkEncoder(writer).eval()
    context, before = list(range(11, 21)), list(range(31, 39))  # 10 tokens: chunks of 4, 4 and 2

    def latents(rows):
        ids, mask = pad_right(rows, 0)
        states = sender_token_states(tiny.model, ids, mask, (0,))
        with torch.no_grad():
            z = encoder.latent(states, mask)
        real = encoder.latent_mask(mask)
        return [z[i][real[i]] for i in range(len(rows))]

    alone = latents([context])[0]
    assert alone.shape == (3, tiny.hidden_size)
    torch.testing.assert_close(latents([before + context])[0][2:], alone)
    torch.testing.assert_close(latents([list(range(40, 70)), context])[1], alone)
    table = tiny.model.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(alone[0], writer(table[torch.tensor([context[:4]])])[0])
        memory = encoder.memory(alone.unsqueeze(0))
    assert memory.shape == (1, 3, tiny.hidden_size)  # one memory vector per chunk, in order
    torch.testing.assert_close(memory[0], alone)


@pytest.mark.parametrize("config, tiny_flags", [("configs/chunk/pretrain.yaml", []),
                                                ("configs/chunk/pretrain-gpu.yaml", []),
                                                ("configs/chunk/sender.yaml", ["--sender-layers", "1"]),
                                                ("configs/pretrain-gpu.yaml", ["--sender-layers", "1"])])
def test_the_shipped_recipes_run_at_tiny_size(config, tiny_flags, tmp_path, capsys):
    """Each recipe's settings are read as they stand; at the tiny LM's size on the CPU, two steps run."""
    from pathlib import Path

    from ilcp.training.chunk_pretrain import load_settings, main

    root = Path(__file__).resolve().parent.parent
    cfg, runtime = load_settings(str(root / config), {})
    assert runtime["lm"] == "smollm2-135m-instruct" and cfg.chunk_tokens == 8 and cfg.steps >= 1500
    code = main(["--config", str(root / config), "--out", str(tmp_path / "run"), "--lm", "tiny-qwen3", "--device", "cpu",
                 "--dtype", "float32", "--steps", "2", "--eval-every", "2", "--heldout-chunks", "4", "--width", "8",
                 "--inner", "16", "--babi-stories", "10", *tiny_flags])
    assert code == 0
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "curve.jsonl").read_text().splitlines()] == [0, 2]


def test_train_py_runs_a_chunk_recipe_into_checkpoints_run_name(tmp_path, capsys):
    """`python train.py --config configs/pretrain-gpu.yaml key=value ...` is the chunk pretraining of that file:
    flat overrides, the folder out_dir/run_name (the file's name by default), --resume going on with the curve,
    and a wrong key or a bare word one line with exit code 2."""
    from pathlib import Path

    from ilcp.cli import train_main

    recipe = str(Path(__file__).resolve().parent.parent / "configs" / "pretrain-gpu.yaml")
    tiny = ["lm=tiny-qwen3", "device=cpu", "dtype=float32", "eval_every=2", "heldout_chunks=4", "width=8",
            "inner=16", "babi_stories=10", "sender_layers=1", f"out_dir={tmp_path}"]
    assert train_main(["--config", recipe, *tiny, "steps=2"]) == 0
    curve = tmp_path / "pretrain-gpu" / "curve.jsonl"
    assert [json.loads(line)["step"] for line in curve.read_text().splitlines()] == [0, 2]
    assert train_main(["--config", recipe, *tiny, "steps=2"]) == 2  # a run is there: --resume or another name
    assert "holds a chunk pretraining; pass --resume" in capsys.readouterr().err
    assert train_main(["--config", recipe, "--resume", *tiny, "steps=4"]) == 0
    assert [json.loads(line)["step"] for line in curve.read_text().splitlines()] == [0, 2, 4]
    assert train_main(["--config", recipe, *tiny, "steps=2", "run_name=other"]) == 0
    assert (tmp_path / "other" / "curve.jsonl").is_file()
    capsys.readouterr()
    assert train_main(["--config", recipe, *tiny, "stepz=2"]) == 2
    assert "unknown chunk pretraining setting(s) stepz" in capsys.readouterr().err
    assert train_main(["--config", recipe, *tiny, "steps"]) == 2
    assert "override 'steps' is not key=value" in capsys.readouterr().err
    assert train_main(["--config", recipe, *tiny, "steps=-1"]) == 2
    assert "steps must be an integer >= 0, got -1" in capsys.readouterr().err


def test_bad_chunk_settings_are_one_line(tmp_path, capsys):
    from ilcp.training.chunk_pretrain import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_tokenz: 8\n")
    assert main(["--config", str(bad), "--out", str(tmp_path / "run")]) == 2
    assert "unknown chunk pretraining setting(s) chunk_tokenz" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "run")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["--continuation-tokens", "-4", "--out", str(tmp_path / "run")]) == 2
    assert "continuation_tokens must be an integer >= 0, got -4" in capsys.readouterr().err


def test_the_direct_path_is_linear_in_the_embeddings_and_skips_padding(tiny):
    torch.manual_seed(0)
    writer = ChunkWriter(tiny.hidden_size, 4, width=8, inner=16, direct=True)
    x1, x2 = torch.randn(2, 1, 4, tiny.hidden_size).unbind(0)
    with torch.no_grad():
        torch.testing.assert_close(writer(x1), x1[:, 0])  # the direct path starts at zero
        torch.nn.init.normal_(writer.direct, std=0.05)
        # with the MLP's zero start the writer is linear: one map for every token of the vocabulary
        torch.testing.assert_close(writer(x1 + x2), writer(x1) + writer(x2), atol=1e-5, rtol=1e-5)
        padded = x1.clone()
        padded[:, 2:] = 7.0
        torch.testing.assert_close(writer(padded, torch.tensor([2])), writer(x1, torch.tensor([2])))
    assert writer.settings()["direct"] is True and "direct" not in ChunkWriter(64, 4).settings()


def test_the_direct_flag_reads_true_and_false(tmp_path, tiny):
    from ilcp.training.chunk_pretrain import load_settings, main

    cfg, _ = load_settings(None, {"direct": True})
    assert cfg.direct is True
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "r"), "--direct", "maybe"])


def test_reading_vectors_come_before_the_chunk_vectors_and_train_with_the_writer(tiny, tmp_path):
    cfg = ChunkPretrainConfig(**{**_tiny_cfg(4).__dict__, "reading_vectors": 2})
    rows = pretrain(tmp_path / "run", tiny, cfg, log=lambda _m: None)
    assert [r["step"] for r in rows] == [0, 4]
    state = json.loads((tmp_path / "run" / "state" / "state.json").read_text())
    assert state["writer"]["reading"] == 2
    from safetensors.torch import load_file

    writer = ChunkWriter(tiny.hidden_size, 4, width=8, inner=16, reading=2)
    writer.load_state_dict(load_file(str(tmp_path / "run" / "state" / "writer.safetensors")))
    reader = ChunkReader(tiny)
    start = reader.table[reader.prefix_ids[-2:]].float()
    assert not torch.allclose(writer.reading.detach(), start)  # they trained, from the instruction's last tokens
    windows = torch.tensor([list(range(10, 18)), list(range(20, 28))])
    with torch.no_grad():
        memory = write(writer, reader, windows)
        plain = ChunkWriter(tiny.hidden_size, 4, width=8, inner=16)
        plain.load_state_dict({k: v for k, v in writer.state_dict().items() if k != "reading"})
        vectors = write(plain, reader, windows)
    assert memory.shape == (2, 4, tiny.hidden_size)
    torch.testing.assert_close(memory[:, :2], writer.reading.detach().expand(2, -1, -1))
    torch.testing.assert_close(memory[:, 2:], vectors)
    with pytest.raises(ValueError, match="reading must be an integer >= 0"):
        ChunkWriter(64, 4, reading=-1)


def test_continuation_reads_the_rest_of_the_row_after_the_windows_vectors(tiny):
    from ilcp.receiver.prompts import continuation_prompt
    from ilcp.training.chunk_pretrain import read_back

    follower = ChunkReader(tiny, continuation_prompt(tiny.tokenizer))
    assert follower.prefix_ids != ChunkReader(tiny).prefix_ids
    torch.manual_seed(2)
    writer = ChunkWriter(tiny.hidden_size, 4, width=8, inner=16)
    torch.nn.init.normal_(writer.mlp[-1].weight, std=0.1)
    rows = torch.randint(5, 200, (3, 8 + 5))  # a window of 2 chunks, then 5 tokens to continue
    got = read_back(writer, follower, rows, memory_tokens=8)
    with torch.no_grad():
        expected = follower.score(write(writer, follower, rows[:, :8]), rows[:, 8:])
    assert got["loss"] == pytest.approx(float(expected["loss"]), abs=1e-4)
    assert got["token_accuracy"] == pytest.approx(float(expected["token_accuracy"]), abs=1e-4)
    alone = read_back(None, follower, rows, memory_tokens=8)  # no memory: the instruction, then the 5 tokens
    assert alone["loss"] == pytest.approx(float(follower.score(None, rows[:, 8:])["loss"]), abs=1e-4)


def test_the_window_stage_with_continuation_trains_on_both_and_curves_both(tiny, tmp_path):
    base = {**_tiny_cfg(3).__dict__, "window_chunks": 2, "continuation_tokens": 4, "eval_every": 3}
    rows = pretrain(tmp_path / "both", tiny, ChunkPretrainConfig(**base), log=lambda _m: None)
    assert {"squad_continuation", "prose_continuation", "squad", "babi_heldout_tasks"} <= set(rows[-1])
    base_line = json.loads((tmp_path / "both" / "no_memory.json").read_text())
    assert "squad_continuation" in base_line
    pretrain(tmp_path / "said", tiny, ChunkPretrainConfig(**{**base, "continuation_weight": 0.0}), log=lambda _m: None)
    from safetensors.torch import load_file

    both = load_file(str(tmp_path / "both" / "state" / "writer.safetensors"))
    said = load_file(str(tmp_path / "said" / "state" / "writer.safetensors"))
    assert not torch.allclose(both["mlp.4.weight"], said["mlp.4.weight"])  # the continuation's loss reached the writer
    from ilcp_experiments.chunk_curves import main as curves

    assert curves([str(tmp_path / "both"), "--out", str(tmp_path / "curves")]) == 0
    assert "squad_continuation acc" in (tmp_path / "curves" / "curves.md").read_text()


def test_every_batch_is_whole_in_every_epoch():
    from ilcp.training.chunk_pretrain import ChunkBatches

    texts = [list(range(100 + 40 * t, 100 + 40 * t + 21 + t)) for t in range(7)]  # ragged: later offsets cut fewer
    batches = ChunkBatches(texts, 4, 5, seed=0)
    per = batches.steps_per_epoch()
    first = batches._epoch_chunks(0)
    assert len(batches._epoch_chunks(1)) < len(first)  # offset 3 leaves fewer whole chunks
    for step in range(4 * per):
        assert batches.at(step).shape == (5, 4)
    assert torch.equal(torch.cat([batches.at(i) for i in range(per)]), first[:per * 5])  # epoch 0 as sliced
