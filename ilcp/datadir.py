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
