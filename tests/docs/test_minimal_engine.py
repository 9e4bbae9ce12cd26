"""The engine of docs/engine.md runs, and its output equals plain greedy decoding (invariant 10)."""

from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path

import pytest
from speccycle.core import SpecConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "minimal_engine.py"
PROMPTS = [(1, 2, 3), (5, 7), (9, 9, 4, 2), (3,)]


def _load():
    spec = importlib.util.spec_from_file_location("minimal_engine", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _greedy(table, prompt, max_new_tokens: int) -> list[int]:
    """Greedy decoding straight from the example's table, without any of its code."""
    tokens = [0, 0, *prompt]
    for _ in range(max_new_tokens):
        tokens.append(int(table[tokens[-3], tokens[-2], tokens[-1]]))
    return tokens[2 + len(prompt) :]


@pytest.mark.parametrize(
    "config",
    [
        SpecConfig(num_steps=4, topk=1, page_size=4),
        SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4),
        SpecConfig(num_steps=2, topk=3, num_draft_tokens=7, page_size=1),
    ],
    ids=["chain", "tree", "wide-tree-P1"],
)
def test_minimal_engine_equals_greedy_decoding(config, capsys):
    engine = _load()
    done = engine.run(config, PROMPTS, max_new_tokens=30)
    assert [r.request_id for r in done] == list(range(len(PROMPTS)))
    for request in done:
        assert list(request.output) == _greedy(engine.TABLE, request.prompt, 30), f"request {request.request_id}"


def test_minimal_engine_needs_the_kv_moves(monkeypatch):
    """The example's target checks its context, so a cycle that skipped the tree's KV moves fails."""
    from speccycle.backends.torch import TorchBackend

    engine = _load()
    monkeypatch.setattr(TorchBackend, "move_kv", lambda self, buffers, src, dst: None)
    with pytest.raises(AssertionError, match="attends positions"):
        engine.run(SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4), PROMPTS, max_new_tokens=40)


def test_minimal_engine_runs_as_a_script(capsys):
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    lines = [line for line in out.splitlines() if "equals greedy decoding" in line]
    assert len(lines) == 6 and all(line.endswith("True") for line in lines), out
