"""Invariant 11 (lossless sampling) and the structure of the sampling ops.

Statistical tests run many independent trials as one batch against a small Markov "model": the token
after a row at depth ``d`` with token ``x`` follows ``P[d, x]`` under the target and ``Q[d, x]`` under the
draft (random Dirichlet tables, processed by `process_logits`). Each test draws its trees from the
draft exactly as a drafter would (`sample_without_replacement`), verifies them, and compares the
committed tokens with the target by a chi-square test at ``ALPHA``, with a fixed seed per example.

Power: every first-token test sizes its sample so that moving 1% of the probability mass from the
most likely token to the second (total variation 0.01; of all moves between two tokens, the one a
chi-square test sees worst) has noncentrality >= 100 + 1.5 df (power > 0.999 at ``ALPHA``; the
thorough profile doubles the samples), and asserts that the same test rejects its own samples with
that shift applied. `test_detects_*` feed realistic broken samplers and assert they are caught.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from speccycle.backends.torch import TorchBackend
from speccycle.backends.torch.sampling import (
    committed_logprobs,
    process_logits,
    residual_distribution,
    safe_uniform,
    sample_categorical,
    sample_without_replacement,
    verify_chain_sampling,
)
from speccycle.backends.torch.sampling_tree import verify_tree_sampling
from speccycle.testing.stats import chi_square_pvalue, chi_square_sf

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
STAT_EXAMPLES = 30 if THOROUGH else 1  # generated configs per statistical test, beside the @example ones
SAMPLE_SCALE = 2 if THOROUGH else 1
ALPHA = 1e-5  # per chi-square test: thorough runs a few hundred of them
N_MIN, N_MAX = 20_000, 300_000
CHUNK_ELEMENTS = 1 << 22  # trials per chunk * N * V: keeps each [chunk, N, V] tensor at 16 MiB

stat_settings = settings(max_examples=STAT_EXAMPLES)

# ---- chi-square ------------------------------------------------------------------------------


def _sample_size(p_root: torch.Tensor) -> tuple[int, bool]:
    """Trials for a first-token test, and whether they give the 1% shift its full power."""
    support = int((p_root > 0).sum())
    if support < 2:
        return N_MIN * SAMPLE_SCALE, False
    top = p_root.double().topk(2).values
    per_trial = 1e-4 * float(1 / top[0] + 1 / top[1])  # noncentrality of the 1% shift per trial
    needed = (100 + 1.5 * (support - 1)) / per_trial
    return int(min(N_MAX, max(N_MIN, needed))) * SAMPLE_SCALE, needed <= N_MAX


def _shift_one_percent(samples: torch.Tensor, probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A 1%-distorted sampler: moves mass 0.01 from the most likely token to the second."""
    first, second = probs.topk(2).indices.tolist()
    flip = (samples == first) & (torch.rand(samples.shape, generator=gen) < 0.01 / float(probs[first]))
    return torch.where(flip, second, samples)


def _assert_matches(samples: torch.Tensor, probs: torch.Tensor, gen: torch.Generator, powered: bool) -> None:
    """The samples pass the chi-square test; when ``powered``, the same samples 1%-distorted fail it."""
    counts = torch.bincount(samples.flatten(), minlength=probs.numel())
    pvalue = chi_square_pvalue(counts, probs)
    assert pvalue >= ALPHA, f"committed tokens do not follow the target: p-value {pvalue:.2e}, n = {samples.numel()}"
    if powered:
        shifted = torch.bincount(_shift_one_percent(samples, probs, gen), minlength=probs.numel())
        pvalue = chi_square_pvalue(shifted, probs)
        assert pvalue < ALPHA, f"the test missed a 1% shift (p-value {pvalue:.2e}): raise the sample size"


# ---- a Markov model and a drafter ------------------------------------------------------------


class MarkovModel:
    """Target and draft next-token tables per depth: ``P, Q [D + 1, V, V]`` float32 (row: previous token).

    The root token is 0, so the first token follows ``P[0, 0]``. The draft mixes the target's raw
    Dirichlet table with an independent one (``agreement`` is the target's weight); both are processed
    by `process_logits` with the same parameters, as an engine would.
    """

    def __init__(self, vocab, depth, seed, temperature=1.0, top_k=0, top_p=1.0, concentration=1.0, agreement=0.5):
        rng = np.random.default_rng(seed)
        shape = (depth + 1, vocab)
        target_raw = torch.from_numpy(rng.dirichlet([concentration] * vocab, size=shape)).float()
        other_raw = torch.from_numpy(rng.dirichlet([concentration] * vocab, size=shape)).float()
        draft_raw = agreement * target_raw + (1 - agreement) * other_raw

        def process(raw):
            logits = torch.log(raw.clamp(min=1e-30)).reshape(-1, vocab)
            return process_logits(logits, temperature, top_k, top_p).reshape(raw.shape)

        self.P, self.Q = process(target_raw), process(draft_raw)
        self.vocab = vocab

    def draft_tree(self, parents: list[int], trials: int, gen: torch.Generator):
        """Draft ``trials`` trees of one shape: children of row ``u`` by Gumbel-top-k from ``Q`` at ``u``.

        Shapes: -> ``tokens [trials, N]``, ``target_probs [trials, N, V]``, ``draft_probs [trials, N, V]``.
        """
        n, vocab = len(parents), self.vocab
        depth = [0] * n
        children: list[list[int]] = [[] for _ in range(n)]
        for c in range(1, n):
            depth[c] = depth[parents[c]] + 1
            children[parents[c]].append(c)
        tokens = torch.zeros(trials, n, dtype=torch.long)
        for u in range(n):
            if children[u]:
                q_u = self.Q[depth[u], tokens[:, u].clamp(min=0)]  # [trials, V]
                ids = sample_without_replacement(q_u, len(children[u]), safe_uniform((trials, vocab), gen))
                tokens[:, children[u]] = torch.where(tokens[:, u, None] >= 0, ids, -1)  # padding begets padding
        rows = torch.tensor(depth)[None, :]
        return tokens, self.P[rows, tokens.clamp(min=0)], self.Q[rows, tokens.clamp(min=0)]


def _in_chunks(trials: int, per_trial: int, run) -> torch.Tensor:
    """``run(chunk_trials)`` over chunks of bounded memory, results concatenated along dim 0."""
    chunk = max(1, CHUNK_ELEMENTS // per_trial)
    return torch.cat([run(min(chunk, trials - start)) for start in range(0, trials, chunk)])


def _chain_parents(num_steps: int) -> list[int]:
    return list(range(-1, num_steps))


def _run_chain(model, num_steps, trials, gen, two_tokens=False):
    """Committed tokens of chain verifies: ``[trials]`` (first) or ``[trials, 2]`` (first two)."""

    def run(m):
        tokens, target_probs, draft_probs = model.draft_tree(_chain_parents(num_steps), m, gen)
        accept_len, predict = verify_chain_sampling(
            tokens[:, 1:],
            draft_probs[:, :num_steps],
            target_probs,
            safe_uniform((m, num_steps + 1), gen),
            safe_uniform((m, model.vocab), gen),
        )
        if not two_tokens:
            return predict[:, 0]
        return torch.stack([predict[:, 0], _second_token(model, predict[:, 0], accept_len, predict[:, 1], gen)], 1)

    return _in_chunks(trials, (num_steps + 1) * model.vocab, run)


def _run_tree(model, parents, trials, gen, two_tokens=False):
    """Committed tokens of tree verifies: ``[trials]`` (first) or ``[trials, 2]`` (first two)."""
    n = len(parents)
    width = _depth(parents) + 1

    def run(m):
        tokens, target_probs, draft_probs = model.draft_tree(parents, m, gen)
        parent_rows = torch.tensor(parents).expand(m, n)
        accept_index, accept_len, predict = verify_tree_sampling(
            tokens,
            parent_rows,
            draft_probs,
            target_probs,
            width,
            safe_uniform((m, n), gen),
            safe_uniform((m, model.vocab), gen),
        )
        first = predict[accept_index[:, 0]]
        if not two_tokens:
            return first
        on_path = predict[accept_index[:, 1].clamp(min=0)] if width > 1 else first
        return torch.stack([first, _second_token(model, first, accept_len, on_path, gen)], 1)

    return _in_chunks(trials, n * model.vocab, run)


def _second_token(model, first, accept_len, on_path, gen):
    """The second committed token: from the accepted path, else what the next cycle samples given the first."""
    fresh = sample_categorical(model.P[1, first], safe_uniform((first.shape[0], model.vocab), gen))
    return torch.where(accept_len >= 2, on_path, fresh)


def _depth(parents: list[int]) -> int:
    depth = [0] * len(parents)
    for c in range(1, len(parents)):
        depth[c] = depth[parents[c]] + 1
    return max(depth)


# ---- strategies ------------------------------------------------------------------------------


@st.composite
def tree_shapes(draw, max_k=3, max_depth=3, max_n=16):
    """Level-order tree shapes (independent of the tokens): each node gets 0..K children, the root >= 1."""
    k = draw(st.integers(1, max_k))
    parents, frontier = [-1], [0]
    for _ in range(draw(st.integers(1, max_depth))):
        grown = []
        for u in frontier:
            for _ in range(min(draw(st.integers(1 if u == 0 else 0, k)), max_n - len(parents))):
                parents.append(u)
                grown.append(len(parents) - 1)
        frontier = grown
    return parents


model_params = st.fixed_dictionaries(
    {
        "vocab": st.sampled_from([8, 16, 32, 64]),
        "seed": st.integers(0, 2**31 - 1),
        "temperature": st.sampled_from([1.0, 0.0, 0.6, 1.5]),
        "top_k": st.sampled_from([0, 2, 5]),
        "top_p": st.sampled_from([1.0, 0.9, 0.6]),
        "concentration": st.sampled_from([1.0, 0.3]),
        "agreement": st.sampled_from([0.5, 0.0, 0.9, 1.0]),
    }
)


def _params(vocab=16, seed=0, temperature=1.0, top_k=0, top_p=1.0, concentration=1.0, agreement=0.5):
    return dict(vocab=vocab, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p,
                concentration=concentration, agreement=agreement)  # fmt: skip


# ---- statistical properties: invariant 11 ----------------------------------------------------


@stat_settings
@given(params=model_params, num_steps=st.integers(1, 3))
@example(params=_params(vocab=8, seed=1), num_steps=3)
@example(params=_params(vocab=32, seed=2, temperature=0.6, top_k=5, top_p=0.9, agreement=0.0), num_steps=2)
def test_chain_first_token_follows_target(params, num_steps):
    model = MarkovModel(depth=num_steps, **params)
    gen = torch.Generator().manual_seed(params["seed"])
    trials, powered = _sample_size(model.P[0, 0])
    _assert_matches(_run_chain(model, num_steps, trials, gen), model.P[0, 0], gen, powered)


@stat_settings
@given(params=model_params, parents=tree_shapes())
@example(params=_params(vocab=8, seed=2, top_k=2, concentration=0.3), parents=[-1, 0, 0, 0, 1, 1, 1])  # padding
@example(params=_params(vocab=16, seed=3, top_k=5, top_p=0.9), parents=[-1, 0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 4, 5])
def test_tree_first_token_follows_target(params, parents):
    model = MarkovModel(depth=_depth(parents), **params)
    gen = torch.Generator().manual_seed(params["seed"])
    trials, powered = _sample_size(model.P[0, 0])
    _assert_matches(_run_tree(model, parents, trials, gen), model.P[0, 0], gen, powered)


@stat_settings
@given(params=model_params, num_children=st.integers(1, 3), chain=st.booleans())
@example(params=_params(vocab=8, seed=1), num_children=3, chain=False)
@example(params=_params(vocab=8, seed=2, temperature=0.6, agreement=0.9), num_children=1, chain=True)
def test_first_two_tokens_follow_target_jointly(params, num_children, chain):
    """``(t1, t2)`` ~ ``P[0, 0](t1) * P[1, t1](t2)``, over depth-2 trees (a chain, or K children per node)."""
    params = {**params, "vocab": min(params["vocab"], 16)}  # V * V cells
    model = MarkovModel(depth=2, **params)
    gen = torch.Generator().manual_seed(params["seed"])
    trials = 100_000 * SAMPLE_SCALE
    if chain:
        pairs = _run_chain(model, 2, trials, gen, two_tokens=True)
    else:
        k = num_children
        parents = [-1] + [0] * k + [1 + i // k for i in range(k * k)]
        pairs = _run_tree(model, parents, trials, gen, two_tokens=True)
    joint = model.P[0, 0][:, None] * model.P[1]  # [V, V]
    counts = torch.bincount(pairs[:, 0] * model.vocab + pairs[:, 1], minlength=model.vocab**2)
    pvalue = chi_square_pvalue(counts, joint)
    assert pvalue >= ALPHA, f"(t1, t2) do not follow the target: p-value {pvalue:.2e}"


def test_point_mass_drafts_are_still_lossless():
    """Verifying with ``q = one_hot(x)`` (target-only verification) is lossless too, so it is no distortion.

    Accepting ``x`` with probability ``p(x)`` and otherwise sampling ``p`` without ``x`` gives
    ``q(y) p(y) + sum_{x != y} q(x) p(y) = p(y)`` for any proposal ``q``: only the acceptance rate suffers.
    """
    model = MarkovModel(vocab=8, depth=2, seed=3, agreement=0.5)
    gen = torch.Generator().manual_seed(3)
    trials, powered = _sample_size(model.P[0, 0])
    tokens, target_probs, _ = model.draft_tree(_chain_parents(2), trials, gen)
    point_mass = torch.nn.functional.one_hot(tokens[:, 1:], model.vocab).float()
    _, predict = verify_chain_sampling(
        tokens[:, 1:], point_mass, target_probs, safe_uniform((trials, 3), gen), safe_uniform((trials, 8), gen)
    )
    _assert_matches(predict[:, 0], model.P[0, 0], gen, powered)


def test_detects_drafts_verified_against_another_distribution():
    """A broken sampler: drafts drawn from top-k-truncated ``q`` but verified against untruncated ``q``."""
    model = MarkovModel(vocab=16, depth=2, seed=5, top_k=4, agreement=0.3)
    untruncated = MarkovModel(vocab=16, depth=2, seed=5, agreement=0.3)
    gen = torch.Generator().manual_seed(5)
    trials, _ = _sample_size(model.P[0, 0])
    tokens, target_probs, _ = model.draft_tree(_chain_parents(2), trials, gen)
    wrong_q = untruncated.Q[torch.tensor([[0, 1]]), tokens[:, :2]]  # [trials, 2, V]: q at rows 0 and 1, not truncated
    _, predict = verify_chain_sampling(
        tokens[:, 1:], wrong_q, target_probs, safe_uniform((trials, 3), gen), safe_uniform((trials, 16), gen)
    )
    counts = torch.bincount(predict[:, 0], minlength=16)
    assert chi_square_pvalue(counts, model.P[0, 0]) < ALPHA


def test_detects_siblings_drawn_with_replacement():
    """A broken drafter: i.i.d. siblings (repeats possible) fed to the without-replacement verify, unvalidated."""
    model = MarkovModel(vocab=8, depth=1, seed=7, concentration=0.3, agreement=0.5)
    gen = torch.Generator().manual_seed(7)
    trials, _ = _sample_size(model.P[0, 0])
    q_root = model.Q[0, 0].expand(trials, 8)
    siblings = torch.stack([sample_categorical(q_root, safe_uniform((trials, 8), gen)) for _ in range(3)], 1)
    tokens = torch.cat([torch.zeros(trials, 1, dtype=torch.long), siblings], 1)
    parents = torch.tensor([-1, 0, 0, 0]).expand(trials, 4)
    rows = torch.tensor([0, 1, 1, 1])[None, :]
    accept_index, _, predict = verify_tree_sampling(
        tokens,
        parents,
        model.Q[rows, tokens],
        model.P[rows, tokens],
        2,
        safe_uniform((trials, 4), gen),
        safe_uniform((trials, 8), gen),
        validate=False,
    )
    counts = torch.bincount(predict[accept_index[:, 0]], minlength=8)
    assert chi_square_pvalue(counts, model.P[0, 0]) < ALPHA
    with pytest.raises(ValueError, match="same token"):
        verify_tree_sampling(
            tokens,
            parents,
            model.Q[rows, tokens],
            model.P[rows, tokens],
            2,
            torch.rand(trials, 4),
            torch.rand(trials, 8),
        )


# ---- structure -------------------------------------------------------------------------------


@given(params=model_params, parents=tree_shapes(max_n=20), extra_width=st.integers(0, 2))
def test_accept_index_structure(params, parents, extra_width):
    """Invariant 5 for the sampling verify, and ``predict`` consistent with the path."""
    model = MarkovModel(depth=_depth(parents), **params)
    gen = torch.Generator().manual_seed(params["seed"])
    bs, n, width = 64, len(parents), _depth(parents) + 1 + extra_width
    tokens, target_probs, draft_probs = model.draft_tree(parents, bs, gen)
    parent_rows = torch.tensor(parents).expand(bs, n)
    uniforms, sample_uniforms = safe_uniform((bs, n), gen), safe_uniform((bs, model.vocab), gen)
    accept_index, accept_len, predict = verify_tree_sampling(
        tokens, parent_rows, draft_probs, target_probs, width, uniforms, sample_uniforms
    )
    assert accept_index.shape == (bs, width) and predict.shape == (bs * n,)
    assert bool(((accept_len >= 1) & (accept_len <= min(width, n))).all())
    # Plain-Python checks on lists: independent of the tensor code under test, and fast.
    predict_rows, token_rows = predict.view(bs, n).tolist(), tokens.tolist()
    for b, (index, length) in enumerate(zip(accept_index.tolist(), accept_len.tolist())):
        path = [i - b * n for i in index[:length]]
        assert path[0] == 0 and all(i == -1 for i in index[length:])
        assert all(0 <= row < n for row in path)
        assert all(parents[child] == parent for parent, child in zip(path, path[1:])), "not a parent-to-child chain"
        committed = [predict_rows[b][row] for row in path]
        assert committed[:-1] == [token_rows[b][row] for row in path[1:]]
        assert all(float(target_probs[b, row, tok]) > 0 for row, tok in zip(path, committed)), "committed p = 0"
        assert all(predict_rows[b][row] == -1 for row in range(n) if row not in path)


@given(params=model_params, num_steps=st.integers(0, 4))
def test_chain_equals_tree_on_a_chain(params, num_steps):
    """The chain op is the tree op on ``parents = [-1, 0, 1, ...]`` under the same uniforms, exactly."""
    model = MarkovModel(depth=num_steps, **params)
    gen = torch.Generator().manual_seed(params["seed"])
    bs, n = 64, num_steps + 1
    tokens, target_probs, draft_probs = model.draft_tree(_chain_parents(num_steps), bs, gen)
    uniforms, sample_uniforms = safe_uniform((bs, n), gen), safe_uniform((bs, model.vocab), gen)
    accept_len, predict = verify_chain_sampling(
        tokens[:, 1:], draft_probs[:, :num_steps], target_probs, uniforms, sample_uniforms
    )
    parents = torch.tensor(_chain_parents(num_steps)).expand(bs, n)
    accept_index, tree_len, tree_predict = verify_tree_sampling(
        tokens, parents, draft_probs, target_probs, n, uniforms, sample_uniforms
    )
    assert torch.equal(accept_len, tree_len)
    assert torch.equal(predict, tree_predict.view(bs, n))
    rows = torch.arange(bs)[:, None] * n + torch.arange(n)[None, :]
    assert torch.equal(accept_index, torch.where(torch.arange(n)[None, :] < accept_len[:, None], rows, -1))


@given(data=st.data(), bs=st.integers(1, 4), n=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_temperature_zero_reproduces_greedy_verify(data, bs, n, seed):
    """With a one-hot target (temperature 0) the sampling verify walks the greedy path, whatever the draft."""
    vocab = 16
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor([[-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)] for _ in range(bs)])
    parents = parents.reshape(bs, n)
    tokens = torch.stack([torch.randperm(vocab, generator=gen)[:n] for _ in range(bs)])  # siblings distinct
    # Target argmax per row: often a child's token, so greedy paths run deep.
    argmax = torch.randint(vocab, (bs, n), generator=gen)
    for b in range(bs):
        for u in range(n):
            kids = (parents[b] == u).nonzero().flatten()
            if len(kids) and data.draw(st.booleans()):
                argmax[b, u] = tokens[b, kids[data.draw(st.integers(0, len(kids) - 1))]]
    logits = torch.randn(bs * n, vocab, generator=gen) + 8 * torch.nn.functional.one_hot(argmax.flatten(), vocab)
    target_probs = process_logits(logits, 0.0).view(bs, n, vocab)
    draft_probs = process_logits(torch.randn(bs * n, vocab, generator=gen), 1.0).view(bs, n, vocab)
    width = data.draw(st.integers(1, n + 1))
    accept_index, accept_len, predict = verify_tree_sampling(
        tokens, parents, draft_probs, target_probs, width, safe_uniform((bs, n), gen), safe_uniform((bs, vocab), gen)
    )
    greedy_predict = logits.argmax(-1).view(bs, n)  # == argmax, unless noise beat the +8 margin
    greedy_index, greedy_len = TorchBackend().verify_greedy(tokens, parents, greedy_predict, width)
    assert torch.equal(accept_index, greedy_index) and torch.equal(accept_len, greedy_len)
    on_path = accept_index[accept_index >= 0]
    assert torch.equal(predict[on_path], greedy_predict.flatten()[on_path])


# ---- unit: process_logits --------------------------------------------------------------------


@given(
    rows=st.lists(
        st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.integers(0, 12), st.sampled_from([1.0, 0.95, 0.5, 0.1])),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_process_logits(rows, seed):
    vocab = 12
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    temperature, top_k, top_p = (torch.tensor(col) for col in zip(*rows))
    probs = process_logits(logits, temperature, top_k, top_p)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(rows)))
    for r, (t, k, top) in enumerate(rows):
        # Rows are independent: the batched result equals the row processed alone.
        torch.testing.assert_close(probs[r], process_logits(logits[r : r + 1], t, k, top)[0])
        kept = (probs[r] > 0).nonzero().flatten()
        if t == 0:
            assert kept.tolist() == [int(logits[r].argmax())] and float(probs[r].max()) == 1.0
            continue
        order = logits[r].argsort(descending=True)
        n_kept = len(kept)
        assert set(kept.tolist()) == set(order[:n_kept].tolist()), "kept tokens are not the most likely ones"
        assert n_kept <= (k if k > 0 else vocab)
        # The nucleus is minimal: its mass (after temperature and top-k) reaches top_p, one token fewer does not.
        base = torch.softmax(logits[r] / t, -1)[order[: (k if k > 0 else vocab)]]
        base = base / base.sum()
        if top < 1:
            assert float(base[:n_kept].sum()) >= top - 1e-6
            assert n_kept == 1 or float(base[: n_kept - 1].sum()) < top + 1e-6
        else:
            assert n_kept == (k if k > 0 else vocab)
        expected = torch.zeros(vocab)
        expected[order[:n_kept]] = base[:n_kept] / base[:n_kept].sum()
        torch.testing.assert_close(probs[r], expected)


# ---- unit: random draws ----------------------------------------------------------------------


def test_safe_uniform_is_never_0_or_1(monkeypatch):
    u = safe_uniform((1 << 20,), torch.Generator().manual_seed(0))
    assert u.dtype == torch.float32 and float(u.min()) > 0 and float(u.max()) < 1
    # The clamp itself, on the endpoints torch.rand can (0) or could (1) return.
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.tensor([0.0, 1.0, 0.5]))
    u = safe_uniform((3,), torch.Generator())
    assert float(u.min()) > 0 and float(u.max()) < 1 and float(u[2]) == 0.5
    keys = torch.log(torch.tensor([1.0, 1.0])) - torch.log(-torch.log(u[:2]))
    assert bool(torch.isfinite(keys).all())


@given(vocab=st.integers(2, 12), k=st.integers(1, 12), support=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_sample_without_replacement_distinct_and_padded(vocab, k, support, seed):
    k, support = min(k, vocab), min(support, vocab)
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(64, vocab, generator=gen) + 0.01
    probs[:, support:] = 0  # only the first `support` tokens have mass
    ids = sample_without_replacement(probs, k, safe_uniform((64, vocab), gen))
    assert ids.shape == (64, k)
    valid = min(k, support)
    assert bool((ids[:, :valid] >= 0).all()) and bool((ids[:, :valid] < support).all())
    assert bool((ids[:, valid:] == -1).all()), "a zero-probability token was drawn instead of padding"
    assert all(len(set(row)) == valid for row in ids[:, :valid].tolist())


def test_sample_without_replacement_follows_sequential_draws():
    """Column 0 ~ p; (column 0, column 1) ~ p(a) p(b) / (1 - p(a)): the order of sequential draws."""
    gen = torch.Generator().manual_seed(11)
    vocab, trials = 6, 200_000
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    ids = sample_without_replacement(p.expand(trials, vocab), 2, safe_uniform((trials, vocab), gen))
    assert chi_square_pvalue(torch.bincount(ids[:, 0], minlength=vocab), p) >= ALPHA
    pairs = p[:, None] * p[None, :] / (1 - p[:, None])
    pairs.fill_diagonal_(0)
    counts = torch.bincount(ids[:, 0] * vocab + ids[:, 1], minlength=vocab * vocab)
    assert chi_square_pvalue(counts, pairs) >= ALPHA
    # k = 1 is categorical sampling, the same draw as sample_categorical.
    u = safe_uniform((trials, vocab), gen)
    rows = p.expand(trials, vocab)
    assert torch.equal(sample_without_replacement(rows, 1, u)[:, 0], sample_categorical(rows, u))


def test_chi_square_pvalue_matches_tables():
    """The helper's survival function against chi-square table values (scipy.stats.chi2.sf)."""
    assert math.isclose(chi_square_sf(3.841459, 1), 0.05, rel_tol=1e-5)
    assert math.isclose(chi_square_sf(14.06714, 7), 0.05, rel_tol=1e-5)
    assert math.isclose(chi_square_sf(82.52873, 63), 0.05, rel_tol=1e-5)
    assert math.isclose(chi_square_sf(19.51142, 1), 1e-5, rel_tol=1e-4)
    # Pooling: cells expecting < 5 are merged, so a rare cell hit once does not fail the test.
    probs = torch.tensor([0.5, 0.5 - 2e-6, 1e-6, 1e-6])
    assert chi_square_pvalue(torch.tensor([50_000, 49_999, 1, 0]), probs) > 0.5


# ---- unit: edge cases ------------------------------------------------------------------------


def test_residual_distribution():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.5, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    residual = residual_distribution(p, q)
    torch.testing.assert_close(residual[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(residual[1], p[1])  # p == q: no residual mass, fall back to p


def test_drafted_token_outside_the_draft_distribution():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])  # [1, 2, 3]: chain S = 1
    q = torch.tensor([[[0.0, 1.0, 0.0]]])
    draft = torch.tensor([[0]])  # q(0) == 0: the draft could not have drawn it
    coins, noise = torch.full((1, 2), 0.5), torch.full((1, 3), 0.5)
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_chain_sampling(draft, q, p, coins, noise)
    accept_len, predict = verify_chain_sampling(draft, q, p, coins, noise, validate=False)
    assert accept_len.tolist() == [2] and predict.tolist() == [[0, int(p[0, 1].argmax())]]  # p(0) > 0: accepted
    tokens, parents = torch.tensor([[1, 0]]), torch.tensor([[-1, 0]])
    with pytest.raises(ValueError, match="probability 0 under its parent"):
        verify_tree_sampling(tokens, parents, torch.cat([q, q], 1), p, 2, coins, noise)


def test_a_rejected_point_mass_draft_leaves_the_rest_of_p():
    """One-hot ``q`` at a token with ``p < 1``: rejection leaves ``p`` without that token."""
    p = torch.tensor([[[0.6, 0.4, 0.0], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    coins = torch.tensor([[0.5, 0.9]])  # 0.9 * 1.0 >= 0.6: rejected
    accept_len, predict = verify_chain_sampling(torch.tensor([[0]]), q, p, coins, torch.full((1, 3), 0.5))
    assert accept_len.tolist() == [1] and predict.tolist() == [[1, -1]]


def test_committed_logprobs():
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.0, 0.9]])
    out = committed_logprobs(probs, torch.tensor([1, -1]))
    torch.testing.assert_close(out, torch.tensor([math.log(0.25), 0.0]))
