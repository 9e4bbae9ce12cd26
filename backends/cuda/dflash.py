"""Triton kernel of the block-draft verify (reference: `backends.torch.block.verify_block`).

One program per request: the index of the first candidate the target disagrees with is the number
of leading matches, the ``cumprod(...).sum()`` of the reference without a scan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _verify_block_kernel(cand_ptr, target_ptr, correct_ptr, bonus_ptr, block_size, BLOCK: tl.constexpr):
    request = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    inside = i < block_size - 1
    base = request * block_size
    cand_next = tl.load(cand_ptr + base + i + 1, mask=inside, other=0)
    target = tl.load(target_ptr + base + i, mask=inside, other=0)
    wrong = inside & (cand_next != target)
    correct_len = tl.min(tl.where(wrong, i, block_size - 1), axis=0)
    tl.store(correct_ptr + request, correct_len.to(tl.int64))
    tl.store(bonus_ptr + request, tl.load(target_ptr + base + correct_len))


def verify_block(candidates: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and shapes as `speccycle.backends.torch.block.verify_block`."""
    if candidates.shape != target.shape or candidates.dim() != 2 or candidates.shape[1] < 1:
        raise ValueError(
            f"verify_block needs candidates and target of one shape [bs, B >= 1], got "
            f"{tuple(candidates.shape)} and {tuple(target.shape)}"
        )
    bs, block_size = candidates.shape
    correct_len = torch.empty(bs, dtype=torch.long, device=candidates.device)
    bonus = torch.empty(bs, dtype=target.dtype, device=target.device)
    if bs:
        _verify_block_kernel[(bs,)](
            candidates.contiguous(),
            target.contiguous(),
            correct_len,
            bonus,
            block_size,
            BLOCK=max(2, triton.next_power_of_2(block_size)),
        )
    return correct_len, bonus
