"""Invariants 12 (recurrent state) and 13 (block drafts) as Hypothesis properties.

* A state machine over the whole cycle with a recurrent target (`RecurrentHashTarget`: its state is
  kept in a real `RecurrentPool` and checked against the tokens every row attends) and five draft
  families (EAGLE-shifted, aligned, random-tree lookup, n-gram, DFlash-like blocks); random configs,
  ragged prompts, requests joining and finishing. Checked mode validates invariant 12 (the pool holds
  exactly ``L`` tokens per live request, no uncommitted verify rows) and 13 (a block's accepted run is
  its agreeing prefix) at every boundary; the rules add losslessness and slot conservation.
* The block-verify op against the chain walk, and the commit of a real Mamba mixer's state against a
  causal run over the accepted path.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from speccycle.backends.torch import TorchBackend
from speccycle.backends.torch.block import verify_block
from speccycle.backends.torch.recurrent import selective_scan_tree
from speccycle.core import Admitted, ForwardBatch, Ports, Request, SamplingParams, SpecConfig
from speccycle.core.config import max_tree_nodes
from speccycle.core.tree import ancestor_mask, chain_tree, tree_depths
from speccycle.engine.memory.recurrent_pool import RecurrentPool
from speccycle.engine.models.mamba import MambaConfig, MambaMixer, random_mamba_weights
from speccycle.statemachine import run_cycle
from speccycle.statemachine.batching import merge_ready
from speccycle.testing import FingerprintPool, NoisyDraft, TreeLookupDraft
from speccycle.testing.recurrent import NoisyBlockDraft, RecurrentHashTarget

VOCAB = 24
FAMILIES = ["shifted", "aligned", "lookup", "block"]


@st.composite
def family_and_config(draw):
    family = draw(st.sampled_from(FAMILIES))
    steps = draw(st.integers(1, 7))
    topk = 1 if family == "block" else draw(st.integers(1, 4))
    n = steps + 1 if topk == 1 else draw(st.integers(2, min(1 + max_tree_nodes(steps, topk), 32)))
    page = draw(st.sampled_from([1, 2, 4, 16]))
    return family, SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=n, page_size=page)


class RecurrentCycleMachine(RuleBasedStateMachine):
    @initialize(setup=family_and_config(), agreement=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    def setup(self, setup, agreement: float) -> None:
        family, config = setup
        self.config = config
        self.pool = FingerprintPool(num_pages=4096 // config.page_size + 64, page_size=config.page_size)
        self.target = RecurrentHashTarget(self.pool, vocab_size=VOCAB, n=3)
        if family == "block":
            draft = NoisyBlockDraft(self.target, config.num_draft_tokens, agreement)
        elif family == "lookup":
            draft = TreeLookupDraft(self.target, agreement)
        else:
            draft = NoisyDraft(self.target, agreement, family)
        self.ports = Ports(target=self.target, draft=draft, kv_pool=self.pool, recurrent=self.target.states)
        self.ready = None
        self.next_id = 0
        self.submitted: dict[int, Request] = {}
        self.finished: dict[int, Request] = {}

    def _absorb(self, ready) -> None:
        for request in ready.retired:
            assert request.request_id not in self.finished, f"request {request.request_id} finished twice"
            self.finished[request.request_id] = request

    @rule(
        prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10), min_size=1, max_size=3),
        max_new=st.lists(st.integers(1, 16), min_size=3, max_size=3),
        stop=st.lists(st.integers(0, VOCAB - 1), max_size=2),
    )
    def admit(self, prompts, max_new, stop) -> None:
        requests = []
        for prompt, budget in zip(prompts, max_new):
            params = SamplingParams(max_new_tokens=budget, stop_token_ids=tuple(stop))
            requests.append(Request(self.next_id, tuple(prompt), params))
            self.submitted[self.next_id] = requests[-1]
            self.next_id += 1
        admitted = run_cycle(Admitted(config=self.config, requests=tuple(requests)), self.ports, checked=True)
        self._absorb(admitted)
        self.ready = admitted if self.ready is None else merge_ready(self.ready, admitted)

    @precondition(lambda self: self.ready is not None and len(self.ready.requests) > 0)
    @rule()
    def cycle(self) -> None:
        self.ready = run_cycle(self.ready, self.ports, checked=True)
        self._absorb(self.ready)

    @invariant()
    def recurrent_slots_are_conserved(self) -> None:
        if getattr(self, "ready", None) is None:
            return
        states = self.target.states
        live = [r.request_id for r in self.ready.requests]
        assert states.num_free_slots == states.max_requests - len(live), "a recurrent state slot leaked"
        assert states.state_lens(live) == self.ready.seq_lens.tolist()

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
        assert self.target.states.num_free_slots == self.target.states.max_requests, "recurrent slots leaked"
        self.finished_outputs_are_greedy()


RecurrentCycleMachine.TestCase.settings = settings(RecurrentCycleMachine.TestCase.settings, max_examples=20)
TestRecurrentCycleMachine = RecurrentCycleMachine.TestCase


@given(
    block=st.integers(1, 12),
    data=st.data(),
)
def test_invariant_13_block_verify_is_the_chain_walk(block, data):
    """``cumprod(cand[1:] == target[:-1]).sum()`` is in [0, B - 1] and equals the chain's greedy walk."""
    bs = data.draw(st.integers(1, 4))
    tokens = st.lists(st.integers(0, 3), min_size=block, max_size=block)
    candidates = torch.tensor(data.draw(st.lists(tokens, min_size=bs, max_size=bs)))
    target = torch.tensor(data.draw(st.lists(tokens, min_size=bs, max_size=bs)))
    correct_len, bonus = verify_block(candidates, target)
    assert bool(((correct_len >= 0) & (correct_len <= block - 1)).all())
    assert torch.equal(bonus, target[torch.arange(bs), correct_len])
    for b in range(bs):  # the first disagreement, by hand
        n = 0
        while n < block - 1 and int(candidates[b, n + 1]) == int(target[b, n]):
            n += 1
        assert int(correct_len[b]) == n
    _, parents = chain_tree(candidates[:, 0], candidates[:, 1:])
    _, accept_len = TorchBackend().verify_greedy(candidates, parents, target, block)
    assert torch.equal(accept_len, correct_len + 1)


MAMBA = MambaConfig(d_model=8, d_inner=6, d_state=3, d_conv=3, dt_rank=2)


def _mixer_and_pool(max_rows: int = 16):
    weights = random_mamba_weights(MAMBA, torch.Generator().manual_seed(0), scale=0.5)
    mixer = MambaMixer(MAMBA, {"m." + k: v for k, v in weights.items()}, "m.", state_layer=0)
    pool = RecurrentPool(num_layers=1, state_shapes=MAMBA.state_shapes(), max_requests=4, max_rows=max_rows)
    return mixer, pool


def _batch(positions, out_slots, extra, request_id=0) -> ForwardBatch:
    n = len(positions)
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.tensor(positions),
        row_request=torch.zeros(n, dtype=torch.long),
        out_slots=torch.tensor(out_slots),
        prefix_lens=torch.tensor(positions) + 1,
        extra_slots=extra,
        page_table=torch.zeros((1, 1), dtype=torch.long),
        page_size=1,
        request_ids=(request_id,),
    )


def _causal(mixer, pool, x, start, request_id=0):
    n = x.shape[0]
    positions = list(range(start, start + n))
    batch = _batch(positions, positions, torch.empty((n, 0), dtype=torch.long), request_id)
    return mixer(x, pool, pool.plan(batch), selective_scan_tree)


@settings(max_examples=30)
@given(data=st.data())
def test_invariant_12_commit_adopts_the_state_of_the_accepted_path(data):
    """After a tree verify and a commit at the last accepted row, the Mamba state (conv window and scan
    state) equals a causal run over the prefix and the accepted path; every verify row's output equals
    the causal output at the end of its root-to-row path."""
    n = data.draw(st.integers(1, 8))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    prefix_len = data.draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    prefix_x = torch.randn(prefix_len, MAMBA.d_model, generator=gen)
    tree_x = torch.randn(n, MAMBA.d_model, generator=gen)
    parents_t = torch.tensor([parents])
    depths = tree_depths(parents_t)[0]
    mask = ancestor_mask(parents_t)[0]
    slots = torch.arange(100, 100 + n)

    mixer, pool = _mixer_and_pool()
    _causal(mixer, pool, prefix_x, 0)
    extra = torch.where(mask, slots[None, :], -1)
    verify = _batch((prefix_len + depths).tolist(), slots.tolist(), extra)
    y_tree = mixer(tree_x, pool, pool.plan(verify), selective_scan_tree)

    def path_to(row):
        path = [row]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        return path

    for row in range(n):  # every verify row equals its causal path
        ref_mixer, ref_pool = _mixer_and_pool()
        y = _causal(ref_mixer, ref_pool, torch.cat([prefix_x, tree_x[path_to(row)]]), 0)
        torch.testing.assert_close(y_tree[row], y[-1], rtol=1e-5, atol=1e-5)

    last = data.draw(st.integers(0, n - 1))  # the last accepted row; its path is the accepted run
    pool.commit(request_ids=(0,), last_correct_step_indices=torch.tensor([last]))
    ref_mixer, ref_pool = _mixer_and_pool()
    _causal(ref_mixer, ref_pool, torch.cat([prefix_x, tree_x[path_to(last)]]), 0)
    assert pool.state_len(request_id=0) == prefix_len + len(path_to(last))
    for name in ("conv", "ssm"):
        torch.testing.assert_close(pool.states[name][:, 0], ref_pool.states[name][:, 0], rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(pool.states["ssm"].abs().sum()))
