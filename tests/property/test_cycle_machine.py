"""The cycle as a Hypothesis state machine, against a small pure-Python model of the KV pool.

Random configs (S 0..8 (0: no draft), K 1..4, N within bounds, P in {1, 2, 4, 16}), four draft families (EAGLE-shifted,
aligned, random-tree lookup, n-gram prompt lookup), ragged
prompts, requests joining between cycles and finishing at different times (stop tokens, length), about one in
four with speculation off (``speculate=False``: one token a cycle, no draft rows, merged with the others).
The machine runs in checked mode, so every invariant of docs/invariants.md is validated at every boundary; the
rules below add what needs the whole run: losslessness (10), KV conservation (8) against the model,
and every request finishing exactly once.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from speccycle.core import Admitted, Ports, Request, SamplingParams, SpecConfig
from speccycle.core.config import max_tree_nodes
from speccycle.engine.drafters.ngram import NgramDraft
from speccycle.statemachine import run_cycle
from speccycle.statemachine.batching import merge_ready
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft, TreeLookupDraft

VOCAB = 24


@st.composite
def configs(draw) -> SpecConfig:
    steps = draw(st.integers(0, 8))
    topk = draw(st.integers(1, 4))
    if steps == 0:  # no draft: the root alone, a plain decode step through the cycle
        n = 1
    elif topk == 1:
        n = steps + 1
    else:
        n = draw(st.integers(2, min(1 + max_tree_nodes(steps, topk), 40)))
    return SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=n, page_size=draw(st.sampled_from([1, 2, 4, 16])))


class CycleMachine(RuleBasedStateMachine):
    backend = None  # the registry's choice (torch on CPU); tests/kernels runs this machine on the Triton kernels

    @initialize(
        config=configs(),
        family=st.sampled_from(["shifted", "aligned", "lookup", "ngram"]),
        agreement=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    )
    def setup(self, config: SpecConfig, family: str, agreement: float) -> None:
        self.config = config
        self.pool = FingerprintPool(num_pages=4096 // config.page_size + 64, page_size=config.page_size)
        self.target = HashedNgramTarget(self.pool, vocab_size=VOCAB, n=3)
        if family == "lookup":
            draft = TreeLookupDraft(self.target, agreement)
        elif family == "ngram":  # the engine's prompt-lookup draft over the requests' own histories
            draft = NgramDraft(VOCAB)
        else:
            draft = NoisyDraft(self.target, agreement, family)
        self.ports = Ports(target=self.target, draft=draft, kv_pool=self.pool)
        self.offset = 1 if family == "aligned" else 0
        self.pairing = "aligned" if family == "aligned" else "shifted"
        self.ready = None
        self.next_id = 0
        self.submitted: dict[int, Request] = {}
        self.finished: dict[int, Request] = {}
        self.expected_pages: dict[int, int] = {}  # the pool model: pages each live request holds

    def _pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.page_size)

    def _absorb(self, ready) -> None:
        for request in ready.retired:
            assert request.request_id not in self.finished, f"request {request.request_id} finished twice"
            self.finished[request.request_id] = request
            self.expected_pages.pop(request.request_id)

    @rule(
        prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), min_size=1, max_size=3),
        max_new=st.lists(st.integers(1, 20), min_size=3, max_size=3),
        stop=st.lists(st.integers(0, VOCAB - 1), max_size=2),
        speculate=st.lists(st.sampled_from([True, True, True, False]), min_size=3, max_size=3),
    )
    def admit(self, prompts, max_new, stop, speculate) -> None:
        requests = []
        for prompt, budget, spec in zip(prompts, max_new, speculate):
            params = SamplingParams(max_new_tokens=budget, stop_token_ids=tuple(stop), speculate=spec)
            requests.append(Request(self.next_id, tuple(prompt), params))
            self.submitted[self.next_id] = requests[-1]
            self.expected_pages[self.next_id] = self._pages(len(prompt) + self.offset)
            self.next_id += 1
        admitted = run_cycle(
            Admitted(config=self.config, requests=tuple(requests)), self.ports, self.backend, checked=True
        )
        self._absorb(admitted)
        self.ready = admitted if self.ready is None else merge_ready(self.ready, admitted)

    @precondition(lambda self: self.ready is not None and len(self.ready.requests) > 0)
    @rule()
    def cycle(self) -> None:
        reserve = self.config.reserve_len(self.pairing)
        for request, L in zip(self.ready.requests, self.ready.seq_lens.tolist()):
            rid = request.request_id
            self.expected_pages[rid] = max(self.expected_pages[rid], self._pages(L + reserve))
        self.ready = run_cycle(self.ready, self.ports, self.backend, checked=True)
        self._absorb(self.ready)

    @invariant()
    def pool_matches_model(self) -> None:
        if not hasattr(self, "pool"):
            return
        for rid, pages in self.expected_pages.items():
            assert self.pool.pages_held(rid) == pages, (
                f"request {rid}: pool {self.pool.pages_held(rid)} != model {pages}"
            )
        for rid in self.finished:
            assert self.pool.pages_held(rid) == 0
        assert self.pool.num_free_pages == self.pool.num_pages - sum(self.expected_pages.values())
        assert len(self.pool.freed) == len(set(self.pool.freed)) == len(self.finished)

    @invariant()
    def finished_outputs_are_greedy(self) -> None:
        for rid, request in getattr(self, "finished", {}).items():
            params = request.sampling
            expected = self.target.greedy(request.prompt, params.max_new_tokens, params.stop_token_ids)
            assert list(request.output) == expected, f"request {rid}: {request.output} != greedy {expected}"

    def teardown(self) -> None:
        if getattr(self, "ready", None) is None:
            return
        while self.ready.requests:
            self.cycle()
        assert set(self.finished) == set(self.submitted), "a request was lost"
        assert self.pool.num_free_pages == self.pool.num_pages, "KV pages leaked"
        self.finished_outputs_are_greedy()


TestCycleMachine = CycleMachine.TestCase
