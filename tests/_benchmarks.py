"""Load a script of benchmarks/ as a module, for the tests that check its functions."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_benchmark(name: str):
    """benchmarks/<name>.py as module ``name`` (registered in sys.modules, so its dataclasses resolve)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
