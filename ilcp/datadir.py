"""Where the datasets the package ships are read from, and where caches are written.

The repository keeps them in its top-level ``data/`` folder (bAbI, the background prose, the SQuAD
subset, an example file in the user format), each with its licence and source. A wheel installs
the same folder as ``ilcp/data`` (pyproject maps it), so both a checkout (editable install) and an
installed package find it: ``$ILCP_DATA_DIR`` if set, else the checkout's ``data/``, else the
installed package's ``ilcp/data``.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "ILCP_DATA_DIR"
CACHE_ENV = "ILCP_CACHE"
_PACKAGE = Path(__file__).resolve().parent


def data_root() -> Path:
    """The folder holding the shipped datasets (``babi/``, ``background/``, ``squad/``, ...)."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    checkout = _PACKAGE.parent / "data"
    if (checkout / "babi").is_dir():
        return checkout
    return _PACKAGE / "data"


def default_cache_dir() -> Path:
    """Where converted models, pooled states and prepared task files live: ``$ILCP_CACHE`` or
    ``~/.cache/ilcp``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ilcp"


def make_folder(folder: Path, what: str, setting: str) -> None:
    """Make ``folder`` and its parents; ValueError in one line when a file or a link that leads
    nowhere stands where one of them goes, naming it, ``what`` needs the folder for, and
    ``setting``, the setting that moves it."""
    for part in (folder, *folder.parents):
        if part.is_symlink() and not part.exists():
            raise ValueError(f"{what} needs the folder {folder}, but {part} is a symbolic link to {os.readlink(part)}, "
                             f"which does not exist: remove the link or make its target, or set {setting} to another "
                             "folder")
        if part.exists():
            if not part.is_dir():
                raise ValueError(f"{what} needs the folder {folder}, but {part} is a file: move it away or set "
                                 f"{setting} to another folder")
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{what} cannot make the folder {folder} ({e.strerror}): set {setting} to a folder this "
                         "user can write") from None
