#!/usr/bin/env bash
# Set up .venv with the dev tools and run the whole test suite (CI profile for Hypothesis).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,docs
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}" TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
exec .venv/bin/python -m pytest -q "$@"
