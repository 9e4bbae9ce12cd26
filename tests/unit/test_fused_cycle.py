"""Fused EAGLE cycles (engine/fast/fused_cycle.py) on the real model, CPU, float32, eagerly.

The fused loop is the transition table's greedy cycle written over static buffers; the state machine
is its reference. For chain and tree configs, page sizes 1 and 16, one request and a ragged batch of
two: the output equals the engine's autoregressive greedy output token for token, every cycle
commits as many tokens as the state machine's cycle does (the accept-length histograms are equal),
stops and the length limit cut a run where `stops.cut_at_stops` cuts it, and every KV page goes back.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from speccycle.bench.forced import force_fused_acceptance
from speccycle.core import SpecConfig
from speccycle.engine.engine import Engine
from speccycle.statemachine.static import expand
from speccycle.statemachine.table import FUSIONS, TABLE
from speccycle.statemachine.transitions import lookup_tree, skip_extend

MESSAGES = ("Write a haiku about KV caches.", "List three prime numbers and explain why each one is prime.")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def engines(model_path):
    out = {}  # 1,024 KV slots hold every batch below; the CPU attention reads every slot the page table spans
    for name, spec in (
        ("chain", SpecConfig(num_steps=4)),
        ("tree", SpecConfig(num_steps=4, topk=2, num_draft_tokens=8, page_size=16)),
    ):
        engine = Engine.load(model_path, draft="eagle", spec=spec, dtype=torch.float32, fast=True, kv_tokens=1024)
        assert engine.fused_cycles is not None
        out[name] = engine
    return out


@pytest.fixture(scope="module")
def replies(engines):
    """``replies(name, prompt, n)``: engine ``name``'s autoregressive reply to ``prompt``, its first ``n`` tokens. The
    reply is decoded once, `NEW_TOKENS` long, per engine and prompt (a shorter budget's is a prefix of it)."""
    cache = {}

    def reply(name, prompt, n=NEW_TOKENS):
        assert n <= NEW_TOKENS
        key = (name, tuple(prompt))
        if key not in cache:
            cache[key] = engines[name].generate_autoregressive([prompt], NEW_TOKENS)[0]
        return cache[key][:n]

    return reply


def _both(engine, prompts, new_tokens):
    """(fused results and stats, state-machine results and stats) of one `generate` call each."""
    fused = engine.generate(prompts, new_tokens)
    keep, engine.fused_cycles = engine.fused_cycles, None
    try:
        reference = engine.generate(prompts, new_tokens)
    finally:
        engine.fused_cycles = keep
    return fused, reference


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_fused_equals_autoregressive_and_the_state_machine(engines, replies, name):
    engine = engines[name]
    prompts = [engine.chat_prompt(m) for m in MESSAGES]
    free = engine.pool.num_free_pages
    ar = [replies(name, p) for p in prompts]
    for batch in ([prompts[0]], prompts):  # one request, then a ragged batch of two
        (results, stats), (ref_results, ref_stats) = _both(engine, batch, NEW_TOKENS)
        for result, ref, expected in zip(results, ref_results, ar):
            assert list(result.output) == expected
            assert list(ref.output) == expected
            assert result.finish_reason == ref.finish_reason
        assert stats.accept_len_histogram == ref_stats.accept_len_histogram
        assert stats.committed == ref_stats.committed and stats.verifies == ref_stats.verifies
        assert stats.tau > 1.0  # the shipped head accepts some drafts
    assert engine.pool.num_free_pages == free


def test_stop_token_and_length_cut_runs_like_the_state_machine(engines, replies, monkeypatch):
    engine = engines["tree"]
    prompt = engine.chat_prompt(MESSAGES[1])
    ar = replies("tree", prompt)
    stop = ar[6]  # a token the reply reaches: the stop cuts a run in the middle of a cycle's commit
    monkeypatch.setattr(type(engine), "stop_token_ids", property(lambda self: (stop,)))
    (results, stats), (ref_results, ref_stats) = _both(engine, [prompt], NEW_TOKENS)
    expected = ar[: ar.index(stop) + 1]
    assert list(results[0].output) == list(ref_results[0].output) == expected
    assert results[0].finish_reason == ref_results[0].finish_reason == "stop"
    assert stats.accept_len_histogram == ref_stats.accept_len_histogram
    monkeypatch.undo()
    for limit in (1, 2, 7):  # the limit inside the first cycle, and mid-run
        (results, _), (ref_results, _) = _both(engine, [prompt], limit)
        assert list(results[0].output) == list(ref_results[0].output) == ar[:limit]
        assert results[0].finish_reason == "length"


def test_bad_requests_get_clear_errors_and_lose_no_page(engines):
    engine = engines["chain"]
    free = engine.pool.num_free_pages
    prompt = engine.chat_prompt(MESSAGES[0])
    too_long = engine.fused_cycles.options.max_decode_steps + 1
    # refused before it starts: past the KV pool (`Engine._check_batch_fits`) or, in a larger pool, past the fused
    # cycles' static logs (`FusedCycles.run`)
    with pytest.raises(ValueError, match="max_decode_steps|KV pages"):
        engine.generate([prompt], too_long)
    assert engine.pool.num_free_pages == free
    results, _ = engine.generate([prompt], 4)  # the engine still works
    assert len(results[0].output) == 4


@pytest.mark.parametrize("name,tau,expected", [("chain", 3.0, {3: 6}), ("tree", 2.0, {2: 9})])
def test_forced_acceptance_takes_the_forced_lengths(engines, name, tau, expected):
    """Benchmarks force tau inside the fused graph (`bench.forced.ForcedFusedCycles`, over the engine's own
    target, draft and options): every cycle commits the forced length (19 tokens: the
    prefill's, then 6 cycles of 3 or 9 of 2). The walk follows the tree's first-child path and stops at a
    leaf, so a tree commits the forced length only where that path is deep enough: a depth-1 child always is
    (EAGLE-2's rescoring keeps the best first-level node), deeper ones depend on the head's scores (with
    the head of 6efd20d, S4 K2 N8 forced to 3 took {1: 1, 2: 1, 3: 5}), hence 2 for the tree."""
    engine = engines[name]
    prompt = engine.chat_prompt(MESSAGES[0])
    keep = engine.fused_cycles
    try:
        force_fused_acceptance(engine, tau)
        _, stats = engine.generate([prompt], 19)
    finally:
        engine.fused_cycles = keep
    assert stats.accept_len_histogram == expected


def test_a_bfloat16_head_over_a_float32_target_stays_lossless(model_path):
    """The draft's dtype is its own (a head in bfloat16 drafts a third cheaper on a CPU); only tau may change."""
    from speccycle.engine.drafters.eagle import EagleHead
    from speccycle.engine.drafters.eagle_heads import shipped_eagle_head

    head = EagleHead.load(shipped_eagle_head(model_path), torch.bfloat16, "cpu")
    engine = Engine.load(model_path, draft="eagle", eagle_head=head, spec=SpecConfig(num_steps=3), kv_tokens=1024)
    prompt = engine.chat_prompt(MESSAGES[1])
    results, stats = engine.generate([prompt], NEW_TOKENS)
    assert list(results[0].output) == engine.generate_autoregressive([prompt], NEW_TOKENS)[0]
    assert stats.tau > 1.0


def test_a_callers_stop_token_is_honoured_and_stop_strings_take_the_table(engines, replies):
    """`SamplingParams.stop_token_ids` of a greedy call reach the fused cycles (merged with the engine's EOS ids),
    and a call with stop strings, which `accept_commit` does not cover, runs the table instead."""
    from speccycle.core.config import SamplingParams

    engine = engines["chain"]
    prompt = engine.chat_prompt(MESSAGES[1])
    ar = replies("chain", prompt)
    stop = ar[5]
    before = engine.fused_cycles.run_s
    results, _ = engine.generate([prompt], NEW_TOKENS, sampling=SamplingParams(stop_token_ids=(stop,)))
    assert engine.fused_cycles.run_s > before  # the fused cycles ran
    assert list(results[0].output) == ar[: ar.index(stop) + 1] and results[0].finish_reason == "stop"
    text = engine.tokenizer.decode(ar[3:6])
    before = engine.fused_cycles.run_s
    results, _ = engine.generate([prompt], NEW_TOKENS, sampling=SamplingParams(stop_strings=(text,)))
    assert engine.fused_cycles.run_s == before  # the table ran: the fusion does not cover stop strings
    assert results[0].finish_reason == "stop" and len(results[0].output) < len(ar)


def test_history_dependent_logits_and_speculation_off_take_the_table(engines, replies):
    """A call with one SamplingParams per prompt where one request has a penalty or speculation off: the fused
    cycles, which take the raw argmax of every request, do not run; the table does, and the plain request stays
    the autoregressive output."""
    from speccycle.core.config import SamplingParams

    engine = engines["chain"]
    prompts = [engine.chat_prompt(m) for m in MESSAGES[:2]]
    ar = replies("chain", prompts[0])
    before = engine.fused_cycles.run_s
    results, _ = engine.generate(
        prompts, NEW_TOKENS, sampling=[SamplingParams(), SamplingParams(frequency_penalty=0.5)]
    )
    assert engine.fused_cycles.run_s == before, "the fused cycles ran a batch with a frequency penalty"
    assert list(results[0].output) == ar
    assert not SamplingParams(speculate=False).plain_greedy  # the same gate keeps speculation off on the table


@pytest.mark.parametrize("name,speculation", [("chain", "on"), ("tree", "on"), ("chain", "off"), ("tree", "adaptive")])
def test_the_scheduler_runs_its_cycles_as_the_captured_cycle(engines, replies, name, speculation):
    """Continuous batching on the graphed executor (`FusedCycles.step`, eagerly on a CPU): requests of different
    budgets finish in different cycles and leave through the table's Ready retire row while a waiting one joins
    (batches of up to three, padded to a power of two); checked at every boundary; every output is the
    autoregressive one, every page goes back. With speculation off every cycle is a plain decode step of shape
    S == 0 over `ZeroDraft` (no draft forward), captured too; adaptive speculation moves the batch between the
    shapes of the config's family, every one of them captured."""
    from speccycle.core.config import SamplingParams
    from speccycle.engine.serving.scheduler import Scheduler

    engine = engines[name]
    prompts = [engine.chat_prompt(m) for m in MESSAGES + ("Name three colors.", "Count to five.")]
    budgets = (NEW_TOKENS, 7, 12, 9)
    ar = [replies(name, p, n) for p, n in zip(prompts, budgets)]
    free, before = engine.pool.num_free_pages, engine.fused_cycles.run_s
    # batches of up to three: a batch of three runs padded to the graph bucket of four
    scheduler = Scheduler.from_engine(engine, checked=True, max_batch_size=3, speculation=speculation)
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets)]
    scheduler.run()
    assert [list(scheduler.finished[i].output) for i in ids] == ar
    eos = set(engine.stop_token_ids)
    for i, out in zip(ids, ar):
        want = "stop" if out and out[-1] in eos else "length"
        assert scheduler.finished[i].finish_reason == want
    stats = scheduler.stats
    assert engine.fused_cycles.run_s > before and stats.fused_cycles == stats.spec_cycles + stats.plain_cycles > 0
    if speculation == "on":  # three requests ran padded to the bucket of four
        assert any(key[0] == 4 for key in engine.fused_cycles._batches)
        assert set(stats.shapes) == {engine.spec} and stats.tau > 1.0
    if speculation == "off":
        assert stats.spec_cycles == 0 and {c.num_steps for c in stats.shapes} == {0}
    if speculation == "adaptive":  # shapes of the family measured, the deepest first
        assert set(stats.shapes) <= set(scheduler.controller.shapes) and len(stats.shapes) >= 2
        assert stats.shapes.get(engine.spec, 0) >= 2
    assert engine.pool.num_free_pages == free


def test_the_scheduler_admits_while_a_captured_cycle_runs(engines, replies, monkeypatch):
    """Overlap: the running batch's cycle is launched before the step's admission and collected after it (the
    prefill's host work runs while the GPU runs the cycle); the admitted requests join for the next cycle. The
    order is seen through the real methods, wrapped; every output is still the autoregressive one."""
    from speccycle.core.config import SamplingParams
    from speccycle.engine.serving.scheduler import Scheduler

    engine = engines["chain"]
    prompts = [engine.chat_prompt(m) for m in MESSAGES]
    ar = [replies("chain", p, 6) for p in prompts]
    scheduler = Scheduler.from_engine(engine, max_batch_size=4, max_prefill_tokens=1)  # one prefill a step
    calls = []
    fused = engine.fused_cycles
    for name, owner in (("launch", fused), ("collect", fused), ("forward", engine.target)):  # forward: a prefill
        real = getattr(owner, name)

        def logged(*args, real=real, name=name, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, logged)
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    scheduler.run()
    assert [list(scheduler.finished[i].output) for i in ids] == ar
    order = "".join({"launch": "L", "forward": "P", "collect": "C"}[c] for c in calls)
    assert order.startswith("PLC")  # nothing ran yet: the first step prefills, then runs its cycle
    assert order.count("LPC") == len(prompts) - 1  # later steps prefill between their cycle's launch and collection


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_pipelined_cycles_go_on_from_the_devices_state(engines, replies, name):
    """A batch nothing joins keeps its cycle in flight past the step; the next step launches the next cycle from
    the device's state (`FusedCycles.launch_next`: the other parity's graph, the same log) before collecting the
    last. Requests finish in different cycles (their rows go on, done, until the batch reloads), one is cancelled
    and others arrive mid-run (a reload); every output is the autoregressive one and every page goes back."""
    from speccycle.core.config import SamplingParams
    from speccycle.engine.serving.scheduler import Scheduler

    engine = engines[name]
    prompts = [engine.chat_prompt(m) for m in MESSAGES + ("Name three colors.", "Count to five.")]
    budgets = (NEW_TOKENS, 5, 14, 9)
    ar = [replies(name, p, n) for p, n in zip(prompts, budgets)]
    free = engine.pool.num_free_pages
    scheduler = Scheduler.from_engine(engine, max_batch_size=4)
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts[:2], budgets[:2])]
    for _ in range(4):
        scheduler.step()
    assert scheduler.stats.pipelined_cycles > 0
    ids += [scheduler.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts[2:], budgets[2:])]
    doomed = scheduler.submit(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS))
    for _ in range(3):
        scheduler.step()
    scheduler.cancel(doomed)
    scheduler.run()
    assert [list(scheduler.finished[i].output) for i in ids] == ar
    assert scheduler.finished[doomed].finish_reason == "cancelled"
    stats = scheduler.stats
    assert stats.pipelined_cycles > 2 and stats.fused_cycles == stats.spec_cycles + stats.plain_cycles
    assert engine.pool.num_free_pages == free


# ---- n-gram drafts on the captured cycle: proposals made on the host before each cycle -----------------
ECHOES = (
    "Repeat after me, twice: the cat sat on the mat, the cat sat on the mat.",
    "Say one two three, one two three, one two three.",
    "List three prime numbers and explain why each one is prime.",
    "Count to five.",
)
NGRAM_TOKENS = 16
NGRAM_SPECS = {
    "chain": SpecConfig(num_steps=5, page_size=16),
    "tree": SpecConfig(num_steps=4, topk=2, num_draft_tokens=8, page_size=16),
}


@pytest.fixture(scope="module")
def ngram(model_path):
    """An n-gram engine on the fast path (`fast.path.accelerate` builds its graphed executor too)."""
    engine = Engine.load(model_path, draft="ngram", spec=NGRAM_SPECS["tree"], dtype=torch.float32, fast=True,
                         kv_tokens=1024)  # fmt: skip
    assert engine.fused_cycles is not None and engine.fused_cycles.draft is engine.draft
    return engine


def _row(run):
    (row,) = (r for r in TABLE if r.run is run)
    return row


def _fusion_rows():
    (fusion,) = (f for f in FUSIONS if f.op == "accept_commit")
    return fusion.rows


def _with_spec(engine, name):
    """The engine's graphed executor rebuilt for ``NGRAM_SPECS[name]`` (over the same target, draft and pool)."""
    from speccycle.engine.fast.fused_cycle import FusedCycles

    spec = NGRAM_SPECS[name]
    return spec, FusedCycles(engine.target, engine.draft, engine.pool, spec, engine.fused_cycles.options)


@pytest.fixture(scope="module")
def echo_ar(ngram):
    """The autoregressive output of each of `ECHOES` (a shorter budget's is a prefix of it)."""
    return [ngram.generate_autoregressive([ngram.chat_prompt(m)], NGRAM_TOKENS)[0] for m in ECHOES]


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_ngram_generate_steps_the_captured_cycle(ngram, echo_ar, monkeypatch, name):
    """`Engine.generate` with an n-gram draft on the fast path runs every cycle as the static executor's (one
    `FusedCycles.step` a cycle: the host step proposes, the cycle verifies N rows), checked at every boundary: the
    output is the autoregressive one, and each cycle commits what the eager table's cycle commits."""
    spec, fused = _with_spec(ngram, name)
    monkeypatch.setattr(ngram, "spec", spec)
    monkeypatch.setattr(ngram, "fused_cycles", fused)
    prompts = [ngram.chat_prompt(m) for m in ECHOES[:2]]
    free = ngram.pool.num_free_pages
    results, stats = ngram.generate(prompts, NGRAM_TOKENS, checked=True)
    assert fused.run_s > 0 and expand(fused.steps) == (_row(lookup_tree), *_fusion_rows(), _row(skip_extend))
    monkeypatch.setattr(ngram, "fused_cycles", None)  # the eager table
    ref_results, ref_stats = ngram.generate(prompts, NGRAM_TOKENS)
    for result, ref, expected in zip(results, ref_results, echo_ar):
        assert list(result.output) == list(ref.output) == expected
        assert result.finish_reason == ref.finish_reason
    assert stats.accept_len_histogram == ref_stats.accept_len_histogram and stats.tau > 1.0
    assert ngram.pool.num_free_pages == free


@pytest.mark.parametrize("checked", [True, False])
def test_the_scheduler_runs_ngram_cycles_as_the_captured_cycle(ngram, echo_ar, checked):
    """Continuous batching with an n-gram draft on the graphed executor: every speculative cycle is a captured one
    (launched and collected, eagerly on a CPU, its proposals from the lookup row's host step), checked at every
    boundary or not; requests of different budgets join and leave between cycles (batches of up to three, padded
    to the bucket of four); every output is the autoregressive one. No cycle is pipelined (launched from the
    device's state before the last was collected): the next proposals need the last commits on the host."""
    from speccycle.core.config import SamplingParams
    from speccycle.engine.serving.scheduler import Scheduler

    prompts = [ngram.chat_prompt(m) for m in ECHOES]
    budgets = (NGRAM_TOKENS, 7, 12, 9)
    free, before = ngram.pool.num_free_pages, ngram.fused_cycles.run_s
    scheduler = Scheduler.from_engine(ngram, checked=checked, max_batch_size=3)
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets)]
    scheduler.run()
    assert [list(scheduler.finished[i].output) for i in ids] == [ar[:n] for ar, n in zip(echo_ar, budgets)]
    stats = scheduler.stats
    assert ngram.fused_cycles.run_s > before
    assert stats.fused_cycles == stats.spec_cycles > 0 and stats.tau > 1.0 and stats.pipelined_cycles == 0
    assert ngram.pool.num_free_pages == free


def test_checked_mode_catches_proposals_the_host_step_did_not_make(ngram, monkeypatch):
    """A static lookup tree that is not what the draft proposes (a proposal one token off, placeholder rows left
    live for the walk) is caught by checked mode at the draft row's boundary (invariant 4)."""
    from speccycle.statemachine.checks import InvariantViolation
    from speccycle.statemachine.static import StaticExecutor

    prepare = StaticExecutor.prepare

    def faulty(self, ready, buffers):
        prepare(self, ready, buffers)
        buffers.lookup[0, :, 1:] += 1  # every proposal one token off
        buffers.lookup[2].zero_()  # no row padding

    monkeypatch.setattr(StaticExecutor, "prepare", faulty)
    free = ngram.pool.num_free_pages
    with pytest.raises(InvariantViolation) as caught:
        ngram.generate([ngram.chat_prompt(ECHOES[0])], 8, checked=True)
    assert caught.value.number == 4
    assert ngram.pool.num_free_pages == free


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", ["chain", "tree"])
def test_ngram_cycles_are_captured_and_lossless_on_cuda(model_path, name):
    """On a GPU the n-gram cycle is a CUDA graph per batch bucket, replayed after each host step: `Engine.generate`
    and the scheduler (a batch of three in the bucket of four, checked and not) give the autoregressive outputs,
    checked mode passes on the replays, no cycle is pipelined, every page goes back."""
    from speccycle.core.config import SamplingParams
    from speccycle.engine.serving.scheduler import Scheduler

    spec = NGRAM_SPECS[name]
    engine = Engine.load(model_path, draft="ngram", spec=spec, device="cuda", dtype=torch.float32, fast=True,
                         kv_tokens=4096)  # fmt: skip
    fused = engine.fused_cycles
    assert fused is not None and fused.use_graphs
    prompts = [engine.chat_prompt(m) for m in ECHOES]
    ar = [engine.generate_autoregressive([p], NEW_TOKENS)[0] for p in prompts]
    free = engine.pool.num_free_pages
    results, stats = engine.generate(prompts[:2], NEW_TOKENS)
    assert [list(r.output) for r in results] == ar[:2] and stats.tau > 1.0
    assert fused.replays > 0 and any(bt.graphs for bt in fused._batches.values())
    results, _ = engine.generate(prompts[:1], NEW_TOKENS, checked=True)
    assert list(results[0].output) == ar[0]
    for checked in (True, False):  # unchecked, the scheduler would pipeline: not an n-gram cycle (no host step)
        scheduler = Scheduler.from_engine(engine, checked=checked, max_batch_size=3)
        ids = [scheduler.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
        scheduler.run()
        assert [list(scheduler.finished[i].output) for i in ids] == ar
        stats = scheduler.stats
        assert stats.fused_cycles == stats.spec_cycles > 0 and stats.pipelined_cycles == 0
    assert engine.pool.num_free_pages == free


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_the_scheduler_serves_sampled_and_greedy_requests_on_the_captured_cycle(engines, replies, name):
    """A mixed batch (sampled requests with temperature, top-k, top-p and their seeds beside greedy ones) runs as the
    captured cycle (`FusedCycles.covers` it), checked at every boundary, and unchecked, where a batch nothing joins
    goes on from the device's state (`FusedCycles.launch_next`): every output equals the eager scheduler's (the same
    requests without the fused cycles) token for token, the greedy one the autoregressive one; every cycle ran as
    the captured one, the sampled batches on buffers of their own."""
    from speccycle.core.config import SamplingParams
    from speccycle.engine.serving.scheduler import Scheduler

    engine = engines[name]
    prompts = [engine.chat_prompt(m) for m in MESSAGES + ("Name three colors.",)]
    params = [
        SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, seed=7),
        SamplingParams(max_new_tokens=4),
        SamplingParams(max_new_tokens=9, temperature=1.0, top_p=0.9, seed=11),
    ]
    free = engine.pool.num_free_pages
    outputs = {}
    for mode in ("checked", "pipelined", "eager"):
        kwargs = {"fused_cycles": None} if mode == "eager" else {}
        scheduler = Scheduler.from_engine(engine, checked=mode == "checked", max_batch_size=2, **kwargs)
        ids = [scheduler.submit(p, sp) for p, sp in zip(prompts, params)]
        scheduler.run()
        outputs[mode] = [list(scheduler.finished[i].output) for i in ids]
        stats = scheduler.stats
        fused = 0 if mode == "eager" else stats.spec_cycles + stats.plain_cycles
        assert stats.fused_cycles == fused and stats.tau > 1.0
        assert (stats.pipelined_cycles > 0) == (mode == "pipelined")
    assert outputs["checked"] == outputs["pipelined"] == outputs["eager"]
    assert outputs["eager"][1] == replies(name, prompts[1], 4)
    assert any(bt.buffers.sampling is not None for bt in engine.fused_cycles._batches.values())
    assert engine.pool.num_free_pages == free


def test_two_schedulers_over_one_engine_keep_their_pipelined_cycles_apart(engines, replies):
    """Two schedulers share one engine's graphed executor, so one bucket's buffers: while the first keeps a cycle
    in flight (pipelined), the second loads the same buffers. The first must not go on from them (their load count
    changed): it collects from the state it cloned after its cycle and reloads. Both outputs are autoregressive."""
    from speccycle.core.config import SamplingParams
    from speccycle.engine.serving.scheduler import Scheduler

    engine = engines["chain"]
    prompts = [engine.chat_prompt(m) for m in MESSAGES]
    ar = [replies("chain", p, 12) for p in prompts]
    free = engine.pool.num_free_pages
    first, second = Scheduler.from_engine(engine), Scheduler.from_engine(engine)
    a = first.submit(prompts[0], SamplingParams(max_new_tokens=12))
    first.step()
    first.step()
    assert first._inflight is not None  # its cycle stays in flight past the step
    b = second.submit(prompts[1], SamplingParams(max_new_tokens=12))
    while not first.idle or not second.idle:
        for scheduler in (first, second):
            if not scheduler.idle:
                scheduler.step()
    assert list(first.finished[a].output) == ar[0] and list(second.finished[b].output) == ar[1]
    assert engine.pool.num_free_pages == free


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_warm_up_captures_every_graph_an_adaptive_scheduler_runs_on_cuda(model_path):
    """`Scheduler.warm_up` captures each shape's graphs at each bucket (both parities, greedy and sampled batches)
    before serving: the adaptive run after it, a sampled request among greedy ones, captures nothing, pipelines, and
    gives the autoregressive outputs; every page goes back."""
    from speccycle.core.config import SamplingParams
    from speccycle.engine.serving.scheduler import Scheduler

    spec = SpecConfig(num_steps=3, topk=1, page_size=16)
    engine = Engine.load(model_path, draft="eagle", spec=spec, device="cuda", dtype=torch.float32, fast=True,
                         kv_tokens=8192)  # fmt: skip
    prompts = [engine.chat_prompt(m) for m in MESSAGES]
    ar = [engine.generate_autoregressive([p], NEW_TOKENS)[0] for p in prompts]
    free = engine.pool.num_free_pages
    scheduler = Scheduler.from_engine(engine, speculation="adaptive", max_batch_size=4)
    # buckets 1, 2, 4, two parities each, greedy and sampled batches
    assert scheduler.warm_up() == 2 * 2 * len(scheduler.controller.shapes) * 3
    assert scheduler.warm_up() == 0  # all there already
    forward_graphs = (engine.target.graphs.num_graphs, engine.draft.extend_graphs.num_graphs)
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    sampled = scheduler.submit(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, seed=3))
    scheduler.run()
    assert [list(scheduler.finished[i].output) for i in ids] == ar
    assert len(scheduler.finished[sampled].output) == NEW_TOKENS
    assert scheduler.stats.captures == 0 and scheduler.stats.pipelined_cycles > 0
    assert engine.pool.num_free_pages == free
    # the admissions' forwards (the target's prefill, the draft's extend) found their graphs captured by warm_up
    assert (engine.target.graphs.num_graphs, engine.draft.extend_graphs.num_graphs) == forward_graphs
    assert scheduler.stats.forward_captures == 0
    # the controller timed the replays on the device (CUDA events), every shape it ran twice or more at a bucket
    device_times = [t for window in scheduler.controller._gpu_window.values() for _, t in window]
    assert device_times and all(0 < t < 1 for t in device_times)


def test_warm_up_runs_a_sampled_batch_beside_each_greedy_one_and_leaves_no_trace(engines):
    """With the graphed executor, `Scheduler.warm_up` runs a sampled batch after each greedy one (a batch with a
    sampled request has buffers and graphs of its own); ``sampled=False`` runs the greedy ones only. Neither leaves a
    request, a statistic or a page behind."""
    from speccycle.engine.serving.scheduler import Scheduler

    engine = engines["chain"]
    free = engine.pool.num_free_pages
    scheduler = Scheduler.from_engine(engine, max_batch_size=2)
    runs = []
    original = Scheduler.run

    def run(self):
        runs.append(sorted({r.sampling.greedy for r in self.waiting}))
        return original(self)

    Scheduler.run = run
    try:
        with pytest.raises(ValueError, match="sampled"):
            scheduler.warm_up([1], sampled=1)
        scheduler.warm_up([1, 2], prompt_len=8, sampled=False)
        assert runs == [[True], [True]]
        runs.clear()
        scheduler.warm_up([1, 2], prompt_len=8)
    finally:
        Scheduler.run = original
    assert runs == [[True], [False], [True], [False]]
    batches = engine.fused_cycles._batches
    assert {key[0] for key in batches if key[1] == engine.spec and key[-1]} >= {1, 2}  # sampled buffers, buckets 1, 2
    assert all(bt.buffers.sampling is not None for key, bt in batches.items() if key[-1])
    assert scheduler.idle and not scheduler.finished and scheduler.stats.steps == 0
    assert engine.pool.num_free_pages == free


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_sampled_generate_runs_the_fused_cycles_and_draws_what_the_table_draws(engines, name):
    """`Engine.generate` with temperature, top-k, top-p and seeds (one for every prompt, then one per prompt beside a
    greedy one) runs as the fused cycles, and every output equals the eager table's draw for draw: both take the
    counter-based generator at the same counters. A penalty beside them keeps the call on the table."""
    from speccycle.core.config import SamplingParams

    engine = engines[name]
    prompts = [engine.chat_prompt(m) for m in MESSAGES]
    calls = (
        SamplingParams(temperature=0.8, top_p=0.9, seed=5),
        [SamplingParams(), SamplingParams(temperature=1.0, top_k=20, seed=9)],
    )
    for sampling in calls:
        before = engine.fused_cycles.run_s
        fused, _ = engine.generate(prompts, 12, sampling=sampling)
        assert engine.fused_cycles.run_s > before, "the sampled call did not run as the fused cycles"
        keep, engine.fused_cycles = engine.fused_cycles, None
        try:
            reference, _ = engine.generate(prompts, 12, sampling=sampling)
        finally:
            engine.fused_cycles = keep
        assert [list(r.output) for r in fused] == [list(r.output) for r in reference]
    third = engine.generate(prompts[1:], 3)[0][0].output[2]  # the greedy output's third token
    before = engine.fused_cycles.run_s
    penalty = [SamplingParams(temperature=1.0, seed=1), SamplingParams(presence_penalty=1.0)]
    engine.generate(prompts, 4, sampling=penalty)
    stop = [SamplingParams(temperature=0.8, seed=1), SamplingParams(stop_token_ids=(third,))]
    results, _ = engine.generate(prompts, 12, sampling=stop)  # one run of the fused cycles loads one stop list
    assert engine.fused_cycles.run_s == before
    assert results[1].finish_reason == "stop" and len(results[1].output) <= 3


def test_prefill_shapes_meet_every_graph_key_a_prefill_can_take():
    """Every prefill of up to ``max_requests`` requests and ``max_rows`` rows takes the graph key (row bucket,
    logits-rows bucket) of one of `prefill_shapes`, which `Scheduler.warm_up` prefills on the graphed path; a
    verify keeps its exact logits-rows bucket."""
    from speccycle.engine.fast.graphs import bucket, logit_bucket, prefill_shapes

    warmed = {(rows, logit_bucket(rows, requests, prefill=True)) for rows, requests in prefill_shapes(512, 64)}
    for rows in range(1, 513):
        for requests in range(1, min(rows, 64) + 1):
            b = bucket(rows)
            assert (b, logit_bucket(b, requests, prefill=True)) in warmed
    assert logit_bucket(64, 5, prefill=False) == 8 and logit_bucket(64, 5, prefill=True) == 8
    assert logit_bucket(24, 20, prefill=True) == 24 and logit_bucket(12, 13, prefill=True) is None


def test_the_adaptive_controller_gets_each_replays_device_time_and_the_steps_host_time(engines, replies, monkeypatch):
    """The scheduler hands the controller each captured cycle's device time (its `CycleTimer`, faked here: a CPU
    replays nothing) and the host's time for it (the step less its waits for commits); a step that prefilled gives
    no host time (``timed=False``) yet its device time counts. The outputs stay the autoregressive ones."""
    from speccycle.core.config import SamplingParams
    from speccycle.engine.fast import fused_cycle
    from speccycle.engine.serving.scheduler import Scheduler

    class Timer:
        gpu_seconds = 10.0  # longer than any host time here (a CPU cycle takes a fraction of a second)
        waited = 0.0

    for name in ("launch", "launch_next"):
        original = getattr(fused_cycle.FusedCycles, name)

        def timed(self, *args, _original=original, **kwargs):
            return attrs.evolve(_original(self, *args, **kwargs), timer=Timer())

        monkeypatch.setattr(fused_cycle.FusedCycles, name, timed)
    engine = engines["chain"]
    prompts = [engine.chat_prompt(m) for m in MESSAGES]
    scheduler = Scheduler.from_engine(engine, speculation="adaptive", max_batch_size=2)
    controller, seen = scheduler.controller, []
    original_record = controller.record

    def record(shape, batch_size, seconds, committed, timed=True, gpu_seconds=None):
        seen.append((scheduler._prefilled, seconds, timed, gpu_seconds))
        original_record(shape, batch_size, seconds, committed, timed, gpu_seconds)

    controller.record = record
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    scheduler.run()
    assert [list(scheduler.finished[i].output) for i in ids] == [replies("chain", p, 12) for p in prompts]
    assert seen and all(gpu == Timer.gpu_seconds for _, _, _, gpu in seen)
    assert all(not timed for prefilled, _, timed, _ in seen if prefilled)
    assert any(timed for prefilled, _, timed, _ in seen if not prefilled)
    assert controller.seconds and all(t == Timer.gpu_seconds for t in controller.seconds.values())
