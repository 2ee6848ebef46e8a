"""Train and evaluate ILCP at several payload sizes; one plot of accuracy against wire bytes.

    python scripts/sweep.py --sweep configs/sweep/tiny.yaml --out /tmp/sweep-tiny --checkpoints /tmp/sweep-tiny-runs
    python scripts/sweep.py --sweep configs/sweep/facts.yaml                # results/sweep-facts
    python scripts/sweep.py --sweep configs/sweep/facts.yaml --resume       # after an interruption

The sweep file's format, what each step does and what it costs: ``--help``, or the docstring of
`ilcp.evaluation.sweep`, which holds the sweep's logic and this command line.
"""

import sys

from ilcp.evaluation.sweep import main

if __name__ == "__main__":
    sys.exit(main())
