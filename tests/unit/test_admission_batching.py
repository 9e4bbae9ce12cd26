"""`Scheduler(admit_fraction=..., admit_wait=...)`: while requests run, the waiting ones are admitted together once
an admission would take the fraction of the running batch (as many wait and as many places are free), or once they
have waited ``admit_wait`` steps. Fewer, larger admissions; every request still finishes with its autoregressive
output, nothing is lost and the pool ends empty. With nothing running, or ``admit_fraction=0``, admission is
immediate. The default holds admissions when the scheduler speculates, never when it does not."""

from __future__ import annotations

import pytest
from speccycle.core import Ports, SamplingParams, SpecConfig
from speccycle.engine.serving.scheduler import Scheduler
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft


def _scheduler(**kwargs):
    config = SpecConfig(num_steps=3, topk=1, page_size=2)
    pool = FingerprintPool(num_pages=2048, page_size=2)
    target = HashedNgramTarget(pool, vocab_size=24)
    ports = Ports(target=target, draft=NoisyDraft(target, agreement=0.6), kv_pool=pool)
    return Scheduler(ports, config, checked=True, **kwargs), target, pool


def _closed_loop(scheduler, clients: int, total: int, seed: int = 0):
    """``clients`` clients, each submitting its next request when its last one finishes (lengths vary, so requests
    finish a few at a time); returns the ids with their prompts and budgets, and per request the steps from its
    submission to the step that admitted it."""
    prompts = [[1 + (seed + i * 7 + j) % 23 for j in range(2 + i % 5)] for i in range(total)]
    budgets = [3 + (i * 5) % 11 for i in range(total)]
    submitted, admitted = {}, {}
    order = []

    def submit(step: int):
        i = len(order)
        rid = scheduler.submit(prompts[i], SamplingParams(max_new_tokens=budgets[i]))
        order.append((rid, i))
        submitted[rid] = step

    for _ in range(clients):
        submit(0)
    step = 0
    while not scheduler.idle:
        step += 1
        finished = scheduler.step()
        for request in scheduler.running.requests if scheduler.running else ():
            admitted.setdefault(request.request_id, step)
        for request in finished:
            admitted.setdefault(request.request_id, step)
            if len(order) < total:
                submit(step)
    waits = {rid: admitted[rid] - submitted[rid] for rid in submitted}
    return [(rid, prompts[i], budgets[i]) for rid, i in order], waits


@pytest.mark.parametrize("fraction, wait", [(0.5, 3), (0.25, 0), (1.0, 6)])
def test_batched_admissions_lose_nothing(fraction, wait):
    plain, target, _ = _scheduler(max_batch_size=8, admit_fraction=0)
    done_plain, plain_waits = _closed_loop(plain, clients=8, total=40)
    batched, _, pool = _scheduler(max_batch_size=8, admit_fraction=fraction, admit_wait=wait)
    done, waits = _closed_loop(batched, clients=8, total=40)
    for rid, prompt, budget in done:  # every request finished once, with its autoregressive output
        request = batched.finished[rid]
        assert request.finish_reason == "length" and list(request.output) == target.greedy(prompt, budget)
    assert len(batched.finished) == 40 and pool.num_free_pages == pool.num_pages
    # a request is admitted at the first step after its submission, or after at most `wait` held steps
    assert set(plain_waits.values()) == {1} and max(waits.values()) <= wait + 1, sorted(waits.values())
    if wait == 0:  # nothing is ever held
        assert batched.stats.held_admissions == 0 and batched.stats.prefills == plain.stats.prefills
    else:
        assert batched.stats.held_admissions > 0
        assert batched.stats.prefills < plain.stats.prefills, (batched.stats.prefills, plain.stats.prefills)
        assert max(waits.values()) > 1
    assert len(done_plain) == 40


def test_the_default_batches_admissions_when_speculating_only():
    from speccycle.engine.serving.scheduler import SPECULATIVE_ADMIT_FRACTION

    assert _scheduler()[0].admit_fraction == SPECULATIVE_ADMIT_FRACTION > 0
    assert _scheduler(speculation="adaptive")[0].admit_fraction == SPECULATIVE_ADMIT_FRACTION
    assert _scheduler(speculation="off")[0].admit_fraction == 0


def test_held_requests_are_admitted_after_admit_wait_steps():
    """Half the batch must wait before an admission; a lone waiting request is admitted after ``admit_wait``
    held steps all the same."""
    scheduler, target, pool = _scheduler(max_batch_size=4, admit_fraction=0.5, admit_wait=2)
    long = [scheduler.submit([1, 2, 3 + i], SamplingParams(max_new_tokens=40)) for i in range(3)]
    scheduler.step()  # nothing ran: admitted at once
    assert scheduler.num_running == 3 and not scheduler.waiting
    late = scheduler.submit([5, 6], SamplingParams(max_new_tokens=4))
    held = []
    while late not in [r.request_id for r in (scheduler.running.requests if scheduler.running else ())]:
        scheduler.step()
        held.append(scheduler.stats.held_admissions)
    assert held[-1] == 2 and len(held) == 3  # two steps held (1 < ceil(0.5 * 3) = 2 waiting), then admitted
    scheduler.run()
    assert list(scheduler.finished[late].output) == target.greedy([5, 6], 4)
    for rid, i in zip(long, range(3)):
        assert list(scheduler.finished[rid].output) == target.greedy([1, 2, 3 + i], 40)
    assert pool.num_free_pages == pool.num_pages


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(admit_fraction=1.5), "admit_fraction=1.5 must be None or a number in"),
        (dict(admit_fraction=True), "admit_fraction=True must be None or a number in"),
        (dict(admit_wait=-1), "admit_wait=-1 must be an int >= 0"),
        (dict(admit_wait=2.0), "admit_wait=2.0 must be an int >= 0"),
    ],
)
def test_bad_admission_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _scheduler(**kwargs)


def test_a_deep_queue_is_admitted_in_batches_too():
    """Three clients for every place: a full batch holds nothing (it has no place), so when places free the
    queue is batched as when the batch was under its size, not admitted one place at a time."""
    plain, target, _ = _scheduler(max_batch_size=8, admit_fraction=0)
    _closed_loop(plain, clients=24, total=96)
    batched, _, pool = _scheduler(max_batch_size=8, admit_fraction=0.5, admit_wait=3)
    done, _ = _closed_loop(batched, clients=24, total=96)
    for rid, prompt, budget in done:
        assert list(batched.finished[rid].output) == target.greedy(prompt, budget)
    assert pool.num_free_pages == pool.num_pages
    assert batched.stats.prefills <= 0.75 * plain.stats.prefills, (batched.stats.prefills, plain.stats.prefills)


def test_an_admission_cut_short_leaves_the_rest_due():
    """A due admission that ``max_prefill_tokens`` cuts short admits the rest at the next step, not after another
    ``admit_wait`` held steps; a held request can be cancelled."""
    scheduler, target, pool = _scheduler(max_batch_size=8, admit_fraction=0.5, admit_wait=5, max_prefill_tokens=6)
    for i in range(4):
        scheduler.submit([1, 2, 3 + i], SamplingParams(max_new_tokens=40))
    scheduler.step()
    scheduler.step()  # the four prompts in two prefills of 6 tokens
    assert scheduler.num_running == 4
    a = scheduler.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=4))
    b = scheduler.submit([9, 10, 11, 12], SamplingParams(max_new_tokens=4))
    scheduler.step()  # 2 >= ceil(0.5 * 4) wait: due, but 6 tokens take one of the two
    running = {r.request_id for r in scheduler.running.requests}
    assert a in running and b not in running
    scheduler.step()
    assert b in {r.request_id for r in scheduler.running.requests}
    held = scheduler.submit([13, 14], SamplingParams(max_new_tokens=4))
    scheduler.step()
    assert held not in {r.request_id for r in scheduler.running.requests} and scheduler.stats.held_admissions >= 1
    assert scheduler.cancel(held) and scheduler.finished[held].finish_reason == "cancelled"
    scheduler.run()
    assert list(scheduler.finished[a].output) == target.greedy([5, 6, 7, 8], 4)
    assert list(scheduler.finished[b].output) == target.greedy([9, 10, 11, 12], 4)
    assert pool.num_free_pages == pool.num_pages


class _RecordingDraft(NoisyDraft):
    """`NoisyDraft` that records, per extend, whether its batch is marked a prefill and its rows' least position."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extends: list[tuple[bool, int]] = []

    def extend(self, batch, target_hidden):
        self.extends.append((batch.prefill, int(batch.positions.min())))
        return super().extend(batch, target_hidden)


def test_a_prefills_draft_extend_is_marked_a_prefill():
    """The draft extend over admitted prompts runs as a prefill (`ExtendRows.prefill`: the fast path attends it with
    the prefill kernel), with a request finished at its first token retired before it and a request that does not
    speculate left out of it; a cycle's extend never is."""
    config = SpecConfig(num_steps=3, topk=1, page_size=2)
    pool = FingerprintPool(num_pages=2048, page_size=2)
    target = HashedNgramTarget(pool, vocab_size=24)
    draft = _RecordingDraft(target, agreement=0.6)
    scheduler = Scheduler(Ports(target=target, draft=draft, kv_pool=pool), config, checked=True)
    scheduler.submit([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=1))  # finishes at the prefill: retired first
    scheduler.submit([6, 7, 8], SamplingParams(max_new_tokens=6, speculate=False))
    scheduler.submit([9, 10, 11, 12], SamplingParams(max_new_tokens=6))
    done = scheduler.run()
    assert len(done) == 3 and all(r.finish_reason == "length" for r in done)
    prefills = [marked for marked, first in draft.extends if first == 0]  # prompt rows start at position 0
    cycles = [marked for marked, first in draft.extends if first > 0]
    assert prefills == [True] and cycles and not any(cycles)
