"""Random draft trees for tests of the cycle's tree ops and kernels."""

from __future__ import annotations

import torch


def random_parents(gen: torch.Generator, batch: int, nodes: int, depth: int) -> torch.Tensor:
    """``[batch, nodes]`` parent rows of random trees, parents before children, at most ``depth`` deep (-1: root)."""
    out = torch.full((batch, nodes), -1, dtype=torch.long)
    for b in range(batch):
        depths = [0]
        for i in range(1, nodes):
            choices = [j for j in range(i) if depths[j] < depth]
            parent = choices[int(torch.randint(len(choices), (1,), generator=gen))]
            out[b, i] = parent
            depths.append(depths[parent] + 1)
    return out
