"""Writing an export: `export_run` writes a training run's trained memory sources into its
folder, `save_encoder` one encoder, each with `model_card`'s README; the layout is described in
`ilcp.export`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import __version__
from .encoder.model import ILCPEncoder, MemorySource
from .encoder.spec import EncoderSpec, ExportError
from .encoder.kinds import config_value
from .export import (BASELINES, CARD_FILE, CONFIG_FILE, EXPORT_FORMAT, EXPORT_VERSION, MODEL_FILE, encoder_state,
                     trained_state, tuned_vectors)
from .export_integrity import SIGNATURE, file_digest, seal_config
from .io import atomic_save_safetensors, atomic_write_json, atomic_write_text


def heldout_entries(data) -> dict:
    """config.json's ``task`` entry: ``data.task``, or with ``data.heldout_tasks`` the task trained on
    without them and ``heldout_tasks`` (their names, which eval reports as held out)."""
    if not data.heldout_tasks:
        return {"task": data.task}
    from .tasks import held_out, resolve_task

    return {"task": held_out(resolve_task(data.task), data.heldout_tasks).name,
            "heldout_tasks": [resolve_task(name).name for name in data.heldout_tasks]}


def finite_state(state: dict, name: str) -> dict:
    """`state` when every tensor is finite; else ExportError naming the first that is not (weights
    with NaN or infinity are never written: a receiver would answer from them silently)."""
    for tensor_name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ExportError(f"the trained weights of {name} hold NaN or infinite values ({tensor_name}): training "
                              "diverged, so nothing is exported; lower the learning rate or check the data")
    return state


def task_settings(data) -> dict:
    """What the training task records beyond the common settings so eval rebuilds its test split
    (a file task's column names and split fractions; nothing for the built-in tasks)."""
    from .tasks import resolve_task

    return resolve_task(data.task).task_settings(data)


def export_run(cfg, lm, sources: dict[str, MemorySource], metrics: dict, precision: str = "32-true",
               key: bytes | None = None, *, max_length: int) -> Path:
    """Write the trained memory sources of a run into ``cfg.run_dir`` (see the module docstring);
    ``precision`` is the compute precision the run trained at (`ilcp.precision`), which its
    receivers use by default; ``max_length`` the context tokens its sender read (``data.max_length``
    resolved against the LM); with ``key``, config.json is signed (`ilcp.export_integrity.seal_config`)."""
    run_dir = cfg.run_dir
    files = {}
    digests = {}
    states = {name: finite_state(trained_state(source), name) for name, source in sources.items()}  # before any write
    for name, state in states.items():
        fname = MODEL_FILE if name == "ilcp" else f"{name}.safetensors"
        atomic_save_safetensors(state, run_dir / fname, {"format": "pt"})
        files[name] = fname
        digests[fname] = file_digest(run_dir / fname)
    atomic_write_json(run_dir / "metrics.json", metrics)
    d = cfg.data
    config = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "package_version": __version__,
        "lm": {"spec": lm.spec, "fingerprint": lm.fingerprint, "dtype": cfg.lm.dtype, "hidden_size": lm.hidden_size,
               "precision": precision},
        "num_memory_tokens": cfg.handoff.num_memory_tokens,
        **heldout_entries(d),
        "task_settings": {"babi_variant": d.babi_variant, "facts_n_facts": d.facts_n_facts,
                          "facts_n_distractors": d.facts_n_distractors, "facts_value_split": d.facts_value_split,
                          "seed": d.seed, **task_settings(d)},
        "files": files,
        "digests": digests,
        "train_config": "train_config.yaml",
        "metrics": "metrics.json",
    }
    spec = EncoderSpec.from_encoder(sources["ilcp"], d.pool_layers, max_length) if "ilcp" in sources else None
    if spec is not None:
        config.update(spec.to_config())
    if config["num_memory_tokens"] != cfg.handoff.num_memory_tokens and set(files) - {"ilcp"}:
        config["tuned_vectors"] = cfg.handoff.num_memory_tokens  # the tuned baselines' K, not the memory's
    atomic_write_text(run_dir / CARD_FILE, model_card(config, spec, metrics))
    atomic_write_json(run_dir / CONFIG_FILE, seal_config(config, key))
    return run_dir


def model_card(config: dict, spec: EncoderSpec | None, metrics: dict | None = None) -> str:
    """A short README for an export: what it is, for which LM, how well it did, how to load it
    (``spec``: its encoder's settings, None without an encoder)."""
    lm = config["lm"]
    lines = [f"# ilcp export: {config.get('task', 'unknown task')}", "",
             f"Trained with ilcp {config.get('package_version')} for the frozen LM `{lm['spec']}` "
             f"(fingerprint `{lm['fingerprint']}`, {lm.get('dtype', 'float32')}); another LM is refused.", ""]
    if spec is not None:
        lines += [f"- ILCP encoder ({config['files'].get('ilcp')}): {spec.memory.describe()} "
                  f"of layers {list(spec.layers)}, latents of {spec.latent_dim} floats ({spec.memory.card_unit()}), "
                  f"each read as {spec.num_memory_tokens} memory vectors."]
    for name in BASELINES:
        if name in config.get("files", {}):
            lines.append(f"- {name} ({config['files'][name]}): {tuned_vectors(config)} learned vectors.")
    variants = (metrics or {}).get("variants", {})
    if variants:
        lines += ["", "| variant | best validation exact match | at step | of steps |", "|---|---|---|---|"]
        for name, m in sorted(variants.items()):
            if not m.get("steps"):  # handoff.max_steps=0: a pretrained encoder
                pretrained = (metrics or {}).get("reconstruct", {})
                loss = pretrained.get("best_val_loss")
                lines.append(f"| {name} | no answer stage: pretrained on text ({pretrained.get('steps')} steps, best "
                             f"validation loss {'-' if loss is None else f'{loss:.3f}'}) | - | 0 |")
                continue
            best = m.get("best_val_exact_match")
            lines.append(f"| {name} | {'-' if best is None else f'{100 * best:.1f}%'} | {m.get('best_step')} | "
                         f"{m.get('steps')} |")
    lines += ["", "```python", "from ilcp.handoff import ILCPHandoff", "",
              'handoff = ILCPHandoff.from_pretrained("THIS_FOLDER")   # loads the LM named above',
              'wire = handoff.to_wire(handoff.send("...the context..."))',
              'print(handoff.receive(wire, "...the question..."))', "```", ""]
    return "\n".join(lines)


def save_encoder(encoder: ILCPEncoder, config: dict, path: str | Path, key: bytes | None = None) -> Path:
    """Write one encoder as an export (config.json + model.safetensors) into `path`; `config` is
    an export config: its lm and task entries are kept, its encoder's entries become `encoder`'s
    own, read with the layers and max_length `config` names (which the module does not hold);
    with ``key``, config.json is signed (`ilcp.export_integrity.seal_config`).

    Raises:
        FileExistsError: `path` is a file, or a folder whose config.json is not an earlier save of
            this kind (a training run, whose other weights it would drop, or a model's own
            folder); nothing is written then.
        ExportError: `config` lacks pooling.layers or pooling.max_length (or holds a bad one).
    """
    path = Path(path)
    try:  # the two settings the module does not hold; every other entry is the encoder's own
        layers = config_value(config, "pooling.layers", list)
        max_length = config_value(config, "pooling.max_length", int, minimum=1)
    except ValueError as e:
        raise ExportError(f"save_encoder's config: {e}") from None
    spec = EncoderSpec.from_encoder(encoder, layers, max_length)
    _check_save_target(path)
    atomic_save_safetensors(finite_state(encoder_state(encoder), "ilcp"), path / MODEL_FILE, {"format": "pt"})
    config = json.loads(json.dumps(config))
    for entry in EncoderSpec.config_keys():  # the encoder's entries are written anew: none of the old one's stays
        config.pop(entry, None)
    config.update(spec.to_config())
    config["files"] = {"ilcp": MODEL_FILE}
    config["digests"] = {MODEL_FILE: file_digest(path / MODEL_FILE)}
    config["package_version"] = __version__
    for entry in ("train_config", "metrics", SIGNATURE):  # files of a training run, and the old signature
        config.pop(entry, None)
    atomic_write_text(path / CARD_FILE, model_card(config, spec))
    atomic_write_json(path / CONFIG_FILE, seal_config(config, key))
    return path


def _check_save_target(path: Path) -> None:
    """`save_encoder` replaces config.json and model.safetensors: only in a new folder or over an
    earlier save (whose config.json lists model.safetensors alone)."""
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{str(path)!r} is a file: save_pretrained writes a folder (config.json, "
                              f"{MODEL_FILE}); nothing was written")
    existing = path / CONFIG_FILE
    if not existing.exists():
        return
    try:
        files = json.loads(existing.read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    if files != {"ilcp": MODEL_FILE}:
        raise FileExistsError(f"{str(path)!r} already holds a config.json that is not a saved handoff (a training "
                              "run or a model's folder): saving there would replace it; choose a new folder "
                              "(nothing was written)")
