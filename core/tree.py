"""Pure tree math of the cycle: EAGLE-2 dynamic tree selection, depths, positions, masks, links.

Every function is a pure function of tensors, batched over ``bs`` requests. A tree has ``N`` rows,
row 0 is the root (the last committed token), and parents precede children (``parents[b, i] < i``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


class FrontierStep(NamedTuple):
    """What `advance_frontier` returns: one level's candidates and the next level's frontier."""

    cum: torch.Tensor  # [bs, K*K] the children's cumulative scores (this level's candidates)
    parents: torch.Tensor  # [bs, K*K] each child's parent's candidate index
    scores: torch.Tensor  # [bs, K] the kept children's scores (the new frontier)
    tokens: torch.Tensor  # [bs, K] their tokens
    cand: torch.Tensor  # [bs, K] their candidate indices, level_base + index among the K*K
    path: torch.Tensor  # [bs, K, D (+1)] their draft KV paths (their parent's, then their own next slot)
    hidden: torch.Tensor | None  # [bs, K, H] their parents' draft hidden states


def draft_position(seq_lens: torch.Tensor, depth: int, offset: int) -> torch.Tensor:
    """Position at which a draft forward feeds the depth-``depth`` tokens: ``L + depth - 1 + offset``.

    ``offset`` is 0 for EAGLE (``shifted``: forward ``j`` feeds depth ``j + 1`` at ``L + j``, one
    behind the target) and 1 for ``aligned`` drafts (depth ``d`` at ``L + d``, like the target).
    SGLang PR 25015 advanced the position before the forward and ran forward 0 at ``L + 1``.

    Shapes: ``seq_lens [bs]`` -> ``[bs]``.
    """
    if depth < 1:
        raise ValueError(f"draft forwards feed depths >= 1, got depth={depth}")
    return seq_lens + (depth - 1 + offset)


def draft_scratch_positions(seq_lens: torch.Tensor, num_steps: int, topk: int, offset: int) -> torch.Tensor:
    """Positions (past ``L``) whose slots hold the draft KV of the forwarded tree nodes.

    Node ``k`` of depth ``d`` (``1 <= d <= S - 1``) writes at ``L + offset + (d - 1) * K + k``:
    distinct, and inside the cycle's reservation ``[L, L + reserve_len)``.

    Shapes: ``seq_lens [bs]`` -> ``[bs, S - 1, K]``.
    """
    return seq_lens[:, None, None] + draft_scratch_offsets(num_steps, topk, offset, seq_lens.device)


@functools.lru_cache(maxsize=256)
def draft_scratch_offsets(num_steps: int, topk: int, offset: int, device: torch.device) -> torch.Tensor:
    """`draft_scratch_positions` less ``L``: ``offset + (d - 1) * K + k``, ``[S - 1, K]`` (shared, read-only)."""
    steps = torch.arange(max(num_steps - 1, 0), device=device)[:, None] * topk
    return offset + steps + torch.arange(topk, device=device)[None, :]


# Trees up to this many rows in all are walked as lists on a CPU: one pass over the rows instead of
# ``depth`` rounds of tensor ops (one 16-row tree: depths ~9 us instead of ~36 us, the mask ~17 us
# instead of ~45 us; the mask's lists grow with rows times depth, so it stops at fewer rows).
HOST_WALK_ROWS = 256
HOST_MASK_ROWS = 64


def _host_rows(parents: torch.Tensor, limit: int = HOST_WALK_ROWS) -> list[list[int]] | None:
    """``parents`` as lists when a host walk applies: on a CPU, small, every parent before its row."""
    if parents.device.type != "cpu" or parents.numel() > limit or parents.dim() < 1:
        return None
    rows = parents.reshape(-1, parents.shape[-1]).tolist()
    for row in rows:
        for i, q in enumerate(row):
            if q >= i:
                return None  # not parents-first: the tensor rounds handle any acyclic order
    return rows


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every row (root 0). Shapes: ``parents [bs, N]`` -> ``[bs, N]``."""
    rows = _host_rows(parents)
    if rows is not None:
        depths = []
        for row in rows:
            depth = [0] * len(row)
            for i, q in enumerate(row):
                if q >= 0:
                    depth[i] = depth[q] + 1
            depths.append(depth)
        return torch.tensor(depths, dtype=parents.dtype).view(parents.shape)
    return _tree_depths_rounds(parents)


def _tree_depths_rounds(parents: torch.Tensor) -> torch.Tensor:
    n = parents.shape[-1]
    depths = torch.zeros_like(parents)
    safe = parents.clamp(min=0)
    # Parents precede children, so N - 1 rounds of "depth = depth[parent] + 1" reach a fixpoint.
    for _ in range(n - 1):
        new = torch.where(parents >= 0, depths.gather(-1, safe) + 1, 0)
        if torch.equal(new, depths):
            break
        depths = new
    return depths


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """The tree mask: row ``i`` sees its ancestors and itself.

    Shapes: ``parents [bs, N]`` -> ``[bs, N, N]`` bool.
    """
    rows = _host_rows(parents, HOST_MASK_ROWS)
    if rows is None:
        return _ancestor_mask_rounds(parents)
    bs, n = parents.shape
    flat = []  # (b * n + i) * n + j for every ancestor j of row i (itself included)
    for b, row in enumerate(rows):
        ancestors: list[list[int]] = []
        for i, q in enumerate(row):
            mine = [i] if q < 0 else ancestors[q] + [i]
            ancestors.append(mine)
            base = (b * n + i) * n
            flat += [base + j for j in mine]
    mask = torch.zeros(bs * n * n, dtype=torch.bool)
    return mask.index_fill_(0, torch.tensor(flat, dtype=torch.long), True).view(bs, n, n)


def _ancestor_mask_rounds(parents: torch.Tensor) -> torch.Tensor:
    bs, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(bs, n, n).clone()
    safe = parents.clamp(min=0)
    has_parent = (parents >= 0)[:, :, None]
    # A row's mask is its parent's mask plus itself; rows are ordered, so n - 1 rounds suffice.
    for _ in range(n - 1):
        inherited = mask.gather(1, safe[:, :, None].expand(bs, n, n)) & has_parent
        new = mask | inherited
        if torch.equal(new, mask):
            break
        mask = new
    return mask


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack the last dimension of a bool mask into bytes, bit ``j % 8`` of byte ``j // 8`` (little-endian).

    Shapes: ``[..., N]`` bool -> ``[..., ceil(N / 8)]`` uint8.
    """
    n = mask.shape[-1]
    padded = torch.nn.functional.pad(mask.to(torch.uint8), (0, (-n) % 8))
    groups = padded.reshape(*mask.shape[:-1], -1, 8)
    weights = (1 << torch.arange(8, device=mask.device)).to(torch.uint8)
    return (groups * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_mask`. Shapes: ``[..., ceil(N / 8)]`` uint8 -> ``[..., N]`` bool."""
    bits = (packed[..., :, None].to(torch.int32) >> torch.arange(8, device=packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :n].bool()


def retrieve_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child / next-sibling links, the form tree-walking verify kernels follow.

    Shapes: ``parents [bs, N]`` -> ``first_child [bs, N]``, ``next_sibling [bs, N]`` (-1: none).
    """
    bs, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    # child_of[b, p, i]: row i is a child of row p.
    child_of = parents[:, None, :] == idx[None, :, None]
    big = torch.full_like(parents[:, None, :].expand(bs, n, n), n)
    first = torch.where(child_of, idx[None, None, :].expand(bs, n, n), big).min(-1).values
    first_child = torch.where(first < n, first, -1)
    # The next sibling of i: the smallest j > i with the same parent.
    same_parent = (parents[:, :, None] == parents[:, None, :]) & (idx[None, None, :] > idx[None, :, None])
    same_parent &= (parents >= 0)[:, :, None]
    nxt = torch.where(same_parent, idx[None, None, :].expand(bs, n, n), big).min(-1).values
    next_sibling = torch.where(nxt < n, nxt, -1)
    return first_child, next_sibling


def expand_frontier(
    frontier_scores: torch.Tensor, child_p: torch.Tensor, child_ids: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One EAGLE-2 level: rescore the ``K * K`` children by cumulative probability and keep ``K``.

    Shapes: ``frontier_scores [bs, K]``, ``child_p [bs, K, K]``, ``child_ids [bs, K, K]`` ->
    ``cum_scores [bs, K*K]`` (every child, the candidates of this level), ``keep [bs, K]`` (indices
    into the ``K*K`` children), ``new_scores [bs, K]``, ``new_tokens [bs, K]``. Ties keep the lower index.
    """
    bs = frontier_scores.shape[0]
    cum_scores = (frontier_scores[:, :, None] * child_p).reshape(bs, -1)
    order = torch.sort(cum_scores, dim=-1, descending=True, stable=True).indices
    keep = order[:, :topk]
    return cum_scores, keep, cum_scores.gather(1, keep), child_ids.reshape(bs, -1).gather(1, keep)


def advance_frontier(
    frontier_scores: torch.Tensor,
    child_p: torch.Tensor,
    child_ids: torch.Tensor,
    frontier_cand: torch.Tensor,
    level_base: int,
    path_slots: torch.Tensor,
    hidden: torch.Tensor | None,
    next_own: torch.Tensor | None,
    topk: int,
) -> FrontierStep:
    """One EAGLE-2 level with its bookkeeping: `expand_frontier`, then what the next level needs.

    Shapes: ``frontier_scores [bs, K]``, ``child_p, child_ids [bs, K, K]``, ``frontier_cand [bs, K]`` (each
    frontier node's candidate index), ``path_slots [bs, K, D]`` (each frontier node's draft KV slots, root
    side first, its own last), ``hidden [bs * K, H]`` (the level's draft hidden states, row ``b * K + k``)
    or None, ``next_own [bs, K]`` (the next level's own slots) or None. Returns a `FrontierStep`: the level's
    candidates (``cum [bs, K*K]``, the children's parents ``parents [bs, K*K]``), the new frontier
    (``scores, tokens, cand [bs, K]``, ``cand = level_base + keep``), its paths ``path [bs, K, D (+1)]``
    (each kept child's parent's path, then its own next slot) and parent states ``hidden [bs, K, H]``.
    """
    bs = frontier_scores.shape[0]
    cum, keep, scores, tokens = expand_frontier(frontier_scores, child_p, child_ids, topk)
    parents = frontier_cand[:, :, None].expand(bs, topk, topk).reshape(bs, topk * topk)
    parent_k = keep // topk  # [bs, K]: the frontier node each kept child hangs under
    path = path_slots.gather(1, parent_k[:, :, None].expand(-1, -1, path_slots.shape[2]))
    if next_own is not None:
        path = torch.cat([path, next_own[:, :, None]], dim=2)
    new_hidden = None
    if hidden is not None:
        rows = hidden.view(bs, topk, -1)
        new_hidden = rows.gather(1, parent_k[:, :, None].expand(-1, -1, rows.shape[-1]))
    return FrontierStep(cum, parents, scores, tokens, level_base + keep, path, new_hidden)


def rerank_tree(
    root_tokens: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_scores: torch.Tensor,
    cand_parents: torch.Tensor,
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the best ``N - 1`` candidates (EAGLE-2 global rerank) and lay them out as verify rows.

    Candidates are in level order and a child's score never exceeds its parent's, so with ties broken
    toward the lower index the kept set contains every kept node's parent.

    Shapes: ``root_tokens [bs]``; ``cand_* [bs, C]`` with ``cand_parents`` a candidate index or -1 for
    the root -> ``tokens [bs, N]``, ``parents [bs, N]`` (row indices, -1 for the root), ``scores [bs, N]``.
    """
    bs, num_cands = cand_tokens.shape
    if num_draft_tokens - 1 > num_cands:
        raise ValueError(f"num_draft_tokens - 1 = {num_draft_tokens - 1} exceeds the {num_cands} candidates")
    order = torch.sort(cand_scores, dim=-1, descending=True, stable=True).indices
    kept = order[:, : num_draft_tokens - 1].sort(dim=-1).values  # [bs, N-1] candidate indices
    # row_of[b, c]: verify row of candidate c (0 = not kept; the root is never a candidate).
    row_of = torch.zeros(bs, num_cands + 1, dtype=torch.long, device=cand_tokens.device)
    rows = torch.arange(1, num_draft_tokens, device=cand_tokens.device).expand(bs, -1)
    row_of.scatter_(1, kept, rows)
    kept_parents = cand_parents.gather(1, kept)
    parent_rows = torch.where(kept_parents >= 0, row_of.gather(1, kept_parents.clamp(min=0)), 0)
    tokens = torch.cat([root_tokens[:, None], cand_tokens.gather(1, kept)], dim=1)
    parents = torch.cat([torch.full_like(root_tokens[:, None], -1), parent_rows], dim=1)
    ones = torch.ones_like(cand_scores[:, :1])
    scores = torch.cat([ones, cand_scores.gather(1, kept)], dim=1)
    return tokens, parents, scores


def chain_tree(root_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``K == 1`` tree: row ``i``'s parent is row ``i - 1``.

    Shapes: ``root_tokens [bs]``, ``draft_tokens [bs, S]`` -> ``tokens [bs, S+1]``, ``parents [bs, S+1]``.
    """
    bs, s = draft_tokens.shape
    tokens = torch.cat([root_tokens[:, None], draft_tokens], dim=1)
    parents = torch.arange(-1, s, device=root_tokens.device).expand(bs, -1).contiguous()
    return tokens, parents
