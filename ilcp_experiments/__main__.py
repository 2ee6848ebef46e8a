"""``python -m ilcp_experiments {sweep,report} ...``: the experiment drivers' command lines."""

from __future__ import annotations

import sys

COMMANDS = {
    "sweep": ("ilcp_experiments.sweep", "train and evaluate at several payload sizes (--sweep FILE)"),
    "report": ("ilcp_experiments.results_docs", "regenerate (or --check) the docs generated from docs/results"),
    "curves": ("ilcp_experiments.chunk_curves", "plot and tabulate chunk pretraining curves (RUN ... --out DIR)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        lines = [f"usage: python -m ilcp_experiments {{{','.join(COMMANDS)}}} [options]", ""]
        lines += [f"  {name:<8}{what}" for name, (_, what) in COMMANDS.items()]
        if argv and not asked:
            lines += ["", f"unknown command {argv[0]!r}"]
        print("\n".join(lines), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
