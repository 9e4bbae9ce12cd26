"""Reference op of block drafts (DFlash): how much of a drafted block the target agrees with.

A block draft proposes a whole block ``[root, c_1, ..., c_{B-1}]`` from one draft forward; the target
scores the block as a chain. ``target[i]`` is the target's token after row ``i``. The draft's
``c_{i+1}`` is correct while it equals ``target[i]`` and every earlier candidate was correct.
"""

from __future__ import annotations

import torch


def verify_block(candidates: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``correct_len = cumprod(candidates[:, 1:] == target[:, :-1]).sum()`` and ``bonus = target[correct_len]``.

    ``correct_len`` lies in ``[0, B - 1]``; the cycle commits ``correct_len + 1`` tokens (the accepted
    candidates and the bonus). Shapes: ``candidates, target [bs, B]`` int64 -> ``correct_len [bs]``,
    ``bonus [bs]`` int64.
    """
    if candidates.shape != target.shape or candidates.dim() != 2 or candidates.shape[1] < 1:
        raise ValueError(
            f"verify_block needs candidates and target of one shape [bs, B >= 1], got "
            f"{tuple(candidates.shape)} and {tuple(target.shape)}"
        )
    matches = (candidates[:, 1:] == target[:, :-1]).long()
    correct_len = torch.cumprod(matches, dim=1).sum(dim=1)
    bonus = target.gather(1, correct_len[:, None]).squeeze(1)
    return correct_len, bonus
