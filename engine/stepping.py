"""One batch through the table to its end: the loop `Engine.generate` and `integrations.transformers` share.

`run_batch` steps an `Admitted` record one transition at a time (`statemachine.step`) until every request of the
batch has retired, and counts what each verify committed (`GenerationStats`): the accept lengths are read from
the `Compacted` record that follows an `Accepted` one (a retire re-emits them, so each verify counts once).
``on_commit(request)`` sees every request after each compaction and retire, with its output so far (streaming).
``fused(ready)``: where it is given, the cycles run on the device from the first `Ready` record on (the graphed
executor's whole-run loop, `engine.fast.fused_cycle.FusedCycles.run`); its final record retires through the table.
A failure mid-batch leaks no KV page: the pages of every request that did not finish are freed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import attrs

from ..core import Accepted, Admitted, Compacted, Ports, Ready, Request
from ..statemachine import step


@attrs.frozen
class GenerationStats:
    """Counts of one `generate` call: tau is the mean tokens committed per request per verify."""

    verifies: int = 0
    committed: int = 0
    accept_len_histogram: dict[int, int] = attrs.field(factory=dict)
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return self.committed / self.verifies if self.verifies else 0.0


def check_batch_fits(pool, config, prompts, max_new_tokens: int, advice: str) -> None:
    """Refuse, before it starts, a batch whose pages at their longest (prompt, ``max_new_tokens``, a cycle's
    reservation, each request's last page partly used) could outgrow ``pool``: `run_batch` has no retraction (the
    `Scheduler` has). ``advice``: what to do, ending the one-line error."""
    page, margin = pool.page_size, 2 * config.reserve_len("aligned")
    need = sum(-(-(len(p) + max_new_tokens + margin) // page) for p in prompts)
    if need > pool.num_pages:
        raise ValueError(
            f"{len(prompts)} prompt(s) with max_new_tokens={max_new_tokens} may need {need} KV pages and the pool "
            f"has {pool.num_pages}: {advice}"
        )


def run_batch(
    record: Admitted,
    ports: Ports,
    backend,
    *,
    checked: bool = False,
    on_step: Callable[[object], None] | None = None,
    on_commit: Callable[[Request], None] | None = None,
    fused: Callable[[Ready], object] | None = None,
) -> tuple[dict[int, Request], GenerationStats]:
    """Every request of ``record`` stepped to its end; returns them by id, and the call's counts (module docstring).
    ``on_step(record)`` sees the record after every transition."""
    ids = [r.request_id for r in record.requests]
    done: dict[int, Request] = {}
    histogram: Counter[int] = Counter()
    verifies = committed = 0
    start = time.perf_counter()
    try:
        while True:
            previous, record = record, step(record, ports, backend, checked=checked)
            if on_step is not None:
                on_step(record)
            if fused is not None and isinstance(record, Ready):  # the cycles run on the device from here
                done.update({r.request_id: r for r in record.retired})
                run = fused(record)
                # the finished requests leave through the table's retire row, which frees their pages
                lens_of = {r.request_id: lens for r, lens in zip(run.final.requests, run.accept_lens)}
                if run.final.requests:
                    record = step(run.final, ports, backend, event="retire", checked=checked)
                for request in record.retired:
                    lens = lens_of.get(request.request_id, ())
                    histogram.update(lens)
                    verifies += len(lens)
                    committed += sum(lens)
                    if on_commit is not None:
                        on_commit(request)
                done.update({r.request_id: r for r in record.retired})
                break
            if not isinstance(record, Compacted):
                continue
            if isinstance(previous, Accepted):  # a retire re-emits accept_len: count each verify once
                lens = record.accept_len.tolist()
                histogram.update(lens)
                verifies += len(lens)
                committed += sum(lens)
            if on_commit is not None:
                for request in record.requests + record.retired:
                    on_commit(request)
            done.update({r.request_id: r for r in record.retired})
            if not record.requests and len(done) == len(ids):
                break
    finally:
        for rid in ids:  # a failure mid-batch leaks no page
            if rid not in done and ports.kv_pool.pages_held(rid):
                ports.kv_pool.free(rid)
    stats = GenerationStats(verifies, committed, dict(sorted(histogram.items())), time.perf_counter() - start)
    return done, stats
