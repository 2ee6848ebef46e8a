"""The LM's input-embedding table without its layers, and the name a server gives the model it
serves: what a receiver behind a vLLM server (`ilcp.engines.served`) holds of the LM.

`load_embedding_lm` reads a model directory's tokenizer and that one tensor, found by name
through the model's class built on the meta device (no weights of other layers are read);
`resolve_model_dir` finds the directory of an LM spec. `table_digest` names a table and its
tokenizer's vocabulary, and `served_model_name` (``ilcp-<LM fingerprint>-<table digest>``) is the
served model's name, which `parse_served_name` reads back.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from ..lm import LM, tensor_bytes, vocab_hash
from ..names import DEFAULT_LM

__all__ = [
    "EmbeddingTable",
    "NAME_PREFIX",
    "load_embedding_lm",
    "parse_served_name",
    "resolve_model_dir",
    "served_model_name",
    "table_digest",
]

NAME_PREFIX = "ilcp-"


def table_digest(table: Tensor, tokenizer) -> str:
    """16 hex characters naming an input-embedding table (dtype, shape, bytes) and a tokenizer's
    vocabulary: what the served model's name carries and clients compare."""
    h = hashlib.sha256(b"ilcp-embedding-table-1")
    t = table.detach()
    h.update(str(t.dtype).encode())
    h.update(str(tuple(t.shape)).encode())
    h.update(tensor_bytes(t))
    h.update(vocab_hash(tokenizer).encode())
    return h.hexdigest()[:16]


def served_model_name(fingerprint: str, digest: str) -> str:
    """``ilcp-<LM fingerprint>-<table digest>``: the name `ilcp.engines.serve.serve_command` gives the served model."""
    return f"{NAME_PREFIX}{fingerprint}-{digest}"


def parse_served_name(name: str) -> tuple[str, str] | None:
    """(LM fingerprint, table digest) of a `served_model_name`, or None for another name."""
    if not isinstance(name, str) or not name.startswith(NAME_PREFIX):
        return None
    parts = name[len(NAME_PREFIX):].split("-")
    if len(parts) != 2 or not all(len(p) == 16 for p in parts):
        return None
    return parts[0], parts[1]


class EmbeddingTable(nn.Module):
    """A causal LM's input embeddings and configuration, without its layers: what
    `ilcp.receiver.prefix.ReceiverPrefix.embeds` and `ILCPHandoff`'s receiver side read of a model.

    Attributes:
        config: the model's ``transformers`` configuration.
        generation_config: its generation configuration, or None (read for the stop ids).
    """

    def __init__(self, weight: Tensor, config, generation_config=None):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(weight, freeze=True)
        self.config = config
        self.generation_config = generation_config
        self.eval()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def forward(self, *args, **kwargs):
        raise RuntimeError("this model holds only the input-embedding table; decoding runs on the server")


def resolve_model_dir(spec: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local model directory of an LM spec without loading it: the directory itself, or
    the converted copy of the embedded SmolLM2 under the cache.

    Raises:
        ValueError: a spec that names no local directory (pass ``model_dir=``).
    """
    from ..lm import SMOLLM2_VERSION, default_cache_dir

    if spec == DEFAULT_LM:
        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        path = cache / "models" / f"smollm2-135m-instruct-{SMOLLM2_VERSION}"
        if (path / "config.json").is_file():
            return path
        raise ValueError(f"the converted {DEFAULT_LM} is not in {path}: load it once with ilcp.lm.load_lm(), or pass "
                         "model_dir=")
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        return path
    raise ValueError(f"the LM spec {spec!r} names no local model directory: pass model_dir= (the directory the "
                     "server serves, or a copy of it)")


def _embedding_key(directory: Path, config) -> str:
    """The safetensors name of the input-embedding weight, from the model's class on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    weight = model.get_input_embeddings().weight
    for name, param in model.named_parameters(remove_duplicate=False):
        if param is weight:
            return name
    raise ValueError(f"could not name the input-embedding weight of {type(model).__name__}")


def _safetensors_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or the files' headers."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / fname for name, fname in weight_map.items()}
    where: dict[str, Path] = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                where[key] = f
    return where


def load_embedding_lm(model_dir: str | os.PathLike, *, dtype: str | torch.dtype = "float32",
                      spec: str | None = None) -> LM:
    """An `LM` bundle of a model directory's tokenizer and input-embedding table only (an
    `EmbeddingTable`); no other weights are read. Its fingerprint is not known (it covers every
    weight): callers set it once they checked it (`ServedReceiver.from_pretrained`).

    Raises:
        ValueError: not a model directory, or no embedding tensor in its safetensors files.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from ..lm import parse_dtype

    directory = Path(model_dir).expanduser()
    if not (directory / "config.json").is_file():
        raise ValueError(f"{str(directory)!r} is not a model directory (no config.json)")
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    files = _safetensors_files(directory)
    key = _embedding_key(directory, config)
    candidates = [key, key.removeprefix("model."), f"model.{key}"]
    found = next((k for k in candidates if k in files), None)
    if found is None:
        raise ValueError(f"{str(directory)!r} holds no {key!r} in its safetensors files")
    with safe_open(str(files[found]), framework="pt") as handle:
        weight = handle.get_tensor(found).to(parse_dtype(dtype))
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        generation = GenerationConfig.from_pretrained(directory, local_files_only=True)
    except OSError:
        generation = None
    return LM(model=EmbeddingTable(weight, config, generation), tokenizer=tokenizer, spec=spec or str(directory))

