"""Train the ILCP compressor and projector (and the two tuned baselines) for one LM.

    python train.py                                        # embedded SmolLM2, bAbI task 1
    python train.py --config configs/tiny.yaml             # tiny random LM, seconds
    python train.py handoff.max_steps=50 run_name=short    # key=value overrides
    python train.py --resume                               # continue an interrupted run

Defaults, then the YAML file, then the overrides; the run is written to checkpoints/RUN_NAME.
"""

import argparse
import sys

from ilcp.config import load_config
from ilcp.training import train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (see configs/)")
    parser.add_argument("--resume", action="store_true", help="continue the run from its last checkpoints")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing run of the same name first")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. handoff.max_steps=50")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as e:
        parser.error(str(e))
    try:
        train(cfg, resume=args.resume, overwrite=args.overwrite)
    except (FileExistsError, ValueError) as e:  # an existing run, a stale stage file, an empty task split
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
