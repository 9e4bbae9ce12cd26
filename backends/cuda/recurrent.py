"""Triton kernel of the tree/chain selective-scan step (reference: `backends.torch.recurrent`).

One program per (segment, block of channels) walks the segment's rows in order. A row whose parent
is the previous row keeps the state in registers (every prefill row, every chain row); a tree row
whose parent is further back reads the parent's state from ``row_states``, where the parent stored
it a few iterations earlier in the same program. The barrier after each store makes that write
visible to every thread of the program before a later row reads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch.recurrent import COMMITTED, PREVIOUS


@triton.jit
def _selective_scan_tree_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    row_order_ptr,
    seg_starts_ptr,
    parent_src_ptr,
    init_ptr,
    init_slot_ptr,
    rows_ptr,
    store_ptr,
    final_ptr,
    y_ptr,
    num_channels,
    state_size,
    COMMITTED_SRC: tl.constexpr,
    PREVIOUS_SRC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seg = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    states = tl.arange(0, BLOCK_N)
    d_mask = channels < num_channels
    n_mask = states < state_size
    mask = d_mask[:, None] & n_mask[None, :]
    offsets = channels[:, None] * state_size + states[None, :]  # [BLOCK_D, BLOCK_N] inside one state
    state_numel = num_channels * state_size

    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    slot = tl.load(init_slot_ptr + seg).to(tl.int64)
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    d_skip = tl.load(d_ptr + channels, mask=d_mask, other=0.0).to(tl.float32)
    committed = tl.load(init_ptr + slot * state_numel + offsets, mask=mask, other=0.0).to(tl.float32)
    h = committed
    for i in range(start, end):
        row = tl.load(row_order_ptr + i).to(tl.int64)
        src = tl.load(parent_src_ptr + row).to(tl.int64)
        src_2d = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.int64) + src  # a scalar condition, as a mask
        stored = tl.load(rows_ptr + tl.maximum(src_2d, 0) * state_numel + offsets, mask=mask & (src_2d >= 0), other=0.0)
        parent = tl.where(src == PREVIOUS_SRC, h, tl.where(src == COMMITTED_SRC, committed, stored.to(tl.float32)))
        x = tl.load(x_ptr + row * num_channels + channels, mask=d_mask, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + row * num_channels + channels, mask=d_mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * state_size + states, mask=n_mask, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + row * state_size + states, mask=n_mask, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * a) * parent + (dt * x)[:, None] * b[None, :]
        y = tl.sum(h * c[None, :], axis=1) + d_skip * x
        tl.store(y_ptr + row * num_channels + channels, y, mask=d_mask)
        keep = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.int64) + tl.load(store_ptr + row).to(tl.int64)
        keep_ptr = rows_ptr + tl.maximum(keep, 0) * state_numel + offsets
        tl.store(keep_ptr, h.to(rows_ptr.dtype.element_ty), mask=mask & (keep >= 0))
        tl.debug_barrier()  # a later row of this program may read the state just stored
    final = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.int64) + tl.load(final_ptr + seg).to(tl.int64)
    final = tl.where(end > start, final, -1)
    final_ptr_2d = init_ptr + tl.maximum(final, 0) * state_numel + offsets
    tl.store(final_ptr_2d, h.to(init_ptr.dtype.element_ty), mask=mask & (final >= 0))


def selective_scan_tree(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    row_order: torch.Tensor,
    seg_starts: torch.Tensor,
    parent_src: torch.Tensor,
    init_states: torch.Tensor,
    init_slot: torch.Tensor,
    row_states: torch.Tensor,
    store_index: torch.Tensor,
    final_slot: torch.Tensor,
) -> torch.Tensor:
    """Same contract and shapes as `speccycle.backends.torch.recurrent.selective_scan_tree`.

    ``init_states`` and ``row_states`` are written in place and must be contiguous.
    """
    num_rows, num_channels = x.shape
    state_size = A.shape[1]
    y = torch.zeros(num_rows, num_channels, dtype=torch.float32, device=x.device)
    num_segments = seg_starts.numel() - 1
    if num_rows == 0 or num_segments == 0:
        return y
    if not (init_states.is_contiguous() and row_states.is_contiguous()):
        raise ValueError("selective_scan_tree writes init_states and row_states in place: pass contiguous tensors")
    if row_states.shape[0] == 0:
        row_states = init_states.new_zeros((1, num_channels, state_size))  # never read: no index points here
    block_d = min(64, triton.next_power_of_2(num_channels))
    block_n = triton.next_power_of_2(state_size)
    grid = (num_segments, triton.cdiv(num_channels, block_d))
    _selective_scan_tree_kernel[grid](
        x.contiguous(),
        dt.contiguous(),
        A.contiguous(),
        B.contiguous(),
        C.contiguous(),
        D.contiguous(),
        row_order.contiguous(),
        seg_starts.contiguous(),
        parent_src.contiguous(),
        init_states,
        init_slot.contiguous(),
        row_states,
        store_index.contiguous(),
        final_slot.contiguous(),
        y,
        num_channels,
        state_size,
        COMMITTED_SRC=COMMITTED,
        PREVIOUS_SRC=PREVIOUS,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
    )
    return y
