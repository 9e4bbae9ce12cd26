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

from .launch import next_power_of_2

_NONE = 2147483647
_BLOCK = 2048
_NATIVE = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _topk_block_kernel(
    logits_ptr,
    row_stride,
    vocab_size,
    max_ptr,
    sum_ptr,
    cand_value_ptr,
    cand_index_ptr,
    num_blocks,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    NONE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab_size
    x = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    top = tl.max(x, axis=0)
    total = tl.sum(tl.where(inside, tl.exp(x - top), 0.0), axis=0)
    total = tl.where(top == float("-inf"), 0.0, total)  # a block of -inf adds nothing (not NaN)
    slot = row * num_blocks + part
    tl.store(max_ptr + slot, top)
    tl.store(sum_ptr + slot, total)
    free = inside
    for k in tl.static_range(K):
        value = tl.max(tl.where(free, x, float("-inf")), axis=0)
        index = tl.min(tl.where(free & (x == value), cols, NONE), axis=0)
        free = free & (cols != index)
        tl.store(cand_value_ptr + slot * K + k, value)
        tl.store(cand_index_ptr + slot * K + k, index)


@triton.jit
def _topk_merge_kernel(
    max_ptr,
    sum_ptr,
    cand_value_ptr,
    cand_index_ptr,
    probs_ptr,
    ids_ptr,
    num_blocks,
    K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NONE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_B)
    part_inside = parts < num_blocks
    block_max = tl.load(max_ptr + row * num_blocks + parts, mask=part_inside, other=float("-inf"))
    block_sum = tl.load(sum_ptr + row * num_blocks + parts, mask=part_inside, other=0.0)
    top = tl.max(block_max, axis=0)
    scale = tl.where(block_max == float("-inf"), 0.0, tl.exp(block_max - top))
    denominator = tl.sum(block_sum * scale, axis=0)
    cands = tl.arange(0, BLOCK_C)
    cand_inside = cands < num_blocks * K
    value = tl.load(cand_value_ptr + row * num_blocks * K + cands, mask=cand_inside, other=float("-inf"))
    index = tl.load(cand_index_ptr + row * num_blocks * K + cands, mask=cand_inside, other=NONE)
    free = cand_inside & (index != NONE)
    for k in tl.static_range(K):
        best = tl.max(tl.where(free, value, float("-inf")), axis=0)
        chosen = tl.min(tl.where(free & (value == best), index, NONE), axis=0)
        free = free & (index != chosen)
        tl.store(probs_ptr + row * K + k, tl.exp(best - top) / denominator)
        tl.store(ids_ptr + row * K + k, chosen.to(tl.int64))


def softmax_topk(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``K`` probabilities and ids of each row without materialising the softmax.

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
    probs = torch.empty(rows, topk, dtype=torch.float32, device=device)
    ids = torch.empty(rows, topk, dtype=torch.long, device=device)
    if rows == 0:
        return probs, ids
    block = min(_BLOCK, max(next_power_of_2(vocab), 16))
    num_blocks = triton.cdiv(vocab, block)
    block_max = torch.empty(rows * num_blocks, dtype=torch.float32, device=device)
    block_sum = torch.empty_like(block_max)
    cand_value = torch.empty(rows * num_blocks * topk, dtype=torch.float32, device=device)
    cand_index = torch.empty(rows * num_blocks * topk, dtype=torch.int32, device=device)
    _topk_block_kernel[(rows, num_blocks)](
        logits,
        logits.stride(0),
        vocab,
        block_max,
        block_sum,
        cand_value,
        cand_index,
        num_blocks,
        K=topk,
        BLOCK=block,
        NONE=_NONE,
    )
    _topk_merge_kernel[(rows,)](
        block_max,
        block_sum,
        cand_value,
        cand_index,
        probs,
        ids,
        num_blocks,
        K=topk,
        BLOCK_B=next_power_of_2(num_blocks),
        BLOCK_C=next_power_of_2(num_blocks * topk),
        NONE=_NONE,
    )
    return probs, ids
