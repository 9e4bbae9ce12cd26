"""Adaptive speculation: each cycle runs the draft shape that commits the most tokens per second at its batch size.

A cycle of shape ``c`` (a `SpecConfig` of the scheduler's family: another ``S`` and ``N``, the same ``K``;
``S == 0`` drafts nothing) commits ``tau_c`` tokens per request on average and costs ``t_c(B)`` seconds at
batch size ``B``. Throughput is ``B * tau_c / t_c(B)``, so the cycle runs

    argmax_c  tau_c / t_c(B)

``t_c(B)`` grows with ``B`` faster for deep shapes: a verify of ``B * N`` rows stays as cheap as ``B`` rows only
while the forward is bound by reading the weights, and the draft's levels add their own forwards. Both are
measured on the running machine: `ShapeController` keeps a moving average of each shape's committed tokens
per request (over every batch size, forgetting per request-verify; for a chain, of each draft depth's chance
to be accepted once the one before was, which every chain's cycles tell up to their depth: a shallow shape's
estimate sharpens with every deeper cycle, a deep one's needs only its last depth from its own), and each
shape's time per batch bucket (powers of two, the graphed executor's buckets). A captured cycle's time is the
longer of two medians over the recent cycles there: the shape's replays' time on the device (CUDA events around
them: steady to a percent) and the host's own time per cycle at the bucket, whichever shape ran (a step's wall
time less its waits for commits, from steps that prefilled no request: a prefill costs the same whatever the
shape, and so does a step's host work, while a shape probed for a few cycles would take its reload's time).
Pipelined, the two overlap and the slower sets the pace; a step's wall time alone is not steady (a step that
collects early is short, the next one long). An eager cycle's
time is the least of its recent wall times (noise only adds to an unpipelined wall clock). A pair not measured
yet runs first (twice: the first run of a shape at a
bucket captures its graph, and is not timed); every ``probe_every`` cycles at a bucket the shape measured
longest ago runs ``probe_cycles`` cycles in a row, so the estimates follow the load (while the bucket's
incumbent holds, the gap doubles after each probe, up to `MAX_PROBE_GAP` times ``probe_every``: a probe of a
worse shape costs); the batch moves off the bucket's incumbent shape only for one
that scores ``margin`` higher. A fixed cost model (``cost``) replaces the timings, for tests and for engines
that know theirs.

Every shape is the table's cycle: ``S == 0`` verifies the root alone (a plain decode step) and a forward draft
still extends over the committed token, so a later cycle of a deeper shape finds its state current
(`statemachine.batching.reshape` moves the batch between shapes). Lossless either way: the shape only changes
how many tokens a verify can commit. `ZeroDraft` is the scheduler's draft with speculation off (no draft
forward at all).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence

import attrs
import torch

from ...core.config import SpecConfig


class ZeroDraft:
    """A `LookupDraft` that proposes no node: every verify is the root alone, one row per request."""

    kind = "lookup"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def propose(self, request_ids: Sequence[int], histories, num_steps: int, num_nodes: int, topk: int):
        empty = torch.zeros((len(request_ids), 0), dtype=torch.long)
        return empty, empty.clone()


def no_draft_shape(config: SpecConfig) -> SpecConfig:
    """The shape of ``config``'s family that drafts nothing (``S == 0``, ``N == 1``)."""
    return attrs.evolve(config, num_steps=0, num_draft_tokens=1)


def shape_family(config: SpecConfig, draft_kind: str = "forward") -> tuple[SpecConfig, ...]:
    """The shapes adaptive speculation chooses among for ``config``, deepest first: ``config`` itself, shallower
    ones of its ``K`` (a chain: every ``S`` below; a tree: ``N`` halved down to 2, ``S`` at most ``log2 N + 1``), and
    ``S == 0``. A block draft proposes its whole block or nothing else: its family is ``config`` alone."""
    if draft_kind == "block":
        return (config,)
    shapes = [config]
    if config.is_chain:
        depths = range(config.num_steps - 1, 0, -1)
        shapes += [attrs.evolve(config, num_steps=s, num_draft_tokens=s + 1) for s in depths]
    else:
        n = config.num_draft_tokens // 2
        while n >= 2:
            depth = min(config.num_steps, n - 1, n.bit_length())  # a tree of N nodes rarely accepts deeper
            shapes.append(attrs.evolve(config, num_steps=depth, num_draft_tokens=n))
            n //= 2
    if config.drafts:
        shapes.append(no_draft_shape(config))
    return tuple(dict.fromkeys(shapes))


def _check_fraction(instance, attribute, value) -> None:
    if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"AdaptiveSpeculation.{attribute.name}={value!r} must lie in (0, 1]")


def _check_count(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"AdaptiveSpeculation.{attribute.name}={value!r} must be an int >= 1")


def _check_margin(instance, attribute, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"AdaptiveSpeculation.margin={value!r} must lie in [0, 1)")


def _check_cost(instance, attribute, value) -> None:
    if value is not None and not callable(value):
        raise ValueError(
            f"AdaptiveSpeculation.cost must be None or a function (shape, batch_size) -> seconds, got {value!r}"
        )


def _check_shapes(instance, attribute, value) -> None:
    if value is None:
        return
    if not isinstance(value, tuple) or not value or not all(isinstance(c, SpecConfig) for c in value):
        raise ValueError(f"AdaptiveSpeculation.shapes={value!r} must be None or a non-empty tuple of SpecConfig")
    if len({(c.topk, c.page_size, c.draft_floor) for c in value}) > 1:
        raise ValueError(
            "AdaptiveSpeculation.shapes must share topk (K), page_size (P) and draft_floor: one family of shapes"
        )


@attrs.frozen
class AdaptiveSpeculation:
    """Which draft shape each cycle runs (module docstring).

    * ``shapes``: the menu, one family (the same ``K``, page size and ``draft_floor``); None: `shape_family` of the
      scheduler's config.
    * ``cost(shape, batch_size)``: a fixed cost model, seconds a cycle; None measures the cycles.
    * ``ema_weight``: weight of the newest cycle in the moving average of a shape's committed tokens per
      request (per `TAU_REQUESTS` request-verifies).
    * ``probe_every``: cycles at a batch bucket between two probes (a probe runs the shape measured longest ago)
      while its incumbent is new; each probe that leaves the incumbent in place doubles the gap, up to
      `MAX_PROBE_GAP` times.
    * ``probe_cycles``: cycles a probe runs in a row. A scheduler that pipelines its cycles pays a reload on every
      change of shape, so a probe's first cycle costs more than the shape does; its next ones run pipelined like
      the incumbent's (and a captured cycle's cost reads its replays' device times and the bucket's host time).
    * ``margin``: how much higher another shape must score before the batch moves to it.
    """

    shapes: tuple[SpecConfig, ...] | None = attrs.field(default=None, validator=_check_shapes)
    cost: Callable[[SpecConfig, int], float] | None = attrs.field(default=None, validator=_check_cost)
    ema_weight: float = attrs.field(default=0.3, validator=_check_fraction)
    probe_every: int = attrs.field(default=32, validator=_check_count)
    margin: float = attrs.field(default=0.03, validator=_check_margin)
    probe_cycles: int = attrs.field(default=3, validator=_check_count)


def batch_bucket(batch_size: int) -> int:
    """The power of two a batch pads to (the graphed executor's bucket)."""
    return 1 << (max(1, batch_size) - 1).bit_length()


TIMING_WINDOW = 8  # a shape's cycle time at a bucket: from its last 8 cycles there (`ShapeController.record`)
# ... taken within the controller's last 256 cycles (contexts grow: old times go stale), times the bucket's probe
# backoff (a shape probed every 8 * probe_every cycles keeps the times of its last probes)
TIMING_AGE = 256
# a shape's tau forgets with every TAU_REQUESTS request-verifies as an EMA does with every cycle: a cycle of one
# request (committed counts from 1 to S + 1) moves it as little as 1/TAU_REQUESTS of a cycle of that many
TAU_REQUESTS = 32
MAX_PROBE_GAP = 8  # a bucket whose incumbent holds probes at least every 8 * probe_every cycles


class ShapeController:
    """The running state of an `AdaptiveSpeculation` policy over ``config``'s family: ask `choose`, then `record`."""

    def __init__(self, policy: AdaptiveSpeculation, config: SpecConfig, draft_kind: str = "forward") -> None:
        self.policy = policy
        self.shapes: tuple[SpecConfig, ...] = policy.shapes or shape_family(config, draft_kind)
        # EMA of the committed tokens per request and cycle of each shape (exactly one with no draft)
        self.tau: dict[SpecConfig, float] = {c: 1.0 for c in self.shapes if not c.drafts}
        self.seconds: dict[tuple[int, SpecConfig], float] = {}  # (bucket, shape) -> a cycle's seconds (`record`)
        self._window: dict[tuple[int, SpecConfig], deque] = {}  # recent (cycle, wall or host seconds)
        self._gpu_window: dict[tuple[int, SpecConfig], deque] = {}  # recent (cycle, a replay's device seconds)
        self._host_window: dict[int, deque] = {}  # bucket -> recent (cycle, host seconds) of its timed replays
        self._tau_sums: dict[SpecConfig, tuple[float, float]] = {}  # decayed sums of committed tokens, of verifies
        # a greedy chain's draft depth d -> decayed counts of request-verifies that reached it, that accepted it
        self._depth_sums: dict[int, tuple[float, float]] = {}
        self._chains_ran: set[int] = set()  # depths of the chains that ran
        self.runs: dict[tuple[int, SpecConfig], int] = {}
        self.last: dict[tuple[int, SpecConfig], int] = {}  # (bucket, shape) -> the cycle it last ran in
        self.since_probe: dict[int, int] = {}
        self.probe_gap: dict[int, int] = {}  # bucket -> cycles between its probes (doubles while the incumbent holds)
        self.cycles = 0
        self.switches = 0
        self.current: SpecConfig | None = None  # the shape of the last cycle (explored, probed or chosen)
        self.incumbent: dict[int, SpecConfig] = {}  # bucket -> the shape the last choice by score ran
        self.chosen: dict[SpecConfig, int] = {c: 0 for c in self.shapes}
        self._probing: dict[int, tuple[SpecConfig, int]] = {}  # bucket -> (the probed shape, its cycles left)

    @property
    def reserve_shape(self) -> SpecConfig:
        """The shape that holds the most positions past ``L`` in a cycle (admission reserves for it)."""
        return max(self.shapes, key=lambda c: c.reserve_len())

    def _timed(self, key) -> bool:
        return self.policy.cost is not None or key in self.seconds

    def timed(self, shape: SpecConfig, batch_size: int) -> bool:
        """Whether ``shape`` has a cycle time at ``batch_size``'s bucket (measured, or the fixed cost model's)."""
        return self._timed((batch_bucket(batch_size), shape))

    def _seconds(self, bucket: int, shape: SpecConfig) -> float:
        if self.policy.cost is not None:
            return float(self.policy.cost(shape, bucket))
        return self.seconds[(bucket, shape)]

    def score(self, shape: SpecConfig, bucket: int) -> float:
        """Committed tokens per request and second of ``shape`` at a bucket: ``tau / t``, ``t`` the time a cycle of
        the shape takes there (`record`: the longer of its replays' device time and the bucket's host time per
        cycle, or an eager cycle's wall time)."""
        return self.tau[shape] / max(self._seconds(bucket, shape), 1e-12)

    def best(self, batch_size: int) -> SpecConfig | None:
        """The shape of the highest measured `score` at this batch size (None: nothing measured there yet); the
        bucket's incumbent (the last shape chosen by score there, never one explored or probed) stays unless
        another scores ``margin`` higher (switches cost page moves, not just cycles)."""
        bucket = batch_bucket(batch_size)
        scored = [c for c in self.shapes if c in self.tau and self._timed((bucket, c))]
        if not scored:
            return None
        top = max(scored, key=lambda c: self.score(c, bucket))
        held = self.incumbent.get(bucket)
        if held in scored and self.score(top, bucket) < (1 + self.policy.margin) * self.score(held, bucket):
            top = held
        if top != held:  # a new incumbent: probe at the base rate again
            self.probe_gap[bucket] = self.policy.probe_every
        self.incumbent[bucket] = top
        return top

    def choose(self, batch_size: int) -> SpecConfig:
        """The shape of the next cycle at this batch size."""
        bucket = batch_bucket(batch_size)
        pick = next((c for c in self.shapes if c not in self.tau or not self._timed((bucket, c))), None)
        probing = self._probing.pop(bucket, None)
        if pick is None and probing is not None:  # a probe runs `probe_cycles` cycles in a row
            pick, left = probing
            if left > 1:
                self._probing[bucket] = (pick, left - 1)
        elif pick is None:
            self.since_probe[bucket] = self.since_probe.get(bucket, 0) + 1
            pick = self.best(batch_size)
            gap = self.probe_gap.get(bucket, self.policy.probe_every)
            if self.since_probe[bucket] >= gap and len(self.shapes) > 1:
                self.since_probe[bucket] = 0
                self.probe_gap[bucket] = min(2 * gap, MAX_PROBE_GAP * self.policy.probe_every)
                others = [c for c in self.shapes if c != pick]
                pick = min(others, key=lambda c: self.last.get((bucket, c), -1))
                if self.policy.probe_cycles > 1:
                    self._probing[bucket] = (pick, self.policy.probe_cycles - 1)
        if pick != self.current:
            self.switches += self.current is not None
            self.current = pick
        return pick

    def record(
        self,
        shape: SpecConfig,
        batch_size: int,
        seconds: float,
        committed: Sequence[int],
        timed: bool = True,
        gpu_seconds: float | None = None,
    ) -> None:
        """Fold in one cycle: its shape, batch size, time and each request's committed tokens. ``timed``: False for
        a cycle whose host or wall time is not its shape's cost (it captured a graph, or its step prefilled).

        Without ``gpu_seconds`` (an eager cycle, a CPU), ``seconds`` is the cycle's wall time and its cost the least
        of the bucket's last `TIMING_WINDOW` such times of the shape taken within the last `TIMING_AGE` cycles
        (times the bucket's probe backoff): what a wall clock adds to an unpipelined cycle (a host pause) only adds.
        With ``gpu_seconds`` (a captured replay's device time, from CUDA events), ``seconds`` is the host's own
        time for the cycle (its step less the waits for commits), and the cost is the longer of the shape's median
        device time and the bucket's median host time over the same windows (`_device_costs`): pipelined, the
        host's work and the GPU's overlap and the slower sets the pace. The device's time is steady where a
        pipelined step's wall time is not (a step that collects early is short, the next one long), and it is
        recorded even from a step that prefilled, whose host time is not the shape's.

        A greedy chain of depth ``S`` drafts the first ``S' < S`` tokens a chain of depth ``S'`` would, so its
        committed counts tell every chain's acceptance up to depth ``S`` (`_record_chain`)."""
        key = (batch_bucket(batch_size), shape)
        runs = self.runs.get(key, 0) + 1
        self.runs[key], self.last[key] = runs, self.cycles
        self.cycles += 1
        self.chosen[shape] = self.chosen.get(shape, 0) + 1
        if runs >= 2:  # a shape's first run at a bucket compiles or captures: not its cost
            bucket = key[0]
            age = TIMING_AGE * self.probe_gap.get(bucket, self.policy.probe_every) / self.policy.probe_every
            if gpu_seconds is not None:
                _push(self._gpu_window, key, self.cycles, gpu_seconds)
                if timed:
                    _push(self._host_window, bucket, self.cycles, seconds)
                self._device_costs(bucket, age)
            elif timed and key not in self._gpu_window:  # an eager cycle: its wall time (not mixed with replays')
                window = _push(self._window, key, self.cycles, seconds)
                self.seconds[key] = min(_recent(window, self.cycles, age))
        if not shape.drafts or not committed:
            return
        keep = (1 - self.policy.ema_weight) ** (len(committed) / TAU_REQUESTS)
        if shape.is_chain:
            self._record_chain(shape.num_steps, committed, keep)
            return
        total, count = self._tau_sums.get(shape, (0.0, 0.0))
        total, count = keep * total + sum(committed), keep * count + len(committed)
        self._tau_sums[shape] = (total, count)
        self.tau[shape] = total / count

    def _device_costs(self, bucket: int, age: float) -> None:
        """Every replayed shape's cost at ``bucket``: the longer of its replays' median device time and the bucket's
        median host time per cycle (whichever shapes' steps told it: the host's work of a step is the same
        whatever the shape, and a shape probed for a few cycles would otherwise take its reload's time; the device
        time alone while no step at the bucket has told the host's)."""
        window = self._host_window.get(bucket)  # none yet where every step so far prefilled: the device alone
        host = statistics.median(_recent(window, self.cycles, age)) if window else 0.0
        for shape in self.shapes:
            times = self._gpu_window.get((bucket, shape))
            if times:
                gpu = statistics.median(_recent(times, self.cycles, age))
                self.seconds[(bucket, shape)] = max(gpu, host)

    def _record_chain(self, depth: int, committed: Sequence[int], keep: float) -> None:
        """A greedy chain's verify that commits ``n`` tokens accepted its first ``n - 1`` drafts and rejected the
        next (or drafted no further: ``n == depth + 1``). Per draft depth ``d``, the share of the verifies that
        reached ``d`` and accepted it estimates ``a_d``, the chance to accept ``d`` once ``d - 1`` was; every
        chain of the family then commits ``tau(S) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_S`` a cycle on average.
        A chain of depth ``S`` tells about depths up to ``S`` only (a full acceptance is censored past it): a
        deeper chain's ``tau`` is known once a chain of its depth ran, and every cycle sharpens the shallower."""
        for d in range(1, depth + 1):
            reached, accepted = self._depth_sums.get(d, (0.0, 0.0))
            reached = keep * reached + sum(n >= d for n in committed)
            accepted = keep * accepted + sum(n >= d + 1 for n in committed)
            self._depth_sums[d] = (reached, accepted)
        self._chains_ran.add(depth)
        for c in self.shapes:
            if c.drafts and c.is_chain:
                tau = self._chain_tau(c.num_steps, partial=c.num_steps in self._chains_ran)
                if tau is not None:
                    self.tau[c] = tau

    def _chain_tau(self, depth: int, partial: bool = False) -> float | None:
        """``1 + sum_d prod_{j <= d} a_j`` up to ``depth`` (`_record_chain`). A depth no verify has reached: None
        (the shape is explored first), or with ``partial`` (a chain of this depth ran, and never got that far)
        the sum up to it, a lower bound that follows the shallower depths' estimates."""
        tau = survive = 1.0
        for d in range(1, depth + 1):
            if survive == 0.0:
                break  # no verify got this far: the deeper terms are zero
            reached, accepted = self._depth_sums.get(d, (0.0, 0.0))
            if reached <= 0.0:
                return tau if partial else None
            survive *= accepted / reached
            tau += survive
        return tau


def _push(windows: dict, key, cycle: int, seconds: float) -> deque:
    """Append ``(cycle, seconds)`` to ``key``'s window (the last `TIMING_WINDOW` entries); returns the window."""
    window = windows.setdefault(key, deque(maxlen=TIMING_WINDOW))
    window.append((cycle, seconds))
    return window


def _recent(window, cycle: int, age: float) -> list[float]:
    """The times of a non-empty ``window`` taken within the last ``age`` cycles; none that fresh: its last one."""
    return [t for when, t in window if cycle - when <= age] or [window[-1][1]]
