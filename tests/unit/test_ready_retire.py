"""The Ready ``retire`` row: requests that finished in a static cycle (it commits and extends in one replay) leave a
`Ready` batch, their pages freed once, and `runner.run_cycle` reports them and runs the cycle of the others."""

from __future__ import annotations

import attrs
from speccycle.core import Admitted, Ports, Request, SamplingParams, SpecConfig
from speccycle.statemachine import run_cycle
from speccycle.statemachine.batching import merge_ready, select_ready
from speccycle.statemachine.runner import select, step
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft


def _ready(config: SpecConfig):
    pool = FingerprintPool(num_pages=256, page_size=config.page_size)
    target = HashedNgramTarget(pool, vocab_size=24, n=3)
    ports = Ports(target=target, draft=NoisyDraft(target, 0.7, "shifted"), kv_pool=pool)
    params = SamplingParams(max_new_tokens=12)
    requests = tuple(Request(i, (1 + i, 5, 7, 2 + i), params) for i in range(3))
    return ports, pool, run_cycle(Admitted(config=config, requests=requests), ports, checked=True)


def test_finished_requests_leave_a_ready_batch_and_the_others_cycle():
    config = SpecConfig(num_steps=3, page_size=4)
    ports, pool, ready = _ready(config)
    done = attrs.evolve(ready.requests[1], finish_reason="length")
    ready = attrs.evolve(ready, requests=(ready.requests[0], done, ready.requests[2]))
    assert select(ready, ports).event == "retire"  # the draft rows' guards require no finished request
    before = {r.request_id: len(r.output) for r in ready.requests}
    after = run_cycle(ready, ports, checked=True)
    assert [r.request_id for r in after.retired] == [1]
    assert pool.pages_held(1) == 0
    assert [r.request_id for r in after.requests] == [0, 2]
    assert all(len(r.output) > before[r.request_id] for r in after.requests)  # their cycle ran


def test_a_ready_batch_whose_requests_all_finished_retires_them_all():
    ports, pool, ready = _ready(SpecConfig(num_steps=2, page_size=4))
    ready = attrs.evolve(ready, requests=tuple(attrs.evolve(r, finish_reason="stop") for r in ready.requests))
    after = step(ready, ports, event="retire", checked=True)
    assert after.requests == () and [r.request_id for r in after.retired] == [0, 1, 2]
    assert all(pool.pages_held(i) == 0 for i in range(3))
    assert run_cycle(ready, ports).retired == after.retired


def test_the_retract_row_takes_named_requests_out_unfinished_and_frees_their_pages():
    """The Ready ``retract`` row (an engine short of KV pages): the requests `Ready.retract` names leave the batch
    with their committed output and no ``finish_reason``, every page they held freed; `run_cycle` runs it before the
    cycle of the others. A name not in the batch is refused; a finished request retires before any retraction."""
    import pytest

    config = SpecConfig(num_steps=3, page_size=4)
    ports, pool, ready = _ready(config)
    marked = attrs.evolve(ready, retract=(2,))
    assert select(marked, ports).event == "retract"  # the draft rows wait for it
    out = step(marked, ports, event="retract", checked=True)
    assert [r.request_id for r in out.requests] == [0, 1] and out.retract == ()
    assert out.retired == (ready.requests[2],) and out.retired[0].finish_reason is None
    assert pool.pages_held(2) == 0 and pool.pages_held(0) > 0
    ports, pool, ready = _ready(config)
    before = {r.request_id: len(r.output) for r in ready.requests}
    after = run_cycle(attrs.evolve(ready, retract=(0,)), ports, checked=True)
    assert [r.request_id for r in after.retired] == [0] and [r.request_id for r in after.requests] == [1, 2]
    assert all(len(r.output) > before[r.request_id] for r in after.requests)  # their cycle ran
    with pytest.raises(ValueError, match="not in the batch"):
        step(attrs.evolve(ready, retract=(7,)), ports, event="retract")
    ports, pool, ready = _ready(config)  # a batch and pool as they were: the run above freed request 0
    done = attrs.evolve(ready.requests[1], finish_reason="stop")
    both = attrs.evolve(ready, requests=(ready.requests[0], done, ready.requests[2]), retract=(2,))
    assert select(both, ports).event == "retire"  # finished requests leave first
    after = run_cycle(both, ports, checked=True)  # the retract waits through the retire row, then runs
    assert [(r.request_id, r.finish_reason) for r in after.retired] == [(1, "stop"), (2, None)]
    assert [r.request_id for r in after.requests] == [0] and after.retract == ()
    assert pool.pages_held(1) == pool.pages_held(2) == 0
    one, two = select_ready(marked, [0]), select_ready(attrs.evolve(marked, retract=(0,)), [0])
    assert one.retract == () and two.retract == (0,)  # a retract names only requests the batch keeps
    assert merge_ready(one, attrs.evolve(select_ready(ready, [2]), retract=(2,))).retract == (2,)
