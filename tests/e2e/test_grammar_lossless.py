"""Constrained greedy speculative output equals constrained autoregressive output, on SmolLM2 in float32 on a CPU.

Two prompts, one under a JSON schema and one under a regex, 16 new tokens, in one batch beside each other: the
shipped EAGLE head, tree and chain, in checked mode (invariant 16 at every boundary). The n-gram draft and the
other draft families are held to constrained greedy decoding on the small models (`tests/unit/test_grammar.py`);
the run over Spec-Bench prompts is a benchmark (``bench/constrained.py --check``), not a test.
"""

from __future__ import annotations

import pytest
import torch
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.engine import Engine

pytestmark = pytest.mark.slow
pytest.importorskip("llguidance")
NEW_TOKENS = 16
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PARAMS = [SamplingParams(json_schema=SCHEMA), SamplingParams(regex=r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]")]
QUESTIONS = [
    "Describe Alice, 30, who lives in Paris, as a JSON object.",
    "When did the first person walk on the Moon? Give the date.",
]
CASES = [SpecConfig(num_steps=3, topk=3, num_draft_tokens=8), SpecConfig(num_steps=3, topk=1)]


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    return Engine.load(draft="eagle", spec=CASES[0], kv_tokens=4096)


@pytest.fixture(scope="module")
def reference(engine):
    prompts = [engine.chat_prompt(q) for q in QUESTIONS]
    return prompts, engine.generate_autoregressive(prompts, NEW_TOKENS, sampling=PARAMS)


@pytest.mark.parametrize("spec", CASES, ids=[f"S{s.num_steps}K{s.topk}N{s.num_draft_tokens}" for s in CASES])
def test_constrained_speculative_equals_constrained_autoregressive(engine, reference, spec):
    engine.spec = spec  # the same page size: the pool and the draft serve both shapes
    prompts, expected = reference
    results, stats = engine.generate(prompts, NEW_TOKENS, sampling=PARAMS, checked=True)
    for result, want in zip(results, expected):
        assert result.error is None
        assert list(result.output) == want, f"{spec}: diverged from constrained autoregressive greedy"
    date = engine.tokenizer.decode(results[1].output, skip_special_tokens=True)
    assert len(date) == 10 and date[4] == "-" and date[7] == "-", date
    assert engine.tokenizer.decode(results[0].output).startswith("{")
    assert stats.verifies > 0 and engine.pool.num_free_pages == engine.pool.num_pages
