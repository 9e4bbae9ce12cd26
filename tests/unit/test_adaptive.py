"""The adaptive-speculation controller: off when tau loses to the measured cost ratio, back on via probes."""

from __future__ import annotations

from speccycle.core import Ports, SamplingParams, SpecConfig
from speccycle.engine.serving.adaptive import AdaptiveSpeculation, SpeculationController
from speccycle.engine.serving.scheduler import Scheduler
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft


def drive(controller: SpeculationController, batch_size: int, tau: float, t_spec: float, t_plain: float, cycles: int):
    """Run ``cycles`` cycles with fixed timings and acceptance; return which of them drafted."""
    kinds = []
    for _ in range(cycles):
        speculative = controller.speculate(batch_size)
        kinds.append(speculative)
        controller.record(speculative, batch_size, t_spec if speculative else t_plain, tau if speculative else None)
    return kinds


def test_measured_threshold_turns_drafting_off_and_probes_turn_it_back_on():
    policy = AdaptiveSpeculation(ema_weight=1.0, probe_every=4, probe_cycles=2)
    controller = SpeculationController(policy)
    # A speculative cycle costs 2x a plain one: tau 1.5 loses, after one plain cycle times the ratio.
    kinds = drive(controller, 8, tau=1.5, t_spec=2.0, t_plain=1.0, cycles=12)
    assert kinds[:2] == [True, False] and not controller.drafting
    assert controller.threshold(8) == 2.0
    assert kinds[2:] == [False] * 4 + [True, True] + [False] * 4  # probes every 4 plain cycles, 2 at a time
    # Acceptance improves: the next probe sees tau 3 > 2 and drafting stays on.
    kinds = drive(controller, 8, tau=3.0, t_spec=2.0, t_plain=1.0, cycles=6)
    assert controller.drafting and kinds[-3:] == [True, True, True]


def test_threshold_depends_on_the_batch_size_bucket():
    controller = SpeculationController(AdaptiveSpeculation(ema_weight=1.0))
    drive(controller, 2, tau=1.6, t_spec=1.2, t_plain=1.0, cycles=3)  # small batch: verify rows are cheap
    assert controller.drafting and abs(controller.threshold(2) - 1.2) < 1e-9
    drive(controller, 64, tau=1.6, t_spec=3.0, t_plain=1.0, cycles=3)  # large batch: 3x the cost
    assert not controller.drafting and controller.threshold(64) == 3.0
    assert controller.threshold(3) == controller.threshold(2)  # same bucket
    assert controller.threshold(1000) == AdaptiveSpeculation().prior_min_tau  # unmeasured: the prior


def test_fixed_threshold_needs_no_timing_and_adaptive_output_is_lossless():
    config = SpecConfig(num_steps=3, topk=1, page_size=1)
    pool = FingerprintPool(num_pages=512)
    target = HashedNgramTarget(pool, vocab_size=24)
    ports = Ports(target=target, draft=NoisyDraft(target, agreement=0.3), kv_pool=pool)
    policy = AdaptiveSpeculation(min_tau=lambda bs: 1.0 + 0.5 * bs, probe_every=3, probe_cycles=1)
    scheduler = Scheduler(ports, config, speculation=policy, checked=True)
    prompts = [[1, 2, 3], [4, 5], [6]]
    results = scheduler.generate(prompts, SamplingParams(max_new_tokens=24))
    assert scheduler.stats.plain_cycles > 0 and scheduler.stats.spec_cycles > 0
    assert scheduler.controller.switches > 0
    for prompt, result in zip(prompts, results):
        assert list(result.output) == target.greedy(prompt, 24)
    assert pool.num_free_pages == pool.num_pages
