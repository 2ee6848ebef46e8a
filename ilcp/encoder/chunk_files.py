"""Where a chunk writer's weights come from: a chunk pretraining's folder (``state/``, what
`ilcp.training.chunk_pretrain` writes and ``--resume`` reads) or a shipped writer (what
`ilcp.training.chunk_ship` writes: ``writer.safetensors`` and a ``config.json`` that records the
writer's settings, the LM it was trained for by fingerprint, the weights' sha256 and its own digest).

`read_writer_state` reads either and refuses, in one line naming the setting, a writer of other
settings, for another LM, or whose bytes changed after it was written.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

__all__ = ["WRITER_FILE", "WRITER_FORMAT", "new_writer", "read_writer_state", "shipped_writer_config", "writer_words"]

WRITER_FORMAT = "ilcp-chunk-writer"
WRITER_FILE = "writer.safetensors"
SETTING = "compressor.memory.writer_from"


def shipped_writer_config(settings: dict, lm_spec: str, lm_dtype: str, fingerprint: str, weights: Path,
                          **extra) -> dict:
    """config.json of a shipped writer whose weights are the file `weights`, sealed with its digest."""
    from ..export_integrity import file_digest, seal_config

    return seal_config({"format": WRITER_FORMAT, "format_version": 1, "writer": settings,
                        "lm": {"spec": lm_spec, "dtype": lm_dtype, "fingerprint": fingerprint,
                               "hidden_size": settings["hidden_size"]},
                        "digests": {WRITER_FILE: file_digest(weights)}, **extra})


def new_writer(settings: dict, model):
    """An untrained writer of these settings (the ``writer`` entry of a pretraining's state.json or
    a shipped writer's config.json) for the LM `model`: the embedding MLP (`ChunkWriter`), or with
    ``kind: sender`` the LM itself (`SenderChunkWriter`, bound to `model`); its weights come next
    (`read_writer_state`). ValueError, its message to follow the writer's name ("--writer FOLDER writes vectors of ..."),
    for settings that do not describe a writer of this LM."""
    import torch

    from .chunk import ChunkWriter
    from .chunk_sender import SenderChunkWriter

    values = dict(settings or {})
    width = int(model.get_input_embeddings().weight.shape[1])
    if values.get("hidden_size") != width:
        raise ValueError(f"writes vectors of {values.get('hidden_size')} floats; the LM's width is {width}")
    try:
        if values.pop("kind", "mlp") == "sender":
            table = model.get_input_embeddings().weight
            return SenderChunkWriter.for_model(model, values["chunk_tokens"], torch.zeros(width, device=table.device),
                                               layers=values["layers"], rank=values["rank"],
                                               reading=values.get("reading", 0))
        return ChunkWriter(**values)
    except (KeyError, TypeError):
        raise ValueError(f"holds writer settings that do not describe a chunk writer: {settings}") from None


def writer_words(settings: dict) -> str:
    """What writes the vectors, in words, for cards and logs."""
    if settings.get("kind") == "sender":
        return (f"the LM itself (the chunk, then a memory token; rank-{settings['rank']} adapters on its top "
                f"{settings['layers']} layers and a linear head)")
    return (f"one shared MLP from the chunk's input embeddings ({settings['width']} floats a token, "
            f"{settings['inner']} hidden{', plus the direct linear path' if settings.get('direct') else ''})")


def _read_json(path: Path, setting: str = SETTING) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{setting}: cannot read {path} ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{setting}: {path} must hold a JSON mapping")
    return value


def read_writer_state(folder: Path, wanted: dict, fingerprint: str | None = None, *, setting: str = SETTING,
                      lm_fix: str = "set lm.spec and lm.dtype to the writer's") -> dict[str, Tensor]:
    """The writer weights in `folder` (a shipped writer or a pretraining's ``state/``), whose
    settings must be `wanted`; a shipped writer's LM fingerprint must be `fingerprint` (when given)
    and its weights must match their recorded sha256. Errors name `setting` (the caller's name for
    the folder) and, for another LM, `lm_fix`."""
    from safetensors.torch import load_file

    folder = Path(folder)
    shipped = folder / "config.json"
    if shipped.is_file():
        from ..export_integrity import check_config_digest, file_digest
        from .spec import ExportError

        config = _read_json(shipped, setting)
        if config.get("format") != WRITER_FORMAT:
            raise ValueError(f"{setting}: {folder} holds no chunk writer (its config.json is not a {WRITER_FORMAT}); "
                             "give a shipped writer or the --out folder of python -m ilcp.training.chunk_pretrain")
        try:
            if not check_config_digest(config, shipped):
                raise ValueError(f"{setting}: {shipped} carries no config_digest; ship the writer again")
        except ExportError as e:
            raise ValueError(f"{setting}: {e}") from None
        saved, weights = config.get("writer"), folder / WRITER_FILE
        lm = config.get("lm") or {}
        if fingerprint is not None and lm.get("fingerprint") != fingerprint:
            raise ValueError(f"{setting}: {folder} was trained for LM {lm.get('spec')!r} (fingerprint "
                             f"{lm.get('fingerprint')}, {lm.get('dtype')}), the run's LM has fingerprint {fingerprint}: "
                             f"{lm_fix}")
        if not weights.is_file():
            raise ValueError(f"{setting}: {folder} lacks {WRITER_FILE}")
        if file_digest(weights) != (config.get("digests") or {}).get(WRITER_FILE):
            raise ValueError(f"{setting}: {weights} does not match the sha256 in its config.json (changed or "
                             "truncated): copy the shipped writer again")
    else:
        state_json = folder / "state" / "state.json"
        if not state_json.is_file():
            raise ValueError(f"{setting}: {folder} holds no chunk writer (neither a shipped writer's config.json nor "
                             "a pretraining's state/state.json); give a shipped writer or the --out folder of "
                             "python -m ilcp.training.chunk_pretrain")
        saved, weights = _read_json(state_json, setting).get("writer"), folder / "state" / WRITER_FILE
    if saved != wanted:
        raise ValueError(f"{setting}: {folder} holds a writer of {saved}, this run builds {wanted}: set "
                         "compressor.memory.chunk_tokens, writer, and width, inner and direct (writer mlp) or "
                         "sender_layers and sender_rank (writer sender) to match")
    return load_file(str(weights))
