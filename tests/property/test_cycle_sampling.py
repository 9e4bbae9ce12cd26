"""Invariant 11 through the cycle: sampled requests commit tokens distributed as the target's.

`test_sampling.py` checks the verify ops alone; here thousands of sampled requests run the whole
cycle (prefill, draft extend, draft, verify, accept, compact) on `BatchedNgramTarget`, whose
distribution after any prefix is known exactly (`HashedNgramTarget.next_logits`, processed by the
request's temperature, top-k and top-p). Each request is one trial with its own seed; its first four
output tokens ``t0`` (the prefill's sample), ``t1`` (the first verify's), ``t2`` and ``t3`` (the same
verify's, or a later cycle's) are compared by chi-square tests with the exact distributions of ``t0``
and of the pairs ``(t1, t2)`` and ``(t2, t3)`` (the earlier tokens summed out): the first committed
token and the joint of two steps, then the steps that reach depth-2 and depth-3 draft nodes.
Chains and trees, forward drafts (shifted and aligned
pairing) and lookup drafts (point masses), with truncation, padding (a draft that runs out of mass)
and a draft equal to the target.

Sizes: the ``ci`` profile runs a few thousand trials per case (seconds); the ``thorough`` profile
sizes each case so that moving 1% of the probability of ``(t1, t2)`` from its most likely cell to the
second has chi-square noncentrality >= 100 + 1.5 df, and asserts that its own samples, so shifted,
fail the test. `test_detects_a_reranked_sampled_tree` shows the test catches EAGLE-2's global rerank.
"""

from __future__ import annotations

import itertools
import math
import os

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from speccycle.backends.torch.sampling import process_logits
from speccycle.core import Accepted, Admitted, Compacted, Ports, Request, SamplingParams, SpecConfig
from speccycle.statemachine import generate, sampling, step
from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft, TreeLookupDraft
from speccycle.testing.batched import BatchedNgramDraft, BatchedNgramTarget
from speccycle.testing.stats import chi_square_pvalue, one_percent_noncentrality, shift_one_percent

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
ALPHA = 1e-5  # per chi-square test
CI_TRIALS = 4000
MAX_TRIALS = 400_000
CHUNK = 2000  # requests per batch
PROMPT = (5, 1, 4, 1)


@attrs.frozen
class Case:
    family: str  # "shifted" / "aligned": BatchedNgramDraft; "lookup": TreeLookupDraft (point masses)
    steps: int
    topk: int
    draft_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    mix: float = 0.5  # the draft's share of salted logits (0: q == p)
    vocab: int = 8
    extra: tuple = ()  # further SamplingParams fields, (name, value) pairs: min_p, penalties, bias, bad words, ...
    resting: bool = False  # requests of odd seed run with speculate=False beside the others

    def config(self) -> SpecConfig:
        return SpecConfig(num_steps=self.steps, topk=self.topk, num_draft_tokens=self.draft_tokens, page_size=4)

    def params(self, seed: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=seed,
            max_new_tokens=4,
            speculate=not (self.resting and seed % 2),
            **dict(self.extra),
        )


def history_bonus(history, row):
    """A logits processor that reads the whole history: +1.5 on token ``sum(history) % V``."""
    row = row.clone()
    row[sum(history) % row.shape[0]] += 1.5
    return row


def reference_logits(params: SamplingParams, prompt, output, logits: torch.Tensor) -> torch.Tensor:
    """What autoregressive decoding does to the logits after ``prompt + output``, written out token by token."""
    x = logits.double().clone()
    history = tuple(prompt) + tuple(output)
    r = params.repetition_penalty
    for t in set(history):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    for t, bias in params.logit_bias:
        x[t] += bias
    for word in params.bad_words:
        if len(word) == 1 or history[len(history) - len(word) + 1 :] == word[:-1]:
            x[word[-1]] = -math.inf
    if params.logits_processor is not None:
        x = params.logits_processor(history, x.float()).double()
    return x.float()


def reference_probs(params: SamplingParams, prompt, output, logits: torch.Tensor) -> torch.Tensor:
    x = reference_logits(params, prompt, output, logits)[None]
    return process_logits(x, params.temperature, params.top_k, params.top_p, params.min_p)[0]


CASES = {
    "chain-shifted": Case("shifted", 3, 1, 4),
    "chain-aligned-q-equals-p": Case("aligned", 2, 1, 3, temperature=0.5, top_k=3, mix=0.0),
    "tree-aligned-truncated": Case("aligned", 3, 3, 8, temperature=0.7, top_k=5),
    "tree-shifted-padding": Case("shifted", 3, 3, 9, temperature=1.5, top_p=0.6, mix=0.3),  # 13% padding rows
    "tree-shifted-deep": Case("shifted", 3, 2, 10, mix=0.2),  # depth 3: nodes under the frontier EAGLE-2 picks
    "tree-lookup-point-mass": Case("lookup", 3, 2, 6, temperature=1.3),
    "chain-lookup-point-mass": Case("lookup", 3, 1, 4, temperature=0.8, top_p=0.9),
    # history-dependent logits: each verify row sees its own tree path (statemachine/logits.py)
    "chain-penalties-min-p": Case(
        "shifted", 3, 1, 4, temperature=0.9, mix=0.3,
        extra=(("min_p", 0.08), ("repetition_penalty", 1.6), ("frequency_penalty", 0.7), ("presence_penalty", 0.4)),
    ),
    "tree-bias-bad-words-resting": Case(
        "aligned", 3, 2, 6, mix=0.3, resting=True,
        extra=(
            ("logit_bias", ((2, 1.5), (5, -1.0))), ("bad_words", ((3,), (1, 4), (4, 4))), ("frequency_penalty", 0.8)
        ),
    ),
    "tree-processor": Case("shifted", 2, 2, 5, temperature=1.2, mix=0.3, extra=(("logits_processor", history_bonus),)),
}  # fmt: skip


def _ports(case: Case, trials: int):
    config = case.config()
    pages = trials * (-(-(len(PROMPT) + 4 + config.reserve_len("aligned")) // config.page_size)) + 64
    pool = FingerprintPool(num_pages=pages, page_size=config.page_size)
    target = BatchedNgramTarget(pool, vocab_size=case.vocab, n=2)
    if case.family == "lookup":
        draft = TreeLookupDraft(target, agreement=0.5)
    else:
        draft = BatchedNgramDraft(target, mix=case.mix, pairing=case.family)
    return Ports(target=target, draft=draft, kv_pool=pool), target


def run_trials(case: Case, trials: int, seed: int) -> tuple[torch.Tensor, float]:
    """The first four output tokens of ``trials`` sampled requests ``[trials, 4]``, and tau of the first verify."""
    outputs, committed, verifies = [], 0, 0
    for start in range(0, trials, CHUNK):
        count = min(CHUNK, trials - start)
        ports, _ = _ports(case, count)
        requests = tuple(Request(start + i, PROMPT, case.params(seed * 1_000_003 + start + i)) for i in range(count))
        record, done, first_verify = Admitted(config=case.config(), requests=requests), {}, True
        while not (isinstance(record, Compacted) and not record.requests):
            previous, record = record, step(record, ports)
            if isinstance(previous, Accepted) and first_verify:
                committed, verifies, first_verify = committed + int(record.accept_len.sum()), verifies + count, False
            if isinstance(record, Compacted):
                done.update({r.request_id: r for r in record.retired})
        outputs.append(torch.tensor([done[r.request_id].output for r in requests]))
    return torch.cat(outputs), committed / verifies


def exact_distributions(target: HashedNgramTarget, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``P(t0)`` ``[V]``, ``P(t1, t2)`` and ``P(t2, t3)`` ``[V, V]``, exactly (earlier tokens summed out)."""
    vocab, params = case.vocab, case.params(0)

    def dist(depth: int) -> torch.Tensor:
        """``P(t_depth | t_0 .. t_depth-1)`` over every prefix: ``[V] * depth + [V]``."""
        prefixes = list(itertools.product(range(vocab), repeat=depth))
        probs = torch.stack(
            [reference_probs(params, PROMPT, prefix, target.next_logits(list(PROMPT + prefix))) for prefix in prefixes]
        ).double()
        return probs.view(*([vocab] * depth), vocab)

    p0, p1, p2, p3 = (dist(d) for d in range(4))
    return p0, torch.einsum("a,ab,abc->bc", p0, p1, p2), torch.einsum("a,ab,abc,abcd->cd", p0, p1, p2, p3)


def _trials_for(joint: torch.Tensor) -> tuple[int, bool]:
    if not THOROUGH:
        return CI_TRIALS, False
    needed = (100 + 1.5 * (int((joint > 0).sum()) - 1)) / one_percent_noncentrality(joint)
    return int(min(MAX_TRIALS, max(CI_TRIALS, needed))), needed <= MAX_TRIALS


@pytest.mark.parametrize("name", list(CASES))
def test_committed_tokens_follow_the_target_through_the_cycle(name):
    case = CASES[name]
    _, target = _ports(case, 1)
    p0, joint, later = exact_distributions(target, case)
    trials, powered = _trials_for(joint)
    tokens, tau = run_trials(case, trials, seed=sorted(CASES).index(name) + 1)
    vocab = case.vocab
    assert tau > 1.2, f"the drafts are hardly ever accepted (tau {tau:.2f}): the case tests little"
    for what, samples, probs in [
        ("t0", tokens[:, 0], p0),
        ("t1", tokens[:, 1], joint.sum(1)),
        ("(t1, t2)", tokens[:, 1] * vocab + tokens[:, 2], joint.flatten()),
        ("(t2, t3)", tokens[:, 2] * vocab + tokens[:, 3], later.flatten()),
    ]:
        pvalue = chi_square_pvalue(torch.bincount(samples, minlength=probs.numel()), probs)
        assert pvalue >= ALPHA, f"{name}: {what} does not follow the target (p-value {pvalue:.2e}, n = {trials})"
    if powered:
        gen = torch.Generator().manual_seed(0)
        shifted = shift_one_percent(tokens[:, 1] * vocab + tokens[:, 2], joint.flatten(), gen)
        pvalue = chi_square_pvalue(torch.bincount(shifted, minlength=vocab * vocab), joint.flatten())
        assert pvalue < ALPHA, f"{name}: the test missed a 1% shift of (t1, t2) (p-value {pvalue:.2e})"


def test_detects_a_reranked_sampled_tree(monkeypatch):
    """EAGLE-2's global rerank on sampled trees: the rerank keeps drawn children by their own q, so it is lossy."""
    case = Case("aligned", 3, 3, 5, mix=0.7)
    _, target = _ports(case, 1)
    _, joint, _ = exact_distributions(target, case)
    monkeypatch.setattr(sampling, "level_order_tree", _rerank_by_score)
    tokens, _ = run_trials(case, CI_TRIALS, seed=11)  # p-value ~1e-19 at 4,000 trials
    pvalue = chi_square_pvalue(torch.bincount(tokens[:, 1], minlength=case.vocab), joint.sum(1))
    assert pvalue < ALPHA, f"a reranked sampled tree passed the test (p-value {pvalue:.2e})"


def _rerank_by_score(root_tokens, cand_tokens, cand_scores, cand_parents, num_draft_tokens):
    from speccycle.core.tree import rerank_tree

    return rerank_tree(root_tokens, cand_tokens, cand_scores, cand_parents, num_draft_tokens)


# ---- reproducibility, mixed batches, logprobs -------------------------------------------------


def _hashed_ports(config: SpecConfig, family: str, vocab: int = 24):
    pool = FingerprintPool(num_pages=8192 // config.page_size + 64, page_size=config.page_size)
    target = HashedNgramTarget(pool, vocab_size=vocab, n=3)
    draft = TreeLookupDraft(target, 0.6) if family == "lookup" else NoisyDraft(target, 0.7, family)
    return Ports(target=target, draft=draft, kv_pool=pool), target


@pytest.mark.parametrize("family", ["shifted", "aligned", "lookup"])
@pytest.mark.parametrize("topk", [1, 3])
def test_a_seeded_request_reproduces_its_output(family, topk):
    config = SpecConfig(num_steps=3, topk=topk, num_draft_tokens=4 if topk == 1 else 8, page_size=2)
    requests = [
        Request(i, (1, 2, 3 + i), SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_new_tokens=16))
        for i in range(4)
    ]
    runs = [generate(requests, config, _hashed_ports(config, family)[0], checked=True) for _ in range(2)]
    assert [r.output for r in runs[0]] == [r.output for r in runs[1]]
    reseeded = [attrs.evolve(r, sampling=attrs.evolve(r.sampling, seed=r.sampling.seed + 7)) for r in requests]
    other = generate(reseeded, config, _hashed_ports(config, family)[0], checked=True)
    assert [r.output for r in other] != [r.output for r in runs[0]], "the seed does not change the samples"


def test_a_request_without_a_seed_gets_one_at_prefill():
    config = SpecConfig(num_steps=2, topk=1)
    ports, _ = _hashed_ports(config, "shifted")
    done = generate([Request(0, (1, 2), SamplingParams(temperature=1.0, max_new_tokens=4))], config, ports)
    seed = done[0].sampling.seed
    assert isinstance(seed, int)
    again = generate([Request(1, (1, 2), done[0].sampling)], config, _hashed_ports(config, "shifted")[0])
    assert again[0].output == done[0].output, "the seed prefill drew does not replay the request"


sampling_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 3]),
    top_p=st.sampled_from([1.0, 0.8, 0.3]),
    seed=st.integers(0, 2**40),
    max_new_tokens=st.integers(1, 14),
    stop_token_ids=st.lists(st.integers(0, 23), max_size=1).map(tuple),
    logprobs=st.booleans(),
)


@st.composite
def configs(draw) -> SpecConfig:
    steps, topk = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    n = steps + 1 if topk == 1 else draw(st.integers(2, min(1 + topk + (steps - 1) * topk * topk, 20)))
    return SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=n, page_size=draw(st.sampled_from([1, 4])))


@settings(max_examples=30 if THOROUGH else 8)
@given(
    config=configs(),
    family=st.sampled_from(["shifted", "aligned", "lookup"]),
    params=st.lists(sampling_params, min_size=1, max_size=4),
)
def test_mixed_batches_keep_greedy_requests_greedy_and_report_logprobs(config, family, params):
    """Greedy and sampled requests in one batch, checked mode: greedy outputs equal target-only greedy
    decoding, and every reported logprob is ``log p(token)`` of the distribution the token came from."""
    ports, target = _hashed_ports(config, family)
    requests = [Request(i, (1 + i, 2, 3), p) for i, p in enumerate(params)]
    done = generate(requests, config, ports, checked=True)
    assert ports.kv_pool.num_free_pages == ports.kv_pool.num_pages
    for request in done:
        p = request.sampling
        assert request.finish_reason in ("stop", "length") and 1 <= len(request.output) <= p.max_new_tokens
        if p.greedy:
            assert list(request.output) == target.greedy(request.prompt, p.max_new_tokens, p.stop_token_ids)
        if not p.logprobs:
            assert request.logprobs == ()
            continue
        assert len(request.logprobs) == len(request.output)
        for i, (token, logprob) in enumerate(zip(request.output, request.logprobs)):
            logits = target.next_logits(list(request.prompt + request.output[:i]))
            if p.greedy:
                expected = float(torch.log_softmax(logits, -1)[token])
            else:
                probs = process_logits(logits[None], p.temperature, p.top_k, p.top_p)[0]
                assert float(probs[token]) > 0, "a token of target probability 0 was committed"
                expected = math.log(float(probs[token]))
            assert math.isclose(logprob, expected, rel_tol=1e-4, abs_tol=1e-5), (i, logprob, expected)


def test_sampled_requests_are_refused_by_block_drafts():
    class Block:
        kind, vocab_size, block_size, mask_token_id = "block", 24, 3, 0

    config = SpecConfig(num_steps=2, topk=1)
    pool = FingerprintPool(num_pages=64)
    ports = Ports(target=HashedNgramTarget(pool, vocab_size=24), draft=Block(), kv_pool=pool)
    record = step(Admitted(config=config, requests=(Request(0, (1, 2), SamplingParams(temperature=0.8)),)), ports)
    assert record.requests[0].finish_reason == "error" and "block drafts verify greedily" in record.requests[0].error


def test_sampled_transitions_call_only_the_ops_their_rows_name():
    """The table stays honest with sampled requests in the batch (tree, forward draft, mixed batch)."""
    from speccycle.backends.torch import TorchBackend
    from speccycle.statemachine import select

    calls: list[str] = []

    class Recording(TorchBackend):
        def __getattribute__(self, name):
            attr = object.__getattribute__(self, name)
            if callable(attr) and not name.startswith("_") and name in dir(TorchBackend):
                calls.append(name)
            return attr

    config = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=2)
    ports, _ = _hashed_ports(config, "shifted")
    params = [SamplingParams(temperature=t, seed=1, max_new_tokens=8) for t in (0.9, 0.0)]
    record = Admitted(config=config, requests=tuple(Request(i, (1, 2, 3), p) for i, p in enumerate(params)))
    seen = set()
    while record.requests:
        row = select(record, ports)
        calls.clear()
        record = step(record, ports, Recording(), checked=True)
        assert set(calls) <= set(row.ops), f"{row.event} called {set(calls) - set(row.ops)}"
        seen.update(calls)
    assert {"process_logits", "uniforms_from_keys", "sample_without_replacement", "verify_tree_sampling"} <= seen


# ---- every sampling parameter: greedy token for token, logprobs, speculation off ---------------


def test_a_verify_that_forgets_the_tree_path_is_caught(monkeypatch):
    """Penalties seen from the committed history alone (each verify row blind to the draft path above it) are
    lossy: rows of depth >= 1 miss the tokens between the root and them. The chi-square test rejects that."""
    from speccycle.statemachine import logits as row_logits

    case = CASES["chain-penalties-min-p"]
    _, target = _ports(case, 1)
    _, joint, _ = exact_distributions(target, case)
    monkeypatch.setattr(row_logits, "tree_paths", lambda tokens, mask: torch.full_like(tokens, -1).view(-1, 1))
    tokens, _ = run_trials(case, CI_TRIALS, seed=12)
    samples = tokens[:, 1] * case.vocab + tokens[:, 2]
    pvalue = chi_square_pvalue(torch.bincount(samples, minlength=joint.numel()), joint.flatten())
    assert pvalue < ALPHA, f"a verify blind to its tree path passed the test (p-value {pvalue:.2e})"


def ban_after_three(history, row):
    """A processor that reads the history: token 7 is banned right after a 3, and the last token is favored."""
    row = row.clone()
    if history[-1] == 3:
        row[7] = -math.inf
    row[history[-1]] += 0.5
    return row


every_param = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.0, 0.8, 1.3]),
    top_k=st.sampled_from([0, 4]),
    top_p=st.sampled_from([1.0, 0.85]),
    min_p=st.sampled_from([0.0, 0.0, 0.1]),
    seed=st.integers(0, 2**40),
    max_new_tokens=st.integers(1, 12),
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.5, 0.8]),
    presence_penalty=st.sampled_from([0.0, 0.6]),
    frequency_penalty=st.sampled_from([0.0, 0.9, -0.3]),
    logit_bias=st.dictionaries(st.integers(0, 23), st.sampled_from([-2.0, 3.0]), max_size=2),
    bad_words=st.lists(st.lists(st.integers(0, 23), min_size=1, max_size=3).map(tuple), max_size=3).map(tuple),
    logits_processor=st.sampled_from([None, None, ban_after_three]),
    speculate=st.sampled_from([True, True, False]),
    logprobs=st.booleans(),
    top_logprobs=st.sampled_from([0, 0, 3]),
)


class Recording:
    """A port that runs the real one and records, per call, how many rows each request id had."""

    def __init__(self, port, calls: list):
        self._port, self._calls = port, calls

    def __getattr__(self, name):
        attr = getattr(self._port, name)
        if name not in ("forward", "extend", "step", "propose"):
            return attr

        def call(*args, **kwargs):
            batch = args[0]
            if name == "propose":
                self._calls.append((name, {rid: 1 for rid in batch}))
            else:
                rows = torch.bincount(batch.row_request, minlength=len(batch.request_ids)).tolist()
                self._calls.append((name, dict(zip(batch.request_ids, rows))))
            return attr(*args, **kwargs)

        return call


@settings(max_examples=30 if THOROUGH else 10)
@given(
    config=st.one_of(configs(), st.just(SpecConfig(num_steps=0, page_size=4))),
    family=st.sampled_from(["shifted", "aligned", "lookup"]),
    params=st.lists(every_param, min_size=1, max_size=4),
)
def test_every_parameter_keeps_greedy_exact_and_reports_autoregressive_logprobs(config, family, params):
    """Mixed batches of every parameter in checked mode: greedy outputs equal greedy decoding of the processed
    logits after each output's own history; sampled tokens have positive processed probability; logprobs and
    top logprobs equal those of the processed distribution after the same history; a request with
    speculate=False gets no draft rows and one verify row a cycle."""
    ports, target = _hashed_ports(config, family)
    calls: list = []
    ports = attrs.evolve(ports, target=Recording(ports.target, calls), draft=Recording(ports.draft, calls))
    requests = [Request(i, (1 + i, 2, 3), p) for i, p in enumerate(params)]
    done = generate(requests, config, ports, checked=True)
    resting = {r.request_id for r in requests if not r.sampling.speculate}
    for name, rows in calls:
        if name in ("extend", "step", "propose"):
            assert not resting & {rid for rid, n in rows.items() if n}, f"the draft's {name} ran rows of {resting}"
    verify_rows = [rows for name, rows in calls if name == "forward"][1:]  # after the prefill
    for rows in verify_rows:
        assert all(rows.get(rid, 1) == 1 for rid in resting), f"a request without speculation verified {rows}"
    for request in done:
        p = request.sampling
        assert request.finish_reason in ("stop", "length"), request.error
        output = list(request.output)
        for i, token in enumerate(output):
            logits = target.next_logits(list(request.prompt) + output[:i])
            adjusted = reference_logits(p, request.prompt, tuple(output[:i]), logits)
            if p.greedy:
                assert token == int(adjusted.argmax()), f"request {request.request_id} token {i} is not greedy"
                log_p = torch.log_softmax(adjusted, -1)
            else:
                probs = process_logits(adjusted[None], p.temperature, p.top_k, p.top_p, p.min_p)[0]
                assert float(probs[token]) > 0, "a token of processed probability 0 was committed"
                log_p = torch.log(probs)
            if p.logprobs:
                assert math.isclose(request.logprobs[i], float(log_p[token]), rel_tol=1e-4, abs_tol=1e-5)
            if p.top_logprobs:
                values, ids = log_p.sort(descending=True, stable=True)
                expected = [(int(t), float(v)) for t, v in zip(ids[: p.top_logprobs], values[: p.top_logprobs])]
                expected = [(t, v) for t, v in expected if v > -math.inf]
                got = request.top_logprobs[i]
                assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-4, abs=1e-5)
                assert all(math.isclose(float(log_p[t]), v, rel_tol=1e-4, abs_tol=1e-5) for t, v in got)
        assert len(request.logprobs) == (len(output) if p.logprobs else 0)
        assert len(request.top_logprobs) == (len(output) if p.top_logprobs else 0)
