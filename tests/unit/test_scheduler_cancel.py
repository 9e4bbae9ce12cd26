"""`Scheduler.cancel`: a waiting request leaves the queue, a running one leaves the batch between cycles through
the table's Ready ``retire`` row; either finishes once with ``"cancelled"``, its output so far kept, its pages
freed, and the requests around it go on to their autoregressive outputs. A cancel from a streaming callback
(during a step, the captured cycle's too) takes effect when that step ends."""

from __future__ import annotations

import pytest
import torch
from speccycle.core import Ports, SamplingParams, SpecConfig
from speccycle.engine.serving.scheduler import Scheduler
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft

NEW = 16


def _scheduler(speculation="on", num_pages=512, **kwargs):
    config = SpecConfig(num_steps=3, topk=1, page_size=2)
    pool = FingerprintPool(num_pages=num_pages, page_size=2)
    target = HashedNgramTarget(pool, vocab_size=24)
    ports = Ports(target=target, draft=NoisyDraft(target, agreement=0.6), kv_pool=pool)
    seen: list[int] = []
    scheduler = Scheduler(
        ports, config, speculation=speculation, checked=True, on_finish=lambda r: seen.append(r.request_id), **kwargs
    )
    return scheduler, target, pool, seen


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_cancelling_waiting_and_running_requests(speculation):
    scheduler, target, pool, seen = _scheduler(speculation, max_batch_size=2)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 1]]
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    # waiting: it leaves the queue at once, before any step, with no output
    assert scheduler.cancel(ids[2]) is True
    assert scheduler.finished[ids[2]].finish_reason == "cancelled" and scheduler.finished[ids[2]].output == ()
    assert seen == [ids[2]] and ids[2] not in [r.request_id for r in scheduler.waiting]
    scheduler.step()
    scheduler.step()
    running = scheduler.running.requests[1]
    assert running.request_id == ids[1] and len(running.output) >= 2 and pool.pages_held(ids[1]) > 0
    # running: it leaves the batch between cycles, its pages freed, its output so far kept
    assert scheduler.cancel(ids[1]) is True
    cancelled = scheduler.finished[ids[1]]
    assert cancelled.finish_reason == "cancelled" and cancelled.output == running.output
    assert pool.pages_held(ids[1]) == 0 and [r.request_id for r in scheduler.running.requests] == [ids[0]]
    assert scheduler.stats.cancelled == 2
    scheduler.run()  # the last waiting request joins the one left running
    for i in (0, 3):
        assert list(scheduler.finished[ids[i]].output) == target.greedy(prompts[i], NEW)
    assert list(cancelled.output) == target.greedy(prompts[1], NEW)[: len(cancelled.output)]
    assert sorted(seen) == sorted(ids) and len(seen) == len(ids)  # each request finished exactly once
    # a finished id: False, nothing changes; an id never issued or not an int: a clear error
    assert scheduler.cancel(ids[0]) is False and scheduler.cancel(ids[1]) is False
    assert scheduler.finished[ids[0]].finish_reason == "length" and scheduler.stats.cancelled == 2
    with pytest.raises(ValueError, match="never submitted"):
        scheduler.cancel(1000)
    with pytest.raises(ValueError, match="must be an int"):
        scheduler.cancel("0")
    assert pool.num_free_pages == pool.num_pages


def test_a_cancel_from_a_streaming_callback_takes_effect_when_the_step_ends():
    scheduler, target, pool, seen = _scheduler()
    prompts = [[1, 2, 3], [4, 5]]
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    calls = []

    def on_tokens(rid, tokens):
        if rid == ids[0] and not calls:
            calls.append(scheduler.cancel(rid))  # in the step: it waits for the step's end

    scheduler.on_tokens = on_tokens
    finished = scheduler.step()  # the prefill streams the first token; the step's cycle still runs it
    assert calls == [True] and [r.request_id for r in finished] == [ids[0]]
    assert len(finished[0].output) > 1
    assert finished[0].finish_reason == "cancelled" and pool.pages_held(ids[0]) == 0
    assert list(finished[0].output) == target.greedy(prompts[0], NEW)[: len(finished[0].output)]
    scheduler.run()
    assert list(scheduler.finished[ids[1]].output) == target.greedy(prompts[1], NEW)
    assert seen == ids and pool.num_free_pages == pool.num_pages


def test_a_retracted_request_cancelled_in_the_queue_keeps_its_output():
    # a pool too small for both requests through their budgets: the newer one is retracted with its output
    scheduler, target, pool, seen = _scheduler(num_pages=14)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
    while not scheduler.stats.retractions:
        scheduler.step()
    (queued,) = scheduler.waiting
    assert queued.request_id == ids[1] and queued.output and pool.pages_held(ids[1]) == 0
    assert scheduler.cancel(ids[1]) is True
    assert scheduler.finished[ids[1]].output == queued.output and not scheduler.waiting
    scheduler.run()
    assert list(scheduler.finished[ids[0]].output) == target.greedy(prompts[0], NEW)
    assert list(queued.output) == target.greedy(prompts[1], NEW)[: len(queued.output)]
    assert pool.num_free_pages == pool.num_pages


@pytest.fixture(scope="module")
def fused_engine(model_path):
    from speccycle.engine.engine import Engine

    engine = Engine.load(model_path, draft="eagle", spec=SpecConfig(num_steps=4), dtype=torch.float32, fast=True)
    assert engine.fused_cycles is not None
    return engine


@pytest.mark.slow
def test_a_cancel_during_a_captured_cycle_retires_the_request_after_it(fused_engine):
    """The graphed executor's cycle (eagerly on a CPU) streams its commits; a cancel from that callback lands
    after the cycle, through the Ready retire row; the other request keeps its autoregressive output."""
    engine = fused_engine
    prompts = [engine.chat_prompt(m) for m in ("Write a haiku about KV caches.", "Count to five.")]
    ar = [engine.generate_autoregressive([p], 10)[0] for p in prompts]
    free, before = engine.pool.num_free_pages, engine.fused_cycles.run_s
    scheduler = Scheduler.from_engine(engine, checked=True, speculation="on")
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    streamed: dict[int, int] = {}

    def on_tokens(rid, tokens):
        streamed[rid] = streamed.get(rid, 0) + len(tokens)
        if rid == ids[1] and streamed[rid] > 1:  # past the prefill's token: a commit of a captured cycle
            scheduler.cancel(rid)

    scheduler.on_tokens = on_tokens
    scheduler.run()
    assert engine.fused_cycles.run_s > before
    cancelled = scheduler.finished[ids[1]]
    assert cancelled.finish_reason == "cancelled" and 1 < len(cancelled.output) < len(ar[1])
    assert list(cancelled.output) == ar[1][: len(cancelled.output)]
    assert list(scheduler.finished[ids[0]].output) == ar[0]
    assert engine.pool.num_free_pages == free
