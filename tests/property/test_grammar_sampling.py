"""Sampled constrained requests commit tokens distributed as the target's masked distribution, through the cycle.

`BatchedNgramTarget` on 8 tokens (seven letters and the end token), a regex whose allowed letters change at every
position (``[ab][a-e][c-g][a-g]``): the grammar's mask after any prefix is known by hand, so the exact masked
distribution of each step is the target's logits with the refused tokens at ``-inf``, then the request's
temperature, top-k and top-p (`process_logits`). Each request is one trial; its four output tokens are compared
by chi-square tests with ``P(t0)``, ``P(t1, t2)`` and ``P(t2, t3)`` (earlier tokens summed out), as in
`test_cycle_sampling.py`. A chain and a tree of a forward draft, whose own proposals are masked too (it proposes only
allowed tokens); lookup drafts (point masses) are held to constrained greedy decoding in `tests/unit/test_grammar.py`.
"""

from __future__ import annotations

import itertools

import attrs
import pytest
import torch
from speccycle.backends.torch.sampling import process_logits
from speccycle.core import Accepted, Admitted, Compacted, Ports, Request, SamplingParams, SpecConfig
from speccycle.statemachine import step
from speccycle.testing import FingerprintPool, TreeLookupDraft
from speccycle.testing.batched import BatchedNgramDraft, BatchedNgramTarget
from speccycle.testing.grammar import SmallVocab
from speccycle.testing.stats import chi_square_pvalue

pytest.importorskip("llguidance")
from speccycle.engine.grammar import LlguidanceCompiler  # noqa: E402

ALPHA = 1e-5
TRIALS = 1000
PROMPT = (5, 1, 4, 1)
VOCAB = SmallVocab("abcdefg")  # ids 0..6, the end token 7
REGEX = "[ab][a-e][c-g][a-g]"
ALLOWED = [set(range(0, 2)), set(range(0, 5)), set(range(2, 7)), set(range(0, 7))]  # per position


@attrs.frozen
class Case:
    family: str
    steps: int
    topk: int
    draft_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def config(self) -> SpecConfig:
        return SpecConfig(num_steps=self.steps, topk=self.topk, num_draft_tokens=self.draft_tokens, page_size=4)


CASES = {
    "chain-shifted": Case("shifted", 3, 1, 4),
    "tree-aligned-top-p": Case("aligned", 3, 3, 8, temperature=0.8, top_p=0.9),
}


def _ports(case: Case, trials: int):
    config = case.config()
    pages = trials * (-(-(len(PROMPT) + 4 + config.reserve_len("aligned")) // config.page_size)) + 64
    pool = FingerprintPool(num_pages=pages, page_size=config.page_size)
    target = BatchedNgramTarget(pool, vocab_size=VOCAB.vocab_size, n=2)
    draft = (
        TreeLookupDraft(target, agreement=0.5)
        if case.family == "lookup"
        else BatchedNgramDraft(target, 0.5, case.family)
    )
    compiler = LlguidanceCompiler(VOCAB, VOCAB.vocab_size, [VOCAB.eos_token_id])
    return Ports(target=target, draft=draft, kv_pool=pool, grammar=compiler), target


def run_trials(case: Case, trials: int, seed: int) -> tuple[torch.Tensor, float]:
    ports, _ = _ports(case, trials)
    params = [
        SamplingParams(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p, seed=seed * 100_003 + i,
                       max_new_tokens=4, regex=REGEX)
        for i in range(trials)
    ]  # fmt: skip
    requests = tuple(Request(i, PROMPT, p) for i, p in enumerate(params))
    record, done, committed, verifies = Admitted(config=case.config(), requests=requests), {}, 0, 0
    while not (isinstance(record, Compacted) and not record.requests):
        previous, record = record, step(record, ports)
        if isinstance(previous, Accepted):
            committed, verifies = committed + int(record.accept_len.sum()), verifies + len(record.requests)
        if isinstance(record, Compacted):
            done.update({r.request_id: r for r in record.retired})
    assert all(len(done[r.request_id].output) == 4 for r in requests), "the regex takes exactly four tokens"
    return torch.tensor([done[r.request_id].output for r in requests]), committed / verifies


def exact_distributions(target, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    vocab = VOCAB.vocab_size

    def dist(depth: int) -> torch.Tensor:
        prefixes = list(itertools.product(range(vocab), repeat=depth))
        logits = torch.stack([target.next_logits(list(PROMPT + prefix)) for prefix in prefixes])
        refused = torch.tensor([t not in ALLOWED[depth] for t in range(vocab)])
        probs = process_logits(logits.masked_fill(refused, float("-inf")), case.temperature, case.top_k, case.top_p)
        return probs.double().view(*([vocab] * depth), vocab)

    p0, p1, p2, p3 = (dist(d) for d in range(4))
    return p0, torch.einsum("a,ab,abc->bc", p0, p1, p2), torch.einsum("a,ab,abc,abcd->cd", p0, p1, p2, p3)


@pytest.mark.parametrize("name", list(CASES))
def test_constrained_samples_follow_the_masked_target_through_the_cycle(name):
    case = CASES[name]
    _, target = _ports(case, 1)
    p0, joint, later = exact_distributions(target, case)
    tokens, tau = run_trials(case, TRIALS, seed=sorted(CASES).index(name) + 1)
    vocab = VOCAB.vocab_size
    assert tau > 1.2, f"the drafts are hardly ever accepted (tau {tau:.2f}): the case tests little"
    for depth in range(4):
        assert set(tokens[:, depth].tolist()) <= ALLOWED[depth], f"a token the grammar refuses at {depth}"
    for what, samples, probs in [
        ("t0", tokens[:, 0], p0),
        ("(t1, t2)", tokens[:, 1] * vocab + tokens[:, 2], joint.flatten()),
        ("(t2, t3)", tokens[:, 2] * vocab + tokens[:, 3], later.flatten()),
    ]:
        pvalue = chi_square_pvalue(torch.bincount(samples, minlength=probs.numel()), probs)
        assert pvalue >= ALPHA, f"{name}: {what} does not follow the masked target (p-value {pvalue:.2e})"
