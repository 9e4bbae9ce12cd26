"""Greedy speculative output equals the engine's autoregressive output, on SmolLM2, for every drafter.

A few Spec-Bench prompts x 32 new tokens, float32 on CPU; chain and tree (K up to 4, N up to 32),
P 1 and 16. The 240-prompt run is a benchmark (`speccycle bench --prompts ...`), not a test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from speccycle.core import SpecConfig
from speccycle.engine.drafters.eagle import EagleDraft
from speccycle.engine.drafters.layerskip import LlamaDraft
from speccycle.engine.drafters.ngram import NgramDraft
from speccycle.engine.engine import Engine, eagle_head_for
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
# the 240 Spec-Bench dev prompts where $SPEC_BENCH_DEV names their file (as speccycle.testing.prompts reads them), else
# the 13 prompts the package ships
DEV_PROMPTS = os.environ.get("SPEC_BENCH_DEV") or None


@pytest.fixture(scope="module")
def smollm2():
    from speccycle.engine.tokenizers.tokenizer import Tokenizer
    from speccycle.engine.weights.weights_gguf import default_model_path, load_gguf

    torch.manual_seed(0)
    path = default_model_path()
    config, weights = load_gguf(path, dtype=torch.float32)
    return config, weights, Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def prompts(smollm2):
    """Three prompts: summarization and rag repeat their input (n-gram hits), writing does not."""
    from speccycle.engine.bench import load_prompts

    items = load_prompts(DEV_PROMPTS)
    wanted = {"summarization", "rag", "writing"}
    picked = {}
    for item in items:
        picked.setdefault(item["category"], item)
    _, _, tokenizer = smollm2
    return [tokenizer.apply_chat_template([{"role": "user", "content": picked[c]["text"]}]) for c in sorted(wanted)]


def _engine(smollm2, spec: SpecConfig, draft: str, eagle_version: int = 1) -> Engine:
    config, weights, tokenizer = smollm2
    feature_layers = None
    head = None
    if draft == "eagle":
        head = eagle_head_for(config, version=eagle_version, seed=1, draft_vocab_size=4096)
        feature_layers = head.config.feature_layers if eagle_version == 3 else None
    model = LlamaModel(config, weights, feature_layers=feature_layers)
    pool = PagedKVPool(num_pages=-(-8192 // spec.page_size), page_size=spec.page_size)

    def build(engine: Engine):
        if draft == "ngram":
            return NgramDraft(config.vocab_size)
        if draft == "layerskip":
            return LlamaDraft(model, pool, num_layers=8)
        if draft == "model":  # a separate, smaller model: a 6-layer copy of the target's weights
            small = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 6}
            import attrs

            return LlamaDraft(LlamaModel(attrs.evolve(config, num_layers=6), small), pool)
        return EagleDraft(head, model, pool)

    return Engine(model, pool, build, spec, tokenizer)


@pytest.fixture(scope="module")
def autoregressive(smollm2, prompts):
    engine = _engine(smollm2, SpecConfig(), "ngram")
    return [engine.generate_autoregressive([p], NEW_TOKENS)[0] for p in prompts]


CASES = [
    ("ngram", SpecConfig(num_steps=5, topk=1, page_size=1)),
    ("ngram", SpecConfig(num_steps=4, topk=4, num_draft_tokens=16, page_size=16)),
    ("layerskip", SpecConfig(num_steps=3, topk=1, page_size=16)),
    ("layerskip", SpecConfig(num_steps=3, topk=2, num_draft_tokens=8, page_size=1)),
    ("model", SpecConfig(num_steps=4, topk=4, num_draft_tokens=32, page_size=16)),
    ("eagle", SpecConfig(num_steps=3, topk=1, page_size=16)),
    ("eagle", SpecConfig(num_steps=3, topk=3, num_draft_tokens=10, page_size=1)),
]


@pytest.mark.parametrize(
    "draft, spec", CASES, ids=[f"{d}-S{s.num_steps}K{s.topk}N{s.num_draft_tokens}P{s.page_size}" for d, s in CASES]
)
def test_speculative_equals_autoregressive(smollm2, prompts, autoregressive, draft, spec):
    engine = _engine(smollm2, spec, draft)
    results, stats = engine.generate(prompts, NEW_TOKENS, checked=True)  # one ragged batch
    for result, expected in zip(results, autoregressive):
        assert list(result.output) == expected, f"{draft} {spec}: diverged from autoregressive greedy"
    assert stats.verifies > 0 and 1.0 <= stats.tau <= spec.num_steps + 1
    if draft == "ngram":  # not a speed test: the drafts must actually be accepted where the answers quote the prompts
        assert stats.tau > 1.0, stats
    assert engine.pool.num_free_pages == engine.pool.num_pages, "KV pages leaked"


def test_eagle3_head_is_lossless_with_a_reduced_vocabulary(smollm2, prompts, autoregressive):
    spec = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=16)
    engine = _engine(smollm2, spec, "eagle", eagle_version=3)
    results, _ = engine.generate(prompts[:1], NEW_TOKENS, checked=True)
    assert list(results[0].output) == autoregressive[0]


def test_prompt_longer_than_the_pool_is_refused_and_nothing_leaks(smollm2):
    config, weights, tokenizer = smollm2
    spec = SpecConfig(num_steps=3, topk=1, page_size=16)
    model = LlamaModel(config, weights)
    pool = PagedKVPool(num_pages=4, page_size=16)
    engine = Engine(model, pool, lambda e: NgramDraft(config.vocab_size), spec, tokenizer)
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        engine.generate([list(range(1, 100))], 8)
    assert pool.num_free_pages == pool.num_pages


def test_sample_prompts_file_is_spec_bench_shaped():
    from speccycle.engine.bench import load_prompts

    items = load_prompts(None)
    assert len(items) == 13 and len({i["category"] for i in items}) == 13
    with pytest.raises(ValueError, match="no prompts file"):
        load_prompts("/nonexistent.jsonl")


def test_dev_prompts_are_spec_bench_shaped():
    if DEV_PROMPTS is None:
        pytest.skip("$SPEC_BENCH_DEV does not name the Spec-Bench dev prompts file")
    first = json.loads(Path(DEV_PROMPTS).read_text().splitlines()[0])
    assert "turns" in first and "category" in first


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path, smollm2):
    import attrs
    from speccycle.engine.errors import ModelLoadError
    from speccycle.engine.models.llama import random_llama_weights
    from speccycle.engine.weights.weights_hf import save_hf

    config, _, _ = smollm2
    small = attrs.evolve(
        config,
        vocab_size=1000,
        num_layers=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
    )
    save_hf(tmp_path, small, random_llama_weights(small, seed=0))
    with pytest.raises(ModelLoadError, match="vocabulary of 1000 tokens and the target 49152"):
        Engine.load(draft="model", draft_model=tmp_path, spec=SpecConfig(num_steps=2), kv_tokens=1024)
