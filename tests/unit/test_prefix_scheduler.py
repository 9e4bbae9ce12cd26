"""The scheduler's prefix cache on a tiny random Llama: reused KV equals computed KV, outputs stay lossless.

* A request admitted over another's cached pages holds, in the target's and the draft's cache, the KV its own
  whole prefill would have written (EAGLE, a shifted draft; layer skip, an aligned one).
* Multi-turn conversations with a shared system prompt, a pool small enough to evict cached pages and retract
  requests, checked mode (invariant 15: no request writes a shared page): every output equals autoregressive
  greedy decoding, the cache served prompt tokens, and the pool's accounting holds throughout.
"""

from __future__ import annotations

import random

import pytest
import torch
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.drafters.eagle import EagleConfig, EagleDraft, EagleHead
from speccycle.engine.drafters.layerskip import LlamaDraft
from speccycle.engine.engine import Engine
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel, random_llama_weights
from speccycle.engine.serving.scheduler import Scheduler
from speccycle.engine.weights.weights_gguf import LlamaConfig
from speccycle.statemachine.checks import InvariantViolation

TINY = LlamaConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=512,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_ids=(2,),
)


@pytest.fixture(scope="module")
def weights():
    return random_llama_weights(TINY, seed=3, scale=0.5)


def _engine(weights, draft: str, spec: SpecConfig, num_pages: int, prefix_cache: bool = True) -> Engine:
    model = LlamaModel(TINY, weights)
    pool = PagedKVPool(num_pages=num_pages, page_size=spec.page_size, prefix_cache=prefix_cache)

    def build(engine):
        if draft == "eagle":
            return EagleDraft(EagleHead.random(EagleConfig.for_target(TINY, 1), seed=3), model, pool)
        return LlamaDraft(model, pool, num_layers=1)

    return Engine(model, pool, build, spec)


def _conversations(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 64) for _ in range(11)]
    return [system + [rng.randrange(3, 64) for _ in range(rng.randrange(1, 8))] for _ in range(count)]


@pytest.mark.parametrize("draft", ["eagle", "layerskip"])
def test_reused_pages_hold_the_kv_a_whole_prefill_writes_in_every_cache(weights, draft):
    spec = SpecConfig(num_steps=2, topk=1, page_size=4)
    first, second = _conversations(1, 2)
    params = SamplingParams(max_new_tokens=8)
    kv = {}
    for prefix_cache in (True, False):
        engine = _engine(weights, draft, spec, 32, prefix_cache=prefix_cache)
        scheduler = Scheduler.from_engine(engine, prefix_cache=prefix_cache, checked=True)
        if prefix_cache:
            scheduler.generate([first], params)
        rid = scheduler.submit(second, params)
        scheduler.step()  # prefill (over the cached prefix), draft extend, one cycle: positions [0, n) are final
        if prefix_cache:  # two full pages of the 11 shared tokens, and a copy of the third's first two
            assert scheduler.stats.cached_tokens == 10
            assert set(engine.pool.pages(rid)[:2]) <= engine.pool.shared_pages()
        slots = engine.pool.slots_for([rid], torch.arange(len(second)))
        kv[prefix_cache] = {name: engine.pool.slot_major(name)[slots].clone() for name in ("target", "draft")}
    for name in ("target", "draft"):
        torch.testing.assert_close(kv[True][name], kv[False][name], atol=1e-5, rtol=1e-5, msg=f"{name} KV")


@pytest.mark.parametrize(
    "spec",
    [SpecConfig(num_steps=3, topk=1, page_size=4), SpecConfig(num_steps=3, topk=2, num_draft_tokens=5, page_size=2)],
)
def test_multi_turn_conversations_under_kv_pressure_equal_autoregressive(weights, spec):
    prompts = _conversations(2, 6)
    engine = _engine(weights, "eagle", spec, num_pages=512 // spec.page_size)
    turn1 = engine.generate_autoregressive(prompts, 10)
    follow = [p + o + [5, 6, 7] for p, o in zip(prompts, turn1)]
    turn2 = engine.generate_autoregressive(follow, 10)
    assert engine.pool.num_free_pages == engine.pool.num_pages

    tight = _engine(weights, "eagle", spec, num_pages=-(-90 // spec.page_size))  # ~3 requests' pages at once
    scheduler = Scheduler.from_engine(tight, prefix_cache=True, checked=True, max_batch_size=4)
    params = SamplingParams(max_new_tokens=10)
    first = scheduler.generate(prompts, params)
    assert [list(r.output) for r in first] == turn1
    second = scheduler.generate(follow, params)
    assert [list(r.output) for r in second] == turn2
    stats = scheduler.stats
    assert stats.cached_tokens > 0 and stats.published_pages > 0
    assert stats.retractions > 0  # the pool was short: requests were retracted, cached pages evicted
    tight.pool.audit()
    assert tight.pool.num_free_pages == tight.pool.num_pages  # every cached page is unreferenced again


def test_invariant_15_checked_mode_refuses_a_cycle_that_writes_a_shared_page(weights):
    spec = SpecConfig(num_steps=3, topk=1, page_size=4)
    engine = _engine(weights, "eagle", spec, 32)
    scheduler = Scheduler.from_engine(engine, prefix_cache=True, checked=True)
    [prompt] = _conversations(3, 1)
    rid = scheduler.submit(prompt, SamplingParams(max_new_tokens=16))
    scheduler.step()
    [request] = scheduler.running.requests
    L = int(scheduler.running.seq_lens[0])
    # a wrong publish: the page past L, where the next cycle's verify rows and draft scratch go, made shared
    engine.pool.publish(rid, list(request.tokens) + [0] * 8, L + 8)
    with pytest.raises(InvariantViolation, match="invariant 15 .*prefix cache shares"):
        scheduler.step()


def test_prefix_cache_option_needs_a_pool_with_one_and_a_bool(weights):
    spec = SpecConfig(num_steps=2, topk=1, page_size=4)
    plain = _engine(weights, "eagle", spec, 16, prefix_cache=False)
    with pytest.raises(ValueError, match=r"PagedKVPool\(\.\.\., prefix_cache=True\)"):
        Scheduler.from_engine(plain, prefix_cache=True)
    with pytest.raises(ValueError, match="must be True or False"):
        Scheduler.from_engine(_engine(weights, "eagle", spec, 16), prefix_cache="yes")


def test_requests_arriving_together_compute_a_shared_prefix_once(weights):
    spec = SpecConfig(num_steps=2, topk=1, page_size=4)
    engine = _engine(weights, "eagle", spec, 64)
    prompts = _conversations(4, 3)  # an 11-token system prompt, then each its own question
    expected = engine.generate_autoregressive(prompts, 6)
    scheduler = Scheduler.from_engine(engine, prefix_cache=True, checked=True)
    assert [list(r.output) for r in scheduler.generate(prompts, SamplingParams(max_new_tokens=6))] == expected
    # the first prefill computes the system prompt's pages; the other two, admitted a step later, read two of
    # them and copy the third's first two slots
    assert scheduler.stats.prefills == 2 and scheduler.stats.cached_tokens == 2 * 10
