"""The README cannot rot: its Python runs as written, and every result file it or the results log names exists.

Each ```python block of README.md runs in a fresh subprocess with this interpreter (the venv's), from the
repository root. Every `bench/results/...` path in README.md and docs/results.md must match at least one
file or folder (a pattern: `*`, `?`, `{a,b}`); in the results log, a bare file name in a row's last
column (`gpu_bench-H100-real-*.json`) is under bench/results/ as the page says.
"""

from __future__ import annotations

import glob
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS_LOG = ROOT / "docs" / "results.md"
RESULTS = "bench/results/"


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python[^\n]*\n(.*?)^```", markdown, re.DOTALL | re.MULTILINE)


def expand_braces(pattern: str) -> list[str]:
    """`a-{x,y}-*.json` -> `a-x-*.json`, `a-y-*.json` (glob has no braces)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [p for alt in match.group(1).split(",") for p in expand_braces(head + alt + tail)]


def results_paths(markdown: str, bare_names: bool) -> list[str]:
    """Every `bench/results/...` path in code spans; with ``bare_names``, also the bare result file and
    folder names of a table row's last column, as paths under bench/results/."""
    paths = [s for s in re.findall(r"`([^`\n]+)`", markdown) if s.startswith(RESULTS)]
    if bare_names:
        for line in markdown.splitlines():
            if not line.startswith("|"):
                continue
            last = line.rstrip().rstrip("|").rsplit(" | ", 1)[-1]
            for span in re.findall(r"`([^`]+)`", last):
                if (ROOT / span.split("/")[0]).exists():
                    continue  # a path from the repository root (`bench/results/...`, `docs/...`)
                if re.fullmatch(r"[a-z][\w.*?{},-]*(/[\w.*?{},-]+)*(\.json|/)", span):
                    paths.append(RESULTS + span)
    return paths


def missing(paths: list[str]) -> list[str]:
    out = []
    for path in paths:
        for pattern in expand_braces(path):
            if not glob.glob(str(ROOT / pattern.rstrip("/"))):
                out.append(pattern)
    return out


def test_the_readme_has_python_to_run():
    assert python_blocks(README.read_text()), "README.md has no ```python block"


@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))))
def test_each_readme_python_block_runs_as_written(index: int):
    code = python_blocks(README.read_text())[index]
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"README.md python block {index} failed:\n{code}\n{result.stdout}\n{result.stderr}"


def test_every_result_file_the_readme_names_exists():
    paths = results_paths(README.read_text(), bare_names=False)
    assert len(paths) >= 5, "the README's results table names its result files under bench/results/"
    assert missing(paths) == []


def test_every_result_file_the_results_log_names_exists():
    paths = results_paths(RESULTS_LOG.read_text(), bare_names=True)
    assert len(paths) >= 50, "the results log names its result files"
    assert missing(paths) == []


def test_path_patterns_expand_and_resolve():
    assert expand_braces("a-{x,y}-{1,2}.json") == ["a-x-1.json", "a-x-2.json", "a-y-1.json", "a-y-2.json"]
    row = "| what | figure | `bench/results/a.json`, `gpu_bench-{a,b}-*.json`, `-cw-*`, `docs/x.md`, `x/`, `tests/` |"
    assert results_paths(row, bare_names=False) == [RESULTS + "a.json"]
    assert results_paths(row, bare_names=True) == [
        RESULTS + "a.json",
        RESULTS + "gpu_bench-{a,b}-*.json",
        RESULTS + "x/",
    ]
    assert missing([RESULTS + "no-such-result-*.json"]) == [RESULTS + "no-such-result-*.json"]
