"""Invariants 1, 4, 5, 7 and 12 as properties of the pure tree math and the reference ops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from speccycle.backends.torch import TorchBackend
from speccycle.core import SpecConfig
from speccycle.core.config import max_tree_nodes
from speccycle.core.ports import ModelOutput
from speccycle.core.tree import (
    advance_frontier,
    ancestor_mask,
    expand_frontier,
    pack_mask,
    rerank_tree,
    retrieve_links,
    tree_depths,
    unpack_mask,
)
from speccycle.statemachine.transitions import draft_levels

backend = TorchBackend()


@st.composite
def trees(draw, max_n=20, max_bs=3):
    """Random trees: ``parents[b, i] < i``, root at 0. Returns parents ``[bs, N]``."""
    bs = draw(st.integers(1, max_bs))
    n = draw(st.integers(1, max_n))
    rows = []
    for _ in range(bs):
        rows.append([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)])
    return torch.tensor(rows, dtype=torch.long)


def _ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


# ---- invariant 1: config ------------------------------------------------------------------------
@given(st.integers(-2, 10), st.integers(-1, 6), st.integers(-1, 200))
def test_invariant_1_config_validation(steps, topk, n):
    if steps == 0:  # no draft: the root alone
        valid = topk >= 1 and n == 1
    else:
        tree = 2 <= n <= 1 + max_tree_nodes(steps, topk)
        valid = steps >= 1 and topk >= 1 and (n == steps + 1 if topk == 1 else tree)
    if valid:
        config = SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=n)
        assert config.accept_width == steps + 1
    else:
        with pytest.raises(ValueError) as err:
            SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=n)
        assert any(name in str(err.value) for name in ("num_steps (S)", "topk (K)", "num_draft_tokens (N)"))
        assert "allowed" in str(err.value) or "must equal" in str(err.value)


# ---- invariant 4: tree --------------------------------------------------------------------------
@given(trees())
def test_invariant_4_tree_mask_is_prefix_ancestors_and_self(parents):
    mask = ancestor_mask(parents)
    for b, row in enumerate(parents.tolist()):
        for i in range(len(row)):
            assert set(torch.nonzero(mask[b, i]).flatten().tolist()) == _ancestors(row, i)
    assert torch.equal(unpack_mask(pack_mask(mask), parents.shape[1]), mask)
    depths = tree_depths(parents)
    assert torch.equal(depths, mask.sum(-1) - 1)


@given(trees())
def test_invariant_4_retrieve_links_rebuild_the_parents(parents):
    first_child, next_sibling = retrieve_links(parents)
    for b in range(parents.shape[0]):
        rebuilt = [-1] * parents.shape[1]
        for p in range(parents.shape[1]):
            c = int(first_child[b, p])
            while c >= 0:
                rebuilt[c] = p
                c = int(next_sibling[b, c])
        assert rebuilt == parents[b].tolist()


@given(st.integers(1, 5), st.integers(2, 4), st.integers(0, 10_000), st.data())
def test_invariant_4_eagle2_selection_keeps_parents_before_children(steps, topk, seed, data):
    gen = torch.Generator().manual_seed(seed)
    bs = 2
    scores = torch.softmax(torch.randn(bs, topk, generator=gen), -1).topk(topk).values
    cand_scores, cand_tokens, cand_parents = (
        [scores],
        [torch.randint(0, 50, (bs, topk), generator=gen)],
        [torch.full((bs, topk), -1)],
    )
    frontier_cand = torch.arange(topk).expand(bs, topk)
    for j in range(steps - 1):
        child_p = torch.softmax(torch.randn(bs, topk, 50, generator=gen), -1).topk(topk)
        cum, keep, scores, _ = expand_frontier(scores, child_p.values, child_p.indices, topk)
        assert torch.equal(scores, cum.sort(-1, descending=True).values[:, :topk])
        cand_scores.append(cum)
        cand_tokens.append(child_p.indices.reshape(bs, -1))
        cand_parents.append(frontier_cand.repeat_interleave(topk, dim=1))
        frontier_cand = topk + j * topk * topk + keep
    n = data.draw(st.integers(2, 1 + max_tree_nodes(steps, topk)))
    tokens, parents, kept_scores = rerank_tree(
        torch.tensor([7, 8]), torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1), torch.cat(cand_parents, 1), n
    )
    assert tokens.shape == parents.shape == (bs, n)
    assert (parents[:, 0] == -1).all() and (parents[:, 1:] < torch.arange(1, n)).all() and (parents[:, 1:] >= 0).all()
    # A child's cumulative score never exceeds its parent's.
    assert (kept_scores[:, 1:] <= kept_scores.gather(1, parents[:, 1:].clamp(min=0)) + 1e-7).all()
    assert int(tree_depths(parents).max()) <= steps


@given(
    st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(0, 6), st.booleans(), st.integers(0, 10_000)
)
def test_invariant_4_advance_frontier_is_the_expand_and_its_bookkeeping(bs, topk, depth, width, has_next, seed):
    """One level of the draft tree: the kept children are `expand_frontier`'s, each one's parent candidate
    is its frontier node's, its path is its parent's path then its own next slot, its state its parent's."""
    gen = torch.Generator().manual_seed(seed)
    frontier = torch.rand(bs, topk, generator=gen)
    child_p = (torch.rand(bs, topk, topk, generator=gen) * 4).round() / 4  # ties: the stable order decides
    child_ids = torch.randint(0, 100, (bs, topk, topk), generator=gen)
    frontier_cand = torch.randint(0, 50, (bs, topk), generator=gen)
    path = torch.randint(0, 500, (bs, topk, depth), generator=gen)
    hidden = torch.randn(bs * topk, width, generator=gen) if width else None
    next_own = torch.randint(0, 500, (bs, topk), generator=gen) if has_next else None
    step = advance_frontier(frontier, child_p, child_ids, frontier_cand, 9, path, hidden, next_own, topk)
    cum, keep, scores, tokens = expand_frontier(frontier, child_p, child_ids, topk)
    assert torch.equal(step.cum, cum) and torch.equal(step.scores, scores) and torch.equal(step.tokens, tokens)
    assert torch.equal(step.cand, 9 + keep)
    for b in range(bs):
        for c in range(topk * topk):
            assert int(step.parents[b, c]) == int(frontier_cand[b, c // topk])
        for k in range(topk):
            parent = int(keep[b, k]) // topk
            assert step.path[b, k, :depth].tolist() == path[b, parent].tolist()
            if has_next:
                assert int(step.path[b, k, depth]) == int(next_own[b, k])
            if width:
                assert torch.equal(step.hidden[b, k], hidden[b * topk + parent])
    assert step.path.shape == (bs, topk, depth + has_next)
    assert (step.hidden is None) == (width == 0)


class _ReducedVocabDraft:
    """A forward draft whose logits are a fixed table of the fed token over a small vocabulary: returned as
    they are with their `ModelOutput.vocab_map` (``reduced``), or scattered into a ``-inf`` target row."""

    kind, pairing = "forward", "shifted"

    def __init__(self, table: torch.Tensor, vocab_map: torch.Tensor, vocab: int, reduced: bool) -> None:
        self.table, self.vocab_map, self.vocab, self.reduced = table, vocab_map, vocab, reduced
        self.draft, self.kv_pool, self.page_size = self, self, 4

    def step(self, batch, parent_hidden):
        small = self.table[batch.input_ids]
        hidden = parent_hidden * 0.5 + batch.input_ids[:, None]
        if self.reduced:
            return ModelOutput(logits=small, hidden=hidden, vocab_map=self.vocab_map)
        full = torch.full((small.shape[0], self.vocab), float("-inf"))
        full[:, self.vocab_map] = small
        return ModelOutput(logits=full, hidden=hidden)


@given(st.integers(2, 4), st.integers(1, 3), st.integers(0, 10_000))
def test_invariant_4_drafting_over_the_draft_vocabulary_equals_the_scattered_logits(steps, topk, seed):
    """Greedy levels over a draft's own vocabulary (`ModelOutput.vocab_map`: top-K there, ids mapped after)
    pick the candidates that the same logits scattered into the target vocabulary give; a sampled draft
    refuses them (it needs the target vocabulary's distribution)."""
    gen = torch.Generator().manual_seed(seed)
    vocab, small = 40, 12
    vocab_map = torch.randperm(vocab, generator=gen)[:small]  # any order, not only increasing
    table = torch.randn(vocab, small, generator=gen)
    cfg = SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=steps + 1 if topk == 1 else 1 + topk)
    bs = 2
    L = torch.tensor([5, 9])
    draft_slots = torch.arange(bs * (steps - 1) * topk).view(bs, steps - 1, topk) + 100
    topk_p = torch.softmax(torch.randn(bs, topk, generator=gen), -1)
    topk_index = vocab_map[torch.randint(0, small, (bs, topk), generator=gen)]
    hidden = torch.randn(bs, 3, generator=gen)
    args = (cfg, (0, 1), L, torch.zeros(bs, 8, dtype=torch.long), draft_slots, topk_p, topk_index, hidden)
    got = draft_levels(_ReducedVocabDraft(table, vocab_map, vocab, True), backend, *args)
    want = draft_levels(_ReducedVocabDraft(table, vocab_map, vocab, False), backend, *args)
    for name, a, b in zip(("tokens", "scores", "parents", "positions"), got, want):
        if name == "scores":
            torch.testing.assert_close(a, b)
        else:
            assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="target vocabulary"):
        draft_levels(_ReducedVocabDraft(table, vocab_map, vocab, True), backend, *args, rows=object())


# ---- invariant 5: accept ------------------------------------------------------------------------
def _walk(tokens: list[int], parents: list[int], predict: list[int], width: int) -> list[int]:
    """The textbook greedy walk: from the root, follow the first child whose token is predicted."""
    path, cur = [0], 0
    while len(path) < width:
        nxt = [c for c in range(len(tokens)) if parents[c] == cur and tokens[c] == predict[cur]]
        if not nxt:
            break
        cur = nxt[0]
        path.append(cur)
    return path


@given(trees(max_n=16), st.integers(1, 6), st.integers(0, 10_000))
def test_invariant_5_greedy_verify_matches_the_walk(parents, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    bs, n = parents.shape
    depths = tree_depths(parents)
    if int(depths.max()) > steps:
        steps = int(depths.max())
    tokens = torch.randint(0, 3, (bs, n), generator=gen)  # a small vocabulary: repeats and matches
    predict = torch.randint(0, 3, (bs, n), generator=gen)
    width = steps + 1
    accept_index, accept_len = backend.verify_greedy(tokens, parents, predict, width)
    assert accept_index.shape == (bs, width)
    for b in range(bs):
        path = _walk(tokens[b].tolist(), parents[b].tolist(), predict[b].tolist(), width)
        assert int(accept_len[b]) == len(path)
        assert accept_index[b].tolist() == [p + b * n for p in path] + [-1] * (width - len(path))
    last = backend.last_correct_step_indices(accept_index, accept_len, n)  # invariant 12
    assert ((last >= 0) & (last < n)).all()


@given(st.integers(1, 4), st.integers(1, 9), st.integers(0, 3), st.integers(0, 10_000))
def test_invariant_5_chain_verify_equals_the_tree_walk(bs, n, extra_width, seed):
    """`verify_greedy_chain` is `verify_greedy` over a chain's parents, for any accept width >= ``n``
    (a lookup draft may propose fewer than ``S`` nodes) and a few below it."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.arange(-1, n - 1).expand(bs, n).contiguous()
    tokens = torch.randint(0, 2, (bs, n), generator=gen)  # two tokens: long runs of matches
    predict = torch.randint(0, 2, (bs, n), generator=gen)
    predict[:, :-1] = torch.where(torch.rand(bs, n - 1, generator=gen) < 0.7, tokens[:, 1:], predict[:, :-1])
    for width in {n + extra_width, max(1, n - extra_width)}:
        got = backend.verify_greedy_chain(tokens, predict, width)
        want = backend.verify_greedy(tokens, parents, predict, width)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@given(trees(max_n=20, max_bs=4), st.booleans())
def test_invariant_4_host_walks_equal_the_tensor_rounds(parents, shuffled):
    """On a CPU, small trees take list walks (`core.tree.HOST_WALK_ROWS`); they equal the tensor rounds
    exactly, and a tree whose parents do not precede their rows (``shuffled``) takes the rounds."""
    from speccycle.core import tree

    if shuffled and parents.shape[1] > 2:  # relabel rows in reverse: each parent now follows its row
        n = parents.shape[1]
        parents = torch.where(parents >= 0, n - 1 - parents, -1).flip(1)
    assert torch.equal(tree.tree_depths(parents), tree._tree_depths_rounds(parents))
    assert torch.equal(tree.ancestor_mask(parents), tree._ancestor_mask_rounds(parents))
    assert tree.tree_depths(parents).dtype == parents.dtype


# ---- invariant 7: KV moves ----------------------------------------------------------------------
@given(trees(max_n=12), st.integers(0, 10_000))
def test_invariant_7_kv_move_puts_the_accepted_path_at_L(parents, seed):
    gen = torch.Generator().manual_seed(seed)
    bs, n = parents.shape
    width = int(tree_depths(parents).max()) + 1
    tokens = torch.randint(0, 2, (bs, n), generator=gen)
    predict = torch.randint(0, 2, (bs, n), generator=gen)
    accept_index, accept_len = backend.verify_greedy(tokens, parents, predict, width)
    verify_slots = torch.randperm(bs * n * 2, generator=gen)[: bs * n].view(bs, n)
    kv = torch.arange(bs * n * 2)[:, None] * 10
    src, dst = backend.plan_kv_move(accept_index, accept_len, verify_slots)
    assert src.numel() <= bs * width
    own = {int(s): b for b in range(bs) for s in verify_slots[b]}
    assert all(own[int(s)] == own[int(d)] for s, d in zip(src, dst)), "a move crossed requests"
    before = kv.clone()
    backend.move_kv([kv], src, dst)
    for b in range(bs):
        for d in range(int(accept_len[b])):
            row = int(accept_index[b, d]) - b * n
            assert int(kv[verify_slots[b, d], 0]) == int(before[verify_slots[b, row], 0])
