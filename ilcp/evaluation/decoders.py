"""The receiver's decoding engines in the evaluation: the HF greedy decoder, and vLLM beside it.

``evaluate(..., engine="vllm")`` decodes every method's receiver prefixes twice, with the HF
decoder (`ilcp.receiver.decoding.greedy_decode`) and through one vLLM engine
(`ilcp.engines.vllm.VLLMDecoder`: ``prompt_embeds``, greedy, the same stop rule and token
budget), and reports both engines' accuracy on the same questions and their agreement: the
fraction of questions whose normalised answers (`ilcp.metrics.normalize_answer` of the first
line, as exact match compares them) are identical.

- `require_engine`: the engine name checked, and vLLM importable (ImportError saying which
  interpreter to use otherwise);
- `start_vllm`: one in-process engine on the run's LM, its caches and temporary files in a
  folder of the output (``VLLM_CACHE_ROOT``, ``VLLM_CONFIG_ROOT``, ``TMPDIR``); the torch thread
  setting and random state it changes while starting are put back;
- `vllm_unavailable`: why the engine cannot take a method's prefixes, or None;
- `compare`: the vLLM entry of a method's metrics (accuracy, agreement, disagreements);
- `receiver_throughput`: questions per second of the receiver's decode at several batch sizes,
  HF and vLLM on the same prefixes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..receiver.decoding import greedy_decode
from ..engines.vllm import VLLMDecoder, model_directory
from ..lm import LM
from ..metrics import first_line, normalize_answer
from ..names import ENGINES
from ..stats import wilson_interval
from ..engines.build import DEFAULT_KV_CACHE_BYTES, create_engine, require_vllm
from .registry import HandoffMethod
from .report import accepted_answers, accuracy_summary

__all__ = [
    "ENGINES",
    "MAX_MODEL_LEN",
    "THROUGHPUT_METHODS",
    "VLLM_ENV_HINT",
    "compare",
    "receiver_throughput",
    "require_engine",
    "start_vllm",
    "vllm_environment",
    "vllm_unavailable",
]

MAX_MODEL_LEN = 4096  # the engine's context (capped by the model's); longer prefixes are unavailable
THROUGHPUT_METHODS = ("ilcp", "cold_read")
DISAGREEMENTS_KEPT = 5
VLLM_ENV_HINT = ("run it with .venv-vllm/bin/python (e.g. `.venv-vllm/bin/python eval.py --ckpt RUN --engine vllm`; "
                 "`bash scripts/install.sh` builds .venv-vllm)")


def require_engine(engine: str) -> str:
    """``engine`` if it is known and can run here.

    Raises:
        ValueError: not "hf" or "vllm".
        ImportError: "vllm" in an environment without vLLM (the message names the interpreter to
            use), or a vLLM that does not import.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "vllm":
        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:
            raise ImportError(f"--engine vllm needs vLLM, which this environment ({sys.executable}) does not have: "
                              f"{VLLM_ENV_HINT}")
        require_vllm()
    return engine


@contextlib.contextmanager
def vllm_environment(folder: Path):
    """vLLM's cache, config and temporary files under ``folder``, an in-process engine core, no
    usage reports and no hub, while an engine starts; the process's own settings are put back
    afterwards."""
    for name in ("cache", "config", "tmp"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    settings = {"VLLM_CACHE_ROOT": str(folder / "cache"), "VLLM_CONFIG_ROOT": str(folder / "config"),
                "TMPDIR": str(folder / "tmp")}
    defaults = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1"}
    settings.update({k: v for k, v in defaults.items() if k not in os.environ})
    saved = {k: os.environ.get(k) for k in settings}
    saved_tempdir = tempfile.tempdir
    os.environ.update(settings)
    tempfile.tempdir = settings["TMPDIR"]
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        tempfile.tempdir = saved_tempdir


# In-process engines share vLLM's process-wide parallel state, and an engine that is garbage
# collected tears it down under the others: engines started here live as long as the process,
# and a later evaluation of the same model with the same settings reuses its engine.
_STARTED: dict[tuple, object] = {}


def start_vllm(lm: LM, folder: str | os.PathLike, *, kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
               max_model_len: int | None = None, dtype: str | None = None,
               log: Callable[[str], None] | None = None) -> VLLMDecoder:
    """One in-process vLLM engine (eager, prompt embeddings) on ``lm``, its weights in ``dtype``
    (None: the LM's dtype).

    The engine lives until the process ends (an in-process engine that is shut down breaks the
    others); a second call for the same model directory and settings reuses it, its caches staying
    where the first call put them.

    The engine serves the directory ``lm`` was loaded from, or, for a model built in memory, a copy
    saved to ``folder/model``. ``max_model_len`` defaults to the model's positions, at most
    `MAX_MODEL_LEN`. Starting an in-process engine replaces ``torch.set_num_threads`` (vLLM's CPU
    worker swaps in a function that only warns) and seeds the global random generators: the
    function, the thread count and the generators' states are put back, so the HF decoder runs as
    it did before (the engine computes on the same torch threads).

    Raises:
        ImportError: vLLM is not installed.
        RuntimeError: the engine did not start (one line with vLLM's reason).
    """
    say = log or (lambda message: None)
    require_vllm()
    folder = Path(folder)
    try:
        directory = model_directory(lm)
    except ValueError:
        directory = model_directory(lm, folder / "model")
    positions = getattr(lm.model.config, "max_position_embeddings", None) or MAX_MODEL_LEN
    max_model_len = max_model_len or min(int(positions), MAX_MODEL_LEN)
    dtype = dtype or str(lm.dtype).removeprefix("torch.")
    key = (str(Path(directory).resolve()), dtype, kv_cache_bytes, max_model_len)
    if key in _STARTED:
        say(f"reusing the vLLM engine on {directory} started earlier in this process")
        return VLLMDecoder(lm, _STARTED[key])
    say(f"starting vLLM on {directory} ({dtype}, max_model_len {max_model_len}, KV cache "
        f"{kv_cache_bytes / 2 ** 20:.0f} MiB, caches in {folder})")
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    states = (torch.random.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        with vllm_environment(folder):
            llm = create_engine(directory, dtype=dtype, kv_cache_memory_bytes=kv_cache_bytes,
                                max_model_len=max_model_len)
    except ImportError:
        raise
    except Exception as e:  # vLLM's reasons come as many exception types
        reason = " ".join(str(e).split()) or type(e).__name__
        raise RuntimeError(f"vLLM could not start on {directory}: {reason}") from e
    finally:
        torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it by a function that warns
        torch.set_num_threads(threads)
        torch.random.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
    _STARTED[key] = llm
    return VLLMDecoder(lm, llm)


def vllm_unavailable(method: HandoffMethod, prefixes: Sequence[torch.Tensor], decoder: VLLMDecoder,
                     max_new_tokens: int) -> str | None:
    """Why ``decoder`` cannot decode these prefixes of ``method`` (one line), or None."""
    reason = getattr(method, "vllm_unavailable", None)
    if reason:
        return str(reason)
    for i, p in enumerate(prefixes):
        try:
            decoder.check_prefix(p, max_new_tokens, i)
        except ValueError as e:
            return str(e)
    return None


def agrees(a: str, b: str) -> bool:
    """Identical normalised first lines (what exact match compares)."""
    return normalize_answer(first_line(a)) == normalize_answer(first_line(b))


def compare(rows: Sequence[dict], hf: Sequence[str], vllm: Sequence[str], decode_s: float, *,
            open_text: bool = False) -> dict:
    """The vLLM entry of a method's metrics: its accuracy on ``rows`` (``open_text``: as SQuAD
    scores it) and its agreement with HF."""
    same = [float(agrees(a, b)) for a, b in zip(hf, vllm)]
    differ = [{"id": r["id"], "question": r["question"], "answer": r["answer"], "hf": a, "vllm": b}
              for r, a, b, s in zip(rows, hf, vllm, same) if not s]

    return {
        **accuracy_summary(vllm, [accepted_answers(r) for r in rows], open_text=open_text),
        "agreement": sum(same) / len(same) if same else None,
        "agreement_ci": wilson_interval(same),
        "disagree": len(differ),
        "disagreements": differ[:DISAGREEMENTS_KEPT],
        "decode_s": round(decode_s, 3),
    }


def _hf_decode(lm: LM, prefixes: list, batch: int, max_new_tokens: int) -> float:
    """Seconds the HF decoder takes to answer ``prefixes``, ``batch`` at a time."""
    t0 = time.perf_counter()
    greedy_decode(lm.model, lm.tokenizer, prefixes, max_new_tokens=max_new_tokens, batch_size=batch,
                  stop_at_newline=True)
    return time.perf_counter() - t0


def _vllm_decode(decoder: VLLMDecoder, prefixes: list, batch: int, max_new_tokens: int) -> float:
    """Seconds vLLM takes to answer ``prefixes`` in ``generate`` calls of ``batch`` prompts."""
    t0 = time.perf_counter()
    for s in range(0, len(prefixes), batch):
        decoder.decode(prefixes[s:s + batch], max_new_tokens=max_new_tokens, stop_at_newline=True)
    return time.perf_counter() - t0


def receiver_throughput(methods: Sequence[HandoffMethod], rows: Sequence[dict], batches: Sequence[int], *,
                        max_new_tokens: int, decoder: VLLMDecoder | None = None,
                        log: Callable[[str], None] | None = None) -> dict:
    """Questions per second of the receiver's decode of ``rows``' prefixes, at each batch size.

    For each method (those of `THROUGHPUT_METHODS` given) the prefixes are built once, untimed,
    and sorted by length (as the accuracy pass batches them); then for each batch size B the HF
    decoder answers them B at a time (`greedy_decode`, ``batch_size=B``) and, with a decoder,
    vLLM answers them in ``generate`` calls of B prompts. One untimed call of B prompts per engine
    and B comes first. Timed: the decode alone, from prefixes to answer strings.
    """
    say = log or (lambda message: None)
    out = []
    for m in methods:
        lm = m.lm
        built = m.build_prefixes(list(rows)).prefixes
        prefixes = sorted(built, key=lambda p: p.shape[0])
        reason = vllm_unavailable(m, prefixes, decoder, max_new_tokens) if decoder is not None else None
        for b in batches:
            _hf_decode(lm, prefixes[:b], b, max_new_tokens)  # warm-up
            hf_s = _hf_decode(lm, prefixes, b, max_new_tokens)
            entry = {"method": m.name, "batch": b, "n": len(prefixes),
                     "mean_prefix_positions": sum(p.shape[0] for p in prefixes) / len(prefixes),
                     "hf_s": round(hf_s, 3), "hf_qps": len(prefixes) / hf_s}
            if decoder is not None and reason is None:
                _vllm_decode(decoder, prefixes[:b], b, max_new_tokens)  # warm-up
                vllm_s = _vllm_decode(decoder, prefixes, b, max_new_tokens)
                entry.update(vllm_s=round(vllm_s, 3), vllm_qps=len(prefixes) / vllm_s)
            elif decoder is not None:
                entry["vllm_unavailable"] = reason
            out.append(entry)
            vllm_text = f", vLLM {entry['vllm_qps']:.2f} q/s" if "vllm_qps" in entry else ""
            say(f"  throughput {m.name} batch {b}: HF {entry['hf_qps']:.2f} q/s{vllm_text}")
    return {"batches": list(batches), "questions": len(rows), "threads": torch.get_num_threads(), "rows": out}
