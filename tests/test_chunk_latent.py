"""A beta-VAE per chunk over a frozen chunk writer (`ilcp.training.chunk_latent`)."""

from __future__ import annotations

import json

import pytest
import torch

from ilcp.lm import load_lm
from ilcp.training.chunk_latent import ChunkLatentConfig, load_writer, main, train_latent
from ilcp.training.chunk_pretrain import ChunkPretrainConfig, ChunkReader, pretrain, write


@pytest.fixture(scope="module")
def tiny():
    return load_lm("tiny-qwen3")


@pytest.fixture(scope="module")
def writer_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("chunk") / "writer"
    pretrain(out, tiny, ChunkPretrainConfig(chunk_tokens=4, batch_chunks=8, steps=3, lr=3e-3, warmup_steps=1,
                                            eval_every=3, heldout_chunks=8, width=8, inner=16, babi_stories=20),
             log=lambda _m: None)
    return out


def _cfg(**kw) -> ChunkLatentConfig:
    return ChunkLatentConfig(**{"latent": 8, "hidden": 32, "steps": 40, "batch_chunks": 32, "eval_every": 20,
                                "heldout_chunks": 8, "babi_stories": 20, "lr": 3e-3, **kw})


def test_the_vae_fits_the_writers_vectors_and_resumes_on_the_same_curve(tiny, writer_run, tmp_path):
    quiet = lambda _m: None  # noqa: E731
    rows = train_latent(tmp_path / "whole", tiny, writer_run, _cfg(), log=quiet)
    assert [r["step"] for r in rows] == [0, 20, 40]
    assert rows[-1]["train_recon"] < rows[1]["train_recon"]  # the vector fit learns
    full = json.loads((tmp_path / "whole" / "full_width.json").read_text())
    assert set(full) == {"squad", "prose", "babi_heldout_tasks"} and "squad" in rows[-1]
    train_latent(tmp_path / "split", tiny, writer_run, _cfg(steps=20), log=quiet)
    with pytest.raises(FileExistsError, match="--resume"):
        train_latent(tmp_path / "split", tiny, writer_run, _cfg(), log=quiet)
    with pytest.raises(ValueError, match="only --steps and --receiver-steps"):
        train_latent(tmp_path / "split", tiny, writer_run, _cfg(latent=4), resume=True, log=quiet)
    resumed = train_latent(tmp_path / "split", tiny, writer_run, _cfg(), resume=True, log=quiet)
    assert [r["step"] for r in resumed] == [0, 20, 40]
    assert resumed[-1]["squad"] == rows[-1]["squad"]  # the data order is a function of the step


def test_the_read_back_stage_trains_the_vae_through_the_receiver_alone(tiny, writer_run, tmp_path):
    from safetensors.torch import load_file

    rows = train_latent(tmp_path / "run", tiny, writer_run, _cfg(steps=2, receiver_steps=4, eval_every=2,
                                                                receiver_batch_chunks=4), log=lambda _m: None)
    assert [r["stage"] for r in rows] == ["vector fit", "vector fit", "read-back", "read-back"]
    writer_before = load_file(str(writer_run / "state" / "writer.safetensors"))
    model_writer = load_writer(writer_run, tiny)
    for k, v in model_writer.state_dict().items():
        torch.testing.assert_close(v, writer_before[k])  # the writer is read, never written
    vae = load_file(str(tmp_path / "run" / "state" / "vae.safetensors"))
    assert vae["mu_head.weight"].shape == (8, 32)


def test_the_decoded_vectors_are_what_the_receiver_reads(tiny, writer_run):
    from ilcp.encoder.compressor import BetaVAE
    from ilcp.training.chunk_latent import LatentWriter

    writer = load_writer(writer_run, tiny)
    model = LatentWriter(writer, BetaVAE(tiny.hidden_size, 8, 32)).eval()
    reader = ChunkReader(tiny)
    chunks = torch.randint(5, 200, (3, 4))
    with torch.no_grad():
        z = model.latent(reader.table[chunks])
        assert z.shape == (3, 8)
        torch.testing.assert_close(write(model, reader, chunks)[:, 0], model.decode(z))


def test_bad_latent_settings_and_writers_are_one_line(tmp_path, capsys):
    assert main(["--writer", str(tmp_path), "--out", str(tmp_path / "o"), "--latent", "0"]) == 2
    assert "latent must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["--writer", str(tmp_path), "--out", str(tmp_path / "o"), "--lm", "tiny-qwen3"]) == 2
    assert "neither a shipped chunk writer nor a chunk pretraining folder" in capsys.readouterr().err
    assert main(["--writer", "pretrained/smollm2-chunk8", "--out", str(tmp_path / "o"), "--lm", "tiny-qwen3"]) == 2
    assert "--writer pretrained/smollm2-chunk8 writes vectors of 576 floats; the LM's width is 64" in \
        capsys.readouterr().err


def test_the_curves_command_tabulates_a_latent_run_beside_its_full_width(tiny, writer_run, tmp_path):
    from ilcp_experiments.chunk_curves import main as curves

    train_latent(tmp_path / "z8", tiny, writer_run, _cfg(steps=4, eval_every=2), log=lambda _m: None)
    assert curves([str(tmp_path / "z8"), str(writer_run), "--out", str(tmp_path / "curves")]) == 0
    md = (tmp_path / "curves" / "curves.md").read_text()
    assert "a beta-VAE per chunk, latent 8 floats" in md and "| the writer's full width |" in md
    assert md.count("| no memory |") == 2 and (tmp_path / "curves" / "curves.png").stat().st_size > 0


def test_the_linear_vae_starts_as_the_writers_best_linear_code_of_its_width(tiny):
    """A linear ChunkVAE scales the vectors by one number and starts from their top principal
    directions: its decoding of the mean latent is the vector projected on those directions (the
    squared error's least for a linear code of that width), in the receiver's own geometry."""
    from ilcp.encoder.chunk import ChunkVAE, decode_vectors

    torch.manual_seed(0)
    h, z = tiny.hidden_size, 8
    vectors = torch.randn(256, h) @ torch.randn(h, h) * torch.linspace(0.1, 3.0, h) + 2.0
    vae = ChunkVAE(h, z, 1024, beta=1e-4, linear=True)
    assert sum(p.numel() for p in vae.parameters()) == 3 * h * z + 2 * z + h  # no body: one matrix each way
    vae.set_standardisation(vectors)
    assert torch.all(vae.input_std == vae.input_std[0])  # one scale for every dimension
    share = vae.start_principal(vectors)
    assert share.shape == (h,) and abs(float(share.sum()) - 1) < 1e-5
    mean = vectors.mean(0)
    _, _, vh = torch.linalg.svd(vectors - mean, full_matrices=False)
    top = vh[:z]
    projected = mean + (vectors - mean) @ top.T @ top
    with torch.no_grad():
        torch.testing.assert_close(decode_vectors(vae, vae.latent(vectors)), projected, atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="linear chunk VAE's start"):
        ChunkVAE(h, z, 16).start_principal(vectors)
    with pytest.raises(ValueError, match="fewer than the latent's 8"):
        ChunkVAE(h, z, 16, linear=True).start_principal(vectors[:4])


def test_a_linear_latent_run_starts_at_its_principal_code_and_records_its_form(tiny, writer_run, tmp_path):
    from safetensors.torch import load_file

    rows = train_latent(tmp_path / "lin", tiny, writer_run, _cfg(linear=True, steps=20), log=lambda _m: None)
    assert [r["step"] for r in rows] == [0, 20]
    meta = json.loads((tmp_path / "lin" / "state" / "state.json").read_text())
    assert meta["vae"]["linear"] is True and meta["config"]["linear"] is True and meta["vae"]["hidden_dim"] == 1
    vae = load_file(str(tmp_path / "lin" / "state" / "vae.safetensors"))
    assert vae["mu_head.weight"].shape == (8, tiny.hidden_size) and "body.0.weight" not in vae
    # the principal start reads back at least as well as an MLP VAE's untrained start
    mlp = train_latent(tmp_path / "mlp", tiny, writer_run, _cfg(steps=20), log=lambda _m: None)
    assert rows[0]["squad"]["loss"] < mlp[0]["squad"]["loss"]
    from ilcp_experiments.chunk_curves import main as curves

    assert curves([str(tmp_path / "lin"), "--out", str(tmp_path / "curves")]) == 0
    assert "lin: a linear beta-VAE per chunk (started from the principal directions), latent 8 floats" in \
        (tmp_path / "curves" / "curves.md").read_text()
    with pytest.raises(SystemExit):
        main(["--writer", str(writer_run), "--out", str(tmp_path / "o"), "--linear", "maybe"])
