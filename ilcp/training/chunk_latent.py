"""A beta-VAE per chunk: how far a pretrained chunk writer's vectors narrow before the receiver
reads them back worse.

The writer (a shipped writer or a pretraining folder, frozen) writes one vector of the LM's width
per chunk; a `ChunkVAE` (the package's `BetaVAE`, the module the slot memory compresses with) encodes each vector into
``latent`` floats, which are what would cross the wire, and decodes them back to a vector the
receiver reads where it read the writer's. Two losses, in turn:

- ``steps``: the vector fit. The VAE's mean squared error in the standardised space plus ``beta``
  times its KL, on the training corpus's chunks (`chunk_pretrain.chunk_corpus`), no receiver in the
  loop: a step is the writer's and the VAE's MLPs on a batch of chunks, so thousands of steps
  cost minutes.
- ``receiver_steps``: then the receiver's read-back loss through the decoded vectors (the frozen
  receiver says the chunk back, as in the writer's pretraining), plus ``beta`` times the KL; the
  writer stays frozen, the VAE learns.

With ``linear`` the VAE is one matrix each way, its vectors scaled by one number, started from the
top ``latent`` principal directions of the writer's vectors on `PRINCIPAL_CHUNKS` training chunks
(`ChunkVAE.start_principal`): the MLP VAE's per-dimension standardisation weighs every dimension alike,
the receiver does not.

The held-out read-back (the writer's own sets: SQuAD validation, the books' validation passages,
the held-out bAbI tasks' stories) of the decoded vectors is measured every ``eval_every`` steps
beside the writer's full-width vectors and no memory, into ``curve.jsonl``. The state is written
atomically at each evaluation and ``--resume`` continues the same curve.

    python -m ilcp.training.chunk_latent --writer pretrained/smollm2-chunk8 --latent 128 --out checkpoints/chunk-c8-z128
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from ..encoder.chunk import ChunkVAE, ChunkWriter, decode_vectors
from ..encoder.compressor import kl_divergence
from ..io import atomic_save_safetensors, atomic_write_json, atomic_write_text
from ..lm import LM
from .chunk_pretrain import (ChunkBatches, ChunkPretrainConfig, ChunkReader, chunk_corpus, cut, even_sample,
                             heldout_texts, read_back, tokenize)
from .chunk_run import adam_moments, parse_flag, restore_adam_moments, run_with_lm

__all__ = ["ChunkLatentConfig", "LatentWriter", "train_latent"]

PRINCIPAL_CHUNKS = 4096  # training chunks a linear VAE's principal directions come from


@dataclass
class ChunkLatentConfig:
    latent: int = 128  # floats a chunk crosses the wire as
    hidden: int = 1024  # the VAE's body and decoder width (an MLP VAE's)
    linear: bool = False  # one matrix each way, started from the writer's principal directions (`ChunkVAE`)
    beta: float = 1e-4  # the KL's weight (the MSE is a mean per dimension, the KL a sum over the latent)
    steps: int = 3000  # vector-fit steps
    receiver_steps: int = 0  # then read-back steps through the receiver
    batch_chunks: int = 256  # chunks a vector-fit step
    receiver_batch_chunks: int = 32  # chunks a read-back step
    lr: float = 1e-3
    eval_every: int = 500
    heldout_chunks: int = 256
    babi_stories: int = 3000
    seed: int = 0

    def __post_init__(self):
        for name, low in (("latent", 1), ("hidden", 1), ("steps", 0), ("receiver_steps", 0), ("batch_chunks", 2),
                          ("receiver_batch_chunks", 1), ("eval_every", 1), ("heldout_chunks", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"chunk latent: {name} must be an integer >= {low}, got {value!r}")
        for name in ("beta", "lr"):
            if not isinstance(getattr(self, name), (int, float)) or not getattr(self, name) >= 0:
                raise ValueError(f"chunk latent: {name} must be a number >= 0, got {getattr(self, name)!r}")


class LatentWriter(nn.Module):
    """A frozen writer followed by a beta-VAE: chunks -> the decoded vectors the receiver reads
    (``forward``, as `ChunkWriter`'s), or the latents that cross the wire (`latent`)."""

    def __init__(self, writer: ChunkWriter, vae: ChunkVAE):
        super().__init__()
        self.writer, self.vae = writer.requires_grad_(False), vae
        self.chunk_tokens = writer.chunk_tokens

    def vectors(self, embeds: Tensor, lengths: Tensor | None = None) -> Tensor:
        with torch.no_grad():
            return self.writer(embeds, lengths).float()

    def latent(self, embeds: Tensor, lengths: Tensor | None = None) -> Tensor:
        return self.vae.latent(self.vectors(embeds, lengths))

    def decode(self, z: Tensor) -> Tensor:
        """Latents (N, Z) -> vectors in the receiver's space (N, H)."""
        return decode_vectors(self.vae, z)

    def forward(self, embeds: Tensor, lengths: Tensor | None = None) -> Tensor:
        mu, logvar = self.vae.encode(self.vectors(embeds, lengths))
        return self.decode(self.vae.reparameterise(mu, logvar) if self.training else mu)

    def with_reading(self, vectors: Tensor) -> Tensor:
        return self.writer.with_reading(vectors)


def load_writer(folder: Path, lm: LM) -> ChunkWriter:
    """A shipped writer (config.json) or a pretraining folder (state/), for this LM."""
    from ..encoder.chunk_files import new_writer, read_writer_state

    folder = Path(folder)
    shipped = folder / "config.json"
    if shipped.is_file():
        settings = json.loads(shipped.read_text()).get("writer") or {}
    elif (folder / "state" / "state.json").is_file():
        settings = json.loads((folder / "state" / "state.json").read_text()).get("writer") or {}
    else:
        raise ValueError(f"--writer {folder}: neither a shipped chunk writer nor a chunk pretraining folder")
    try:
        writer = new_writer(settings, lm.model)
    except ValueError as e:
        raise ValueError(f"--writer {folder} {e}") from None
    writer.load_state_dict(read_writer_state(folder, writer.settings(), lm.fingerprint if shipped.is_file() else None,
                                             setting="--writer", lm_fix="set --lm and --dtype to the writer's"))
    return writer.to(lm.device).eval()


def _save(out: Path, model: LatentWriter, opt: torch.optim.Optimizer, step: int, seconds: float, meta: dict) -> None:
    state = out / "state"
    state.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors({k: v.detach().cpu().contiguous() for k, v in model.vae.state_dict().items()},
                            state / "vae.safetensors")
    atomic_save_safetensors(adam_moments(model.vae, opt), state / "optimizer.safetensors")
    atomic_write_json(state / "state.json", {"step": step, "seconds": seconds, **meta})


def _load(out: Path, model: LatentWriter, opt: torch.optim.Optimizer) -> tuple[int, float]:
    state = out / "state"
    meta = json.loads((state / "state.json").read_text())
    model.vae.load_state_dict(load_file(str(state / "vae.safetensors")))
    restore_adam_moments(model.vae, opt, load_file(str(state / "optimizer.safetensors")), meta["step"])
    return int(meta["step"]), float(meta["seconds"])


def train_latent(out: Path, lm: LM, writer_from: Path, cfg: ChunkLatentConfig, *, resume: bool = False,
                 log=print) -> list[dict]:
    """Fit (or go on fitting) a beta-VAE over a frozen writer's vectors; returns the curve's rows."""
    out = Path(out)
    if (out / "state" / "state.json").exists() and not resume:
        raise FileExistsError(f"{out} holds a chunk latent run; pass --resume to go on with it or pick another --out")
    torch.manual_seed(cfg.seed)
    writer = load_writer(writer_from, lm)
    c = writer.chunk_tokens
    model = LatentWriter(writer, ChunkVAE(lm.hidden_size, cfg.latent, cfg.hidden, beta=cfg.beta,
                                          linear=cfg.linear).to(lm.device))
    opt = torch.optim.AdamW(model.vae.parameters(), lr=cfg.lr, weight_decay=0.0)
    reader = ChunkReader(lm)
    tok = lm.tokenizer
    corpus_cfg = ChunkPretrainConfig(chunk_tokens=c, babi_stories=cfg.babi_stories, seed=cfg.seed)
    tokens = [ids for texts in chunk_corpus(corpus_cfg).values() for ids in tokenize(tok, texts)]
    fit = ChunkBatches(tokens, c, cfg.batch_chunks, cfg.seed)
    said = ChunkBatches(tokens, c, cfg.receiver_batch_chunks, cfg.seed + 1)
    heldout = {name: even_sample(cut(tokenize(tok, texts), c), cfg.heldout_chunks)
               for name, texts in heldout_texts(corpus_cfg).items()}
    meta = {"config": asdict(cfg), "writer_from": str(writer_from), "writer": writer.settings(),
            "vae": {"input_dim": lm.hidden_size, "latent_dim": cfg.latent, "hidden_dim": model.vae.hidden_dim,
                    "beta": cfg.beta, "linear": cfg.linear}}
    step, seconds = 0, 0.0
    if resume and (out / "state" / "state.json").exists():
        saved = json.loads((out / "state" / "state.json").read_text())
        keep = ("steps", "receiver_steps")
        if ({k: v for k, v in saved["config"].items() if k not in keep}  # settings added since are not compared
                != {k: meta["config"][k] for k in saved["config"] if k not in keep}
                or saved["writer_from"] != str(writer_from)):
            raise ValueError(f"{out} was trained with other settings ({saved['config']}, writer "
                             f"{saved['writer_from']}); only --steps and --receiver-steps may change on --resume")
        step, seconds = _load(out, model, opt)
        log(f"[latent] resumed at step {step} ({seconds / 3600:.2f} h trained)")
    else:
        with torch.no_grad():  # the VAE's standardisation (and a linear VAE's directions) from the first epoch's chunks
            batches = max(16, math.ceil(PRINCIPAL_CHUNKS / cfg.batch_chunks)) if cfg.linear else 16
            sample = torch.cat([fit.at(i) for i in range(min(fit.steps_per_epoch(), batches))])
            vectors = torch.cat([model.vectors(reader.table[part.to(reader.table.device)])
                                 for part in sample.split(cfg.batch_chunks)])
            model.vae.set_standardisation(vectors)
            if cfg.linear:
                share = model.vae.start_principal(vectors)
                log(f"[latent] linear VAE from the principal directions of {len(vectors)} vectors: the top "
                    f"{cfg.latent} hold {float(share[:cfg.latent].sum()):.3f} of their variance")
    out.mkdir(parents=True, exist_ok=True)
    from ..provenance import provenance

    sessions_path = out / "sessions.json"
    sessions = json.loads(sessions_path.read_text()) if sessions_path.exists() else []
    atomic_write_json(sessions_path, sessions + [{"from_step": step, **provenance()}])
    curve_path = out / "curve.jsonl"
    rows = [r for r in map(json.loads, curve_path.read_text().splitlines()) if r["step"] <= step] \
        if curve_path.exists() else []
    if not rows:
        base = {name: read_back(None, reader, chunks) for name, chunks in heldout.items()}
        full = {name: read_back(writer, reader, chunks) for name, chunks in heldout.items()}
        atomic_write_json(out / "no_memory.json", base)
        atomic_write_json(out / "full_width.json", full)
        log(f"[latent] no memory: {json.dumps(base)}")
        log(f"[latent] the writer's full width: {json.dumps(full)}")
    total = cfg.steps + cfg.receiver_steps
    losses: dict[str, list[float]] = {"loss": [], "recon": [], "kl": []}
    last = time.perf_counter()

    def evaluate():
        nonlocal last, seconds
        seconds += time.perf_counter() - last
        model.eval()
        row = {"step": step, "seconds": round(seconds, 1), "stage": "vector fit" if step <= cfg.steps else "read-back",
               **{f"train_{k}": round(sum(v) / len(v), 5) for k, v in losses.items() if v},
               **{name: read_back(model, reader, chunks) for name, chunks in heldout.items()}}
        model.train()
        rows.append(row)
        atomic_write_text(curve_path, "".join(json.dumps(r) + "\n" for r in rows))
        _save(out, model, opt, step, seconds, meta)
        log(f"[latent] step {step} ({row['stage']}) | {seconds / 60:.1f} min | " + " | ".join(
            f"{name} acc {row[name]['token_accuracy']:.3f}" for name in heldout)
            + (f" | train loss {row['train_loss']:.4f}" if losses["loss"] else ""))
        for v in losses.values():
            v.clear()
        last = time.perf_counter()

    if not rows:
        evaluate()
    model.train()
    while step < total:
        torch.manual_seed(cfg.seed * 1_000_003 + step)  # the VAE's samples too are a function of the step
        if step < cfg.steps:
            chunks = fit.at(step)
            vae_out = model.vae(model.vectors(reader.table[chunks.to(reader.table.device)]))
            recon, kl = vae_out.recon, vae_out.kl
            loss = recon + cfg.beta * kl
        else:
            chunks = said.at(step - cfg.steps)
            mu, logvar = model.vae.encode(model.vectors(reader.table[chunks.to(reader.table.device)]))
            memory = model.decode(model.vae.reparameterise(mu, logvar)).unsqueeze(1)
            recon = reader.score(writer.with_reading(memory), chunks)["loss"]
            kl = kl_divergence(mu, logvar).mean()
            loss = recon + cfg.beta * kl
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(f"chunk latent: the loss is {float(loss)} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.vae.parameters(), 1.0)
        opt.step()
        for k, v in (("loss", loss), ("recon", recon), ("kl", kl)):
            losses[k].append(float(v.detach()))
        step += 1
        if step % 100 == 0:
            log(f"[latent] step {step}/{total} | loss {sum(losses['loss'][-100:]) / len(losses['loss'][-100:]):.4f} "
                f"| {(seconds + time.perf_counter() - last) / step:.3f} s/step")
        if step % cfg.eval_every == 0 or step in (cfg.steps, total):
            evaluate()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ilcp.training.chunk_latent", description=__doc__.split("\n")[0])
    p.add_argument("--writer", required=True, type=Path,
                   help="a shipped chunk writer (pretrained/smollm2-chunk8) or a chunk pretraining folder")
    p.add_argument("--out", required=True, type=Path, help="the run's folder (curve.jsonl, state/)")
    p.add_argument("--lm", default="smollm2-135m-instruct", help="the frozen LM the writer was trained for")
    p.add_argument("--dtype", default="float32", help="the frozen receiver's dtype, the writer's (default float32)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--resume", action="store_true", help="go on with the run in --out")
    for name, value in asdict(ChunkLatentConfig()).items():
        kind = parse_flag if isinstance(value, bool) else type(value)
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value, help=f"default {value!r}")
    args = p.parse_args(argv)
    try:
        cfg = ChunkLatentConfig(**{k: getattr(args, k) for k in asdict(ChunkLatentConfig())})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_with_lm({"lm": args.lm, "dtype": args.dtype, "device": args.device},
                       lambda lm: train_latent(args.out, lm, args.writer, cfg, resume=args.resume,
                                               log=lambda m: print(m, flush=True)))


if __name__ == "__main__":
    sys.exit(main())
