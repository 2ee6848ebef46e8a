"""The in-process vLLM engine an RCLC agent binds (``backend="vllm"``): starting one, reaching its
model in this process, its configuration (`engine_facts`) and the check that the adapter can
serve it (`check_engine`). This build has no KV capture connector: `RCCCaptureConnector` raises
`BackendUnavailableError`, and so does an engine created with a ``kv_transfer_config``.

Importing this module does not import vLLM.
"""

from __future__ import annotations

import os

from torch import nn

from ilcp.engines.build import create_engine, require_vllm
from ilcp.rclc.backends import BackendUnavailableError, vllm_version

__all__ = [
    "CAPTURE_UNSUPPORTED",
    "RCCCaptureConnector",
    "SUPPORTED_MODEL_TYPES",
    "capture_unsupported",
    "check_engine",
    "engine_facts",
    "engine_model",
    "llm_engine",
    "require_vllm_backend",
    "start_engine",
]

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")


def capture_unsupported() -> str:
    """Why this build captures no KV through a connector, and what it does instead (one line)."""
    version = vllm_version() or "?"
    return (
        f"KV capture through a connector is not supported with vllm {version}: ilcp.rclc ships no capture "
        "connector for this vLLM (its CPU attention backend keeps KV pages in a layout nothing here reads). "
        "Create the engine without kv_transfer_config; rclc.bind(llm, backend='vllm', ...) re-prefills the "
        "sender's prompt through the shared-weight view instead"
    )


CAPTURE_UNSUPPORTED = "KV capture through a connector is not supported"  # the start of the error message


class RCCCaptureConnector:
    """The spec's capture connector name. This build has none: constructing it (which vLLM does
    when an engine is created with ``kv_transfer_config`` naming it) raises `BackendUnavailableError`."""

    def __init__(self, *args, **kwargs) -> None:
        raise BackendUnavailableError(capture_unsupported())


def require_vllm_backend():
    """The ``vllm`` module (`ilcp.engines.build.require_vllm`), or BackendUnavailableError saying
    how to get it."""
    try:
        return require_vllm()
    except ImportError as e:
        raise BackendUnavailableError(
            f"backend='vllm' needs vLLM, which this environment does not have ({e.__cause__ or e}); run with "
            ".venv-vllm/bin/python (`bash scripts/install.sh` builds it) or use backend='hf'"
        ) from None


def llm_engine(llm):
    """The engine of a ``vllm.LLM`` (``llm.llm_engine``), or TypeError for anything else."""
    engine = getattr(llm, "llm_engine", None)
    config = getattr(engine, "model_config", None)
    if engine is None or config is None:
        raise TypeError(f"backend='vllm' needs a vllm.LLM engine, got {type(llm).__name__}")
    return engine


_MODEL_PATHS = (
    ("model_executor", "driver_worker", "worker", "model_runner", "model"),
    ("model_executor", "driver_worker", "model_runner", "model"),
    ("engine_core", "engine_core", "model_executor", "driver_worker", "worker", "model_runner", "model"),
)


def engine_model(llm) -> nn.Module:
    """The engine's model module, in this process.

    Raises:
        TypeError: not a vLLM engine.
        BackendUnavailableError: the model lives in another process.
    """
    engine = llm_engine(llm)
    for path in _MODEL_PATHS:
        obj = engine
        for name in path:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, nn.Module):
            return obj
    raise BackendUnavailableError(
        "backend='vllm' needs the engine's model in this process, and this engine runs it elsewhere: set "
        "os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0' before creating the LLM (tensor parallel size 1)"
    )


def start_engine(directory, *, max_model_len: int | None = None, kv_cache_bytes: int = 64 << 20, dtype: str = "auto"):
    """An in-process engine the adapter can bind: `ilcp.engines.build.create_engine` (prompt
    embeddings on, eager) with ``enable_prefix_caching=False``, ``tensor_parallel_size=1``, a small
    fixed KV cache and, unless ``max_model_len`` is given, the model's own context. Sets
    VLLM_ENABLE_V1_MULTIPROCESSING=0 unless it is set already.

    Raises:
        BackendUnavailableError: vLLM is not installed.
    """
    require_vllm_backend()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return create_engine(directory, dtype=dtype, kv_cache_memory_bytes=kv_cache_bytes, max_model_len=max_model_len,
                         enable_prefix_caching=False, tensor_parallel_size=1)


def engine_facts(llm) -> dict:
    """JSON-serialisable configuration of an engine (no forward pass)."""
    engine = llm_engine(llm)
    vc = engine.vllm_config
    config = engine.model_config
    return {
        "vllm": vllm_version(),
        "device": str(getattr(vc.device_config, "device", None) or getattr(vc.device_config, "device_type", "")),
        "model": str(config.model),
        "model_type": getattr(config.hf_config, "model_type", None),
        "dtype": str(config.dtype).replace("torch.", ""),
        "max_model_len": int(config.max_model_len),
        "runner": str(getattr(config, "runner_type", "generate")),
        "enable_prompt_embeds": bool(getattr(config, "enable_prompt_embeds", False)),
        "enforce_eager": bool(getattr(config, "enforce_eager", False)),
        "enable_prefix_caching": bool(getattr(vc.cache_config, "enable_prefix_caching", False)),
        "kv_cache_dtype": str(getattr(vc.cache_config, "cache_dtype", "auto")),
        "quantization": getattr(config, "quantization", None),
        "tensor_parallel_size": int(vc.parallel_config.tensor_parallel_size),
        "kv_transfer_config": vc.kv_transfer_config is not None,
        "unsupported": {
            "kv_capture_connector": capture_unsupported(),
            "past_key_values": "HF caches are not the engine's KV; pass exact IDs (they are re-prefilled)",
        },
    }


def check_engine(llm) -> None:
    """Refuse engines the adapter cannot serve (one line each, naming the setting)."""
    facts = engine_facts(llm)
    if facts["kv_transfer_config"]:
        raise BackendUnavailableError(capture_unsupported())
    if facts["runner"] != "generate":
        raise ValueError(f"backend='vllm' needs a generating engine; this one runs {facts['runner']!r}")
    if not facts["enable_prompt_embeds"]:
        raise ValueError("backend='vllm' hands received rows to the engine as prompt_embeds: create the LLM with "
                         "enable_prompt_embeds=True")
    if facts["tensor_parallel_size"] != 1:
        raise ValueError(f"backend='vllm' supports tensor_parallel_size=1, got {facts['tensor_parallel_size']}")
    if facts["quantization"]:
        raise ValueError(f"backend='vllm' supports unquantized weights, got quantization={facts['quantization']!r}")
    if facts["kv_cache_dtype"] != "auto":
        raise ValueError(f"backend='vllm' needs kv_cache_dtype='auto', got {facts['kv_cache_dtype']!r}")
    if facts["model_type"] not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"backend='vllm' supports dense {', '.join(SUPPORTED_MODEL_TYPES)} models, got "
                         f"{facts['model_type']!r}")
    hf_config = llm_engine(llm).model_config.hf_config
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("backend='vllm' does not support sliding-window attention")
