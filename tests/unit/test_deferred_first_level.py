"""A cycle of S == 0 defers the draft's depth-1 top-K (the table's deferred extend row); the ``first_level`` row
computes it when the batch moves to a shape that drafts (invariant 17).

On a tiny random Llama with random EAGLE heads, float32, CPU: the top-K computed late from the hidden state the
deferred extend left equals the one the full extend computes, bit for bit, for the reference draft and the fast
one; random sequences of shapes (S == 0 followed by deeper shapes among them) through `batching.reshape`, run by
the eager table and by the graphed executor's cycle (eagerly here), give the autoregressive output. On a GPU the
last test captures cycles of S == 0 followed by deeper ones in the scheduler and compares with autoregressive.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from speccycle.core import Admitted, Ports, Request, SamplingParams, SpecConfig
from speccycle.core.ports import defers_first_level
from speccycle.engine.drafters.eagle import EagleConfig, EagleDraft, EagleHead
from speccycle.engine.engine import Engine
from speccycle.engine.fast.path import accelerate
from speccycle.engine.kernels.fused_ops import TorchOps
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel, random_llama_weights
from speccycle.engine.serving.adaptive import no_draft_shape, shape_family
from speccycle.statemachine import run_cycle, step
from speccycle.statemachine.batching import reshape
from speccycle.statemachine.checks import InvariantViolation, check_record
from speccycle.testing.configs import TINY_LLAMA as TINY

TREE = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)
PROMPTS = ((5, 9, 14, 3, 22, 7, 9, 14), (11, 4, 30), (8, 8, 17, 40, 2 + 1, 61))
# EAGLE-1, EAGLE-3 with its own LM head over a draft vocabulary, over the target's LM head, with two layers
HEADS = ((1, None, 1), (3, 40, 1), (3, 0, 1), (3, 40, 2))


@pytest.fixture(scope="module")
def weights():
    return random_llama_weights(TINY, seed=0, scale=0.3)


def _engine(weights, head_kind=(3, 40, 1), fast: bool = False, spec: SpecConfig = TREE, max_rows: int = 64) -> Engine:
    version, vocab, layers = head_kind
    config = EagleConfig.for_target(TINY, version, draft_vocab_size=vocab)
    features = None
    if version == 3:
        features = (1, 2, 3)
        config = attrs.evolve(config, feature_layers=features, num_layers=layers)
    model = LlamaModel(TINY, weights, feature_layers=features)
    head = EagleHead.random(config, seed=version + layers, target_vocab=TINY.vocab_size)
    pool = PagedKVPool(num_pages=96, page_size=spec.page_size)
    engine = Engine(model, pool, lambda e: EagleDraft(head, model, pool), spec)
    if fast:
        accelerate(engine, graphs=False, ops=TorchOps, max_rows=max_rows)
    return engine


def _ports(engine: Engine) -> Ports:
    return Ports(target=engine.target, draft=engine.draft, kv_pool=engine.pool)


def _requests(first_id: int = 0, budget: int = 24) -> tuple[Request, ...]:
    params = SamplingParams(max_new_tokens=budget)
    return tuple(Request(request_id=first_id + i, prompt=p, sampling=params) for i, p in enumerate(PROMPTS))


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
@pytest.mark.parametrize("head_kind", HEADS, ids=lambda h: f"eagle{h[0]}-{h[1]}-{h[2]}")
def test_invariant_17_the_deferred_top_k_equals_the_full_extends(weights, head_kind, fast):
    """The prefill's draft extend in the deep shape (the full extend: LM head and top-K) and in the shape of S == 0
    (the layers alone, the top-K pending), then the ``first_level`` row after a reshape to the deep shape: the same
    hidden state and the same top-K, exactly (float32); the draft's KV the same. The fast draft's graphs take 12 rows
    at most: the 17 prompt rows run in chunks (`ForwardGraphs` of a long prefill), with logits rows and without."""
    results = []
    for config in (TREE, no_draft_shape(TREE)):
        engine = _engine(weights, head_kind, fast, max_rows=12)
        ports = _ports(engine)
        assert defers_first_level(ports)
        compacted = step(Admitted(config=config, requests=_requests()), ports, checked=True)
        ready = step(compacted, ports, checked=True)
        assert ready.topk_pending == (not config.drafts)
        if ready.topk_pending:
            assert ready.topk_p is None and ready.topk_index is None
            ready = step(reshape(ready, TREE, engine.pool), ports, event="first_level", checked=True)
            assert not ready.topk_pending
        table = engine.pool.page_table([r.request_id for r in ready.requests])
        k_cache = engine.draft.kv[0]
        slots = [table[b, p // 4] * 4 + p % 4 for b, prompt in enumerate(PROMPTS) for p in range(len(prompt))]
        results.append((ready.topk_p, ready.topk_index, ready.draft_hidden, k_cache[torch.stack(slots)]))
    (p_full, i_full, h_full, kv_full), (p_late, i_late, h_late, kv_late) = results
    assert torch.equal(h_late, h_full) and torch.equal(kv_late, kv_full)
    assert torch.equal(i_late, i_full) and torch.equal(p_late, p_full)


def test_invariant_17_checked_mode_names_a_stale_or_missing_top_k(weights):
    engine = _engine(weights)
    ports = _ports(engine)
    ready = run_cycle(Admitted(config=no_draft_shape(TREE), requests=_requests()), ports, checked=True)
    assert ready.topk_pending
    with pytest.raises(InvariantViolation, match="invariant 17.*stale"):  # a pending top-K that holds one
        check_record(attrs.evolve(ready, topk_p=torch.zeros(3, 2), topk_index=torch.zeros(3, 2, dtype=torch.long)),
                     ports)  # fmt: skip
    with pytest.raises(InvariantViolation, match="invariant 17.*first_level"):  # a deeper shape without one
        check_record(attrs.evolve(ready, config=TREE, topk_pending=False), ports)
    deep = reshape(ready, TREE, engine.pool)
    with pytest.raises(Exception, match="no row applies to Ready on 'draft'"):  # the draft waits for first_level
        step(deep, ports, event="draft")


def _autoregressive(engine: Engine, budget: int) -> list[list[int]]:
    return [engine.generate_autoregressive([list(p)], budget)[0] for p in PROMPTS]


SHAPES = shape_family(TREE)  # (S3 N6), (S2 N3), (S0 N1): the family's shapes, S == 0 among them


@pytest.mark.parametrize("executor", ["table", "fused"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.lists(st.sampled_from(range(len(SHAPES))), min_size=4, max_size=9))
def test_random_shape_sequences_through_S0_equal_autoregressive(weights, shapes, executor):
    """Every cycle in a drawn shape of the family (a run of S == 0 cycles, then deeper ones, forced in the middle),
    the batch moved between shapes by `batching.reshape` (and the ``first_level`` row where it drafts again), run by
    the eager table or by the graphed executor's cycle (`FusedCycles.step`, eagerly), checked at every boundary:
    every request's output is its autoregressive output; every page goes back."""
    budget = 14
    engine = _engine(weights, fast=executor == "fused")
    ports = _ports(engine)
    want = _autoregressive(engine, budget)
    order = [SHAPES[i] for i in shapes]
    zero = no_draft_shape(TREE)
    order[len(order) // 2 : len(order) // 2] = [zero, zero, TREE]  # S == 0 twice, then the deep shape
    ready = run_cycle(Admitted(config=order[0], requests=_requests(budget=budget)), ports, checked=True)
    done, moves, fused, cycle = {}, 0, 0, 0
    while ready.requests:
        shape = order[cycle % len(order)]
        ready = reshape(ready, shape, engine.pool)
        if ready.topk_pending and shape.drafts:  # as the scheduler does; run_cycle would too
            ready = step(ready, ports, event="first_level", checked=True)
            moves += 1
        if executor == "fused" and engine.fused_cycles.covers(ready, ports):
            ready, _ = engine.fused_cycles.step(ready, checked=True, ports=ports)
            fused += 1
            if any(r.finish_reason for r in ready.requests):
                ready = step(ready, ports, event="retire", checked=True)
        else:
            ready = run_cycle(ready, ports, checked=True)
        done.update({r.request_id: r for r in ready.retired})
        ready = attrs.evolve(ready, retired=())
        cycle += 1
    assert moves >= 1  # S == 0 then a shape that drafts: the deferred top-K was computed late
    assert fused == (cycle if executor == "fused" else 0)  # every cycle the captured one, S == 0 ones included
    assert [list(done[i].output) for i in range(len(PROMPTS))] == want
    assert engine.pool.num_free_pages == engine.pool.num_pages


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: needs a GPU")
@pytest.mark.parametrize("spec", [SpecConfig(num_steps=4, topk=1, page_size=4), TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "pipelined"])
def test_captured_S0_cycles_then_deeper_ones_equal_autoregressive_on_a_gpu(weights, spec, checked):
    """The scheduler's captured cycles under CUDA graphs, driven through S == 0 (the deferred extend captured) and
    back to the deepest shape (the first_level row between) by a cost model that flips with the batch bucket, while
    requests of different budgets leave and waiting ones join; checked at every boundary, or unchecked and
    pipelined: every output is the autoregressive one, every page goes back."""
    from speccycle.engine.serving.adaptive import AdaptiveSpeculation
    from speccycle.engine.serving.scheduler import Scheduler

    config = attrs.evolve(EagleConfig.for_target(TINY, 3, draft_vocab_size=40), feature_layers=(1, 2, 3))
    model = LlamaModel(TINY, weights, device="cuda", feature_layers=(1, 2, 3))
    pool = PagedKVPool(num_pages=512, page_size=spec.page_size, device="cuda")
    head = EagleHead.random(config, seed=4, device="cuda", target_vocab=TINY.vocab_size)
    engine = Engine(model, pool, lambda e: EagleDraft(head, model, pool), spec, fast=True)
    assert engine.fused_cycles is not None and defers_first_level(_ports(engine))
    prompts = [list(PROMPTS[i % 3]) + [3 + i] for i in range(12)]
    budgets = [10 + (i % 4) * 5 for i in range(12)]
    want = [engine.generate_autoregressive([p], n)[0] for p, n in zip(prompts, budgets)]
    family = shape_family(spec)

    def cost(shape, bs):  # the deepest shape wins at buckets 1, 4, 16; S == 0 at 2, 8: the batch moves both ways
        deep = bs.bit_length() % 2 == 1
        return 1.0 + (0.1 if deep == (shape == family[0]) else 5.0) * (shape.num_steps + 1)

    policy = AdaptiveSpeculation(cost=cost, probe_every=3)
    scheduler = Scheduler.from_engine(engine, speculation=policy, checked=checked, max_batch_size=9)
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets)]
    scheduler.run()
    assert [list(scheduler.finished[i].output) for i in ids] == want
    stats = scheduler.stats
    assert stats.plain_cycles > 0 and stats.spec_cycles > 0 and stats.first_levels > 0
    assert stats.fused_cycles == stats.plain_cycles + stats.spec_cycles and engine.fused_cycles.use_graphs
    assert pool.num_free_pages == pool.num_pages
