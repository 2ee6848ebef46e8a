"""Evaluate a run: ``python eval.py --ckpt checkpoints/RUN [--tasks ...] [--methods ...]``.

The same as ``ilcp-eval`` and ``python -m ilcp eval``; ``python eval.py --help`` lists the
options and what each costs (`ilcp.cli`).
"""

import sys

from ilcp.cli import build_eval_parser as build_parser
from ilcp.cli import eval_main as main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
