"""Where a measurement came from: the command, date, commit, versions, threads and machine.

`provenance` is recorded in every results.json that eval writes (key ``"provenance"``), and
`ilcp_experiments.results_docs` prints it at the top of each docs/results/ folder's README. A field that
could not be read is None, which the READMEs print as "not recorded".
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

__all__ = ["FIELDS", "provenance", "command_line"]

# The fields, in the order the READMEs print them.
FIELDS = ("command", "date", "commit", "package_version", "torch", "transformers", "threads", "machine")


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: ``python eval.py ...``, ``python -m ilcp eval ...`` or the script's name."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    first = Path(argv[0])
    if first.name == "__main__.py":
        head = ["python", "-m", first.parent.name]
    elif first.suffix == ".py":
        try:
            head = ["python", str(first.resolve().relative_to(Path.cwd()))]
        except ValueError:
            head = ["python", str(first)]
    else:
        head = [first.name]
    return shlex.join(head + argv[1:])


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _commit() -> str | None:
    """The package checkout's commit (short), marked when its tracked files had changes."""
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    return commit


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError):
        pass
    return None


def _machine() -> str:
    parts = [f"{_cpu_name()}, {os.cpu_count()} CPUs"]
    memory = _memory_gib()
    if memory is not None:
        parts.append(f"{memory:.0f} GiB")
    try:
        import torch

        if torch.cuda.is_available():
            parts.append(torch.cuda.get_device_name(0))
    except ImportError:
        pass
    return ", ".join(parts)


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except (ImportError, AttributeError):
        return None


def provenance(command: str | None = None) -> dict:
    """The `FIELDS` of this process: ``command`` (default: this process's command line), today's
    date (UTC), the commit, the package, torch and transformers versions, torch's threads and
    the machine."""
    from . import __version__

    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:
        threads = None
    return {
        "command": command_line() if command is None else command,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "commit": _commit(),
        "package_version": __version__,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "threads": threads,
        "machine": _machine(),
    }
