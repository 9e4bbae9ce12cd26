"""Sampling on SmolLM2: a seeded request reproduces its output, and its logprobs are the target's.

One prompt x 12 new tokens per drafter, float32 on CPU. The statistical proof of losslessness runs on
the synthetic models (`tests/property/test_cycle_sampling.py`); tau under sampling is a benchmark
(`bench/sampling_tau.py`).
"""

from __future__ import annotations

import pytest
import torch
from speccycle.backends.torch.sampling import process_logits
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.drafters.eagle import EagleDraft
from speccycle.engine.drafters.layerskip import LlamaDraft
from speccycle.engine.drafters.ngram import NgramDraft
from speccycle.engine.engine import Engine, eagle_head_for
from speccycle.engine.greedy import extend_batch
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel

pytestmark = pytest.mark.slow
NEW_TOKENS = 12
PARAMS = SamplingParams(temperature=0.8, seed=5, logprobs=True)


@pytest.fixture(scope="module")
def smollm2():
    from speccycle.engine.tokenizers.tokenizer import Tokenizer
    from speccycle.engine.weights.weights_gguf import default_model_path, load_gguf

    path = default_model_path()
    config, weights = load_gguf(path, dtype=torch.float32)
    return config, weights, Tokenizer.from_gguf(path)


def _engine(smollm2, draft: str, spec: SpecConfig) -> Engine:
    config, weights, tokenizer = smollm2
    model = LlamaModel(config, weights)
    pool = PagedKVPool(num_pages=-(-4096 // spec.page_size), page_size=spec.page_size)

    def build(engine: Engine):
        if draft == "ngram":
            return NgramDraft(config.vocab_size)
        if draft == "layerskip":
            return LlamaDraft(model, pool, num_layers=8)
        return EagleDraft(eagle_head_for(config, seed=1), model, pool)  # a random head: low acceptance

    return Engine(model, pool, build, spec, tokenizer)


@pytest.mark.parametrize(
    "draft, spec",
    [
        ("ngram", SpecConfig(num_steps=4, topk=2, num_draft_tokens=6, page_size=16)),
        ("layerskip", SpecConfig(num_steps=3, topk=1, page_size=16)),
        ("eagle", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=1)),
    ],
)
def test_seeded_sampling_reproduces_and_reports_the_targets_logprobs(smollm2, draft, spec):
    engine = _engine(smollm2, draft, spec)
    prompt = engine.chat_prompt("Repeat after me: the cat sat on the mat, the cat sat on the mat.")
    first, stats = engine.generate([prompt], NEW_TOKENS, sampling=PARAMS, checked=True)
    again, _ = engine.generate([prompt], NEW_TOKENS, sampling=PARAMS)
    assert first[0].output == again[0].output and first[0].logprobs == again[0].logprobs
    assert stats.verifies > 0 and engine.pool.num_free_pages == engine.pool.num_pages
    output = list(first[0].output)
    assert len(first[0].logprobs) == len(output)
    # The target over prompt + output in one extend: log p(token) under temperature 0.8 at each step.
    batch = extend_batch(engine.pool, [10_000], [prompt + output[:-1]], [0], last_logits_only=False)
    logits = engine.target.forward(batch).logits[len(prompt) - 1 :]
    engine.pool.free(10_000)
    probs = process_logits(logits, PARAMS.temperature)
    expected = torch.log(probs.gather(1, torch.tensor(output)[:, None])).squeeze(1)
    torch.testing.assert_close(torch.tensor(first[0].logprobs), expected, atol=2e-3, rtol=1e-3)


def test_greedy_requests_ignore_the_sampling_machinery(smollm2):
    """``sampling=None`` and an explicit temperature 0 decode the same greedy tokens as autoregressive."""
    engine = _engine(smollm2, "ngram", SpecConfig(num_steps=4, topk=1, page_size=16))
    prompt = engine.chat_prompt("Name three colors.")
    ar = engine.generate_autoregressive([prompt], NEW_TOKENS)[0]
    plain, _ = engine.generate([prompt], NEW_TOKENS)
    explicit, _ = engine.generate([prompt], NEW_TOKENS, sampling=SamplingParams(temperature=0.0, logprobs=True))
    assert list(plain[0].output) == list(explicit[0].output) == ar
    assert len(explicit[0].logprobs) == len(ar) and all(lp <= 0 for lp in explicit[0].logprobs)
