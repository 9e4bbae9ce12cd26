"""The one-request CPU attention plan (engine/kernels/attention.py): same keys and mask as the reference layout,
the same attention up to rounding, on decode, prefill, chain and tree verify batches."""

from __future__ import annotations

import pytest
import torch
from attrs import evolve
from speccycle.core.ports import ForwardBatch
from speccycle.engine.kernels import attention
from speccycle.engine.kernels.attention import paged_attention, plan_attention

H, HKV, D = 6, 2, 8


def one_request_batch(kind: str, page_size: int, scattered: bool) -> ForwardBatch:
    """A batch of one request at ``L = 11``: ``decode`` (1 row), ``prefill`` (rows 0..10), ``chain`` (4 verify
    rows) or ``tree`` (5 rows: root, two children, a grandchild under each). ``scattered``: pages out of order."""
    length = 11
    num_pages = -(-(length + 6) // page_size)
    pages = list(range(num_pages))
    if scattered:
        pages = pages[::-1]
    page_table = torch.tensor([pages], dtype=torch.long)

    def slot(position: int) -> int:
        return pages[position // page_size] * page_size + position % page_size

    if kind == "decode":
        positions, prefix, extra = [length], [length + 1], torch.empty((1, 0), dtype=torch.long)
    elif kind == "prefill":
        positions = list(range(length))
        prefix, extra = [p + 1 for p in positions], torch.empty((length, 0), dtype=torch.long)
    else:
        parents = [-1, 0, 1, 2] if kind == "chain" else [-1, 0, 0, 1, 2]
        depths = [0]
        for parent in parents[1:]:
            depths.append(depths[parent] + 1)
        n = len(parents)
        positions, prefix = [length + d for d in depths], [length] * n
        extra = torch.full((n, n), -1, dtype=torch.long)
        for row in range(n):
            node = row
            while node >= 0:  # the row's ancestors and itself, at their verify slots
                extra[row, node] = slot(length + node)
                node = parents[node]
    rows = len(positions)
    out_slots = [slot(length + i) for i in range(rows)] if kind in ("chain", "tree") else [slot(p) for p in positions]
    return ForwardBatch(
        input_ids=torch.zeros(rows, dtype=torch.long),
        positions=torch.tensor(positions),
        row_request=torch.zeros(rows, dtype=torch.long),
        out_slots=torch.tensor(out_slots),
        prefix_lens=torch.tensor(prefix),
        extra_slots=extra,
        page_table=page_table,
        page_size=page_size,
        request_ids=(0,),
    )


def attended(plan, row: int) -> set[int]:
    """The slots row ``row`` of a one-request plan attends."""
    return set(plan.key_slots[0][plan.mask[0, 0, row]].tolist())


def reference_plan(batch, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(attention, "_plan_one_request", lambda batch: None)
        return plan_attention(batch)


@pytest.mark.parametrize("kind", ["decode", "prefill", "chain", "tree"])
@pytest.mark.parametrize("page_size, scattered", [(1, False), (3, False), (16, False), (3, True)])
def test_compact_plan_attends_the_reference_keys_and_agrees(kind, page_size, scattered, monkeypatch):
    batch = one_request_batch(kind, page_size, scattered)
    compact, reference = plan_attention(batch), reference_plan(batch, monkeypatch)
    assert compact.compact and not reference.compact
    for row in range(batch.num_rows):
        assert attended(compact, row) == attended(reference, row)
    assert (compact.key_start is not None) == (not scattered or page_size == 16)  # one page: one run
    expected_kind = {"decode": "full", "prefill": "causal"}.get(kind, "mask")
    assert compact.mask_kind == expected_kind
    gen = torch.Generator().manual_seed(0)
    num_slots = batch.page_table.numel() * page_size
    k_cache, v_cache = torch.randn(num_slots, HKV, D, generator=gen), torch.randn(num_slots, HKV, D, generator=gen)
    q = torch.randn(batch.num_rows, H, D, generator=gen)
    expected = paged_attention(reference, q, k_cache, v_cache)
    torch.testing.assert_close(paged_attention(compact, q, k_cache, v_cache), expected, atol=1e-6, rtol=1e-5)
    with monkeypatch.context() as patch:  # the other path of the compact plan: SDPA for every row count
        patch.setattr(attention, "SMALL_ROWS", 0)
        torch.testing.assert_close(paged_attention(compact, q, k_cache, v_cache), expected, atol=1e-6, rtol=1e-5)


def test_a_chain_verify_attends_its_rows_once_not_a_block_per_row():
    batch = one_request_batch("chain", 16, False)
    plan = plan_attention(batch)
    assert plan.key_slots.shape == (1, 11 + 4)  # prefix + the 4 verify slots, not 11 + 4 * 4
    assert plan.key_start == 0 and plan.prefix_width == 11
    assert torch.equal(plan.bias.isinf(), ~plan.mask[0, 0])


def test_an_extra_slot_inside_the_prefix_keeps_the_reference_layout():
    batch = one_request_batch("chain", 16, False)
    extra = batch.extra_slots.clone()
    extra[:, 0] = 3  # slot of position 3, also a prefix key: the reference attends it twice
    plan = plan_attention(evolve(batch, extra_slots=extra))
    assert not plan.compact
