"""The table is honest (rows call the ops they name), renders, and the runner fails clearly."""

from __future__ import annotations

import attrs
import pytest
import torch
from speccycle.backends.torch import TorchBackend
from speccycle.core import Admitted, KVPoolExhausted, Ports, Request, SamplingParams, SpecConfig
from speccycle.statemachine import TABLE, NoTransition, TraceEvent, generate, run_cycle, select, step
from speccycle.statemachine.render import to_markdown, to_mermaid
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft, TreeLookupDraft


class RecordingBackend(TorchBackend):
    """Records the name of every backend op a transition calls."""

    def __init__(self):
        self.calls: list[str] = []

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if callable(attr) and not name.startswith("_") and name in dir(TorchBackend):
            object.__getattribute__(self, "calls").append(name)
        return attr


def _ports(config, family="shifted", pages=256, nan_requests=()):
    pool = FingerprintPool(num_pages=pages, page_size=config.page_size)
    target = HashedNgramTarget(pool, vocab_size=32, n=3, nan_requests=nan_requests)
    draft = TreeLookupDraft(target) if family == "lookup" else NoisyDraft(target, 0.7, family)
    return Ports(target=target, draft=draft, kv_pool=pool)


def _requests(n=2, max_new=12):
    return tuple(Request(i, tuple(range(1 + i, 6 + 2 * i)), SamplingParams(max_new_tokens=max_new)) for i in range(n))


@pytest.mark.parametrize("family,floor", [("shifted", None), ("lookup", None), ("shifted", 0.3)])
def test_each_transition_calls_only_the_ops_its_row_names(family, floor):
    """Also a chain cut by its draft's confidence (`SpecConfig.draft_floor`: the top-1 probabilities)."""
    config = SpecConfig(num_steps=3, topk=2, num_draft_tokens=5, page_size=2)
    if floor is not None:
        config = SpecConfig(num_steps=3, topk=1, page_size=2, draft_floor=floor)
    ports = _ports(config, family)
    backend = RecordingBackend()
    record = Admitted(config=config, requests=_requests(2, max_new=8))
    seen = set()
    for _ in range(40):
        if not record.requests:
            break
        row = select(record, ports)
        backend.calls.clear()
        record = step(record, ports, backend, checked=True)
        assert set(backend.calls) <= set(row.ops), f"{row.event} called {set(backend.calls) - set(row.ops)}"
        seen.add((row.event, row.guard_name))
    assert {e for e, _ in seen} >= {"prefill", "extend", "draft", "verify", "accept", "compact", "retire"}


def test_renderings_name_every_row():
    mermaid, markdown = to_mermaid(), to_markdown()
    assert mermaid.startswith("stateDiagram-v2")
    for row in TABLE:
        assert f"{row.source.__name__} --> {row.target.__name__}: {row.event}" in mermaid
        assert f"| `{row.source.__name__}` | `{row.event}` |" in markdown


def test_trace_events_cover_a_cycle():
    config = SpecConfig(num_steps=2, topk=1)
    ports = _ports(config)
    events: list[TraceEvent] = []
    generate(_requests(1, 4), config, ports, trace=events.append)
    assert [e.event for e in events][:4] == ["prefill", "extend", "draft", "verify"]
    assert all(e.duration_s >= 0 for e in events)
    assert any(e.event == "verify" and e.rows == config.num_draft_tokens for e in events)


def test_no_row_applies_is_a_clear_error():
    with pytest.raises(NoTransition, match="no row applies to Admitted on 'verify'"):
        step(Admitted(config=SpecConfig(), requests=()), _ports(SpecConfig()), event="verify")


@pytest.mark.parametrize(
    "request_, message",
    [
        (Request(0, ()), "prompt is empty"),
        (Request(0, (1, 99)), "outside the vocabulary"),
    ],
)
def test_bad_requests_are_refused_with_what_to_do_and_the_others_go_on(request_, message):
    config = SpecConfig()
    ports = _ports(config)
    good = Request(5, (1, 2, 3), SamplingParams(max_new_tokens=6))
    done = generate([good, attrs.evolve(request_, request_id=9)], config, ports, checked=True)
    assert done[1].finish_reason == "error" and message in done[1].error
    assert list(done[0].output) == ports.target.greedy(good.prompt, 6)
    assert ports.kv_pool.num_free_pages == ports.kv_pool.num_pages
    alone = generate([attrs.evolve(request_, request_id=10)], config, ports, checked=True)
    assert alone[0].finish_reason == "error"


@pytest.mark.parametrize("family", ["shifted", "lookup"])
def test_a_request_id_twice_in_one_batch_is_refused_at_admission(family):
    """Two requests of one batch with one id would share its KV pages (the pool is keyed by id): the prefill
    row, which every entry (`generate`, the engine, the scheduler) takes, refuses the batch and touches no page."""
    config = SpecConfig(num_steps=3, topk=1)
    ports = _ports(config, family)
    params = SamplingParams(max_new_tokens=6)
    batch = [Request(0, (1, 2, 3), params), Request(4, (2, 3), params), Request(0, (4, 5, 6), params)]
    once = r"request id 0 is given more than once in one batch .*: give each request its own id"
    with pytest.raises(ValueError, match=once):
        generate(batch, config, ports)
    assert ports.kv_pool.num_free_pages == ports.kv_pool.num_pages
    with pytest.raises(ValueError, match=r"request ids 0, 4 "):
        step(Admitted(config=config, requests=(*batch, attrs.evolve(batch[1], prompt=(7, 8)))), ports)
    assert ports.kv_pool.num_free_pages == ports.kv_pool.num_pages
    done = generate(batch[:2], config, ports, checked=True)  # distinct ids: decoded as before
    assert [list(r.output) for r in done] == [ports.target.greedy(r.prompt, 6) for r in batch[:2]]


def test_pool_exhaustion_raises_before_touching_the_pool_and_loses_nothing():
    config = SpecConfig(num_steps=4, topk=1)
    ports = _ports(config, pages=14)
    ready = run_cycle(Admitted(config=config, requests=_requests(2, 30)), ports)
    free_before = ports.kv_pool.num_free_pages
    held_before = [ports.kv_pool.pages_held(r.request_id) for r in ready.requests]
    with pytest.raises(KVPoolExhausted, match="retract or defer"):
        for _ in range(20):
            ready = run_cycle(ready, ports, checked=True)
            free_before = ports.kv_pool.num_free_pages
            held_before = [ports.kv_pool.pages_held(r.request_id) for r in ready.requests]
    # Nothing was allocated by the failed reservation; the Ready record is still valid to retry.
    assert ports.kv_pool.num_free_pages == free_before
    assert [ports.kv_pool.pages_held(r.request_id) for r in ready.requests] == held_before
    # With pages back (an engine retracts another request), the same record goes on, losslessly.
    ports.kv_pool._free.extend(range(ports.kv_pool.num_pages, ports.kv_pool.num_pages + 64))
    ports.kv_pool.num_pages += 64
    ports.kv_pool.target = torch.cat([ports.kv_pool.target, torch.full((64 * config.page_size, 2), -1)])
    ports.kv_pool.draft = torch.cat([ports.kv_pool.draft, torch.full((64 * config.page_size, 2), -1)])
    done = {}
    while ready.requests:
        ready = run_cycle(ready, ports, checked=True)
        done.update({r.request_id: r for r in ready.retired})
    for request in _requests(2, 30):
        assert list(done[request.request_id].output) == ports.target.greedy(request.prompt, 30)


def test_nan_logits_stop_that_request_with_an_error_and_keep_the_others():
    config = SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)
    ports = _ports(config, nan_requests=(1,))
    done = generate(_requests(3, 10), config, ports, checked=True)
    assert done[1].finish_reason == "error" and "non-finite logits" in done[1].error
    target = ports.target
    for request in (done[0], done[2]):
        assert list(request.output) == target.greedy(request.prompt, 10)
    assert ports.kv_pool.num_free_pages == ports.kv_pool.num_pages


def test_records_are_frozen():
    config = SpecConfig()
    record = Admitted(config=config, requests=_requests(1))
    with pytest.raises(AttributeError):
        record.requests = ()  # type: ignore[misc]
    assert torch.is_tensor(run_cycle(record, _ports(config)).seq_lens)


def test_logits_check_finds_each_bad_request_and_not_an_overflowing_sum():
    from speccycle.core import ModelOutput
    from speccycle.statemachine.transitions import _check_logits

    row_request = torch.tensor([0, 0, 1, 1, 2, 2])
    big = torch.full((6, 4), 3e38)  # finite, but their sum overflows to inf: the rows are checked one by one
    assert _check_logits(ModelOutput(logits=big, hidden=None), row_request, 3) == [False, False, False]
    for bad in (float("nan"), float("inf"), float("-inf")):
        logits = torch.zeros(6, 4)
        logits[3, 2] = bad
        assert _check_logits(ModelOutput(logits=logits, hidden=None), row_request, 3) == [False, True, False]
        assert _check_logits(ModelOutput(logits=big.clone().index_fill_(0, torch.tensor([5]), bad), hidden=None),
                             row_request, 3) == [False, False, True]  # fmt: skip
    finite = torch.tensor([True, True, True, True, False, True])  # a port's own reduction is used as given
    out = ModelOutput(logits=torch.zeros(6, 4), hidden=None, finite=finite)
    assert _check_logits(out, row_request, 3) == [False, False, True]
    out = ModelOutput(logits=torch.full((6, 4), float("nan")), hidden=None, finite=torch.ones(6, dtype=torch.bool))
    assert _check_logits(out, row_request, 3) == [False, False, False]


@pytest.mark.parametrize("topk, nodes", [(1, None), (2, 5)])
def test_draft_forward_batches_hold_contiguous_slots(topk, nodes):
    """A port's kernel may read ``out_slots`` and ``extra_slots`` rows as flat arrays (the fast engine's
    fused KV write reads ``out_slots[row]`` by pointer); at batch > 1 a chain's were strided column views."""
    config = SpecConfig(num_steps=4, topk=topk, num_draft_tokens=nodes, page_size=2)
    ports = _ports(config)
    seen = []
    step_forward = ports.draft.step

    def step_checked(batch, parent_hidden):
        seen.append((batch.out_slots.is_contiguous(), batch.extra_slots.is_contiguous()))
        return step_forward(batch, parent_hidden)

    ports.draft.step = step_checked
    generate(_requests(3, 8), config, ports, checked=True)
    assert seen and all(out and extra for out, extra in seen)
