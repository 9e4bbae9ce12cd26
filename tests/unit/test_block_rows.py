"""The block-draft rows of the table: they call only the ops they name, and the guards pick one row."""

from __future__ import annotations

import pytest
from speccycle.backends.torch import TorchBackend
from speccycle.core import Admitted, Ports, Request, SamplingParams, SpecConfig
from speccycle.statemachine import select, step
from speccycle.testing import FingerprintPool, HashedNgramTarget
from speccycle.testing.recurrent import NoisyBlockDraft, RecurrentHashTarget


class RecordingBackend(TorchBackend):
    def __init__(self):
        self.calls: list[str] = []

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if callable(attr) and not name.startswith("_") and name in dir(TorchBackend):
            object.__getattribute__(self, "calls").append(name)
        return attr


@pytest.mark.parametrize("recurrent", [False, True])
def test_block_rows_call_only_the_ops_they_name(recurrent):
    config = SpecConfig(num_steps=3, topk=1, page_size=2)
    pool = FingerprintPool(num_pages=256, page_size=2)
    target = RecurrentHashTarget(pool, vocab_size=32) if recurrent else HashedNgramTarget(pool, vocab_size=32)
    ports = Ports(
        target=target,
        draft=NoisyBlockDraft(target, block_size=4, agreement=0.8),
        kv_pool=pool,
        **({"recurrent": target.states} if recurrent else {}),
    )
    backend = RecordingBackend()
    requests = tuple(Request(i, tuple(range(1 + i, 6 + 2 * i)), SamplingParams(max_new_tokens=10)) for i in range(2))
    record = Admitted(config=config, requests=requests)
    seen, finished = set(), []
    for _ in range(60):
        if not record.requests:
            break
        row = select(record, ports)
        backend.calls.clear()
        record = step(record, ports, backend, checked=True)
        assert set(backend.calls) <= set(row.ops), f"{row.event} called {set(backend.calls) - set(row.ops)}"
        seen.add((row.event, row.guard_name))
        finished += getattr(record, "retired", ()) if row.event == "retire" else ()
    assert {("extend", "block_ready"), ("draft", "block_draft_live"), ("verify", "block_draft")} <= seen
    assert sorted(r.request_id for r in finished) == [0, 1]
    for request in finished:
        assert list(request.output) == target.greedy(request.prompt, 10)
