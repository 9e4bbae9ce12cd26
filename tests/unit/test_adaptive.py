"""Adaptive speculation: the shape of the family with the highest measured tau / t runs at each batch size."""

from __future__ import annotations

import itertools

import attrs
import pytest
from speccycle.core import Admitted, Ports, Request, SamplingParams, SpecConfig
from speccycle.engine.serving.adaptive import AdaptiveSpeculation, ShapeController, batch_bucket, shape_family
from speccycle.engine.serving.scheduler import Scheduler
from speccycle.statemachine import run_cycle
from speccycle.statemachine.batching import reshape
from speccycle.statemachine.checks import InvariantViolation
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft

CHAIN = SpecConfig(num_steps=3, topk=1, page_size=1)


def drive(controller: ShapeController, batch_size: int, tau, seconds, cycles: int) -> list[SpecConfig]:
    """Run ``cycles`` cycles where shape ``c`` commits ``tau(c)`` a request and costs ``seconds(c, bs)``."""
    ran = []
    for _ in range(cycles):
        shape = controller.choose(batch_size)
        ran.append(shape)
        controller.record(shape, batch_size, seconds(shape, batch_size), [tau(shape)])
    return ran


def test_the_family_of_a_chain_and_of_a_tree():
    assert [c.num_steps for c in shape_family(CHAIN)] == [3, 2, 1, 0]
    tree = shape_family(SpecConfig(num_steps=5, topk=4, num_draft_tokens=16))
    assert [(c.num_steps, c.num_draft_tokens) for c in tree] == [(5, 16), (4, 8), (3, 4), (1, 2), (0, 1)]
    assert all(c.topk == 4 for c in tree)
    assert shape_family(CHAIN, "block") == (CHAIN,)


def test_each_shape_is_measured_then_the_fastest_runs_and_probes_follow_the_load():
    controller = ShapeController(AdaptiveSpeculation(ema_weight=1.0, probe_every=5, probe_cycles=1), CHAIN)

    def tau(c):
        return min(c.num_steps + 1, 3)  # the draft's first two tokens are accepted, the third never

    def small(c, bs):
        return 1.0 + 0.05 * c.num_steps  # a small batch: verify rows are nearly free

    ran = drive(controller, 2, tau, small, 8)
    assert ran[:8] == [c for c in controller.shapes for _ in range(2)]  # each shape twice: the first is not timed
    two = controller.shapes[1]  # S2: it commits as much as S3, for less
    assert drive(controller, 2, tau, small, 3) == [two] * 3
    assert controller.tau == {c: min(c.num_steps + 1, 3) for c in controller.shapes}

    def large(c, bs):
        return 1.0 + 1.5 * c.num_steps  # a large batch: every row costs

    ran = drive(controller, 64, tau, large, 12)
    assert ran[:8] == [c for c in controller.shapes for _ in range(2)]  # a new bucket is measured again
    assert set(ran[8:]) == {controller.shapes[-1]}  # no draft: 1 token at cost 1 beats 2 at 2.5, 3 at 4
    ran = drive(controller, 64, tau, large, 15)
    probes = [c for c in ran if c != controller.shapes[-1]]  # the shape measured longest ago, after 5 then 10 cycles
    assert probes == list(controller.shapes[:2]) and controller.probe_gap[64] == 20
    assert batch_bucket(3) == batch_bucket(4) == 4 and batch_bucket(64) == 64


def test_bad_policies_are_refused():
    bads = (dict(ema_weight=0), dict(probe_every=0), dict(probe_cycles=0), dict(cost=3.0))
    bads += (dict(shapes=(CHAIN, SpecConfig(2, 2, 4))),)
    for bad in bads:
        with pytest.raises(ValueError, match="AdaptiveSpeculation"):
            AdaptiveSpeculation(**bad)


def test_a_probe_runs_its_shape_several_cycles_in_a_row():
    """A pipelining scheduler reloads its batch on every change of shape: a probe runs ``probe_cycles`` cycles in
    a row, so its shape is timed on pipelined cycles too, like the incumbent's, then the best shape comes back."""
    controller = ShapeController(AdaptiveSpeculation(probe_every=6, probe_cycles=3), CHAIN)
    tau = {3: 3, 2: 3, 1: 2, 0: 1}
    seconds = {3: 1.2, 2: 1.0, 1: 0.8, 0: 0.5}  # S2 is best
    shapes = drive(controller, 1, lambda c: tau[c.num_steps], lambda c, bs: seconds[c.num_steps], 40)
    ran = [s.num_steps for s in shapes]
    after = ran[8:]  # after each shape ran twice
    runs = [(a, len(list(g))) for a, g in itertools.groupby(after)]
    probes = [(shape, n) for shape, n in runs if shape != 2]
    assert probes and all(n == 3 for _, n in probes)  # each probe: three cycles of its shape in a row
    assert after.count(2) == len(after) - 3 * len(probes)


def test_a_fixed_cost_model_moves_the_batch_between_shapes_losslessly():
    pool = FingerprintPool(num_pages=512)
    target = HashedNgramTarget(pool, vocab_size=24)
    ports = Ports(target=target, draft=NoisyDraft(target, agreement=0.3), kv_pool=pool)
    # a cost that grows with the rows: deep shapes pay at batch 1, the no-draft shape wins at batch 3
    policy = AdaptiveSpeculation(cost=lambda c, bs: 1.0 + 0.4 * bs * c.num_steps, probe_every=3)
    scheduler = Scheduler(ports, CHAIN, speculation=policy, checked=True)
    prompts = [[1, 2, 3], [4, 5], [6]]
    results = scheduler.generate(prompts, SamplingParams(max_new_tokens=24))
    assert scheduler.stats.plain_cycles > 0 and scheduler.stats.spec_cycles > 0
    assert scheduler.controller.switches > 0 and len(scheduler.stats.shapes) >= 2
    for prompt, result in zip(prompts, results):
        assert list(result.output) == target.greedy(prompt, 24)
    assert pool.num_free_pages == pool.num_pages


def test_probes_and_exploration_do_not_hold_the_batch_off_the_best_shape():
    """The margin keeps the bucket's incumbent (the last shape chosen by score), never the shape a probe ran."""
    controller = ShapeController(AdaptiveSpeculation(probe_every=8, probe_cycles=1), CHAIN)
    tau = {3: 3, 2: 3, 1: 2, 0: 1}
    seconds = {3: 1.2, 2: 1.0, 1: 0.69, 0: 0.34}  # scores 2.5, 3.0, 2.90, 2.94: S2 is best by 2%
    ran = [
        s.num_steps for s in drive(controller, 1, lambda c: tau[c.num_steps], lambda c, bs: seconds[c.num_steps], 88)
    ]
    assert ran[8:].count(2) == 77  # every cycle after the exploration but the probes after 8, 16 and 32 more


def test_probes_back_off_while_the_incumbent_holds_and_come_back_when_the_load_changes():
    controller = ShapeController(AdaptiveSpeculation(probe_every=4, probe_cycles=1), CHAIN)
    tau = {3: 3, 2: 3, 1: 2, 0: 1}
    seconds = {3: 1.2, 2: 1.0, 1: 0.8, 0: 0.5}  # S2 is best: 3.0 a second against 2.5, 2.5, 2.0
    ran = drive(controller, 1, lambda c: tau[c.num_steps], lambda c, bs: seconds[c.num_steps], 8 + 200)
    probe_at = [i for i, c in enumerate(ran[8:]) if c.num_steps != 2]
    gaps = [b - a for a, b in zip(probe_at, probe_at[1:])]
    assert gaps[:4] == [8, 16, 32, 32] and max(gaps) == 32  # doubling from 4 up to the cap, 8 * 4
    assert controller.probe_gap[1] == 32
    slower = {3: 1.2, 2: 2.0, 1: 0.8, 0: 0.5}  # the load changes: S2 is now the worst (1.5 a second)
    for _ in range(40):  # its window of times fills with the new ones: S3 (2.5 a second) takes over
        drive(controller, 1, lambda c: tau[c.num_steps], lambda c, bs: slower[c.num_steps], 1)
        if controller.incumbent[1].num_steps != 2:
            break
    assert controller.incumbent[1].num_steps == 3 and controller.probe_gap[1] <= 8  # back to the base rate


def test_a_reshape_to_a_shallower_shape_gives_the_deeper_reservation_back():
    pool = FingerprintPool(num_pages=512, page_size=1)
    target = HashedNgramTarget(pool, vocab_size=24)
    ports = Ports(target=target, draft=NoisyDraft(target, 0.5), kv_pool=pool)
    deep = SpecConfig(num_steps=4, topk=2, num_draft_tokens=8)
    request = Request(request_id=0, prompt=(1, 2, 3), sampling=SamplingParams(max_new_tokens=30))
    ready = run_cycle(run_cycle(Admitted(config=deep, requests=(request,)), ports, checked=True), ports, checked=True)
    shallow = SpecConfig(num_steps=0, topk=2)
    with pytest.raises(InvariantViolation, match="invariant 8"):  # the caller kept the deeper reservation
        run_cycle(reshape(ready, shallow), ports, checked=True)
    ready = run_cycle(Admitted(config=deep, requests=(attrs.evolve(request, request_id=1),)), ports, checked=True)
    ready = run_cycle(ready, ports, checked=True)
    ready = reshape(ready, shallow, pool)
    assert pool.pages_held(1) == int(ready.seq_lens[0]) + shallow.reserve_len()
    run_cycle(ready, ports, checked=True)


def test_the_scheduler_refuses_shapes_of_another_family():
    pool = FingerprintPool(num_pages=512, page_size=4)
    target = HashedNgramTarget(pool, vocab_size=24)
    ports = Ports(target=target, draft=NoisyDraft(target, 0.5), kv_pool=pool)
    config = SpecConfig(num_steps=3, page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        Scheduler(ports, config, speculation=AdaptiveSpeculation(shapes=(SpecConfig(3), SpecConfig(0))))


def test_a_chains_acceptance_per_depth_gives_every_chains_tau():
    """Counts 1..S + 1 of a depth-S chain estimate each depth's acceptance; shallower chains follow from them, a
    deeper one only once a chain of its depth ran."""
    controller = ShapeController(AdaptiveSpeculation(ema_weight=1.0), CHAIN)
    s3, s2, s1 = controller.shapes[:3]
    controller.record(s2, 4, 1.0, [1, 2, 3, 3])  # depth 1: 4 reached, 3 accepted; depth 2: 3 reached, 2 accepted
    a1, a2 = 3 / 4, 2 / 3
    assert controller.tau[s1] == pytest.approx(1 + a1)
    assert controller.tau[s2] == pytest.approx(1 + a1 + a1 * a2) == pytest.approx((1 + 2 + 3 + 3) / 4)
    assert s3 not in controller.tau  # depth 3 never reached: unknown, explored first
    assert controller.choose(4) == s3
    controller.record(s3, 4, 1.0, [4, 4, 1, 2])  # the same requests' window: decayed fully (ema_weight 1)
    assert controller.tau[s3] == pytest.approx(1 + 3 / 4 + 3 / 4 * 2 / 3 + 3 / 4 * 2 / 3 * 2 / 2)
    assert controller.tau[s3] == pytest.approx((4 + 4 + 1 + 2) / 4)


def test_no_draft_gets_to_zero_acceptance_past_a_depth_nobody_accepts():
    controller = ShapeController(AdaptiveSpeculation(ema_weight=1.0), CHAIN)
    controller.record(controller.shapes[2], 2, 1.0, [1, 1])  # S1 rejected every time: deeper chains add nothing
    assert [controller.tau.get(c) for c in controller.shapes] == [1.0, 1.0, 1.0, 1.0]


def test_warm_up_runs_every_shape_at_every_bucket_and_leaves_the_scheduler_as_it_was():
    pool = FingerprintPool(num_pages=400, page_size=1)
    target = HashedNgramTarget(pool, vocab_size=24)
    ports = Ports(target=target, draft=NoisyDraft(target, agreement=0.3), kv_pool=pool)
    scheduler = Scheduler(ports, CHAIN, speculation="adaptive", max_batch_size=3)
    ran = []
    original = Scheduler.run

    def run(self):
        done = original(self)
        ran.append((self.config, len(done), self.stats.spec_cycles + self.stats.plain_cycles))
        return done

    Scheduler.run = run
    try:
        assert scheduler.warm_up() == 0  # no graphed executor: nothing captured
    finally:
        Scheduler.run = original
    assert [(c, n) for c, n, _ in ran] == [(c, n) for c in scheduler.controller.shapes for n in (1, 2, 3)]
    assert all(cycles >= 4 for _, _, cycles in ran)
    assert scheduler.stats.steps == 0 and scheduler.controller.cycles == 0 and not scheduler.finished
    assert pool.num_free_pages == 400
    assert [len(r.output) for r in scheduler.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5))] == [5]
    scheduler.submit([1, 2])
    with pytest.raises(ValueError, match="idle scheduler"):
        scheduler.warm_up()
    with pytest.raises(ValueError, match="batch_sizes"):
        Scheduler(ports, CHAIN, speculation="on").warm_up([0])


def test_a_step_that_prefilled_times_only_a_shape_without_a_time():
    """An admission's prefill costs the same whatever the shape: its step's time goes to the controller only for a
    shape that has no time at the bucket yet."""
    pool = FingerprintPool(num_pages=512, page_size=1)
    target = HashedNgramTarget(pool, vocab_size=24)
    ports = Ports(target=target, draft=NoisyDraft(target, agreement=0.6), kv_pool=pool)
    controller = ShapeController(AdaptiveSpeculation(), CHAIN)
    scheduler = Scheduler(ports, CHAIN, speculation=controller, max_batch_size=4)
    seen, original = [], controller.record

    def record(shape, batch_size, seconds, committed, timed=True, gpu_seconds=None):
        seen.append((timed, controller.timed(shape, batch_size), scheduler.stats.prefills))
        original(shape, batch_size, seconds, committed, timed, gpu_seconds)

    controller.record = record
    steps = []  # (whether the step prefilled, its records)
    for i in range(40):
        if i % 3 == 0:
            scheduler.submit([1 + i % 7, 2, 3], SamplingParams(max_new_tokens=6))
        before, count = scheduler.stats.prefills, len(seen)
        scheduler.step()
        steps.append((scheduler.stats.prefills > before, seen[count:]))
    scheduler.run()
    prefilled = [r for admitted, records in steps if admitted for r in records]
    assert prefilled and all(not timed or not had for timed, had, _ in prefilled)
    assert any(timed for admitted, records in steps if not admitted for timed, _, _ in records)


def test_a_backed_off_probe_keeps_the_times_of_the_probes_before_it():
    """Probes every 8 * probe_every cycles: a probe's one slow cycle (a reload, a host pause) does not become its
    shape's time while the earlier probes' times are within the backed-off age."""
    controller = ShapeController(AdaptiveSpeculation(probe_every=32), CHAIN)
    s3, s0 = controller.shapes[0], controller.shapes[-1]
    for _ in range(2):
        controller.record(s3, 1, 1.0, [4])
    controller.probe_gap[1] = 8 * 32  # backed off to the cap
    for _ in range(300):  # more than TIMING_AGE cycles of the incumbent
        controller.record(s0, 1, 0.5, [1])
    controller.record(s3, 1, 5.0, [4])
    assert controller.seconds[(1, s3)] == 1.0
    controller.probe_gap[1] = 32  # no backoff: the old time has aged out
    controller.record(s3, 1, 6.0, [4])
    assert controller.seconds[(1, s3)] == 5.0


def test_a_chain_that_ran_short_of_a_depth_follows_the_shallower_estimates():
    """A chain whose verifies never reached its last depth has the sum up to there (a lower bound) and keeps
    following the shallower depths, neither stale nor explored without end."""
    controller = ShapeController(AdaptiveSpeculation(ema_weight=1.0), CHAIN)
    s3, s2 = controller.shapes[:2]
    controller.record(s3, 1, 1.0, [2])  # depth 2 rejected: depth 3 never reached
    assert controller.tau[s3] == pytest.approx(2.0)
    for _ in range(50):
        controller.record(s2, 1, 1.0, [3])  # S2 now accepts both of its drafts every time
    assert controller.tau[s2] == pytest.approx(3.0) and controller.tau[s3] == pytest.approx(3.0)
    menu = ShapeController(AdaptiveSpeculation(shapes=(s3, controller.shapes[2])), CHAIN)
    menu.record(controller.shapes[2], 1, 1.0, [2])
    menu.record(s3, 1, 1.0, [1])  # S3 rejected its first draft: no deeper depth reached, still a tau
    assert s3 in menu.tau


def test_warm_up_fills_each_bucket_and_a_failed_one_leaves_nothing_behind(monkeypatch):
    pool = FingerprintPool(num_pages=1000, page_size=1)
    target = HashedNgramTarget(pool, vocab_size=24)
    ports = Ports(target=target, draft=NoisyDraft(target, agreement=0.9), kv_pool=pool)
    scheduler = Scheduler(ports, CHAIN, speculation="on", max_batch_size=16, max_prefill_tokens=8)
    widest, original_step = [], Scheduler.step

    def step(self):
        done = original_step(self)
        widest.append(self.num_running)
        return done

    monkeypatch.setattr(Scheduler, "step", step)
    scheduler.warm_up([16], prompt_len=16)  # one request a prefill: the first would finish before the 16th joins
    assert max(widest) == 16 and scheduler.max_prefill_tokens == 8
    calls, original_cycle = [], Scheduler._cycle

    def failing(self, finished):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a device fault")
        return original_cycle(self, finished)

    monkeypatch.setattr(Scheduler, "_cycle", failing)
    stats = scheduler.stats
    with pytest.raises(RuntimeError, match="a device fault"):
        scheduler.warm_up([2, 4])
    assert scheduler.idle and not scheduler.finished and scheduler.stats is stats
    assert pool.num_free_pages == 1000 and not scheduler._arrival
    monkeypatch.setattr(Scheduler, "_cycle", original_cycle)
    assert [len(r.output) for r in scheduler.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5))] == [5]
    with pytest.raises(ValueError, match="batch_sizes"):
        scheduler.warm_up(b for b in (1, 0))


def test_a_long_running_scheduler_keeps_nothing_of_a_finished_request_but_its_result():
    """Arrival order and streamed counts go with the request (a server runs millions); retraction still takes the
    newest arrival."""
    pool = FingerprintPool(num_pages=40, page_size=1)
    target = HashedNgramTarget(pool, vocab_size=24)
    ports = Ports(target=target, draft=NoisyDraft(target, agreement=0.5), kv_pool=pool)
    scheduler = Scheduler(ports, CHAIN, speculation="on", max_batch_size=8)
    for _ in range(3):
        ids = [scheduler.submit([1 + i, 2, 3, 4], SamplingParams(max_new_tokens=9)) for i in range(4)]
        scheduler.run()
        assert all(scheduler.finished[i].finish_reason == "length" for i in ids)
        assert not scheduler._arrival and not scheduler._sent
    assert scheduler.stats.retractions > 0  # a pool of 40 slots for four requests of 13 tokens and a reservation
    assert pool.num_free_pages == 40


def test_a_captured_cycle_costs_the_longer_of_its_device_and_host_medians():
    """With a replay's device time, a cycle's cost is max(median of the device times, median of the host times):
    a pipelined step's alternating host times (one short, the next long) move no estimate, and a step that
    prefilled still tells the device's time while its host time stays out."""
    controller = ShapeController(AdaptiveSpeculation(), CHAIN)
    s3 = controller.shapes[0]
    controller.record(s3, 64, 9.0, [4], gpu_seconds=9.0)  # the first run captures: not timed
    assert (64, s3) not in controller.seconds
    for host in (0.5, 1.5, 0.5, 1.5, 0.5):
        controller.record(s3, 64, host, [4], gpu_seconds=2.0)
    assert controller.seconds[(64, s3)] == 2.0  # GPU-bound: the device sets the pace
    for _ in range(8):
        controller.record(s3, 64, 1.0, [4], timed=False, gpu_seconds=3.0)  # steps that prefilled
    assert controller.seconds[(64, s3)] == 3.0
    for _ in range(8):
        controller.record(s3, 64, 4.0, [4], gpu_seconds=3.0)  # host-bound
    assert controller.seconds[(64, s3)] == 4.0


def test_device_times_rank_shapes_that_wall_times_would_misrank():
    """Shapes of the same device time per committed token, the host's time per step the same for all: the deepest
    spreads the host's time over the most tokens and wins (S2's cycle is host-bound, S3's is not), whatever the
    jitter of the steps' host times."""
    controller = ShapeController(AdaptiveSpeculation(ema_weight=1.0, probe_every=4, probe_cycles=1), CHAIN)
    jitter = itertools.cycle([0.2, 1.8, 0.4, 1.6, 1.0])
    for _ in range(200):
        shape = controller.choose(64)
        tau = 1 + shape.num_steps  # every draft accepted: tau = S + 1
        gpu = 0.6 * tau  # the device's time per committed token is flat across shapes
        controller.record(shape, 64, 2.0 * next(jitter), [tau], gpu_seconds=gpu)
    assert controller.best(64) == controller.shapes[0]  # S = 3


def test_the_host_time_is_the_buckets_whichever_shape_ran():
    """A bucket's host time per cycle is pooled over its shapes: a shape probed for a few cycles (its first one a
    reload, slower on the host) costs its own device time against the bucket's host time, not its reload's."""
    controller = ShapeController(AdaptiveSpeculation(), CHAIN)
    s3, s0 = controller.shapes[0], controller.shapes[-1]
    for _ in range(9):
        controller.record(s3, 64, 1.0, [4], gpu_seconds=2.0)
    for host in (9.0, 9.0, 1.0):  # the probe: a capture, then a reload, then a pipelined cycle
        controller.record(s0, 64, host, [1], gpu_seconds=0.5)
    assert controller.seconds[(64, s0)] == 1.0 and controller.seconds[(64, s3)] == 2.0
