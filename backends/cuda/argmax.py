"""Fused vocabulary argmax: the ``K == 1`` draft and the greedy verify (reference: ``logits.argmax(-1)``).

No softmax: the chain never uses the probability, and argmax of the logits is exact in any dtype.
Each row's vocabulary is split into chunks; stage 1 runs one program per (row, chunk), each walking
its chunk in blocks and keeping, per lane, the largest value and the first index holding it; stage 2
reduces the chunk winners of a row. With one chunk per row (many rows) stage 1 writes the answer
and stage 2 is skipped.

Same answer as ``torch.argmax``, ties included: the lowest index among equal maxima (a lane keeps its
first maximum, lanes and chunks pick the lowest index among equals); a NaN is larger than everything,
so a row with NaNs gives its first NaN; a row of ``-inf`` gives 0. Values are compared in float32,
exact for float16, bfloat16 and float32 logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_power_of_2, target_programs

_NONE = 2147483647  # an index past any vocabulary: "no candidate"
_BLOCK = 1024
_NATIVE = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _argmax_chunk_kernel(
    logits_ptr,
    row_stride,
    vocab_size,
    chunk,
    value_ptr,
    index_ptr,
    num_chunks,
    BLOCK: tl.constexpr,
    NONE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], NONE, tl.int32)
    first_nan = tl.full([BLOCK], NONE, tl.int32)
    start = part * chunk
    end = tl.minimum(start + chunk, vocab_size)
    for offset in range(start, end, BLOCK):
        cols = offset + lanes
        inside = cols < end
        x = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
        is_nan = x != x
        # Strictly greater keeps a lane's first maximum; the first valid element seeds an empty lane,
        # so a row of -inf still names an index.
        better = inside & ~is_nan & ((x > best) | (best_index == NONE))
        best = tl.where(better, x, best)
        best_index = tl.where(better, cols, best_index)
        first_nan = tl.minimum(first_nan, tl.where(inside & is_nan, cols, NONE))
    top = tl.max(best, axis=0)
    index = tl.min(tl.where((best == top) & (best_index != NONE), best_index, NONE), axis=0)
    nan_index = tl.min(first_nan, axis=0)
    has_nan = nan_index != NONE
    index = tl.where(has_nan, nan_index, index)
    top = tl.where(has_nan, float("nan"), top)
    out = row * num_chunks + part
    tl.store(value_ptr + out, top)
    tl.store(index_ptr + out, index.to(index_ptr.dtype.element_ty))


@triton.jit
def _argmax_reduce_kernel(value_ptr, index_ptr, out_ptr, num_chunks, BLOCK: tl.constexpr, NONE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK)
    inside = parts < num_chunks
    value = tl.load(value_ptr + row * num_chunks + parts, mask=inside, other=float("-inf"))
    index = tl.load(index_ptr + row * num_chunks + parts, mask=inside, other=NONE)
    is_nan = value != value
    nan_index = tl.min(tl.where(is_nan, index, NONE), axis=0)
    value = tl.where(is_nan, float("-inf"), value)
    top = tl.max(value, axis=0)
    best = tl.min(tl.where(inside & (value == top), index, NONE), axis=0)
    best = tl.where(nan_index != NONE, nan_index, best)
    tl.store(out_ptr + row, best.to(tl.int64))


def vocab_argmax(logits: torch.Tensor, num_chunks: int | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` for float16 / bfloat16 / float32 (float8 is widened to float32 first).

    ``num_chunks`` splits each row (default: enough programs to fill the device). Shapes:
    ``logits [R, V]`` -> ``[R]`` int64.
    """
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"vocab_argmax needs logits [R, V >= 1], got {tuple(logits.shape)}")
    if logits.dtype not in _NATIVE:
        if not logits.dtype.is_floating_point or logits.dtype == torch.float64:
            raise ValueError(f"vocab_argmax takes float16, bfloat16, float32 or float8 logits, got {logits.dtype}")
        logits = logits.float()  # float8 -> float32 is exact
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    block = min(_BLOCK, next_power_of_2(vocab))
    blocks = triton.cdiv(vocab, block)
    if num_chunks is None:
        num_chunks = triton.cdiv(target_programs(logits.device), rows)
    num_chunks = max(1, min(int(num_chunks), blocks))
    chunk = triton.cdiv(blocks, num_chunks) * block
    num_chunks = triton.cdiv(vocab, chunk)
    if num_chunks == 1:
        values = torch.empty(rows, dtype=torch.float32, device=logits.device)
        _argmax_chunk_kernel[(rows, 1)](logits, logits.stride(0), vocab, chunk, values, out, 1, BLOCK=block, NONE=_NONE)
        return out
    values = torch.empty(rows * num_chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows * num_chunks, dtype=torch.int32, device=logits.device)
    _argmax_chunk_kernel[(rows, num_chunks)](
        logits, logits.stride(0), vocab, chunk, values, indices, num_chunks, BLOCK=block, NONE=_NONE
    )
    _argmax_reduce_kernel[(rows,)](values, indices, out, num_chunks, BLOCK=next_power_of_2(num_chunks), NONE=_NONE)
    return out
