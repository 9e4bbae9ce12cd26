#!/usr/bin/env bash
# Set up .venv with the dev tools and run the whole test suite (CI profile for Hypothesis).
# The tests run in one worker process per core, up to 4 (SPECCYCLE_TEST_WORKERS sets the count; 1: this process
# alone), each test file whole in one worker, so a file's model loads once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,docs
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}" TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
cores="$(nproc 2>/dev/null || echo 1)"
workers="${SPECCYCLE_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
case "$workers" in
  ''|*[!0-9]*) echo "SPECCYCLE_TEST_WORKERS=$workers: give a number of worker processes (1: none)" >&2; exit 2 ;;
esac
if [ "$workers" -gt 1 ]; then
  exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
