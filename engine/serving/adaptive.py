"""Adaptive speculation: draft only while measured acceptance pays for the drafting.

A speculative cycle commits ``tau`` tokens per request on average and costs ``t_spec`` seconds; a
cycle with drafting off commits one token per request and costs ``t_plain``. Drafting pays while

    tau > t_spec / t_plain        (the threshold, a function of the batch size)

The ratio grows with the batch: a verify of ``bs * N`` rows stays as cheap as ``bs`` rows only while
the forward is bound by reading the weights, not by arithmetic. `SpeculationController` keeps an
exponential moving average of ``tau`` (speculative cycles only) and of both cycle times per
batch-size bucket (powers of two), turns drafting off when the average falls below the threshold,
and runs a few speculative *probe* cycles every ``probe_every`` plain cycles to see whether it pays
again. A fixed threshold (``min_tau``) replaces the timings, for tests and for engines that know
their cost model.

A cycle with drafting off is still the table's cycle: its draft is `ZeroDraft`, a lookup draft that
proposes nothing, so the verify is one row per request (a plain decode step) and accept, compact and
retire run as always; a forward draft's extend still runs after it, so its cache stays current for
the probes. Lossless either way: drafting only changes how many tokens a verify can commit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch


class ZeroDraft:
    """A `LookupDraft` that proposes no node: every verify is the root alone, one row per request."""

    kind = "lookup"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def propose(self, request_ids: Sequence[int], histories, num_steps: int, num_nodes: int, topk: int):
        empty = torch.zeros((len(request_ids), 0), dtype=torch.long)
        return empty, empty.clone()


def _check_fraction(instance, attribute, value) -> None:
    if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"AdaptiveSpeculation.{attribute.name}={value!r} must lie in (0, 1]")


def _check_count(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"AdaptiveSpeculation.{attribute.name}={value!r} must be an int >= 1")


def _check_threshold(instance, attribute, value) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"AdaptiveSpeculation.min_tau must be None or a function of the batch size, got {value!r}")


def _check_prior(instance, attribute, value) -> None:
    if not isinstance(value, (int, float)) or not value >= 1.0:
        raise ValueError(f"AdaptiveSpeculation.prior_min_tau={value!r} must be a number >= 1")


@attrs.frozen
class AdaptiveSpeculation:
    """When to draft.

    * ``min_tau``: a fixed threshold ``min_tau(bs)``; None measures it (``t_spec / t_plain``).
    * ``prior_min_tau``: the threshold at a batch size whose two cycle times are not measured yet.
    * ``ema_weight``: weight of the newest cycle in the moving averages.
    * ``probe_every``: plain cycles between two probes; ``probe_cycles``: speculative cycles a probe runs.
    """

    min_tau: Callable[[int], float] | None = attrs.field(default=None, validator=_check_threshold)
    prior_min_tau: float = attrs.field(default=1.3, validator=_check_prior)
    ema_weight: float = attrs.field(default=0.3, validator=_check_fraction)
    probe_every: int = attrs.field(default=16, validator=_check_count)
    probe_cycles: int = attrs.field(default=2, validator=_check_count)


def _bucket(batch_size: int) -> int:
    return max(1, batch_size).bit_length()  # 1, 2-3, 4-7, 8-15, ...


class SpeculationController:
    """The running state of an `AdaptiveSpeculation` policy: ask `speculate`, then `record` the cycle."""

    def __init__(self, policy: AdaptiveSpeculation) -> None:
        self.policy = policy
        self.drafting = True
        self.tau: float | None = None  # EMA of mean accept_len over speculative cycles
        self.seconds: dict[tuple[int, bool], float] = {}  # (bucket, speculative) -> EMA of cycle seconds
        self.plain_run = 0  # plain cycles since drafting was last turned off or probed
        self.probe_left = 0
        self.switches = 0

    def threshold(self, batch_size: int) -> float:
        """The ``tau`` drafting must reach at this batch size to beat a plain decode step."""
        if self.policy.min_tau is not None:
            return float(self.policy.min_tau(batch_size))
        bucket = _bucket(batch_size)
        spec, plain = self.seconds.get((bucket, True)), self.seconds.get((bucket, False))
        if spec is None or plain is None or plain <= 0.0:
            return self.policy.prior_min_tau
        return spec / plain

    def speculate(self, batch_size: int) -> bool:
        """Whether the next cycle drafts."""
        if self.probe_left > 0:
            return True
        if self.drafting:
            # With measured thresholds, time one plain cycle at each batch size drafting runs at.
            bucket = _bucket(batch_size)
            timed = (bucket, True) in self.seconds and (bucket, False) not in self.seconds
            return not (self.policy.min_tau is None and timed)
        if self.plain_run >= self.policy.probe_every:
            self.probe_left = self.policy.probe_cycles
            self.plain_run = 0
            return True
        return False

    def record(self, speculative: bool, batch_size: int, seconds: float, mean_accept_len: float | None) -> None:
        """Fold in one cycle: its kind, batch size, wall time and (speculative) mean ``accept_len``."""
        w = self.policy.ema_weight
        key = (_bucket(batch_size), speculative)
        self.seconds[key] = seconds if key not in self.seconds else (1 - w) * self.seconds[key] + w * seconds
        if speculative and mean_accept_len is not None:
            self.tau = mean_accept_len if self.tau is None else (1 - w) * self.tau + w * mean_accept_len
        if speculative and self.probe_left > 0:
            self.probe_left -= 1
            if self.probe_left > 0:
                return
        elif not speculative and not self.drafting:
            self.plain_run += 1
            return
        pays = self.tau is None or self.tau >= self.threshold(batch_size)
        if pays != self.drafting:
            self.switches += 1
            self.plain_run = 0
        self.drafting = pays
