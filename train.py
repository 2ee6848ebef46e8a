"""Train the ILCP compressor and projector (and the two tuned baselines) for one LM.

    python train.py                                        # embedded SmolLM2, bAbI task 1
    python train.py --config configs/tiny.yaml             # tiny random LM, seconds
    python train.py handoff.max_steps=50 run_name=short    # key=value overrides
    python train.py --resume                               # continue an interrupted run

Defaults, then the YAML file, then the overrides; the run is written to checkpoints/RUN_NAME.
"""

import sys

from ilcp.cli import train_main as main

if __name__ == "__main__":
    sys.exit(main())
