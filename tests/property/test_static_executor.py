"""The static executor (`statemachine.static`) against the eager table, on the real model, in checked mode.

Random configs (S 0..5, K 1..3, N within bounds), batches of one to three prompts, each greedy or sampled
(temperature, top-k, top-p, a seed), a token budget that cuts runs mid-cycle and stop tokens drawn from the
reply: the executor runs the fused cycles on a CPU (the graphed
executor's rows, eagerly), with every boundary of every cycle validated (`StaticExecutor.check`), and the
eager table (`runner.generate`, checked) runs the same batch. Held equal: every request's output and finish
reason, the committed count of every cycle, and the pages (all back in the pool). The steps the executor ran
are the table's rows for the config once its fusions are expanded, and a fault put into the fused op's torch
twin (the bonus read one row late, a KV move kept past the committed run) is caught by checked mode.
"""

from __future__ import annotations

import functools
import inspect

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from speccycle.backends.cuda import cycle as cycle_ops
from speccycle.core import Admitted, Ports, Ready, Request, SamplingParams, SpecConfig
from speccycle.core.config import max_tree_nodes
from speccycle.engine.drafters.ngram import NgramDraft
from speccycle.engine.engine import Engine
from speccycle.engine.fast.fused_cycle import FusedCycles
from speccycle.engine.models.catalog import default_model_path
from speccycle.statemachine import runner
from speccycle.statemachine.checks import InvariantViolation
from speccycle.statemachine.static import expand
from speccycle.statemachine.table import TABLE

MESSAGES = ("Write a haiku about KV caches.", "List three prime numbers.", "Name three colors.")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as tests/unit's conftest gives: on a busy 2-core box OpenMP's spinning threads slowed an
    example of the n-gram test below from 1.8 s to 36 s."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine():
    try:
        path = default_model_path()
    except Exception as error:  # the model package is missing: the install command is in the message
        pytest.skip(str(error))
    spec = SpecConfig(num_steps=4, topk=2, num_draft_tokens=8, page_size=16)
    # 1,024 slots hold three requests with room to spare; the CPU attention reads every slot the page table spans
    built = Engine.load(path, draft="eagle", spec=spec, dtype=torch.float32, fast=True, kv_tokens=1024)
    assert built.fused_cycles is not None
    return built


@st.composite
def configs(draw) -> SpecConfig:
    steps, topk = draw(st.integers(0, 5)), draw(st.integers(1, 3))
    if steps == 0:  # no draft: the root alone, a plain decode step through the cycle
        return SpecConfig(num_steps=0, topk=topk, page_size=16)
    n = steps + 1 if topk == 1 else draw(st.integers(2, min(1 + max_tree_nodes(steps, topk), 12)))
    # a chain may be cut where its draft's confidence runs out (`SpecConfig.draft_floor`: widths per request)
    floor = draw(st.sampled_from([0.0, 0.3, 0.7])) if topk == 1 else 0.0
    return SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=n, page_size=16, draft_floor=floor)


def _requests(engine, count: int, max_new: int, stops: tuple[int, ...], sampled=()) -> list[Request]:
    """``sampled``: per request, None (greedy) or ``(temperature, top_k, top_p, seed)``."""
    base = SamplingParams(max_new_tokens=max_new, stop_token_ids=stops)
    out = []
    for i, m in enumerate(MESSAGES[:count]):
        draw = sampled[i] if i < len(sampled) else None
        params = base
        if draw is not None:
            temperature, top_k, top_p, seed = draw
            params = attrs.evolve(base, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        out.append(Request(1000 + i, tuple(engine.chat_prompt(m)), params))
    return out


# a request's sampling: greedy, or a temperature with top-k and top-p (top-k 2 often leaves a tree's node fewer
# children than K: padding) and its seed
SAMPLING = st.one_of(
    st.none(),
    st.tuples(
        st.sampled_from([0.6, 1.0]), st.sampled_from([0, 2, 20]), st.sampled_from([1.0, 0.8]), st.integers(0, 2**40)
    ),
)


def _eager(engine, config, requests, draft=None):
    """The table's own run: every request's result and each cycle's committed counts (``draft`` None: the
    engine's)."""
    ports = Ports(target=engine.target, draft=draft or engine.draft, kv_pool=engine.pool)
    counts: dict[int, list[int]] = {r.request_id: [] for r in requests}

    record = runner.run_cycle(Admitted(config=config, requests=tuple(requests)), ports, engine.backend, checked=True)
    done = {r.request_id: r for r in record.retired}
    while record.requests:
        before = {r.request_id: len(r.output) for r in record.requests}
        record = runner.run_cycle(record, ports, engine.backend, checked=True)
        for r in record.requests + record.retired:
            if r.request_id in before:
                counts[r.request_id].append(len(r.output) - before[r.request_id])
        done.update({r.request_id: r for r in record.retired})
    return [done[r.request_id] for r in requests], [tuple(counts[r.request_id]) for r in requests]


def _static(engine, config, requests, fused: FusedCycles):
    """The static executor's run from the table's prefill and first extend, in checked mode, retired by the table."""
    ports = Ports(target=engine.target, draft=fused.draft, kv_pool=engine.pool)
    ready = runner.run_cycle(Admitted(config=config, requests=tuple(requests)), ports, engine.backend, checked=True)
    stops = requests[0].sampling.stop_token_ids
    run = fused.run(ready, requests[0].sampling.max_new_tokens, stops, checked=True)
    done = {r.request_id: r for r in ready.retired}  # a request the prefill finished left before the cycles
    if run.final.requests:
        record = runner.step(run.final, ports, engine.backend, event="retire", checked=True)
        done.update({r.request_id: r for r in record.retired})
    counts = {r.request_id: lens for r, lens in zip(run.final.requests, run.accept_lens)}
    return [done[r.request_id] for r in requests], [counts.get(r.request_id, ()) for r in requests], run


def _fused(engine, config, draft=None) -> FusedCycles:
    return FusedCycles(engine.target, draft or engine.draft, engine.pool, config, engine.fused_cycles.options)


@functools.cache
def _first_reply(engine) -> list[int]:
    """The first message's autoregressive reply (14 tokens), where the examples' stop tokens come from."""
    return engine.generate_autoregressive([engine.chat_prompt(MESSAGES[0])], 14)[0]


# each example runs the real model twice (about a second a cycle on two CPU cores, both runs checked): a dozen
# examples, shrinking included, keep it near a minute
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    config=configs(),
    count=st.integers(1, 3),
    max_new=st.integers(1, 14),
    stop_at=st.integers(-1, 12),
    sampled=st.lists(SAMPLING, min_size=3, max_size=3),
)
def test_the_static_executor_commits_what_the_table_commits(engine, config, count, max_new, stop_at, sampled):
    """Greedy, sampled and mixed batches: a sampled request draws the same numbers on both executors (its seed and
    committed count key them), so it commits the same tokens too."""
    free = engine.pool.num_free_pages
    ar = _first_reply(engine)
    stops = (ar[stop_at],) if stop_at >= 0 else ()  # a token the first reply reaches: its run is cut there
    ref, ref_counts = _eager(engine, config, _requests(engine, count, max_new, stops, sampled))
    assert engine.pool.num_free_pages == free
    fused = _fused(engine, config)
    got, got_counts, run = _static(engine, config, _requests(engine, count, max_new, stops, sampled), fused)
    assert engine.pool.num_free_pages == free
    for g, r in zip(got, ref):
        assert (g.output, g.finish_reason) == (r.output, r.finish_reason)
    assert [tuple(c) for c in got_counts] == ref_counts


# an n-gram draft over the same target: its proposals come from the host before each cycle (the lookup row's
# host step, `static_rows.lookup_proposals`). Prompts that repeat themselves give it matches to propose from.
ECHOES = (
    "Repeat after me, twice: the cat sat on the mat, the cat sat on the mat.",
    "Say one two three, one two three, one two three.",
    "List three prime numbers.",
)


@st.composite
def lookup_configs(draw) -> SpecConfig:
    steps, topk = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    n = steps + 1 if topk == 1 else draw(st.integers(2, min(1 + max_tree_nodes(steps, topk), 12)))
    return SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=n, page_size=16)


@functools.cache
def _echo_reply(engine) -> list[int]:
    """The first echo prompt's autoregressive reply (14 tokens at most: it may end early at EOS)."""
    return engine.generate_autoregressive([engine.chat_prompt(ECHOES[0])], 14)[0]


def _echo_requests(engine, count: int, max_new: int, stops: tuple[int, ...]) -> list[Request]:
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=stops)
    return [Request(2000 + i, tuple(engine.chat_prompt(m)), params) for i, m in enumerate(ECHOES[:count])]


# 1 to 4 s an example on two CPU cores: five examples (tests/unit/test_fused_cycle.py runs a chain and a tree
# through `Engine.generate` and the scheduler)
@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(config=lookup_configs(), count=st.integers(1, 2), max_new=st.integers(1, 8), stop_at=st.integers(-1, 12))
def test_the_static_executor_commits_what_the_table_commits_for_an_ngram_draft(engine, config, count, max_new, stop_at):
    """Chains and trees of the n-gram draft: the static cycle (its proposals made on the host before it, the verify
    over N rows, the rows past the proposals padding) commits what the eager lookup row's verify commits, cycle by
    cycle, in checked mode (the host step's proposals validated too)."""
    draft = NgramDraft(engine.target.vocab_size)
    free = engine.pool.num_free_pages
    ar = _echo_reply(engine)
    stops = (ar[min(stop_at, len(ar) - 1)],) if stop_at >= 0 else ()  # the reply may end early (EOS)
    ref, ref_counts = _eager(engine, config, _echo_requests(engine, count, max_new, stops), draft)
    assert engine.pool.num_free_pages == free
    fused = _fused(engine, config, draft)
    got, got_counts, run = _static(engine, config, _echo_requests(engine, count, max_new, stops), fused)
    assert engine.pool.num_free_pages == free
    for g, r in zip(got, ref):
        assert (g.output, g.finish_reason) == (r.output, r.finish_reason)
    assert [tuple(c) for c in got_counts] == ref_counts
    if run.cycles:  # the cycles ran the lookup row's static form, its proposals from the host step
        assert expand(fused.steps) == _one_cycle_rows(engine, config, draft)


def _one_cycle_rows(engine, config, draft=None) -> tuple:
    """The rows the eager runner takes from a `Ready` record to the next one (`runner.select`)."""
    ports = Ports(target=engine.target, draft=draft or engine.draft, kv_pool=engine.pool)
    requests = _requests(engine, 1, 8, ())
    record = runner.run_cycle(Admitted(config=config, requests=tuple(requests)), ports, engine.backend)
    rows = []
    try:
        while True:
            row = runner.select(record, ports)
            rows.append(row)
            record = runner.step(record, ports, engine.backend)
            if isinstance(record, Ready):
                return tuple(rows)
    finally:
        engine.pool.free(requests[0].request_id)


@pytest.mark.parametrize(
    "config", [SpecConfig(num_steps=3, page_size=16), SpecConfig(4, 2, 8, page_size=16), SpecConfig(0, 2, page_size=16)]
)
def test_the_executor_runs_the_tables_rows(engine, config):
    """The steps a static cycle ran, its fusions expanded, are the rows the eager runner takes for the config."""
    fused = _fused(engine, config)
    _static(engine, config, _requests(engine, 1, 8, ()), fused)
    assert fused.steps and expand(fused.steps) == _one_cycle_rows(engine, config)
    assert all(row in TABLE for row in expand(fused.steps))


def _mutated_twin(old: str, new: str):
    """`accept_commit_torch` with one line of its source changed (a mutant of the fused op's twin)."""
    source = inspect.getsource(cycle_ops.accept_commit_torch)
    assert old in source, old
    scope = dict(vars(cycle_ops))
    exec(compile(source.replace(old, new), cycle_ops.__file__, "exec"), scope)
    return scope["accept_commit_torch"]


MUTANTS = {
    # the next root read one row past the committed run (the bonus at the wrong stride)
    "bonus stride": (
        "committed.gather(1, (keep - 1).clamp(min=0)[:, None])",
        "committed.gather(1, keep.clamp(max=W - 1)[:, None])",
        6,
    ),
    # a tree's KV moves sized by the walk's run, past the rows the cut committed
    "move bound": ("moves = kept & (rows != width[None])", "moves = (rows != width[None])", 7),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_checked_mode_catches_a_fault_in_the_fused_twin(engine, monkeypatch, name):
    old, new, number = MUTANTS[name]
    config = SpecConfig(num_steps=4, topk=2, num_draft_tokens=8, page_size=16)
    fused = _fused(engine, config)
    fused.kernels = False  # the torch twins run, the mutant among them
    monkeypatch.setattr(cycle_ops, "accept_commit_torch", _mutated_twin(old, new))
    free = engine.pool.num_free_pages
    requests = _requests(engine, 2, 12, ())
    with pytest.raises(InvariantViolation) as caught:
        _static(engine, config, requests, fused)
    assert caught.value.number == number
    for r in requests:  # the failed run's pages go back as an engine's would
        if engine.pool.pages_held(r.request_id):
            engine.pool.free(r.request_id)
    assert engine.pool.num_free_pages == free
    monkeypatch.undo()
    got, _, _ = _static(engine, config, _requests(engine, 2, 12, ()), fused)  # the real twin passes
    assert all(attrs.has(type(r)) and r.finish_reason == "length" for r in got)
