"""`bench.forced.forced_walk`: the scale benchmarks' forced acceptance in fused cycles, as whole-tensor ops,
against the walk it stands for, step by step in Python: from the root, while fewer than ``accept`` rows are
taken, a row predicts its first child's token (the lowest-index row whose parent it is); every other row
predicts -1."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from speccycle.bench.forced import forced_walk


def walk_step_by_step(tokens: list[int], parents: list[int] | None, accept: int, steps: int) -> list[int]:
    n = len(tokens)
    parents = parents if parents is not None else [i - 1 for i in range(n)]
    walk, row = [-1] * n, 0
    for i in range(steps):
        children = [c for c in range(n) if parents[c] == row]
        if not children:
            break  # a leaf: the path ends
        if i + 1 < accept:
            walk[row] = tokens[children[0]]
        row = children[0]
    return walk


@st.composite
def trees(draw):
    batch = draw(st.integers(1, 3))
    n = draw(st.integers(2, 12))
    steps = draw(st.integers(1, n - 1))
    # row 0 is the root; every other row's parent comes before it (the verify's row order)
    parents = [[-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)] for _ in range(batch)]
    tokens = [draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)) for _ in range(batch)]
    accept = draw(st.integers(1, steps + 1))
    return tokens, parents, accept, steps


@settings(max_examples=150, deadline=None)
@given(trees())
def test_the_forced_tree_walk_is_the_first_child_walk(case):
    tokens, parents, accept, steps = case
    got = forced_walk(torch.tensor(tokens), torch.tensor(parents), torch.tensor([accept]), steps)
    expected = [walk_step_by_step(t, p, accept, steps) for t, p in zip(tokens, parents)]
    assert got.tolist() == expected


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(2, 9), st.data())
def test_the_forced_chain_walk_takes_accept_rows(batch, n, data):
    tokens = [data.draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)) for _ in range(batch)]
    accept = data.draw(st.integers(1, n))
    got = forced_walk(torch.tensor(tokens), None, torch.tensor([accept]), n - 1)
    assert got.tolist() == [walk_step_by_step(t, None, accept, n - 1) for t in tokens]
    # the chain as a tree (row i's parent i - 1) walks the same
    as_tree = torch.arange(n).sub(1).expand(batch, n)
    assert torch.equal(forced_walk(torch.tensor(tokens), as_tree, torch.tensor([accept]), n - 1), got)
