"""Atomic writes: a temporary file in the destination's folder, then a rename.

A crash or an exception mid-write leaves the previous file (or nothing) in place, never half a file.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor


def _atomic(path: Path, write) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created like open() would create it (0666 less the umask), not mkstemp's 0600.
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    mode = os.stat(tmp).st_mode
    try:
        write(str(tmp))
        os.chmod(tmp, mode)  # some writers (safetensors) replace the file with a 0600 one
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    _atomic(path, write)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_save_safetensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Contiguous copies (shared storage cloned) written as one safetensors file."""
    clean = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    _atomic(path, lambda tmp: save_file(clean, tmp, metadata=metadata))


def file_kind(path: Path) -> str:
    """What a path that is not a regular file is, in words: a folder, a named pipe, ..."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        return "a link to nothing"
    for test, words in (("is_dir", "a folder"), ("is_fifo", "a named pipe"), ("is_socket", "a socket"),
                        ("is_block_device", "a block device"), ("is_char_device", "a character device")):
        if getattr(path, test)():
            return words
    return "neither a file nor a folder"
