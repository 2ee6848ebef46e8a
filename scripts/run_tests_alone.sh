#!/usr/bin/env bash
# Runs test modules one at a time, each in a fresh pytest process, so that a module that passes
# only after another one has run (a fixture or cache it relies on without asking for it) fails here.
#   bash scripts/run_tests_alone.sh                       # every tests/**/test_*.py (long)
#   bash scripts/run_tests_alone.sh tests/rclc tests/test_eval.py
# PYTHON picks the interpreter (default .venv/bin/python; .venv-vllm/bin/python for tests/vllm).
# Extra pytest arguments go in PYTEST_ARGS. Prints one line per module and exits 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(tests)
modules=()
for target in "${targets[@]}"; do
  if [ -d "$target" ]; then
    while IFS= read -r f; do modules+=("$f"); done < <(find "$target" -name 'test_*.py' | sort)
  else
    modules+=("$target")
  fi
done
failed=()
for module in "${modules[@]}"; do
  start=$(date +%s)
  # shellcheck disable=SC2086
  "$PYTHON" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} "$module" > /tmp/run_tests_alone.$$.log 2>&1
  rc=$?
  summary=$(tail -n 1 /tmp/run_tests_alone.$$.log)
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then  # 5: nothing collected (skipped module)
    failed+=("$module")
    echo "FAIL $module ($(( $(date +%s) - start )) s): $summary"
    grep -E '^(FAILED|ERROR) ' /tmp/run_tests_alone.$$.log | sed 's/^/    /'
  else
    echo "ok   $module ($(( $(date +%s) - start )) s): $summary"
  fi
done
rm -f /tmp/run_tests_alone.$$.log
[ ${#failed[@]} -eq 0 ] || { echo "${#failed[@]} module(s) failed alone: ${failed[*]}"; exit 1; }
