"""`bench.forced.ForcedAcceptance`: the scale benchmark's forced acceptance, on both greedy verifies.

The host plane verifies a chain (K == 1) with `verify_greedy_chain` and a tree with `verify_greedy`; a wrapper
that forces only one of them leaves the other's rows unforced (tau 1.0 on random weights), which is what the
scale records' host-plane chain rows showed until dbb4567.
"""

import math

import torch
from speccycle.backends.torch.ops import TorchBackend
from speccycle.bench.forced import ForcedAcceptance
from speccycle.bench.forced import beatty as fused_schedule


def beatty(tau: float, cycles: int, cap: int) -> list[int]:
    return [max(1, min(cap, math.floor(i * tau) - math.floor((i - 1) * tau))) for i in range(1, cycles + 1)]


def chain(bs: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (bs, n), generator=gen)
    predict = torch.randint(50, 100, (bs, n), generator=gen)  # never equal to a draft token: nothing accepted
    parents = torch.arange(-1, n - 1).expand(bs, n).contiguous()
    return tokens, predict, parents


def test_the_chain_verify_accepts_the_forced_counts_and_agrees_with_the_tree_walk():
    bs, n, tau = 3, 5, 2.7
    want = beatty(tau, 12, n)
    by_chain, by_tree = ForcedAcceptance(TorchBackend(), tau), ForcedAcceptance(TorchBackend(), tau)
    for cycle in range(12):
        tokens, predict, parents = chain(bs, n, cycle)
        index_c, len_c = by_chain.verify_greedy_chain(tokens, predict, n)
        index_t, len_t = by_tree.verify_greedy(tokens, parents, predict, n)
        assert len_c.tolist() == [want[cycle]] * bs
        assert torch.equal(len_c, len_t) and torch.equal(index_c, index_t)
    assert abs(sum(want) / len(want) - tau) < 0.1  # the schedule averages tau


def test_unforced_random_drafts_accept_only_the_bonus_token():
    tokens, predict, _ = chain(2, 5, 0)
    _, accept_len = TorchBackend().verify_greedy_chain(tokens, predict, 5)
    assert accept_len.tolist() == [1, 1]  # the wrapper, not the data, makes the acceptance


def test_the_fused_cycles_force_the_same_lengths():
    """`ForcedFusedCycles` takes its accept lengths from a buffer filled once (`bench.forced.beatty`), the host
    plane's wrapper one cycle at a time: the two schedules agree, clamped to the accept width alike."""
    for tau, cap in ((2.7, 5), (3.98, 6), (1.0, 4), (4.5, 3), (0.5, 5)):
        assert fused_schedule(tau, 40, cap).tolist() == beatty(tau, 40, cap)
