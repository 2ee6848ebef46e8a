"""Train a run: ``python train.py [--config FILE] [--resume] [--overwrite] [key=value ...]``.

The same as ``ilcp-train`` and ``python -m ilcp train``; ``python train.py --help`` lists the
options (`ilcp.cli`).
"""

import sys

from ilcp.cli import train_main as main

if __name__ == "__main__":
    sys.exit(main())
