"""The runner: ``step(record, ports, backend) -> record`` and whole cycles on top of it.

`step` finds the one table row that applies to the record (its type, the event if given, the guard),
runs it, and in checked mode validates every invariant of the record it returns. Trace events go to
an optional callback; nothing else leaves a step but the record (and what the ports did).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import attrs

from ..backends.registry import get_backend
from ..core.config import SpecConfig
from ..core.ports import Ports, target_device
from ..core.records import Admitted, Compacted, Ready, Request
from . import checks
from .table import TABLE, Transition
from .transitions import any_finished, first_level_due, retracting


class NoTransition(RuntimeError):
    """No row of the table (or more than one) applies to the record."""


@attrs.frozen
class TraceEvent:
    """One transition: which row ran, how long it took, and the sizes it worked on."""

    event: str
    source: str
    target: str
    duration_s: float
    batch_size: int
    rows: int  # verify rows (bs * N) or extend rows, 0 where none


@functools.lru_cache(maxsize=64)
def _candidates(kind: type, event: str | None) -> tuple[Transition, ...]:
    """The table's rows for a record type (and event), in table order: the table is a constant."""
    return tuple(r for r in TABLE if issubclass(kind, r.source) and (event is None or r.event == event))


def select(record, ports: Ports, event: str | None = None) -> Transition:
    """The row that applies to ``record``: its type, ``event`` when given, and a true guard."""
    rows = _candidates(type(record), event)
    enabled = [r for r in rows if r.guard(record, ports)]
    if len(enabled) != 1:
        what = type(record).__name__ + (f" on {event!r}" if event else "")
        names = [f"{r.event}[{r.guard_name}]" for r in (enabled or rows)]
        problem = "no row applies" if not enabled else "several rows apply"
        raise NoTransition(f"{problem} to {what}: candidates {names}")
    return enabled[0]


def step(
    record,
    ports: Ports,
    backend=None,
    *,
    event: str | None = None,
    checked: bool = False,
    trace: Callable[[TraceEvent], None] | None = None,
):
    """Run one transition. ``checked`` validates the invariants (docs/invariants.md) on the result."""
    backend = backend if backend is not None else get_backend(target_device(ports))
    row = select(record, ports, event)
    start = time.perf_counter()
    result = row.run(record, ports, backend)
    duration = time.perf_counter() - start
    if checked:
        checks.check_transition(record, result, ports)
    if trace is not None:
        trace(
            TraceEvent(
                row.event,
                row.source.__name__,
                row.target.__name__,
                duration,
                len(record.requests),
                checks.row_count(result),
            )
        )
    return result


def run_cycle(record, ports: Ports, backend=None, **kwargs) -> Ready:
    """Step until the next `Ready` record: from `Admitted` through prefill, from `Ready` one full cycle (after the
    Ready ``retire`` row, where requests of the record had finished, the ``retract`` row, where the record names
    requests to take out (`Ready.retract`), and the ``first_level`` row, where a cycle of ``S == 0`` deferred the
    top-K the record's shape drafts from). ``retired``: every request that left (retracted ones unfinished)."""
    retired: tuple[Request, ...] = ()
    if isinstance(record, Ready) and any_finished(record, ports):
        record = step(record, ports, backend, event="retire", **kwargs)
        retired, record = record.retired, attrs.evolve(record, retired=())
        if not record.requests:
            return attrs.evolve(record, retired=retired)
    if isinstance(record, Ready) and retracting(record, ports):
        record = step(record, ports, backend, event="retract", **kwargs)
        retired, record = retired + record.retired, attrs.evolve(record, retired=())
        if not record.requests:
            return attrs.evolve(record, retired=retired)
    if isinstance(record, Ready) and first_level_due(record, ports):
        record = step(record, ports, backend, event="first_level", **kwargs)
    record = step(record, ports, backend, **kwargs)
    while not isinstance(record, Ready):
        if isinstance(record, Compacted) and record.retired:
            retired += record.retired
        record = step(record, ports, backend, **kwargs)
    return record if record.retired == retired else attrs.evolve(record, retired=retired)


def generate(
    requests: Sequence[Request],
    config: SpecConfig,
    ports: Ports,
    backend=None,
    **kwargs,
) -> tuple[Request, ...]:
    """Run a batch to completion; returns the finished requests in their input order."""
    record = run_cycle(Admitted(config=config, requests=tuple(requests)), ports, backend, **kwargs)
    done = {r.request_id: r for r in record.retired}
    while record.requests:
        record = run_cycle(record, ports, backend, **kwargs)
        done.update({r.request_id: r for r in record.retired})
    return tuple(done[r.request_id] for r in requests)
