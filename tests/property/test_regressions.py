"""One named test per historical bug class behind the invariants of docs/invariants.md."""

from __future__ import annotations

import re

import attrs
import hypothesis
import pytest
import torch
from hypothesis import strategies as st
from speccycle.backends.torch import TorchBackend
from speccycle.core import Admitted, Ports, Request, SamplingParams, SpecConfig
from speccycle.statemachine import InvariantViolation, step, transitions
from speccycle.statemachine.checks import check_transition
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft

backend = TorchBackend()


def _machine(config: SpecConfig, pairing: str = "shifted", agreement: float = 0.8):
    pool = FingerprintPool(num_pages=512, page_size=config.page_size)
    target = HashedNgramTarget(pool, vocab_size=32, n=3)
    draft = NoisyDraft(target, agreement, pairing)
    return Ports(target=target, draft=draft, kv_pool=pool), target, draft


def _ready(ports, config, prompts=((1, 2, 3, 4, 5), (7, 8, 9))):
    requests = tuple(Request(i, p, SamplingParams(max_new_tokens=40)) for i, p in enumerate(prompts))
    record = Admitted(config=config, requests=requests)
    while type(record).__name__ != "Ready":
        record = step(record, ports, backend, checked=True)
    return record


def test_draft_forward_j_runs_at_L_plus_j_not_L_plus_j_plus_1():
    """SGLang PR 25015: the position was advanced before the forward, so forward 0 ran at L + 1."""
    config = SpecConfig(num_steps=4, topk=2, num_draft_tokens=7)
    ports, _, draft = _machine(config)
    ready = _ready(ports, config)
    drafted = step(ready, ports, backend, checked=True)
    for j, positions in enumerate(draft.step_positions):
        expected = ready.seq_lens.repeat_interleave(config.topk) + j
        assert torch.equal(positions, expected), f"draft forward {j} ran at {positions.tolist()}"
    # The same record with positions advanced before the forward is rejected by checked mode...
    shifted = attrs.evolve(drafted, draft_positions=drafted.draft_positions + 1)
    with pytest.raises(InvariantViolation, match="invariant 2"):
        check_transition(ready, shifted, ports)


def test_advancing_the_position_before_the_forward_is_caught(monkeypatch):
    """...and a runner with the PR 25015 bug fails: the EAGLE draft sees its parent at the wrong position."""
    config = SpecConfig(num_steps=3, topk=1)
    ports, _, _ = _machine(config)
    ready = _ready(ports, config)
    monkeypatch.setattr(transitions, "draft_position", lambda L, depth, offset: L + depth + offset)
    with pytest.raises(AssertionError, match="parent must sit one position before"):
        step(ready, ports, backend, checked=True)


def test_bonus_is_read_at_stride_S_plus_1_not_N():
    """SGLang PR 26866: the bonus token was read at stride N (num_draft_tokens), past the row."""
    config = SpecConfig(num_steps=2, topk=3, num_draft_tokens=7)  # N = 7 > S + 1 = 3
    accept_tokens = torch.tensor([[10, 11, 12], [20, 21, 22]])  # [bs, S + 1]
    accept_len = torch.tensor([2, 3])
    assert backend.fill_bonus(accept_tokens, accept_len, config.accept_width).tolist() == [11, 22]
    with pytest.raises(ValueError, match="expected bs \\* stride"):
        backend.fill_bonus(accept_tokens, accept_len, config.num_draft_tokens)
    # In a real cycle, a bonus read at stride N is a checked-mode failure.
    ports, _, _ = _machine(config)
    record = _ready(ports, config)
    while type(record).__name__ != "Accepted":
        previous, record = record, step(record, ports, backend, checked=True)
    flat = record.accepted_rows.predict.reshape(-1)
    wide = torch.cat([flat, flat.new_zeros(len(record.requests) * config.num_draft_tokens)])
    wrong = wide[torch.arange(len(record.requests)) * config.num_draft_tokens + record.accept_len - 1]
    if not torch.equal(wrong, record.bonus):
        with pytest.raises(InvariantViolation, match="invariant 6"):
            check_transition(previous, attrs.evolve(record, bonus=wrong), ports)


def test_kv_move_is_sized_by_accept_width_not_bs_times_N():
    """SGLang PR 26866: the KV move was sized bs * N and read out of bounds."""
    bs, n, width = 3, 9, 4  # S = 3, N = 9
    verify_slots = torch.arange(bs * n).view(bs, n) + 100
    # Each request accepted the path 0 -> 2 -> 5 -> 8 (rows already in the tree's depth order).
    rows = torch.tensor([0, 2, 5, 8])
    accept_index = rows[None, :] + (torch.arange(bs) * n)[:, None]
    accept_len = torch.tensor([4, 2, 1])
    src, dst = backend.plan_kv_move(accept_index, accept_len, verify_slots)
    assert src.numel() <= bs * width
    assert src.tolist() == [102, 105, 108, 111] and dst.tolist() == [101, 102, 103, 110]
    buf = torch.arange(200)[:, None].repeat(1, 2)
    backend.move_kv([buf], src, dst)  # gather first: row 5 -> 2 while row 2 -> 1
    assert buf[101:104, 0].tolist() == [102, 105, 108] and buf[110, 0] == 111
    # A Compacted record claiming bs * N moves is rejected.
    config = SpecConfig(num_steps=3, topk=3, num_draft_tokens=9)
    ports, _, _ = _machine(config)
    record = _ready(ports, config, prompts=((1, 2, 3),) * 1)
    while type(record).__name__ != "Accepted":
        record = step(record, ports, backend, checked=True)
    compacted = step(record, ports, backend, checked=True)
    oversized = torch.zeros(len(record.requests) * config.num_draft_tokens + 1, dtype=torch.long)
    with pytest.raises(InvariantViolation, match="invariant 7"):
        check_transition(record, attrs.evolve(compacted, kv_moves=(oversized, oversized)), ports)


def test_draft_leaves_positions_and_seq_lens_as_it_found_them():
    """SGLang PR 25015: a captured draft loop advanced positions in place and left them advanced."""
    config = SpecConfig(num_steps=5, topk=1)
    ports, _, draft = _machine(config)
    ready = _ready(ports, config)
    seq_lens_before = ready.seq_lens.clone()
    step(ready, ports, backend, checked=True)
    assert torch.equal(ready.seq_lens, seq_lens_before)
    for given, at_call in draft.step_inputs:
        assert torch.equal(given, at_call), "a positions tensor handed to the draft was changed afterwards"


def test_argmax_fast_path_picks_the_true_maximum_where_low_precision_softmax_ties():
    """SGLang PR 26235/26397: argmax and softmax + max picked different tokens in low precision.

    Two logits that differ in bf16 round to one probability after a bf16 softmax; max then returns
    the lower index. The K == 1 fast path takes argmax of the logits, which is exact in any dtype.
    """
    logits = torch.zeros((1, 64), dtype=torch.bfloat16)
    logits[0, 3] = 0.25
    logits[0, 40] = 0.251953125  # the true maximum, one bf16 ulp above
    low_precision = torch.softmax(logits, dim=-1)
    assert low_precision[0, 3] == low_precision[0, 40], "the bf16 softmax is expected to tie here"
    assert int(low_precision.argmax()) == 3  # softmax + max picks the wrong token
    _, ids = backend.select_topk(logits, 1)
    assert int(ids[0, 0]) == 40 == int(logits.float().argmax())


class _PermutedVocabDraft:
    """`NoisyDraft` whose extend and step return their logits' columns in a permuted order, with the permutation
    as `ModelOutput.vocab_map` (column ``j`` is token ``perm[j]``): a draft with its own vocabulary ordering."""

    def __init__(self, draft: NoisyDraft, vocab_size: int, seed: int) -> None:
        self.inner, self.kind, self.pairing = draft, draft.kind, draft.pairing
        self.perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))

    def _permuted(self, out):
        return attrs.evolve(out, logits=out.logits[:, self.perm], vocab_map=self.perm)

    def extend(self, batch, target_hidden):
        return self._permuted(self.inner.extend(batch, target_hidden))

    def step(self, batch, parent_hidden):
        return self._permuted(self.inner.step(batch, parent_hidden))


@pytest.mark.parametrize("config", [SpecConfig(num_steps=3), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)])
def test_a_draft_vocabulary_map_is_applied_in_the_extend_and_every_level(config):
    """`ModelOutput.vocab_map` from the draft extend and from each draft level: the candidates are the target's
    ids (`select_topk(..., vocab_map)`), so a draft returning its logits in its own column order runs the same
    greedy cycles as the unpermuted draft, in checked mode; a sampled request refuses such a draft."""
    from speccycle.statemachine import generate

    runs = []
    for permuted in (False, True):
        ports, target, draft = _machine(config)
        if permuted:
            ports = attrs.evolve(ports, draft=_PermutedVocabDraft(draft, target.vocab_size, seed=5))
        requests = [Request(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(((1, 2, 3, 4), (9, 8)))]
        events = []
        done = generate(requests, config, ports, backend, checked=True, trace=events.append)
        runs.append(([list(r.output) for r in done], sum(e.event == "verify" for e in events)))
    # the outputs match whatever the draft proposes (lossless); the verify count shows the proposals matched
    assert runs[0] == runs[1]
    assert runs[0][1] < 24  # drafts were accepted: ids read as columns would rarely be
    ports, target, draft = _machine(config)
    ports = attrs.evolve(ports, draft=_PermutedVocabDraft(draft, target.vocab_size, seed=5))
    sampled = Request(0, (1, 2, 3, 4), SamplingParams(max_new_tokens=8, temperature=1.0, seed=0))
    with pytest.raises(ValueError, match="target vocabulary"):
        generate([sampled], config, ports, backend)


@hypothesis.given(
    num_steps=st.integers(0, 6) | st.sampled_from([64, 65]),
    topk=st.integers(0, 4) | st.sampled_from([16, 17]),
    n=st.none() | st.integers(0, 40),
    page=st.sampled_from([0, 1, 16, 1024, 1025]),
)
@hypothesis.example(num_steps=2, topk=2, n=50, page=1)  # the message that said [1, 7]
def test_every_range_a_spec_config_error_states_is_the_range_it_enforces(num_steps, topk, n, page):
    """`SpecConfig(num_steps=2, topk=2, num_draft_tokens=50)` said "allowed [1, 7]" where N = 1 was refused
    too: each bound a message states is accepted, and one past it is refused with the same message."""
    kwargs = dict(num_steps=num_steps, topk=topk, num_draft_tokens=n, page_size=page)
    try:
        SpecConfig(**kwargs)
        return
    except ValueError as error:
        message = str(error)
    stated = re.match(r"(\w+) \(\w\)=(-?\d+) is out of range: allowed \[(-?\d+), (-?\d+)\]", message)
    if stated is None:  # the chain's rule, N == S + 1: a value, not a range
        assert "must equal num_steps (S) + 1" in message, message
        return
    field, low, high = stated.group(1), int(stated.group(3)), int(stated.group(4))
    for value, inside in ((low, True), (high, True), (low - 1, False), (high + 1, False)):
        try:
            SpecConfig(**{**kwargs, field: value})
        except ValueError as other:
            if inside:  # a bound: refused, if at all, for another field
                assert not str(other).startswith(f"{field} "), (value, str(other))
            else:
                assert str(other).startswith(f"{field} ") and f"allowed [{low}, {high}]" in str(other), str(other)
        else:
            assert inside, f"{field}={value} is outside the stated [{low}, {high}] and was accepted"
