"""Fused vocabulary argmax: the ``K == 1`` draft and the greedy verify (reference: ``logits.argmax(-1)``); and the
top token's probability a chain's cut reads (`vocab_top1_probability`, reference `TorchBackend.top1_probability`).

No softmax: the chain's token needs no probability (its cut reads one apart), and argmax of the logits is exact in
any dtype.
Each row's vocabulary is split into chunks; stage 1 runs one program per (rows, chunk), each walking
its chunk in blocks and keeping, per lane, the largest value and the first index holding it; stage 2
reduces the chunk winners of a row. With one chunk per row (many rows) stage 1 writes the answer
and stage 2 is skipped. A program takes one row of a real vocabulary, several rows of a short one.

Same answer as ``torch.argmax``, ties included: the lowest index among equal maxima (a lane keeps its
first maximum, lanes and chunks pick the lowest index among equals); a NaN is larger than everything,
so a row with NaNs gives its first NaN; a row of ``-inf`` gives 0. Values are compared in float32,
exact for float16, bfloat16 and float32 logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import ROWS_PER_PROGRAM, interpreted, next_power_of_2, target_programs

_NONE = 2147483647  # an index past any vocabulary: "no candidate"
_BLOCK = 1024
_NATIVE = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _argmax_chunk_kernel(
    logits_ptr,
    num_rows,
    row_stride,
    vocab_size,
    chunk,
    value_ptr,
    index_ptr,
    num_chunks,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
    NONE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_inside = rows < num_rows
    part = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK_R, BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK_R, BLOCK], NONE, tl.int32)
    first_nan = tl.full([BLOCK_R, BLOCK], NONE, tl.int32)
    start = part * chunk
    end = tl.minimum(start + chunk, vocab_size)
    base = rows.to(tl.int64)[:, None] * row_stride
    for offset in range(start, end, BLOCK):
        cols = (offset + lanes)[None, :]
        inside = row_inside[:, None] & (cols < end)
        x = tl.load(logits_ptr + base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        is_nan = x != x
        # Strictly greater keeps a lane's first maximum; the first valid element seeds an empty lane,
        # so a row of -inf still names an index.
        better = inside & ~is_nan & ((x > best) | (best_index == NONE))
        best = tl.where(better, x, best)
        best_index = tl.where(better, cols, best_index)
        first_nan = tl.minimum(first_nan, tl.where(inside & is_nan, cols, NONE))
    top = tl.max(best, axis=1)
    index = tl.min(tl.where((best == top[:, None]) & (best_index != NONE), best_index, NONE), axis=1)
    nan_index = tl.min(first_nan, axis=1)
    has_nan = nan_index != NONE
    index = tl.where(has_nan, nan_index, index)
    top = tl.where(has_nan, float("nan"), top)
    out = rows.to(tl.int64) * num_chunks + part
    tl.store(value_ptr + out, top, mask=row_inside)
    tl.store(index_ptr + out, index.to(index_ptr.dtype.element_ty), mask=row_inside)


@triton.jit
def _argmax_reduce_kernel(
    value_ptr, index_ptr, out_ptr, num_rows, num_chunks, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, NONE: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_inside = rows < num_rows
    parts = tl.arange(0, BLOCK)
    inside = row_inside[:, None] & (parts < num_chunks)[None, :]
    where = rows.to(tl.int64)[:, None] * num_chunks + parts[None, :]
    value = tl.load(value_ptr + where, mask=inside, other=float("-inf"))
    index = tl.load(index_ptr + where, mask=inside, other=NONE)
    is_nan = value != value
    nan_index = tl.min(tl.where(is_nan, index, NONE), axis=1)
    value = tl.where(is_nan, float("-inf"), value)
    top = tl.max(value, axis=1)
    best = tl.min(tl.where(inside & (value == top[:, None]), index, NONE), axis=1)
    best = tl.where(nan_index != NONE, nan_index, best)
    tl.store(out_ptr + rows, best.to(tl.int64), mask=row_inside)


def _kernel_logits(logits: torch.Tensor, name: str) -> torch.Tensor:
    """``logits [R, V >= 1]`` as the kernels here read them: float16 / bfloat16 / float32 with a contiguous last
    dimension (float8 widened to float32, exactly)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"{name} needs logits [R, V >= 1], got {tuple(logits.shape)}")
    if logits.dtype not in _NATIVE:
        if not logits.dtype.is_floating_point or logits.dtype == torch.float64:
            raise ValueError(f"{name} takes float16, bfloat16, float32 or float8 logits, got {logits.dtype}")
        logits = logits.float()  # float8 -> float32 is exact
    return logits if logits.stride(1) == 1 else logits.contiguous()


def vocab_argmax(logits: torch.Tensor, num_chunks: int | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` for float16 / bfloat16 / float32 (float8 is widened to float32 first).

    ``num_chunks`` splits each row (default: enough programs to fill the device). Shapes:
    ``logits [R, V]`` -> ``[R]`` int64.
    """
    logits = _kernel_logits(logits, "vocab_argmax")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    block = min(_BLOCK, next_power_of_2(vocab))
    blocks = triton.cdiv(vocab, block)
    # Rows per program: one where a row fills a program (a real vocabulary), many where rows are short
    # (and all of them under the interpreter, where each program and each reduction costs Python time).
    block_r = min(next_power_of_2(rows), ROWS_PER_PROGRAM if interpreted() else max(1, _BLOCK // block))
    row_programs = triton.cdiv(rows, block_r)
    if num_chunks is None:
        num_chunks = 1 if interpreted() else triton.cdiv(target_programs(logits.device), row_programs)
    num_chunks = max(1, min(int(num_chunks), blocks))
    chunk = triton.cdiv(blocks, num_chunks) * block
    num_chunks = triton.cdiv(vocab, chunk)
    if num_chunks == 1:
        values = torch.empty(rows, dtype=torch.float32, device=logits.device)
        _argmax_chunk_kernel[(row_programs, 1)](
            logits, rows, logits.stride(0), vocab, chunk, values, out, 1, BLOCK_R=block_r, BLOCK=block, NONE=_NONE
        )
        return out
    values = torch.empty(rows * num_chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows * num_chunks, dtype=torch.int32, device=logits.device)
    _argmax_chunk_kernel[(row_programs, num_chunks)](
        logits,
        rows,
        logits.stride(0),
        vocab,
        chunk,
        values,
        indices,
        num_chunks,
        BLOCK_R=block_r,
        BLOCK=block,
        NONE=_NONE,
    )
    reduce_r = min(next_power_of_2(rows), ROWS_PER_PROGRAM if interpreted() else 16)
    _argmax_reduce_kernel[(triton.cdiv(rows, reduce_r),)](
        values, indices, out, rows, num_chunks, BLOCK_R=reduce_r, BLOCK=next_power_of_2(num_chunks), NONE=_NONE
    )
    return out


@triton.jit
def _top1_probability_kernel(logits_ptr, num_rows, row_stride, vocab_size, out_ptr, BLOCK_R: tl.constexpr,
                             BLOCK: tl.constexpr):  # fmt: skip
    """Each row's ``max softmax = 1 / sum(exp(x - max))``: one online pass over the row in float32."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_inside = rows < num_rows
    lanes = tl.arange(0, BLOCK)
    base = rows.to(tl.int64)[:, None] * row_stride
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    for offset in range(0, vocab_size, BLOCK):
        cols = (offset + lanes)[None, :]
        x = tl.load(logits_ptr + base + cols, mask=row_inside[:, None] & (cols < vocab_size), other=float("-inf"))
        x = x.to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, axis=1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        total = total * tl.exp(top - safe) + tl.sum(tl.exp(x - safe[:, None]), axis=1)
        top = new_top
    p = tl.where(total > 0, 1.0 / total, 0.0)
    tl.store(out_ptr + rows, tl.where(p == p, p, 0.0), mask=row_inside)  # a NaN row: 0, as the reference


def vocab_top1_probability(logits: torch.Tensor) -> torch.Tensor:
    """The probability of each row's top token, ``softmax(logits).max(-1)`` in float32 (0 for a row without a finite
    logit or with a NaN), one launch: ``logits [R, V]`` float16 / bfloat16 / float32 (float8 widened) -> ``[R]``
    float32. Equal to `TorchBackend.top1_probability` up to float32 rounding (its sums run in another order)."""
    logits = _kernel_logits(logits, "vocab_top1_probability")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out
    block = min(_BLOCK, next_power_of_2(vocab))
    block_r = min(next_power_of_2(rows), ROWS_PER_PROGRAM if interpreted() else max(1, _BLOCK // block))
    _top1_probability_kernel[(triton.cdiv(rows, block_r),)](logits, rows, logits.stride(0), vocab, out, BLOCK_R=block_r,
                                                             BLOCK=block)  # fmt: skip
    return out
