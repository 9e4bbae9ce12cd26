"""Fused softmax top-K of the draft logits (reference: ``softmax(logits.float()).topk(K)``), ``K > 1``.

The reference writes the whole float32 softmax (``R x V``) and sorts it; this reads the logits once.
Softmax is monotonic, so the top ``K`` probabilities are those of the top ``K`` logits:

* stage 1, one program per (row, vocabulary block): the block's maximum ``m``, its
  ``sum(exp(x - m))`` and its top ``K`` logits (``K`` max-and-remove passes over the block);
* stage 2, one program per row: the row's maximum ``M``, the denominator
  ``sum_blocks s_b * exp(m_b - M)`` (the online-softmax rescaling), the top ``K`` of the blocks'
  candidates, and ``p = exp(x - M) / denominator``.

Indices equal the reference's wherever the top ``K`` probabilities are distinct; equal logits are
ordered lowest index first (``torch.topk`` leaves the order of ties unspecified). Probabilities
equal the reference's to float32 rounding (the sum runs in another order). A NaN logit is read as
``-inf``, so a row with NaNs still names ``K`` indices inside the vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import ROWS_PER_PROGRAM, interpreted, next_power_of_2

_NONE = 2147483647
_BLOCK = 2048
_NATIVE = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _topk_block_kernel(
    logits_ptr,
    num_rows,
    row_stride,
    vocab_size,
    max_ptr,
    sum_ptr,
    cand_value_ptr,
    cand_index_ptr,
    num_blocks,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
    NONE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_inside = rows < num_rows
    part = tl.program_id(1)
    cols = (part * BLOCK + tl.arange(0, BLOCK))[None, :]
    inside = row_inside[:, None] & (cols < vocab_size)
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * row_stride + cols, mask=inside, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    top = tl.max(x, axis=1)
    shift = tl.where(top == float("-inf"), 0.0, top)  # a block of -inf adds 0, not NaN
    total = tl.sum(tl.where(inside, tl.exp(x - shift[:, None]), 0.0), axis=1)
    slot = rows.to(tl.int64) * num_blocks + part
    tl.store(max_ptr + slot, top, mask=row_inside)
    tl.store(sum_ptr + slot, total, mask=row_inside)
    free = inside
    for k in tl.static_range(K):
        value = tl.max(tl.where(free, x, float("-inf")), axis=1)
        index = tl.min(tl.where(free & (x == value[:, None]), cols, NONE), axis=1)
        free = free & (cols != index[:, None])
        tl.store(cand_value_ptr + slot * K + k, value, mask=row_inside)
        tl.store(cand_index_ptr + slot * K + k, index, mask=row_inside)


@triton.jit
def _topk_merge_kernel(
    max_ptr,
    sum_ptr,
    cand_value_ptr,
    cand_index_ptr,
    probs_ptr,
    ids_ptr,
    map_ptr,
    num_rows,
    num_blocks,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NONE: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_inside = rows < num_rows
    flat_rows = rows.to(tl.int64)
    rows64 = flat_rows[:, None]
    parts = tl.arange(0, BLOCK_B)[None, :]
    part_inside = row_inside[:, None] & (parts < num_blocks)
    block_max = tl.load(max_ptr + rows64 * num_blocks + parts, mask=part_inside, other=float("-inf"))
    block_sum = tl.load(sum_ptr + rows64 * num_blocks + parts, mask=part_inside, other=0.0)
    top = tl.max(block_max, axis=1)
    shift = tl.where(top == float("-inf"), 0.0, top)
    denominator = tl.sum(block_sum * tl.exp(block_max - shift[:, None]), axis=1)
    # A row of -inf (or NaN) logits has no distribution: NaN, as the reference's softmax gives.
    safe = tl.where(denominator > 0.0, denominator, 1.0)
    cands = tl.arange(0, BLOCK_C)[None, :]
    cand_inside = row_inside[:, None] & (cands < num_blocks * K)
    where = rows64 * num_blocks * K + cands
    value = tl.load(cand_value_ptr + where, mask=cand_inside, other=float("-inf"))
    index = tl.load(cand_index_ptr + where, mask=cand_inside, other=NONE)
    free = cand_inside & (index != NONE)
    for k in tl.static_range(K):
        best = tl.max(tl.where(free, value, float("-inf")), axis=1)
        chosen = tl.min(tl.where(free & (value == best[:, None]), index, NONE), axis=1)
        free = free & (index != chosen[:, None])
        prob = tl.where(denominator > 0.0, tl.exp(best - shift) / safe, float("nan"))
        chosen = chosen.to(tl.int64)
        if HAS_MAP:  # a draft vocabulary's column -> the target's id
            chosen = tl.load(map_ptr + chosen, mask=row_inside, other=0)
        tl.store(probs_ptr + flat_rows * K + k, prob, mask=row_inside)
        tl.store(ids_ptr + flat_rows * K + k, chosen, mask=row_inside)


def softmax_topk(
    logits: torch.Tensor,
    topk: int,
    vocab_map: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``K`` probabilities and ids of each row without materialising the softmax.

    ``vocab_map [V]`` int64: each chosen column ``c`` is written as ``vocab_map[c]`` (a draft vocabulary's
    ids mapped to the target's in the merge kernel, not by a gather launch after it). ``out``: contiguous
    ``(probs, ids)`` tensors the merge kernel writes (a captured graph's static buffers) instead of new ones.

    Shapes: ``logits [R, V]`` (float16 / bfloat16 / float32; float8 is widened first) ->
    ``probs [R, K]`` float32 (descending), ``ids [R, K]`` int64.
    """
    if logits.dim() != 2:
        raise ValueError(f"softmax_topk needs logits [R, V], got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if not 1 <= topk <= vocab:
        raise ValueError(f"topk={topk} is out of range for a vocabulary of {vocab}: allowed [1, {vocab}]")
    if logits.dtype not in _NATIVE:
        if not logits.dtype.is_floating_point or logits.dtype == torch.float64:
            raise ValueError(f"softmax_topk takes float16, bfloat16, float32 or float8 logits, got {logits.dtype}")
        logits = logits.float()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    if vocab_map is not None:
        if vocab_map.dtype != torch.long or vocab_map.shape != (vocab,):
            raise ValueError(f"vocab_map must be int64 [{vocab}] (one id per logits column), got "
                             f"{vocab_map.dtype} {tuple(vocab_map.shape)}")  # fmt: skip
        vocab_map = vocab_map.contiguous()
    if out is not None:
        probs, ids = out
        want = [(torch.float32, (rows, topk)), (torch.long, (rows, topk))]
        if [(t.dtype, tuple(t.shape)) for t in out] != want or not all(t.is_contiguous() for t in out):
            raise ValueError(f"out= needs contiguous float32 and int64 tensors of shape {(rows, topk)}, got "
                             f"{[(t.dtype, tuple(t.shape)) for t in out]}")  # fmt: skip
    else:
        probs = torch.empty(rows, topk, dtype=torch.float32, device=device)
        ids = torch.empty(rows, topk, dtype=torch.long, device=device)
    if rows == 0:
        return probs, ids
    block = min(_BLOCK, max(next_power_of_2(vocab), 16))
    num_blocks = triton.cdiv(vocab, block)
    # Rows per program: one for a real vocabulary, several for a short one, all under the interpreter.
    block_r = min(next_power_of_2(rows), ROWS_PER_PROGRAM if interpreted() else max(1, _BLOCK // block))
    block_c = next_power_of_2(num_blocks * topk)
    merge_r = min(next_power_of_2(rows), ROWS_PER_PROGRAM if interpreted() else max(1, 1024 // block_c))
    block_max = torch.empty(rows * num_blocks, dtype=torch.float32, device=device)
    block_sum = torch.empty_like(block_max)
    cand_value = torch.empty(rows * num_blocks * topk, dtype=torch.float32, device=device)
    cand_index = torch.empty(rows * num_blocks * topk, dtype=torch.int32, device=device)
    _topk_block_kernel[(triton.cdiv(rows, block_r), num_blocks)](
        logits,
        rows,
        logits.stride(0),
        vocab,
        block_max,
        block_sum,
        cand_value,
        cand_index,
        num_blocks,
        K=topk,
        BLOCK_R=block_r,
        BLOCK=block,
        NONE=_NONE,
    )
    _topk_merge_kernel[(triton.cdiv(rows, merge_r),)](
        block_max,
        block_sum,
        cand_value,
        cand_index,
        probs,
        ids,
        ids if vocab_map is None else vocab_map,
        rows,
        num_blocks,
        K=topk,
        BLOCK_R=merge_r,
        BLOCK_B=next_power_of_2(num_blocks),
        BLOCK_C=block_c,
        NONE=_NONE,
        HAS_MAP=vocab_map is not None,
    )
    return probs, ids
