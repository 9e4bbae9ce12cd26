"""The continuous-batching scheduler as a Hypothesis state machine, on the synthetic models.

Random configs, draft families (EAGLE-shifted, aligned, random-tree lookup), pool sizes from roomy
to too tight for one request (forcing retraction and refusal), batch caps, speculation on / off /
adaptive (a fixed cost model: the batch moves between draft shapes), random arrivals with ragged prompts
and outputs, stop token ids, stop strings (a toy detokenizer with multi-byte characters split across
tokens), NaN-logit requests, invalid prompts, and cancellations (between steps, and from the streaming callback
during a step). Checked mode validates every invariant of docs/invariants.md
at every transition; the machine checks what needs the whole run:

* every request finishes or errors exactly once, and streamed tokens add up to its output;
* a finished output equals autoregressive greedy decoding with the same stop rules (an independent,
  quadratic oracle below), a retracted-and-resumed request included;
* errors only where expected (NaN logits, invalid prompt, a request too big for the pool);
* sampled requests (temperature > 0, mixed into the batches) stop exactly at their first stop;
* a cancelled request was cancelled, and its output is a prefix of what it would have produced, short of any
  stop (a greedy one: of its autoregressive output); a cancel between steps finishes it at once;
* pages: the running requests hold exactly what the pool has lent, and it returns to empty.
"""

from __future__ import annotations

import codecs
import math

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from speccycle.core import Ports, SamplingParams, SpecConfig
from speccycle.core.config import max_tree_nodes
from speccycle.engine.serving.adaptive import AdaptiveSpeculation
from speccycle.engine.serving.scheduler import Scheduler
from speccycle.statemachine.stops import stop_text_reference
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft, TreeLookupDraft
from speccycle.testing.text import ToyDetokenizer

VOCAB = 24
STOP_STRINGS = ("ab", "é", "€", "a b", "yz\n", "cc")


def greedy_with_stops(target, detokenizer, prompt, params: SamplingParams) -> tuple[list[int], str]:
    """Autoregressive greedy decoding, one token at a time, checking each stop rule after each token."""
    tokens, out = list(prompt), []
    while True:
        token = int(target.next_logits(tokens).argmax())
        out.append(token)
        tokens.append(token)
        if token in params.stop_token_ids:
            return out, "stop"
        data = b"".join(detokenizer.token_bytes(t) for t in out)
        text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data)  # complete characters
        if any(s in text for s in params.stop_strings):
            return out, "stop"
        if len(out) >= params.max_new_tokens:
            return out, "length"


class OptimisticPool(FingerprintPool):
    """Reports two more free pages than it has, as a pool shared with another user may: reservations the
    scheduler counted as fitting fail late (`KVPoolExhausted`), and it must defer or retract then."""

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + 2


@st.composite
def configs(draw) -> SpecConfig:
    steps = draw(st.integers(1, 4))
    topk = draw(st.integers(1, 3))
    n = steps + 1 if topk == 1 else draw(st.integers(2, min(1 + max_tree_nodes(steps, topk), 12)))
    return SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=n, page_size=draw(st.sampled_from([1, 2, 4])))


def request_specs():
    """prompt, max_new_tokens, stop ids, stop strings, and what is wrong with it (None: nothing)."""
    return st.tuples(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
        st.integers(1, 24),
        st.lists(st.integers(0, VOCAB - 1), max_size=2).map(tuple),
        st.lists(st.sampled_from(STOP_STRINGS), max_size=2).map(tuple),
        st.sampled_from([None] * 10 + ["nan", "empty", "vocab", "sampled", "sampled"]),
    )


speculations = st.sampled_from(["on", "off", "adaptive-low", "adaptive-high"])


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        config=configs(),
        family=st.sampled_from(["shifted", "aligned", "lookup"]),
        agreement=st.sampled_from([0.0, 0.6, 0.9]),
        pool_tokens=st.integers(10, 64),
        max_batch=st.integers(1, 6),
        max_prefill=st.none() | st.integers(1, 16),
        admit=st.tuples(st.sampled_from([None, 0.0, 0.5, 1.0]), st.integers(0, 3)),  # admission batching
        optimistic=st.booleans(),
        speculation=speculations,
        first=st.lists(request_specs(), min_size=1, max_size=4),
    )
    def setup(
        self, config, family, agreement, pool_tokens, max_batch, max_prefill, admit, optimistic, speculation, first
    ):
        self.config = config
        pool_class = OptimisticPool if optimistic else FingerprintPool
        self.pool = pool_class(num_pages=math.ceil(pool_tokens / config.page_size), page_size=config.page_size)
        self.target = HashedNgramTarget(self.pool, vocab_size=VOCAB, n=3)
        draft = (
            TreeLookupDraft(self.target, agreement)
            if family == "lookup"
            else NoisyDraft(self.target, agreement, family)
        )
        self.detokenizer = ToyDetokenizer()
        ports = Ports(target=self.target, draft=draft, kv_pool=self.pool, detokenizer=self.detokenizer)
        if speculation.startswith("adaptive"):  # a fixed cost model: the batch moves between shapes, deterministically
            level = 0.1 if speculation == "adaptive-low" else 0.6
            speculation = AdaptiveSpeculation(cost=lambda c, bs: 1.0 + level * bs * c.num_steps, probe_every=2)
        self.streamed: dict[int, list[int]] = {}
        self.finish_calls: list[int] = []
        self.scheduler = Scheduler(
            ports,
            config,
            max_batch_size=max_batch,
            max_prefill_tokens=max_prefill,
            admit_fraction=admit[0],
            admit_wait=admit[1],
            speculation=speculation,
            checked=True,
            on_tokens=self.on_tokens,
            on_finish=lambda request: self.finish_calls.append(request.request_id),
        )
        pairing = "aligned" if family == "aligned" else "shifted"
        self.reserve = config.reserve_len(pairing)
        self.submitted: dict[int, tuple[tuple[int, ...], SamplingParams, str | None]] = {}
        self.cancel_requested: set[int] = set()
        self.cancel_on_stream: set[int] = set()
        self.submit(first)

    def on_tokens(self, rid: int, tokens: list[int]) -> None:
        self.streamed.setdefault(rid, []).extend(tokens)
        if rid in self.cancel_on_stream:  # during a step: it lands when the step ends
            self.cancel_on_stream.discard(rid)
            self.scheduler.cancel(rid)

    @rule(batch=st.lists(request_specs(), min_size=1, max_size=3))
    def submit(self, batch) -> None:
        for prompt, max_new, stop_ids, stop_strings, trouble in batch:
            if trouble == "empty":
                prompt = []
            elif trouble == "vocab":
                prompt = prompt + [VOCAB + 3]
            temperature, seed = (0.8, len(self.submitted)) if trouble == "sampled" else (0.0, None)
            params = SamplingParams(
                max_new_tokens=max_new,
                stop_token_ids=stop_ids,
                stop_strings=stop_strings,
                temperature=temperature,
                seed=seed,
            )
            rid = self.scheduler.submit(prompt, params)
            if trouble == "nan":
                self.target.nan_requests.add(rid)
            self.submitted[rid] = (tuple(prompt), params, trouble)

    @rule(index=st.integers(0, 1000), in_stream=st.booleans())
    def cancel(self, index, in_stream) -> None:
        rid = sorted(self.submitted)[index % len(self.submitted)]
        self.cancel_requested.add(rid)
        if in_stream:
            self.cancel_on_stream.add(rid)
            return
        was_finished = rid in self.scheduler.finished
        assert self.scheduler.cancel(rid) is (not was_finished)
        if not was_finished:
            assert self.scheduler.finished[rid].finish_reason == "cancelled", f"request {rid}: cancel did not land"
            assert self.pool.pages_held(rid) == 0

    @rule(times=st.integers(1, 3))
    def step(self, times) -> None:
        for _ in range(times):
            self.scheduler.step()

    @invariant()
    def pages_are_accounted(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        running = self.scheduler.running.requests if self.scheduler.running is not None else ()
        held = sum(self.pool.pages_held(r.request_id) for r in running)
        assert len(self.pool._free) + held == self.pool.num_pages, "pages held outside the running batch"
        for rid in self.scheduler.finished:
            assert self.pool.pages_held(rid) == 0, f"finished request {rid} still holds pages"

    @invariant()
    def each_finish_is_right(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        assert len(self.finish_calls) == len(set(self.finish_calls)), "a request finished twice"
        assert set(self.finish_calls) == set(self.scheduler.finished)
        for rid, request in self.scheduler.finished.items():
            prompt, params, trouble = self.submitted[rid]
            assert self.streamed.get(rid, []) == list(request.output), f"request {rid}: streamed != output"
            if request.finish_reason == "cancelled":
                self.check_cancelled(rid, request, prompt, params, trouble)
                continue
            if trouble == "sampled":  # no token oracle (sampling is another test's): the stop rules still hold
                self.check_stops(rid, request, prompt, params)
                continue
            if trouble is not None:
                assert request.finish_reason == "error" and request.error, f"request {rid} ({trouble}) did not error"
                continue
            expected, reason = greedy_with_stops(self.target, self.detokenizer, prompt, params)
            fits = math.ceil((len(prompt) + params.max_new_tokens + self.reserve) / self.config.page_size)
            if request.finish_reason == "error":
                assert fits > self.pool.num_pages, f"request {rid} errored but fits the pool: {request.error}"
                assert "pool" in request.error
                assert list(request.output) == expected[: len(request.output)], f"request {rid}: not a prefix"
                continue
            assert list(request.output) == expected, f"request {rid}: {request.output} != greedy {expected}"
            assert request.finish_reason == reason, f"request {rid}: {request.finish_reason} != {reason}"

    def check_cancelled(self, rid, request, prompt, params, trouble) -> None:
        assert rid in self.cancel_requested, f"request {rid} cancelled without a cancel"
        output = list(request.output)
        if trouble not in (None, "sampled"):  # it would have errored at its prefill: cancelled before it
            assert output == [], f"request {rid} ({trouble}): cancelled with an output"
            return
        if trouble is None:
            expected, _ = greedy_with_stops(self.target, self.detokenizer, prompt, params)
            assert len(output) < len(expected) and output == expected[: len(output)], f"request {rid}: not a prefix"
            return
        hit = stop_text_reference(output, params.stop_strings, self.detokenizer) if params.stop_strings else None
        assert hit is None and not set(output) & set(params.stop_token_ids), f"request {rid}: cancelled past a stop"
        assert len(output) < params.max_new_tokens

    def check_stops(self, rid, request, prompt, params) -> None:
        output = list(request.output)
        fits = math.ceil((len(prompt) + params.max_new_tokens + self.reserve) / self.config.page_size)
        if request.finish_reason == "error":
            assert fits > self.pool.num_pages and "pool" in request.error, f"request {rid}: {request.error}"
            return
        assert 1 <= len(output) <= params.max_new_tokens and all(0 <= t < VOCAB for t in output)
        hit = stop_text_reference(output, params.stop_strings, self.detokenizer) if params.stop_strings else None
        stop_ids = [i for i, t in enumerate(output) if t in params.stop_token_ids]
        first_stop = min([i for i in [hit, *stop_ids] if i is not None], default=None)
        if request.finish_reason == "stop":
            assert first_stop == len(output) - 1, (
                f"request {rid}: stopped at {len(output) - 1}, first stop {first_stop}"
            )
        else:
            assert request.finish_reason == "length" and len(output) == params.max_new_tokens and first_stop is None

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        for _ in range(2000):
            if self.scheduler.idle:
                break
            self.scheduler.step()
        assert self.scheduler.idle, "the scheduler did not drain"
        assert set(self.scheduler.finished) == set(self.submitted), "a request was lost"
        self.each_finish_is_right()
        assert len(self.pool._free) == self.pool.num_pages, "KV pages leaked"
        stats, reasons = self.scheduler.stats, [r.finish_reason for r in self.scheduler.finished.values()]
        event(f"retracted: {stats.retractions > 0}")
        event(f"refused: {stats.refused > 0}")
        event(f"late refusals: {isinstance(self.pool, OptimisticPool) and stats.retractions > 0}")
        event(f"both cycle kinds: {stats.spec_cycles > 0 and stats.plain_cycles > 0}")
        event(f"finish reasons: {sorted(set(reasons))}")


TestSchedulerMachine = SchedulerMachine.TestCase


def test_tight_pool_retracts_and_resumes_identically():
    """A pool that holds two requests' cycles but not four: retraction happens, outputs are exact."""
    config = SpecConfig(num_steps=3, topk=1, page_size=2)
    pool = FingerprintPool(num_pages=24, page_size=2)
    target = HashedNgramTarget(pool, vocab_size=VOCAB, n=3)
    ports = Ports(target=target, draft=NoisyDraft(target, 0.8), kv_pool=pool)
    scheduler = Scheduler(ports, config, checked=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    params = SamplingParams(max_new_tokens=20)
    ids = [scheduler.submit(prompts[0], params), scheduler.submit(prompts[1], params)]
    scheduler.step()
    ids += [scheduler.submit(p, params) for p in prompts[2:]]
    scheduler.run()
    assert scheduler.stats.retractions > 0, "the pool was meant to be too small for every request at once"
    for rid, prompt in zip(ids, prompts):
        assert list(scheduler.finished[rid].output) == target.greedy(prompt, 20)
    assert pool.num_free_pages == pool.num_pages
