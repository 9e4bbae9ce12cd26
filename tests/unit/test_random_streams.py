"""The sampled cycle's random streams (`statemachine.sampling`): a counter-based generator on the device.

Every draw is keyed by ``(seed, committed count, stream, level)`` and computed with int64 tensor ops, so a CUDA graph
captures it and the eager and static executors draw the same numbers. Held here: the tensor hash equals its host
reference bit for bit (int64 wraps and masked shifts), the uniforms are uniform and inside ``(0, 1)``, distinct
streams are uncorrelated, and a request draws the same numbers whatever batch it is in.
"""

from __future__ import annotations

import random

import torch
from speccycle.core import Request, SamplingParams
from speccycle.statemachine import sampling
from speccycle.testing.stats import chi_square_pvalue

MASK64 = (1 << 64) - 1


def test_the_device_generator_equals_its_host_reference():
    rng = random.Random(0)
    seeds = [0, 1, (1 << 63) - 1, 1 << 62] + [rng.randrange(1 << 63) for _ in range(60)]
    counters = [0, 1, 1 << 40] + [rng.randrange(1 << 20) for _ in range(61)]
    for stream in (sampling.STREAM_FIRST, sampling.STREAM_DRAFT, sampling.STREAM_COINS, sampling.STREAM_FINAL):
        level = rng.randrange(8)
        keys = sampling.stream_keys(torch.tensor(seeds), torch.tensor(counters), stream, level)
        want = [sampling.stream_key(s, c, stream, level) for s, c in zip(seeds, counters)]
        assert [k & MASK64 for k in keys.tolist()] == want
        got = sampling.uniforms_from_keys(keys, 40).tolist()
        assert got == [sampling.key_uniforms(k, 40) for k in want]


def test_the_uniforms_are_uniform_inside_the_open_interval_and_streams_are_independent():
    seeds, counters = torch.arange(8) * 7919 + 3, torch.arange(8) * 13
    coins = sampling.uniforms_from_keys(sampling.stream_keys(seeds, counters, sampling.STREAM_COINS), 20_000)
    drafts = sampling.uniforms_from_keys(sampling.stream_keys(seeds, counters, sampling.STREAM_DRAFT, 1), 20_000)
    for u in (coins, drafts):
        assert bool((u > 0).all()) and bool((u < 1).all())
        counts = torch.bincount((u * 64).long().flatten(), minlength=64)
        assert chi_square_pvalue(counts, torch.full((64,), 1 / 64)) > 1e-5
    # the same request's draft draws and coins: uncorrelated (|r| of 160k pairs below 5 standard errors)
    r = torch.corrcoef(torch.stack([coins.flatten(), drafts.flatten()]))[0, 1]
    assert abs(float(r)) < 5 / coins.numel() ** 0.5
    # the next committed count gives fresh numbers
    later = sampling.uniforms_from_keys(sampling.stream_keys(seeds, counters + 1, sampling.STREAM_COINS), 20_000)
    assert not torch.equal(later, coins)


def test_a_request_draws_the_same_numbers_in_any_batch():
    def request(i, seed, output):
        return Request(i, (1, 2, 3), SamplingParams(temperature=0.7, seed=seed), output=output)

    alone = sampling.sampled_rows([request(0, 99, (4, 5))], "cpu")
    greedy = Request(1, (1, 2), SamplingParams())
    batch = sampling.sampled_rows([greedy, request(2, 5, ()), request(0, 99, (4, 5))], "cpu")
    assert torch.equal(batch.index, torch.tensor([1, 2]))
    for stream, level in ((sampling.STREAM_DRAFT, 2), (sampling.STREAM_FINAL, 0)):
        assert torch.equal(alone.uniforms((3, 50), stream, level)[0], batch.uniforms((3, 50), stream, level)[1])
