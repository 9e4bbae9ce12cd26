"""Triton kernels of the accept step (reference: `TorchBackend.gather_accepted`, `TorchBackend.fill_bonus`).

* `gather_accepted`: every per-row output (predict, hidden states, ...) gathered along the accepted
  path in one launch: a tile of (accepted entries x features), each entry reading its verify row.
  Entries past ``accept_len`` are the row at index 0 times zero, as in the reference (so a ``-0.0`` or
  a NaN there matches it bit for bit).
* `fill_bonus`: the bonus token ``accept_tokens.flat[b * stride + accept_len[b] - 1]`` with the stride
  ``S + 1`` (never ``N``); one launch instead of four.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GATHER_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64)
FILL_BONUS_BLOCK = 128  # requests a program of `fill_bonus`: fixed, so every batch size runs one compiled kernel
NARROW_FEATURES = 32  # `gather_accepted` rows this wide or narrower take the narrow blocks


# The entry count (requests x accepted positions) changes from call to call in serving, and so does the row width
# at one call site (the top-n logprobs' columns: the batch's largest ``top_logprobs``): neither is specialized, and
# the blocks take one of two fixed shapes (`_gather_blocks`), so a new batch compiles no kernel mid-serving.
@triton.jit(do_not_specialize=["num_entries", "features"])
def _gather_accepted_kernel(
    rows_ptr,
    accept_index_ptr,
    out_ptr,
    num_entries,
    features,
    BLOCK_E: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    entries = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    entry_inside = entries < num_entries
    inside = entry_inside[:, None] & (cols < features)[None, :]
    row = tl.load(accept_index_ptr + entries, mask=entry_inside, other=-1)
    valid = row >= 0
    source = tl.maximum(row, 0).to(tl.int64)
    x = tl.load(rows_ptr + source[:, None] * features + cols[None, :], mask=inside, other=0)
    x = x * valid[:, None].to(x.dtype)
    tl.store(out_ptr + entries.to(tl.int64)[:, None] * features + cols[None, :], x, mask=inside)


def _gather_blocks(features: int) -> tuple[int, int]:
    """(entries, features) a program of `gather_accepted`: narrow rows (tokens, top-n logprobs: up to
    `NARROW_FEATURES`) or wide ones (hidden states), 4,096 elements a program either way."""
    block_f = NARROW_FEATURES if features <= NARROW_FEATURES else 1024
    return 4096 // block_f, block_f


def gather_accepted(rows: torch.Tensor, accept_index: torch.Tensor) -> torch.Tensor:
    """Same contract and shapes as `TorchBackend.gather_accepted`: ``rows [bs * N, ...]`` ->
    ``[bs, S + 1, ...]`` for the dtypes in ``GATHER_DTYPES``."""
    if rows.dtype not in GATHER_DTYPES:
        raise ValueError(f"gather_accepted's kernel takes {GATHER_DTYPES}, got {rows.dtype}")
    features = 1
    for size in rows.shape[1:]:
        features *= size
    out = torch.empty(*accept_index.shape, *rows.shape[1:], dtype=rows.dtype, device=rows.device)
    num_entries = accept_index.numel()
    if num_entries == 0 or features == 0:
        return out
    if rows.shape[0] == 0:
        raise IndexError("gather_accepted: accept_index points into an empty rows tensor")
    flat = rows.reshape(rows.shape[0], features).contiguous()
    block_e, block_f = _gather_blocks(features)
    grid = (triton.cdiv(num_entries, block_e), triton.cdiv(features, block_f))
    _gather_accepted_kernel[grid](
        flat, accept_index.contiguous(), out, num_entries, features, BLOCK_E=block_e, BLOCK_F=block_f
    )
    return out


@triton.jit(do_not_specialize=["bs", "stride"])
def _fill_bonus_kernel(tokens_ptr, accept_len_ptr, out_ptr, bs, stride, BLOCK: tl.constexpr):
    requests = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = requests < bs
    length = tl.load(accept_len_ptr + requests, mask=inside, other=1)
    bonus = tl.load(tokens_ptr + requests.to(tl.int64) * stride + length - 1, mask=inside)
    tl.store(out_ptr + requests, bonus, mask=inside)


def fill_bonus(accept_tokens: torch.Tensor, accept_len: torch.Tensor, stride: int) -> torch.Tensor:
    """Same contract and shapes as `TorchBackend.fill_bonus`; ``accept_len`` must lie in ``[1, stride]``."""
    flat = accept_tokens.reshape(-1)
    bs = accept_len.shape[0]
    if flat.numel() != bs * stride:
        raise ValueError(f"accept_tokens holds {flat.numel()} entries, expected bs * stride = {bs * stride}")
    out = torch.empty(bs, dtype=flat.dtype, device=flat.device)
    if bs:
        _fill_bonus_kernel[(triton.cdiv(bs, FILL_BONUS_BLOCK),)](
            flat.contiguous(), accept_len.contiguous(), out, bs, stride, BLOCK=FILL_BONUS_BLOCK
        )
    return out
