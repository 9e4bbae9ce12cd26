"""Forced acceptance for the benchmarks: the cost of speculation at a chosen tau, on random weights.

At the Llama-3-8B shape with random weights a draft is almost never accepted, so the scale benchmarks
(`gpu_bench`'s ``scale`` part, `scale_profile`, `fused_forced_check`) force it: the verify's greedy walk accepts
exactly ``a`` rows a cycle, ``a`` following the Beatty sequence ``floor(i tau) - floor((i - 1) tau)`` (mean
``tau``, clamped to ``[1, accept_width]``). Every forward, the draft's included, runs for real; only the
acceptance decision is forced (what SGLang's simulated acceptance does), so the committed tokens are the target's
predictions along each tree's first-child path, not its greedy output.

Two ways, one per control plane:

* `ForcedFusedCycles`: `engine.fast.fused_cycle.FusedCycles` with its walk's predictions replaced inside the cycle's
  graph (`FusedCycles._walk`), by `forced_walk`; `force_fused_acceptance` puts it on an engine.
* `ForcedAcceptance`: a backend wrapper for the host and device planes' greedy verifies;
  `force_plane_acceptance` wraps the backend of each `generate` call.
"""

from __future__ import annotations

import math

import torch
from speccycle.engine.fast.fused_cycle import FusedCycles


def beatty(tau: float, count: int, cap: int) -> torch.Tensor:
    """The accept lengths of cycles ``1 .. count``: ``floor(i tau) - floor((i - 1) tau)``, clamped to ``[1, cap]``."""
    k = torch.arange(1, count + 1, dtype=torch.float64)
    return (torch.floor(k * tau) - torch.floor((k - 1) * tau)).long().clamp(1, cap)


def forced_walk(tokens: torch.Tensor, parents: torch.Tensor | None, accept: torch.Tensor, steps: int) -> torch.Tensor:
    """Target predictions that make the greedy walk accept exactly ``accept`` rows.

    ``tokens [B, N]`` the verify's rows, ``parents [B, N]`` a tree's (None: a chain, row ``i``'s parent is
    ``i - 1``), ``accept [1]`` the rows to accept (the bonus row included), ``steps`` the walk's longest run
    (``accept_width - 1``). The path is each tree's first-child path from the root: row ``r`` on it predicts
    its first child's token while fewer than ``accept`` rows are taken, every other row predicts -1 (no
    token), so the walk stops there or at a leaf. A few whole-tensor ops (about 4 + ``steps`` kernels for a
    tree, 3 for a chain) instead of a loop of 7 small ops a step, whose ~70 kernels the real verify's walk
    does not have: at the 8B shape on an H100 the verify phase's small torch kernels went from 117 to 46 µs
    a 32-node tree cycle (`bench.scale_profile`, bench/results/scale_profile-H100-20261126-155a47a/).
    """
    B, N = tokens.shape
    offs = torch.arange(N, device=tokens.device)
    if parents is None:  # the first-child path is rows 0, 1, ..., N - 1: row i predicts row i + 1's token
        return torch.where(offs + 1 < accept, tokens.roll(-1, 1), -1)
    # first child of each row (N: a leaf), and a sentinel column N whose child is itself and whose token is -1
    first = torch.where(parents[:, None, :] == offs[None, :, None], offs, N).amin(-1)
    first = torch.nn.functional.pad(first, (0, 1), value=N)
    tok = torch.nn.functional.pad(tokens, (0, 1), value=-1)
    path = [torch.zeros((B, 1), dtype=torch.long, device=tokens.device)]
    for _ in range(steps):
        path.append(first.gather(1, path[-1]))  # past a leaf: the sentinel
    path = torch.cat(path, 1)  # [B, steps + 1]
    take = offs[:steps] + 1 < accept
    walk = torch.full_like(tok, -1)
    walk.scatter_(1, path[:, :-1], torch.where(take, tok.gather(1, path[:, 1:]), -1))  # the sentinel: only -1s
    return walk[:, :N]


class ForcedFusedCycles(FusedCycles):
    """`FusedCycles` whose greedy walk accepts exactly ``a`` rows a cycle, ``a`` the Beatty sequence of ``tau``.

    The walk follows each tree's first-child path for ``a`` rows whatever the target predicted (`forced_walk`,
    inside the cycle's graph); the cycle's accept lengths sit in a static buffer per batch size, indexed by the
    cycle counter the graph holds. A scheduler reloads its batch (the counter back to 0) whenever it changes, so
    under a scheduler only an integer ``tau`` is forced exactly (each reload starts the sequence again).
    """

    def __init__(self, target, draft, pool, spec, options, tau: float) -> None:
        super().__init__(target, draft, pool, spec, options)
        self.tau = tau
        self._accepts: dict[int, torch.Tensor] = {}  # batch size -> [cycles + 1] forced accept lengths

    def _batch(self, batch: int, *shape, **kwargs):
        bt = super()._batch(batch, *shape, **kwargs)
        if batch not in self._accepts:
            lens = beatty(self.tau, bt.buffers.hist.shape[0], self.spec.accept_width)
            self._accepts[batch] = lens.to(self.device)
        return bt

    def _walk(self, drafted, tokens: torch.Tensor, parents: torch.Tensor | None,
              predict: torch.Tensor) -> torch.Tensor:  # fmt: skip
        width = drafted.config.accept_width  # the cycle's shape (a scheduler's batch moves between shapes)
        if width == 1:  # no draft: the root's own prediction, a real decode step
            return predict
        accept = self._accepts[drafted.tree.tokens.shape[0]].index_select(0, drafted.log.cycle)  # [1] (buffer rows)
        return forced_walk(tokens, parents, accept.clamp(max=width), width - 1)


def force_fused_acceptance(engine, tau: float) -> ForcedFusedCycles:
    """Replace the engine's fused cycles (`fast.path.accelerate` builds them for a fast EAGLE draft) with
    `ForcedFusedCycles` over the same target, draft, pool, config and options; returns them."""
    fused = engine.fused_cycles
    if fused is None:
        raise ValueError("the engine runs no fused cycles (the fast path with a greedy EAGLE draft builds them)")
    forced = ForcedFusedCycles(fused.target, fused.draft, fused.pool, fused.spec, fused.options, tau)
    forced.kernels = fused.kernels
    engine.fused_cycles = forced
    return forced


class ForcedAcceptance:
    """A backend whose greedy verify accepts exactly ``a`` rows per request, ``a`` averaging ``tau`` (`beatty`).

    Everything else is the wrapped backend's.
    """

    def __init__(self, base, tau: float) -> None:
        self.base, self.tau, self.cycles = base, tau, 0

    def __getattr__(self, name):
        return getattr(self.base, name)

    def _next_accept(self, accept_width: int) -> int:
        self.cycles += 1
        accept = math.floor(self.cycles * self.tau) - math.floor((self.cycles - 1) * self.tau)
        return max(1, min(accept, accept_width))

    def verify_greedy(self, tokens, parents, predict, accept_width):
        from speccycle.core.tree import retrieve_links

        accept = self._next_accept(accept_width)
        first_child, _ = retrieve_links(parents)
        forced = torch.full_like(predict, -1)
        row = torch.zeros((tokens.shape[0], 1), dtype=torch.long, device=tokens.device)
        for _ in range(accept - 1):
            child = first_child.gather(1, row).clamp(min=0)
            forced.scatter_(1, row, tokens.gather(1, child))
            row = child
        return self.base.verify_greedy(tokens, parents, forced, accept_width)

    def verify_greedy_chain(self, tokens, predict, accept_width):
        # the chain's verify (K == 1; row i's parent is row i - 1): until dbb4567 it was not wrapped, so the
        # host plane's chain of 4 ran unforced (measured tau 1.0 on random weights) in every scale record
        accept = self._next_accept(accept_width)
        forced = torch.full_like(predict, -1)
        forced[:, : accept - 1] = tokens[:, 1:accept]
        return self.base.verify_greedy_chain(tokens, forced, accept_width)


def force_plane_acceptance(engine, tau: float) -> list[str]:
    """Wrap the backend of each `generate` call in `ForcedAcceptance` (fresh per call), on whichever control
    plane the engine picks for it (`Engine._cycle_ports`: host or device). Returns the planes' backends' names."""
    pick = engine._cycle_ports
    planes: list[str] = []

    def cycle_ports(sampling):
        ports, backend = pick(sampling)
        planes.append(type(backend).__name__)
        return ports, ForcedAcceptance(backend, tau)

    engine._cycle_ports = cycle_ports
    return planes
