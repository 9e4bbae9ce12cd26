"""Index tensors a cycle builds again and again for the same batch shape, built once per shape and device.

``arange(N)``, the request of each verify row, a chain's parents and mask: each costs a few
microseconds of host time as a tensor op, and a cycle needed dozens of them. Every function here
returns the same tensor for the same arguments, shared by every record and batch that uses it, so
these tensors are read-only: nothing may write into them. (Nothing in the cycle writes a record's
or a `ForwardBatch`'s tensors in place; ports copy from them.)
"""

from __future__ import annotations

import functools

import torch

_CACHE = functools.lru_cache(maxsize=512)


@_CACHE
def arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)``: ``[n]`` int64."""
    return torch.arange(n, device=device)


@_CACHE
def repeat_rows(bs: int, n: int, device: torch.device) -> torch.Tensor:
    """``arange(bs).repeat_interleave(n)``: ``[bs * n]`` int64, the request of each of ``n`` rows per request."""
    return torch.arange(bs, device=device).repeat_interleave(n)


@_CACHE
def block_starts(bs: int, n: int, device: torch.device) -> torch.Tensor:
    """``arange(bs)[:, None] * n``: ``[bs, 1]`` int64, the first flat row of each request's ``n``-block."""
    return torch.arange(bs, device=device)[:, None] * n


@_CACHE
def chain_parents(bs: int, n: int, device: torch.device) -> torch.Tensor:
    """A chain's parents ``[bs, n]`` int64: row ``i``'s parent is row ``i - 1``, the root's -1."""
    return torch.arange(-1, n - 1, device=device).expand(bs, n).contiguous()


@_CACHE
def chain_depths(bs: int, n: int, device: torch.device) -> torch.Tensor:
    """A chain's depths ``[bs, n]`` int64: row ``i`` at depth ``i``."""
    return torch.arange(n, device=device).expand(bs, n).contiguous()  # a kernel may read it as a flat array


@_CACHE
def chain_mask(n: int, device: torch.device) -> torch.Tensor:
    """``[n, n]`` bool, row ``i`` sees rows ``0..i``: a comparison, not ``tril`` (see `transitions.chain_mask`)."""
    rows = torch.arange(n, device=device)
    return rows[:, None] >= rows[None, :]


@_CACHE
def strictly_lower(n: int, device: torch.device) -> torch.Tensor:
    """``[n, n]`` bool, ``[i, j]`` true where ``j < i``: the rows before each row."""
    rows = torch.arange(n, device=device)
    return rows[:, None] > rows[None, :]


@_CACHE
def no_extra_slots(rows: int, device: torch.device) -> torch.Tensor:
    """``[rows, 0]`` int64: the extra slots of a causal batch (none)."""
    return torch.empty((rows, 0), dtype=torch.long, device=device)
