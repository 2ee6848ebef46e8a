"""The parts files of an evaluation: each finished (task, method) result is saved under
OUT/parts/TASK/METHOD.json with the key of everything it depends on, so that ``resume`` reuses it
when the key still matches and computes it again otherwise."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from .. import __version__
from ..io import atomic_write_json
from .session import EvalSession

__all__ = ["part_key", "part_path", "read_part", "write_part"]


def part_path(out, task: str, method: str) -> Path:
    """Where one (task, method) result of an evaluation is saved: out/parts/TASK/METHOD.json."""
    def safe(name: str) -> str:
        return re.sub(r"[^A-Za-z0-9._+-]", "_", name)

    return Path(out) / "parts" / safe(task) / f"{safe(method)}.json"


def part_key(session: EvalSession, task: str, method: str) -> dict:
    """Everything a saved (task, method) result depends on: the run's export (its config.json,
    weight digests included), the task, the method and the settings that change its numbers."""
    cfg = session.config
    return {"run": hashlib.sha256(json.dumps(session.run_config, sort_keys=True).encode()).hexdigest()[:16],
            "lm": session.lm.fingerprint, "task": task, "method": method, "limit": cfg.limit,
            "latency_n": cfg.latency_n, "batch_size": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens,
            "payload_dtype": cfg.payload_dtype, "engine": cfg.engine, "precision": session.precision,
            "package": __version__,
            **({"split": cfg.split} if cfg.split != "test" else {})}  # test parts saved before the split keep their key


def read_part(path: Path, key: dict) -> tuple[dict, list[str], list[str] | None] | None:
    """A saved (task, method) result made with ``key``'s settings, else None."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("key") != key:
        return None
    return saved["metrics"], saved["predictions"], saved.get("vllm_predictions")


def write_part(path: Path, key: dict, metrics: dict, predictions: list[str],
               vllm_predictions: list[str] | None) -> None:
    """Save one finished (task, method) result, written whole or not at all, for `read_part`."""
    atomic_write_json(path, {"key": key, "metrics": metrics, "predictions": predictions,
                             "vllm_predictions": vllm_predictions})
