"""Invariant 14 for the hybrid and block-draft kernels: each Triton kernel equals its torch reference.

Runs on CPU under ``TRITON_INTERPRET=1`` (CI) and on a GPU as is. Trees, chains, prefills, stored
parents from an earlier forward and masked channel blocks all appear in one launch.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from speccycle.backends.torch import block as block_ref
from speccycle.backends.torch import recurrent as scan_ref

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from speccycle.backends.cuda import dflash as block_fast  # noqa: E402
from speccycle.backends.cuda import recurrent as scan_fast  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _scan_case(seed: int, num_channels: int, state_size: int):
    """Segments of every kind, rows of all segments interleaved in the batch."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_slots, num_stored = 5, 64
    kinds = ["prefill", "chain", "tree", "draft_step", "tree"]
    parent_src, store_index, segments, final_slot = [], [], [], []
    free_store = list(range(8, num_stored))  # 0..7 hold states of "earlier forwards"
    rows_of = []
    next_row = 0
    for kind in kinds:
        n = rng.randint(1, 9)
        rows = list(range(next_row, next_row + n))
        next_row += n
        rows_of.append(rows)
        final_slot.append(len(segments) if kind == "prefill" else -1)
        segments.append(rows)
        for i in range(n):
            if kind == "prefill":
                parent_src.append(scan_ref.COMMITTED if i == 0 else scan_ref.PREVIOUS)
                store_index.append(free_store.pop() if rng.random() < 0.3 else -1)
                continue
            if i == 0:
                parent_src.append(rng.randrange(8) if kind == "draft_step" else scan_ref.COMMITTED)
            elif kind == "chain":
                parent_src.append(scan_ref.PREVIOUS)
            else:
                j = rng.randrange(i)
                parent_src.append(scan_ref.PREVIOUS if j == i - 1 else store_index[rows[j]])
            store_index.append(free_store.pop())
    num_rows = next_row
    order = torch.randperm(num_rows, generator=gen)  # batch row of the k-th row in segment order
    flat_rows = [r for rows in rows_of for r in rows]
    # Relabel: segment order position k lives at batch row order[k].
    batch_row = {k: int(order[i]) for i, k in enumerate(flat_rows)}
    parent_batch = torch.empty(num_rows, dtype=torch.long)
    store_batch = torch.empty(num_rows, dtype=torch.long)
    for k in flat_rows:
        parent_batch[batch_row[k]] = parent_src[k]
        store_batch[batch_row[k]] = store_index[k]
    row_order = torch.tensor([batch_row[k] for k in flat_rows], dtype=torch.long)
    counts = torch.tensor([len(r) for r in rows_of])
    seg_starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    tensors = dict(
        x=torch.randn(num_rows, num_channels, generator=gen),
        dt=torch.nn.functional.softplus(torch.randn(num_rows, num_channels, generator=gen)),
        A=-torch.exp(torch.randn(num_channels, state_size, generator=gen) * 0.5),
        B=torch.randn(num_rows, state_size, generator=gen),
        C=torch.randn(num_rows, state_size, generator=gen),
        D=torch.randn(num_channels, generator=gen),
        row_order=row_order,
        seg_starts=seg_starts,
        parent_src=parent_batch,
        init_states=torch.randn(num_slots, num_channels, state_size, generator=gen),
        init_slot=torch.tensor(rng.sample(range(num_slots), len(kinds))),
        row_states=torch.randn(num_stored, num_channels, state_size, generator=gen),
        store_index=store_batch,
        final_slot=torch.tensor(final_slot),
    )
    tensors["final_slot"] = torch.where(tensors["final_slot"] >= 0, tensors["init_slot"], -1)
    return tensors


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_channels, state_size", [(24, 5), (80, 16)])
def test_invariant_14_selective_scan_tree_kernel_equals_reference(seed, num_channels, state_size):
    case = _scan_case(seed, num_channels, state_size)
    ref = {k: v.clone() for k, v in case.items()}
    fast = {k: v.clone().to(DEVICE) for k, v in case.items()}
    y_ref = scan_ref.selective_scan_tree(**ref)
    y_fast = scan_fast.selective_scan_tree(**fast)
    torch.testing.assert_close(y_fast.cpu(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast["row_states"].cpu(), ref["row_states"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast["init_states"].cpu(), ref["init_states"], rtol=1e-5, atol=1e-5)


def test_selective_scan_tree_reference_follows_parents_not_row_order():
    """A tree row continues its parent's state: equal to a plain scan along its root-to-row path."""
    case = _scan_case(7, 6, 3)
    ref = {k: v.clone() for k, v in case.items()}
    y = scan_ref.selective_scan_tree(**ref)
    seg = 2  # the first "tree" segment
    rows = case["row_order"][case["seg_starts"][seg] : case["seg_starts"][seg + 1]].tolist()
    stored_at = {int(case["store_index"][r]): r for r in rows}
    for row in rows:
        path = [row]
        while True:
            src = int(case["parent_src"][path[0]])
            if src == scan_ref.COMMITTED:
                break
            path.insert(0, rows[rows.index(path[0]) - 1] if src == scan_ref.PREVIOUS else stored_at[src])
        h = case["init_states"][case["init_slot"][seg]].clone()
        for r in path:
            dt, x = case["dt"][r], case["x"][r]
            h = torch.exp(dt[:, None] * case["A"]) * h + (dt * x)[:, None] * case["B"][r][None, :]
        expected = (h * case["C"][row][None, :]).sum(-1) + case["D"] * case["x"][row]
        torch.testing.assert_close(y[row], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 2, 5, 16, 17])
def test_invariant_14_verify_block_kernel_equals_reference(block_size):
    gen = torch.Generator().manual_seed(block_size)
    bs = 9
    target = torch.randint(0, 4, (bs, block_size), generator=gen)
    candidates = torch.randint(0, 4, (bs, block_size), generator=gen)
    # Make long agreeing prefixes likely: copy the target's shifted tokens, then break a few.
    keep = torch.rand(bs, block_size - 1, generator=gen) < 0.8
    candidates[:, 1:] = torch.where(keep, target[:, :-1], candidates[:, 1:])
    candidates[0, 1:] = target[0, :-1]  # every candidate right: correct_len = B - 1
    correct_ref, bonus_ref = block_ref.verify_block(candidates, target)
    correct_fast, bonus_fast = block_fast.verify_block(candidates.to(DEVICE), target.to(DEVICE))
    assert torch.equal(correct_fast.cpu(), correct_ref)
    assert torch.equal(bonus_fast.cpu(), bonus_ref)
    assert int(correct_ref[0]) == block_size - 1
