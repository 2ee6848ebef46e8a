"""``python -m ilcp.rclc doctor [--backend hf|vllm] [--allow-unstable] [--model DIR]``

Prints `ilcp.rclc.check`'s report as JSON (with a fix for each issue) and exits 1 when there
are issues, 0 otherwise. It downloads nothing. ``--backend vllm`` where vLLM is not installed
prints one line saying which interpreter to use and exits 2. ``--model DIR`` (vLLM only) starts
an in-process engine on a local model directory, binds an agent to it and adds the real engine's
settings (device, dtype, prompt embeddings, context, what is unsupported) under ``agent.engine``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ilcp.rclc.backends import BACKENDS, vllm_importable


def _engine_report(directory: str, allow_unstable: bool) -> dict:
    """`check` of an agent bound to a fresh in-process engine on ``directory`` (issues on failure)."""
    from ilcp.rclc.check import check

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from ilcp.rclc.agent import bind
        from ilcp.rclc.vllm_engine import start_engine

        agent = bind(start_engine(directory), backend="vllm", allow_unstable=allow_unstable)
    except Exception as e:  # vLLM's reasons come as many exception types: report them as one issue
        report = check(backend="vllm", allow_unstable=allow_unstable)
        report["issues"].append({"check": "vllm.engine", "message": f"binding an engine on {directory} failed: "
                                 + (" ".join(str(e).split()) or type(e).__name__),
                                 "fix": "pass a local Hugging Face model directory of a supported dense model"})
        report["ok"] = False
        return report
    return check(agent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ilcp.rclc", description="RCLC environment checks")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="report versions, GPU availability and backend readiness as JSON")
    doctor.add_argument("--backend", choices=BACKENDS, default="hf", help="the backend to check (default: hf)")
    doctor.add_argument("--allow-unstable", action="store_true", help="accept a vLLM release the adapter was not tested with")
    doctor.add_argument("--model", metavar="DIR", help="vLLM: start an in-process engine on this local model directory "
                        "and report it")
    args = parser.parse_args(argv)
    if args.model is not None and args.backend != "vllm":
        parser.error("--model needs --backend vllm")
    if args.backend == "vllm" and not vllm_importable():
        print(f"doctor --backend vllm: vllm is not installed in this environment ({sys.executable}); run it with "
              ".venv-vllm/bin/python -m ilcp.rclc doctor --backend vllm (`bash scripts/install.sh` builds .venv-vllm)",
              file=sys.stderr)
        return 2

    from ilcp.rclc.check import check

    if args.model is not None:
        report = _engine_report(args.model, args.allow_unstable)
    else:
        report = check(backend=args.backend, allow_unstable=args.allow_unstable)
    print(json.dumps(report, indent=2, sort_keys=True, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
