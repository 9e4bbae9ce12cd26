"""The prefix cache on SmolLM2 with its EAGLE head: requests that share a prefix are lossless.

Three conversations share a system prompt; each runs two turns (the second renders the first's answer into
the chat template, as a chat client sends it back). Through the scheduler with the prefix cache, EAGLE chain
and tree, float32 on CPU, checked mode: every output equals the target's own greedy decoding of the same
prompt, and the second turn is served mostly from cached pages (the system prompt and the first turn).
"""

from __future__ import annotations

import pytest
import torch
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.drafters.eagle import EagleDraft, EagleHead
from speccycle.engine.drafters.eagle_heads import shipped_eagle_head
from speccycle.engine.engine import Engine, eagle_head_dtype
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.catalog import build_model
from speccycle.engine.serving.scheduler import Scheduler

pytestmark = pytest.mark.slow
NEW_TOKENS = 8
SYSTEM = "You are the help desk of a bicycle shop. Answer in one or two short sentences, politely."
TURNS = (("Do you repair flat tyres?", "How long does it take?"), ("Are you open on Sundays?", "And on holidays?"))


@pytest.fixture(scope="module")
def smollm2():
    from speccycle.engine.tokenizers.tokenizer import Tokenizer
    from speccycle.engine.weights.weights_gguf import default_model_path, load_gguf

    path = default_model_path()
    config, weights = load_gguf(path, dtype=torch.float32)
    head = EagleHead.load(shipped_eagle_head(path), eagle_head_dtype("cpu", torch.float32), "cpu")
    return config, weights, head, Tokenizer.from_gguf(path)


def _engine(smollm2, spec: SpecConfig) -> Engine:
    config, weights, head, tokenizer = smollm2
    feature_layers = head.config.feature_layers if head.config.version == 3 else None
    model = build_model(config, weights, feature_layers=feature_layers)
    pool = PagedKVPool(num_pages=4096 // spec.page_size, page_size=spec.page_size, prefix_cache=True)
    return Engine(model, pool, lambda engine: EagleDraft(head, model, pool), spec, tokenizer)


@pytest.fixture(scope="module")
def conversations(smollm2):
    """Each turn's prompts and the target's own greedy outputs (no draft, no cache)."""
    engine = _engine(smollm2, SpecConfig(num_steps=1, topk=1, page_size=16))
    tokenizer, stops = engine.tokenizer, engine.stop_token_ids
    messages = [[{"role": "system", "content": SYSTEM}] for _ in TURNS]
    turns = []
    for turn in range(2):
        for history, questions in zip(messages, TURNS):
            history.append({"role": "user", "content": questions[turn]})
        prompts = [tokenizer.apply_chat_template(m) for m in messages]
        outputs = engine.generate_autoregressive(prompts, NEW_TOKENS)
        turns.append((prompts, outputs))
        for history, output in zip(messages, outputs):
            history.append({"role": "assistant", "content": tokenizer.decode([t for t in output if t not in stops])})
    return turns


@pytest.mark.parametrize(
    "spec",
    [SpecConfig(num_steps=4, topk=1, page_size=16), SpecConfig(num_steps=4, topk=4, num_draft_tokens=8, page_size=8)],
    ids=["chain", "tree"],
)
def test_shared_prefixes_and_later_turns_equal_autoregressive(smollm2, conversations, spec):
    engine = _engine(smollm2, spec)
    scheduler = Scheduler.from_engine(engine, prefix_cache=True, checked=True)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    for turn, (prompts, expected) in enumerate(conversations):
        before = scheduler.stats.cached_tokens, scheduler.stats.prefill_tokens
        assert [list(r.output) for r in scheduler.generate(prompts, params)] == expected
        cached = scheduler.stats.cached_tokens - before[0]
        total = scheduler.stats.prefill_tokens - before[1]
        if turn == 1:  # the system prompt and the first turn come from the cache
            assert cached >= 0.4 * total, (cached, total)
    assert scheduler.stats.tau > 1.0  # drafts over cached draft KV are accepted
    engine.pool.audit()
    assert engine.pool.num_free_pages == engine.pool.num_pages
