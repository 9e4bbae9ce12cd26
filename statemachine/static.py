"""The static executor: the table's rows over records at stable addresses, one cycle a call.

`runner.step` runs a row's ``run`` on fresh tensors; this executor runs the same rows, chosen the same way
(`runner.select`: the record's type and the guards), through their static forms (`Transition.static`), and a
declared fusion's form in place of the rows it covers where the fusion covers the record (`Fusion.covers`).
The forms write into `static_rows.CycleBuffers`, so a cycle from set ``p`` leaves its records in set ``1 - p``
at the same addresses every time: the graphed executor (`engine.fast.fused_cycle`) captures `StaticExecutor.cycle`
once per parity and replays it, and on a CPU it runs eagerly (tests).

A row's static form may declare a host step (`Transition.host`: a lookup draft's proposals, read from the
requests' token histories): `prepare` runs it on the host before the cycle, writing into the buffers what the
form then reads, so the captured cycle stays static and the host step is a declared part of the row.

Each call returns the boundaries it crossed (the row or fusion that ran, its source and result records): the
rows a capture recorded are what a test holds equal to the table's rows for the config (`expand`), and in
checked mode `check` validates every boundary after the cycle ran (after each replay, for a captured one:
the records' tensors hold that replay's values).

A static record's ``requests`` are the host's view as of the cycle's start: commits go to the records'
`OutputLog` on the device, and a request finishes there (``done``). The loop reads the done flags (one cycle
behind the GPU for a graphed run) and, once it stops, `materialize` turns the log into the requests' outputs
and finish reasons, so the table's ``retire`` row frees their pages as in any run.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ..core.ports import static_forwards
from ..core.records import Compacted, ExtendRows, Ready, RowOutputs
from . import checks
from .runner import select
from .static_rows import CycleBuffers, StaticContext, StaticOps
from .table import FUSIONS, Fusion, Transition


class NotStatic(RuntimeError):
    """The record or ports need a row that has no static form (the eager executor serves them)."""


@attrs.frozen(eq=False)
class Boundary:
    """One step of a static cycle: the row or fusion that ran, its source and result records, and for a fusion
    that takes over a verify the verify's row outputs and the predictions its walk followed."""

    step: Transition | Fusion
    source: object
    result: object
    rows: RowOutputs | None = None
    walk: torch.Tensor | None = None


def expand(steps: Sequence[Transition | Fusion]) -> tuple[Transition, ...]:
    """The table rows a sequence of steps stands for: a fusion stands for its rows."""
    rows: list[Transition] = []
    for s in steps:
        rows.extend(s.rows if isinstance(s, Fusion) else (s,))
    return tuple(rows)


class StaticExecutor:
    """Runs the table's cycle over `CycleBuffers` (module docstring). ``kernels``: the bookkeeping ops as the
    kernels of `backends.cuda.cycle` (False: their torch twins); ``walk(drafted, tokens, parents, predict)``: the
    predictions a fused greedy walk follows (None: the target's own; benchmarks force acceptance with it)."""

    def __init__(self, ports, backend, *, kernels: bool = True, walk=None) -> None:
        forwards = static_forwards(ports)
        if forwards is None:
            raise NotStatic("the ports declare no static forwards (core.ports.StaticForwards): run them eagerly")
        self.ports, self.backend, self.forwards, self.walk = ports, backend, forwards, walk
        self.ops = StaticOps.of(kernels)

    def covers(self, record) -> bool:
        """Whether every fusion a static cycle needs covers ``record`` (today: `static_rows.static_covers`)."""
        return all(f.covers(record, self.ports) for f in FUSIONS if f.static is not None)

    def host_steps(self, ready: Ready) -> bool:
        """Whether a cycle from ``ready`` starts with a row that declares a host step (`Transition.host`: a lookup
        draft's proposals): then `prepare` must run before each cycle, and a loop of cycles with no host between
        them (`engine.fast.fused_cycle.FusedCycles.run`'s) cannot serve it."""
        host = select(ready, self.ports).host
        return host is not None and host.needed(ready)

    def prepare(self, ready: Ready, buffers: CycleBuffers) -> None:
        """The host step of the row a cycle from ``ready`` starts with (`Transition.host`), if it declares one: run
        on the host before the cycle (before a captured cycle's replay), writing into ``buffers`` what the row's
        static form reads. ``ready``: the record over the set the cycle reads, its requests the host's view."""
        host = select(ready, self.ports).host
        if host is not None and host.needed(ready):
            host.run(ready, self.ports, buffers)

    def cycle(
        self, ready: Ready, buffers: CycleBuffers, into: int, kv_bound: int
    ) -> tuple[Ready, tuple[Boundary, ...]]:
        """One cycle from ``ready`` (a record over set ``1 - into``) to the next `Ready` record (over set ``into``).
        A row with a host step reads what `prepare` wrote for this cycle: the caller runs it first."""
        if buffers.sampling is None and any(not r.sampling.greedy for r in ready.requests):
            raise ValueError("a batch with sampled requests needs CycleBuffers built to serve sampling (vocab=...)")
        ctx = StaticContext(buffers, into, kv_bound, self.ops, self.forwards, self.walk)
        record, boundaries = ready, []
        while True:
            row = select(record, self.ports)
            if row.host is not None and row.host.needed(record) and record is not ready:
                raise NotStatic(
                    f"row {row.source.__name__} -{row.event}-> {row.target.__name__} has a host step and does not "
                    "start the cycle: a host step runs before the cycle only"
                )
            fusion = next((f for f in FUSIONS if f.rows[0] is row and f.static and f.covers(record, self.ports)), None)
            if fusion is not None:
                result = fusion.static(record, self.ports, self.backend, ctx)
                boundaries.append(Boundary(fusion, record, result, ctx.rows, ctx.walked))
            elif row.static is not None:
                result = row.static(record, self.ports, self.backend, ctx)
                boundaries.append(Boundary(row, record, result))
            else:
                raise NotStatic(f"row {row.source.__name__} -{row.event}-> {row.target.__name__} has no static form")
            record = result
            if isinstance(record, Ready):
                return record, tuple(boundaries)

    def check(self, boundaries: Sequence[Boundary]) -> None:
        """Checked mode: every invariant at every boundary of a cycle that ran (docs/invariants.md)."""
        for b in boundaries:
            if isinstance(b.step, Fusion):
                checks.check_fusion(b.source, b.result, b.rows, b.walk, self.ports, forced=self.walk is not None)
            else:
                checks.check_transition(b.source, b.result, self.ports)


@attrs.frozen(eq=False)
class LogCopy:
    """A static record's log on its way to the host (`copy_log`): each request's log length, done flag and first
    ``width`` log tokens packed in one int64 tensor, the copy enqueued on the device's stream (``event`` fires when
    it has landed; None: a CPU record, already there)."""

    packed: torch.Tensor  # [2n + n * width] int64 on the host
    event: object | None
    n: int
    width: int

    def lists(self) -> tuple[list[int], list[bool], list[list[int]]]:
        """The lengths, done flags and token rows as lists (waits for the copy)."""
        if self.event is not None:
            self.event.synchronize()
        n, width, packed = self.n, self.width, self.packed.tolist()
        rows = [packed[2 * n + b * width : 2 * n + (b + 1) * width] for b in range(n)]
        return packed[:n], [bool(d) for d in packed[n : 2 * n]], rows


def copy_log(record, width: int) -> LogCopy:
    """Start copying the first ``width`` columns of a static record's log to the host (one copy, not waited for:
    work enqueued after it does not delay it)."""
    log, n = record.log, len(record.requests)
    packed = torch.cat([log.lengths[:n], log.done[:n].long(), log.tokens[:n, :width].reshape(-1)])
    if packed.device.type != "cuda":
        return LogCopy(packed, None, n, width)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return LogCopy(host, event, n, width)


def _log_on_host(record, width: int | None) -> tuple[list[int], list[bool], list[list[int]]]:
    """Each request's log length, done flag and log tokens, on the host. ``width``: the log columns a run may have
    written (one cycle's, ``S + 1``: then one copy brings all three back); None: its whole log, in two copies."""
    log, n = record.log, len(record.requests)
    if not n:
        return [], [], []
    if width is None:
        lengths, done = log.lengths[:n].tolist(), log.done[:n].tolist()
        width = max(lengths, default=0)
        return lengths, done, log.tokens[:n, :width].cpu().tolist()
    return copy_log(record, width).lists()


def materialize(record, stop_ids: Sequence[int], width: int | None = None, copy: LogCopy | None = None) -> Compacted:
    """The eager `Compacted` record of a static one (`Ready` or `Compacted` with a log): each request's output with
    the log's tokens appended, a finished request's reason (``stop``: its last token is a stop id, else
    ``length``), no log. ``width``: the log columns the run may have written (None: all); ``copy``: the log's
    copy to the host already started (`copy_log`)."""
    requests = []
    lengths, done, rows = copy.lists() if copy is not None else _log_on_host(record, width)
    stops = set(stop_ids)
    for b, request in enumerate(record.requests):
        output = request.output + tuple(rows[b][: lengths[b]])
        reason = None
        if done[b]:
            reason = "stop" if output and output[-1] in stops else "length"
        requests.append(attrs.evolve(request, output=output, finish_reason=reason))
    empty = torch.zeros(0, dtype=torch.long, device=record.seq_lens.device)
    n = len(requests)  # rows past n: a padded batch's padding
    return Compacted(
        config=record.config,
        requests=tuple(requests),
        seq_lens=record.seq_lens[:n].clone(),
        root_tokens=record.root_tokens[:n].clone(),
        extend=ExtendRows(input_ids=empty, positions=empty, row_request=empty, hidden=None),
    )


def snapshot_state(record: Ready) -> Ready:
    """The record with its state (lengths, roots, the draft's first level) cloned off the buffers now, its log as
    it is: enqueued right after a cycle, the copies hold that cycle's state whatever the buffers hold later (a
    reload of the same buffers by another caller before the cycle is collected)."""
    n = len(record.requests)

    def rows(t):
        return None if t is None else t[:n].clone()

    return attrs.evolve(
        record,
        seq_lens=rows(record.seq_lens),
        root_tokens=rows(record.root_tokens),
        topk_p=rows(record.topk_p),
        topk_index=rows(record.topk_index),
        draft_hidden=rows(record.draft_hidden),
        draft_probs=rows(record.draft_probs),
    )


def materialize_ready(
    record: Ready, stop_ids: Sequence[int], width: int | None = None, copy: LogCopy | None = None
) -> Ready:
    """The eager `Ready` record of a static one: the requests as `materialize` gives them, the state cloned off the
    buffers (a later cycle overwrites them). Requests that finished retire through the table's Ready ``retire``."""
    done = materialize(record, stop_ids, width, copy)
    n = len(record.requests)  # rows past n: a padded batch's padding

    def rows(t):
        return None if t is None else t[:n].clone()

    return Ready(
        config=record.config,
        requests=done.requests,
        seq_lens=done.seq_lens,
        root_tokens=done.root_tokens,
        topk_p=rows(record.topk_p),
        topk_index=rows(record.topk_index),
        draft_hidden=rows(record.draft_hidden),
        topk_pending=record.topk_pending,
        draft_probs=rows(record.draft_probs),
    )


def accepted_counts(record, cycles: int) -> list[tuple[int, ...]]:
    """Each request's committed count of each of the first ``cycles`` cycles of a static record's log (the cycles
    after it finished, 0, left out)."""
    hist = record.log.accepted[:cycles, : len(record.requests)].cpu().T.tolist()
    return [tuple(n for n in row if n > 0) for row in hist]
