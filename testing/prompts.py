"""Spec-Bench prompts for tests: the 240 dev prompts where ``$SPEC_BENCH_DEV`` names their file, else the 13 the
package ships (one a category, `engine/data/spec_bench_sample.jsonl`), so a test reads the same file on every
machine that has no copy of the dev set."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path


def spec_bench_rows() -> list[dict]:
    """Each prompt's JSON object (``category``, ``turns``), in file order."""
    named = os.environ.get("SPEC_BENCH_DEV")
    if named:
        text = Path(named).read_text(encoding="utf-8")
    else:
        text = resources.files("speccycle.engine").joinpath("data", "spec_bench_sample.jsonl").read_text("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def spec_bench_prompts() -> list[str]:
    """The first turn of every prompt."""
    return [row["turns"][0] for row in spec_bench_rows()]


def one_prompt_of(categories: tuple[str, ...]) -> list[str]:
    """The first prompt of each category, in the order given."""
    rows = spec_bench_rows()
    return [next(r["turns"][0] for r in rows if r.get("category") == c) for c in categories]
