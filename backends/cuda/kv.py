"""Triton kernels of the cache slots and the tree compaction's KV move.

* `slots_for_positions`: slot ``page_table[b, pos // P] * P + pos % P`` of each position (the draft
  scratch and the verify rows), ``P == 1`` and ``P > 1`` alike; a position past the request's pages
  raises `IndexError` like the reference (one host check after the kernel).
* `plan_kv_move_padded`: per request and accepted depth ``d`` the move ``slot(L + a_d) -> slot(L + d)``,
  ``-1`` where nothing moves (past ``accept_len``, or a row already in place). `plan_kv_move` keeps
  the moves, in the reference's order.
* `move_kv`: copy slot ``src[m]`` to ``dst[m]`` in a slot-major buffer, **all reads before any write**:
  one program owns a block of a slot's elements for every move, loads them all, waits at a barrier,
  then stores them; programs own disjoint elements, so a move that writes a slot another move reads
  (row 3 to 2 while 2 moves to 1) is safe. Moves with a negative ``src`` or ``dst`` are skipped, so a
  padded plan can be moved without compacting it (no host sync). The copy is bitwise (the buffer is
  viewed as integers of its item size). A buffer is any slot-major view ``[num_slots, ...]`` whose
  trailing dimensions are contiguous and whose middle dimensions collapse to one stride (the
  engine's ``[num_slots, layers * 2, Hkv, D]`` view of ``[layers, 2, num_slots, Hkv, D]`` is one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .launch import ROWS_PER_PROGRAM, interpreted, next_power_of_2

MAX_MOVES = 1024  # moves held in one program's registers; the backend moves larger plans in torch
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SLOTS_BLOCK_R, SLOTS_BLOCK = 16, 64  # `slots_for_positions`' requests x positions a program, where it compiles


# The batch's size, its positions' width and its page table's shape change from call to call in serving: not
# specialized, and the blocks are fixed (`SLOTS_BLOCK_R` x `SLOTS_BLOCK`) where the kernel compiles, so a new shape
# compiles no kernel mid-serving (a soak on an H200 compiled it twice inside a timed run when the blocks followed
# the batch's shape).
@triton.jit(do_not_specialize=["table_stride", "max_pages", "bs", "width"])
def _slots_kernel(
    page_table_ptr,
    table_stride,
    max_pages,
    positions_ptr,
    out_ptr,
    bs,
    width,
    page_size,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    requests = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    inside = (requests < bs) & (cols < width)
    position = tl.load(positions_ptr + requests * width + cols, mask=inside, other=0).to(tl.int64)
    page_index = position // page_size
    valid = inside & (position >= 0) & (page_index < max_pages)
    page = tl.load(page_table_ptr + requests * table_stride + page_index, mask=valid, other=-1).to(tl.int64)
    slot = tl.where(valid & (page >= 0), page * page_size + position % page_size, -1)
    tl.store(out_ptr + requests * width + cols, slot, mask=inside)


def slots_for_positions(
    page_table: torch.Tensor, positions: torch.Tensor, page_size: int, covered: bool = False
) -> torch.Tensor:
    """Same contract and shapes as `TorchBackend.slots_for_positions`: ``[bs, X...]`` -> ``[bs, X...]`` int64."""
    bs = positions.shape[0]
    flat = positions.reshape(bs, -1).contiguous()
    width = flat.shape[1]
    out = torch.empty(bs, width, dtype=torch.long, device=positions.device)
    if bs and width:
        if page_table.stride(1) != 1:
            page_table = page_table.contiguous()
        if interpreted():  # nothing compiles: blocks that fit the call keep the interpreter's steps few
            block = min(1024, next_power_of_2(width))
            block_r = min(next_power_of_2(bs), ROWS_PER_PROGRAM)
        else:
            block_r, block = SLOTS_BLOCK_R, SLOTS_BLOCK
        _slots_kernel[(triton.cdiv(bs, block_r), triton.cdiv(width, block))](
            page_table,
            page_table.stride(0),
            page_table.shape[1],
            flat,
            out,
            bs,
            width,
            page_size,
            BLOCK_R=block_r,
            BLOCK=block,
        )
        if not covered and bool((out < 0).any()):
            raise IndexError("a position lies past the pages its request holds; reserve before assigning slots")
    return out.reshape(positions.shape)


@triton.jit
def _plan_kernel(accept_index_ptr, accept_len_ptr, slots_ptr, src_ptr, dst_ptr, n, width, BLOCK: tl.constexpr):
    request = tl.program_id(0).to(tl.int64)
    depth = tl.arange(0, BLOCK)
    inside = depth < width
    accepted = tl.load(accept_index_ptr + request * width + depth, mask=inside, other=-1)
    length = tl.load(accept_len_ptr + request)
    row = accepted - request * n
    moves = inside & (depth < length) & (row != depth) & (accepted >= 0)
    src = tl.load(slots_ptr + request * n + tl.minimum(tl.maximum(row, 0), n - 1), mask=inside, other=-1)
    dst = tl.load(slots_ptr + request * n + tl.minimum(depth, n - 1), mask=inside, other=-1)
    tl.store(src_ptr + request * width + depth, tl.where(moves, src, -1), mask=inside)
    tl.store(dst_ptr + request * width + depth, tl.where(moves, dst, -1), mask=inside)


def plan_kv_move_padded(
    accept_index: torch.Tensor, accept_len: torch.Tensor, verify_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The moves of `TorchBackend.plan_kv_move`, one per (request, depth), ``-1`` where none.

    Shapes: ``accept_index [bs, S + 1]``, ``accept_len [bs]``, ``verify_slots [bs, N]`` ->
    ``src [bs * (S + 1)]``, ``dst [bs * (S + 1)]``.
    """
    bs, n = verify_slots.shape
    width = accept_index.shape[1]
    src = torch.empty(bs * width, dtype=verify_slots.dtype, device=verify_slots.device)
    dst = torch.empty_like(src)
    if bs and width:
        _plan_kernel[(bs,)](
            accept_index.contiguous(),
            accept_len.contiguous(),
            verify_slots.contiguous(),
            src,
            dst,
            n,
            width,
            BLOCK=next_power_of_2(width),
        )
    return src, dst


def plan_kv_move(
    accept_index: torch.Tensor, accept_len: torch.Tensor, verify_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and shapes as `TorchBackend.plan_kv_move` (one host sync, for the count)."""
    src, dst = plan_kv_move_padded(accept_index, accept_len, verify_slots)
    keep = ((src >= 0) & (dst >= 0)).nonzero().squeeze(1)
    return src[keep], dst[keep]


@triton.jit
def _move_kv_kernel(
    buf_ptr,
    src_ptr,
    dst_ptr,
    num_moves,
    slot_stride,
    group_stride,
    inner,
    row_numel,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    col_inside = cols < row_numel
    offset = (cols // inner).to(tl.int64) * group_stride + cols % inner
    moves = tl.arange(0, BLOCK_M)
    move_inside = moves < num_moves
    src = tl.load(src_ptr + moves, mask=move_inside, other=-1).to(tl.int64)
    dst = tl.load(dst_ptr + moves, mask=move_inside, other=-1).to(tl.int64)
    ok = (move_inside & (src >= 0) & (dst >= 0))[:, None] & col_inside[None, :]
    x = tl.load(buf_ptr + src[:, None] * slot_stride + offset[None, :], mask=ok)
    tl.debug_barrier()  # every read of this program's elements lands before any write
    tl.store(buf_ptr + dst[:, None] * slot_stride + offset[None, :], x, mask=ok)


def slot_layout(buf: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``(slot_stride, groups, group_stride, inner)`` of a slot-major buffer, or None when it has none.

    Element ``(g, e)`` of slot ``s`` lies at ``s * slot_stride + g * group_stride + e``, ``e < inner``.
    """
    dims = [(size, stride) for size, stride in zip(buf.shape[1:], buf.stride()[1:]) if size != 1]
    inner = 1
    while dims and dims[-1][1] == inner:
        inner *= dims.pop()[0]
    if not dims:
        return buf.stride(0), 1, 0, inner
    for (_, stride), (size_next, stride_next) in zip(dims, dims[1:]):
        if stride != stride_next * size_next:
            return None
    groups = 1
    for size, _ in dims:
        groups *= size
    return buf.stride(0), groups, dims[-1][1], inner


def movable(buf: torch.Tensor) -> bool:
    """Whether `move_kv`'s kernel can copy slots of ``buf`` (else the backend uses torch indexing)."""
    return buf.dim() >= 1 and buf.element_size() in _BITS and slot_layout(buf) is not None


def move_kv(buffers: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy slot ``src[m]`` to ``dst[m]`` in every buffer, all reads before any write; negatives skipped.

    Shapes: ``src [M]``, ``dst [M]`` with ``M <= MAX_MOVES``; each buffer passes `movable`.
    """
    num_moves = src.numel()
    if num_moves == 0:
        return
    if num_moves > MAX_MOVES:
        raise ValueError(f"move_kv's kernel moves at most {MAX_MOVES} slots per call, got {num_moves}")
    src, dst = src.contiguous(), dst.contiguous()
    block_m = next_power_of_2(num_moves)
    for buf in buffers:
        layout = slot_layout(buf)
        if layout is None or buf.element_size() not in _BITS:
            raise ValueError(f"move_kv's kernel needs a slot-major buffer with a strided layout, got {buf.shape}")
        slot_stride, groups, group_stride, inner = layout
        row_numel = groups * inner
        if row_numel == 0:
            continue
        bits = buf.view(_BITS[buf.element_size()]) if buf.dtype != _BITS[buf.element_size()] else buf
        block_e = max(16, min(next_power_of_2(row_numel), 8192 // block_m))
        _move_kv_kernel[(triton.cdiv(row_numel, block_e),)](
            bits,
            src,
            dst,
            num_moves,
            slot_stride,
            group_stride,
            inner,
            row_numel,
            BLOCK_M=block_m,
            BLOCK_E=block_e,
        )
