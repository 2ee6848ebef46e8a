"""``python -m ilcp.rclc doctor [--backend hf|vllm] [--allow-unstable]``

Prints `ilcp.rclc.check`'s report as JSON (with a fix for each issue) and exits 1 when there
are issues, 0 otherwise. It downloads nothing and runs no model.
"""

from __future__ import annotations

import argparse
import json
import sys

from ilcp.rclc.backends import BACKENDS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ilcp.rclc", description="RCLC environment checks")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="report versions, GPU availability and backend readiness as JSON")
    doctor.add_argument("--backend", choices=BACKENDS, default="hf", help="the backend to check (default: hf)")
    doctor.add_argument("--allow-unstable", action="store_true", help="accept the opt-in vLLM 0.26.0 release")
    args = parser.parse_args(argv)

    from ilcp.rclc.check import check

    report = check(backend=args.backend, allow_unstable=args.allow_unstable)
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
