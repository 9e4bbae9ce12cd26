"""Triton kernels of the tree build and the greedy walk (references: `speccycle.core.tree`, `TorchBackend`).

Every tree of the cycle is small (``K * K <= 256`` children per level, at most
``N <= 1 + K + (S - 1) K^2`` rows), so a request's whole tree lives in one program's registers. A
program takes one request on a GPU and a block of requests under the interpreter (where each program
and each reduction costs milliseconds of Python).

* `expand_frontier`: cumulative scores of the ``K * K`` children and the best ``K``. The reference
  is a float multiply, a stable sort and three gathers (six launches); here one launch.
* `rerank_tree`: the best ``N - 1`` candidates laid out as verify rows (the reference: two sorts, a
  scatter, four gathers, three concatenations). A candidate's row is the running count of kept
  candidates before it; the parent's row is read back from a per-request scratch row.
* `tree_mask`: row ``i`` walks up its ancestors, ``N - 1`` steps, in registers; full ``[N, N]`` or
  packed to bytes (bit ``j % 8`` of byte ``j // 8``, as `core.tree.pack_mask`).
* `verify_greedy`: the walk from the root, one level per step: the first child (lowest row) whose
  token equals the target's prediction at the current node.

Both selections use the order of ``torch.sort(descending=True, stable=True)``: larger first, NaN
before every number, equal scores by index. A candidate's rank is the count of candidates that sort
before it, so the kernels equal the reference exactly, ties and NaNs included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import interpreted, next_power_of_2

# Hidden-state columns each program of `advance_frontier` copies (the grid's second axis; part 0 does the rest).
HIDDEN_COLUMNS = 256
MAX_CANDIDATES = 4096  # beyond this a one-program rank is too slow: the backend keeps the torch rerank


@triton.jit
def _sorts_before(a, a_index, b, b_index):
    """(a, a_index) comes before (b, b_index) in a stable descending sort with NaN first."""
    a_nan = a != a
    b_nan = b != b
    same = (a == b) | (a_nan & b_nan)
    return (a_nan & ~b_nan) | (a > b) | (same & (a_index < b_index))


@triton.jit
def _expand_frontier_kernel(
    frontier_ptr,
    child_p_ptr,
    child_ids_ptr,
    cum_ptr,
    keep_ptr,
    new_scores_ptr,
    new_tokens_ptr,
    bs,
    K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK: tl.constexpr,
    INNER: tl.constexpr,
):
    requests = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)[:, None]  # [B, 1]
    request_inside = requests < bs
    c = tl.arange(0, BLOCK)[None, :]  # [1, C]
    inside = request_inside & (c < K * K)
    cum = tl.load(frontier_ptr + requests * K + c // K, mask=inside, other=0.0) * tl.load(
        child_p_ptr + requests * K * K + c, mask=inside, other=0.0
    )
    tl.store(cum_ptr + requests * K * K + c, cum, mask=inside)
    rank = tl.zeros([BLOCK_B, BLOCK], dtype=tl.int32)
    for start in range(0, K * K, INNER):
        o = start + tl.arange(0, INNER)[None, :]  # [1, I]
        o_inside = request_inside & (o < K * K)
        other = tl.load(frontier_ptr + requests * K + o // K, mask=o_inside, other=0.0) * tl.load(
            child_p_ptr + requests * K * K + o, mask=o_inside, other=0.0
        )
        before = _sorts_before(other[:, None, :], o[:, None, :], cum[:, :, None], c[:, :, None])
        rank += tl.sum((before & o_inside[:, None, :]).to(tl.int32), axis=2)
    kept = inside & (rank < K)
    tl.store(keep_ptr + requests * K + rank, c.to(tl.int64) + 0 * requests, mask=kept)
    tl.store(new_scores_ptr + requests * K + rank, cum, mask=kept)
    tokens = tl.load(child_ids_ptr + requests * K * K + c, mask=inside, other=0)
    tl.store(new_tokens_ptr + requests * K + rank, tokens, mask=kept)


def _requests_per_program(bs: int) -> int:
    return min(next_power_of_2(bs), 16) if interpreted() else 1


def expand_frontier(
    frontier_scores: torch.Tensor, child_p: torch.Tensor, child_ids: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract and shapes as `speccycle.core.tree.expand_frontier`; float32 scores, int64 ids."""
    bs = frontier_scores.shape[0]
    kk = topk * topk
    device = frontier_scores.device
    cum = torch.empty(bs, kk, dtype=torch.float32, device=device)
    keep = torch.empty(bs, topk, dtype=torch.long, device=device)
    new_scores = torch.empty(bs, topk, dtype=torch.float32, device=device)
    new_tokens = torch.empty(bs, topk, dtype=child_ids.dtype, device=device)
    if bs:
        block = next_power_of_2(kk)
        block_b = _requests_per_program(bs)
        _expand_frontier_kernel[(triton.cdiv(bs, block_b),)](
            frontier_scores.contiguous(),
            child_p.contiguous(),
            child_ids.contiguous(),
            cum,
            keep,
            new_scores,
            new_tokens,
            bs,
            K=topk,
            BLOCK_B=block_b,
            BLOCK=block,
            INNER=block if interpreted() else min(block, max(1, 2048 // block)),
        )
    return cum, keep, new_scores, new_tokens


@triton.jit
def _advance_frontier_kernel(
    frontier_ptr,
    child_p_ptr,
    child_ids_ptr,
    frontier_cand_ptr,
    path_ptr,
    next_own_ptr,
    hidden_ptr,
    cum_ptr,
    parents_ptr,
    scores_ptr,
    tokens_ptr,
    cand_ptr,
    new_path_ptr,
    new_hidden_ptr,
    level_base,
    depth,
    stride_own,
    width,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    INNER: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NEXT: tl.constexpr,
):
    """Programs ``(request, part)``: every program ranks the request's children as `_expand_frontier_kernel`
    does; part 0 then does the level's bookkeeping in place of five more launches (the children's parents,
    the kept candidates' scores, tokens, indices and paths), part ``j >= 1`` copies columns
    ``[(j - 1) * BLOCK_H, j * BLOCK_H)`` of the kept children's parents' hidden rows (at the Llama-3-8B shape
    one program copying all 4,096 columns took 10 µs a level)."""
    r = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    c = tl.arange(0, BLOCK)
    inside = c < K * K
    cum = tl.load(frontier_ptr + r * K + c // K, mask=inside, other=0.0) * tl.load(
        child_p_ptr + r * K * K + c, mask=inside, other=0.0
    )
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, K * K, INNER):
        o = start + tl.arange(0, INNER)
        o_inside = o < K * K
        other = tl.load(frontier_ptr + r * K + o // K, mask=o_inside, other=0.0) * tl.load(
            child_p_ptr + r * K * K + o, mask=o_inside, other=0.0
        )
        before = _sorts_before(other[None, :], o[None, :], cum[:, None], c[:, None])
        rank += tl.sum((before & o_inside[None, :]).to(tl.int32), axis=1)
    kept = inside & (rank < K)
    parent = c // K  # the frontier node a child hangs under
    if part > 0:  # the parent's draft hidden state, copied as is: this program's columns
        h = (part - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = kept[:, None] & (h[None, :] < width)
        row = tl.load(hidden_ptr + (r * K + parent)[:, None] * width + h[None, :], mask=m, other=0.0)
        tl.store(new_hidden_ptr + (r * K + rank)[:, None] * width + h[None, :], row, mask=m)
    else:
        tl.store(cum_ptr + r * K * K + c, cum, mask=inside)
        parent_cand = tl.load(frontier_cand_ptr + r * K + parent, mask=inside, other=0)
        tl.store(parents_ptr + r * K * K + c, parent_cand, mask=inside)
        tl.store(scores_ptr + r * K + rank, cum, mask=kept)
        tl.store(tokens_ptr + r * K + rank, tl.load(child_ids_ptr + r * K * K + c, mask=inside, other=0), mask=kept)
        tl.store(cand_ptr + r * K + rank, level_base + c.to(tl.int64), mask=kept)
        # the kept child's path: its parent's slots, then (HAS_NEXT) its own slot of the next level
        d = tl.arange(0, BLOCK_D)
        out_depth = depth + HAS_NEXT
        src_mask = kept[:, None] & (d[None, :] < depth)
        src = tl.load(path_ptr + (r * K + parent)[:, None] * depth + d[None, :], mask=src_mask, other=0)
        tl.store(new_path_ptr + (r * K + rank)[:, None] * out_depth + d[None, :], src, mask=src_mask)
        if HAS_NEXT:
            own = tl.load(next_own_ptr + r * stride_own + rank, mask=kept, other=0)
            tl.store(new_path_ptr + (r * K + rank) * out_depth + depth, own, mask=kept)


def advance_frontier(
    frontier_scores, child_p, child_ids, frontier_cand, level_base, path_slots, hidden, next_own, topk
):
    """Same contract as `speccycle.core.tree.advance_frontier` (float32 scores, int64 ids and slots), one launch."""
    from ...core.tree import FrontierStep

    bs, kk = frontier_scores.shape[0], topk * topk
    device = frontier_scores.device
    depth = path_slots.shape[2]
    cum = torch.empty(bs, kk, dtype=torch.float32, device=device)
    parents = torch.empty(bs, kk, dtype=torch.long, device=device)
    scores = torch.empty(bs, topk, dtype=torch.float32, device=device)
    tokens = torch.empty(bs, topk, dtype=child_ids.dtype, device=device)
    cand = torch.empty(bs, topk, dtype=torch.long, device=device)
    path = torch.empty(bs, topk, depth + (next_own is not None), dtype=torch.long, device=device)
    new_hidden = None
    width = 0
    if hidden is not None:
        hidden = hidden.reshape(bs * topk, -1).contiguous()
        width = hidden.shape[1]
        new_hidden = torch.empty(bs, topk, width, dtype=hidden.dtype, device=device)
    if next_own is not None and next_own.stride(1) != 1:
        next_own = next_own.contiguous()
    if bs:
        block = next_power_of_2(kk)
        block_h = min(HIDDEN_COLUMNS, next_power_of_2(max(width, 1)))
        _advance_frontier_kernel[(bs, 1 + triton.cdiv(width, block_h))](
            frontier_scores.contiguous(), child_p.contiguous(), child_ids.contiguous(), frontier_cand.contiguous(),
            path_slots.contiguous(), cum if next_own is None else next_own, cum if hidden is None else hidden,
            cum, parents, scores, tokens, cand, path, cum if new_hidden is None else new_hidden,
            level_base, depth, 0 if next_own is None else next_own.stride(0), width,
            K=topk, BLOCK=block, INNER=block if interpreted() else min(block, max(1, 2048 // block)),
            BLOCK_D=next_power_of_2(max(depth, 1)), BLOCK_H=block_h,
            HAS_NEXT=next_own is not None,
        )  # fmt: skip
    return FrontierStep(cum, parents, scores, tokens, cand, path, new_hidden)


@triton.jit
def _rerank_kernel(
    root_ptr,
    cand_tokens_ptr,
    cand_scores_ptr,
    cand_parents_ptr,
    row_of_ptr,
    tokens_ptr,
    parents_ptr,
    scores_ptr,
    bs,
    num_cands,
    num_rows,
    BLOCK_B: tl.constexpr,
    BLOCK: tl.constexpr,
    INNER: tl.constexpr,
):
    requests = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)[:, None]  # [B, 1]
    request_inside = requests < bs
    c = tl.arange(0, BLOCK)[None, :]
    inside = request_inside & (c < num_cands)
    base = requests * num_cands
    score = tl.load(cand_scores_ptr + base + c, mask=inside, other=0.0)
    rank = tl.zeros([BLOCK_B, BLOCK], dtype=tl.int32)
    for start in range(0, num_cands, INNER):
        o = start + tl.arange(0, INNER)[None, :]
        o_inside = request_inside & (o < num_cands)
        other = tl.load(cand_scores_ptr + base + o, mask=o_inside, other=0.0)
        before = _sorts_before(other[:, None, :], o[:, None, :], score[:, :, None], c[:, :, None])
        rank += tl.sum((before & o_inside[:, None, :]).to(tl.int32), axis=2)
    kept = inside & (rank < num_rows - 1)
    # Kept candidates keep their candidate order: the k-th kept one (from 1) is verify row k.
    row = tl.cumsum(kept.to(tl.int32), axis=1)
    row_of = tl.where(kept, row, 0)  # 0: not kept; a kept node under a dropped parent hangs off the root
    tl.store(row_of_ptr + base + c, row_of, mask=inside)
    tl.debug_barrier()  # the parents' rows below are read by other threads of this program
    parent = tl.load(cand_parents_ptr + base + c, mask=inside, other=-1)
    parent_row = tl.load(row_of_ptr + base + tl.maximum(parent, 0), mask=kept & (parent >= 0), other=0)
    out = requests * num_rows + row
    tl.store(tokens_ptr + out, tl.load(cand_tokens_ptr + base + c, mask=inside, other=0), mask=kept)
    tl.store(parents_ptr + out, parent_row.to(tl.int64), mask=kept)
    tl.store(scores_ptr + out, score, mask=kept)
    root = requests * num_rows
    tl.store(tokens_ptr + root, tl.load(root_ptr + requests, mask=request_inside), mask=request_inside)
    tl.store(parents_ptr + root, tl.full([BLOCK_B, 1], -1, tl.int64), mask=request_inside)
    tl.store(scores_ptr + root, tl.full([BLOCK_B, 1], 1.0, tl.float32), mask=request_inside)


def rerank_tree(
    root_tokens: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_scores: torch.Tensor,
    cand_parents: torch.Tensor,
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract and shapes as `speccycle.core.tree.rerank_tree`; int64 tokens, float32 scores."""
    bs, num_cands = cand_tokens.shape
    if num_draft_tokens - 1 > num_cands:
        raise ValueError(f"num_draft_tokens - 1 = {num_draft_tokens - 1} exceeds the {num_cands} candidates")
    if num_cands > MAX_CANDIDATES:
        raise ValueError(f"rerank_tree's kernel ranks at most {MAX_CANDIDATES} candidates, got {num_cands}")
    device = cand_tokens.device
    tokens = torch.empty(bs, num_draft_tokens, dtype=torch.long, device=device)
    parents = torch.empty(bs, num_draft_tokens, dtype=torch.long, device=device)
    scores = torch.empty(bs, num_draft_tokens, dtype=torch.float32, device=device)
    if bs:
        row_of = torch.empty(bs, num_cands, dtype=torch.int32, device=device)
        block = next_power_of_2(num_cands)
        block_b = _requests_per_program(bs)
        _rerank_kernel[(triton.cdiv(bs, block_b),)](
            root_tokens.contiguous(),
            cand_tokens.contiguous(),
            cand_scores.contiguous(),
            cand_parents.contiguous(),
            row_of,
            tokens,
            parents,
            scores,
            bs,
            num_cands,
            num_draft_tokens,
            BLOCK_B=block_b,
            BLOCK=block,
            INNER=min(block, 256) if interpreted() else min(block, max(1, 4096 // block)),
        )
    return tokens, parents, scores


@triton.jit
def _tree_mask_kernel(
    parents_ptr, out_ptr, bs, n, num_bytes, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, PACKED: tl.constexpr
):
    requests = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)[:, None, None]  # [B, 1, 1]
    rows = tl.arange(0, BLOCK)[None, :, None]  # [1, N, 1]
    cols = tl.arange(0, BLOCK)[None, None, :]  # [1, 1, N]
    inside = (requests < bs) & (rows < n)  # [B, N, 1]
    mask = (rows == cols) & (requests >= 0)
    node = tl.load(parents_ptr + requests * n + rows, mask=inside, other=-1)  # [B, N, 1]
    # Parents precede children, so an ancestor chain has at most n - 1 links.
    for _ in range(n - 1):
        mask = mask | ((cols == node) & (node >= 0))
        node = tl.load(parents_ptr + requests * n + tl.maximum(node, 0), mask=node >= 0, other=-1)
    if PACKED:
        bits = mask.to(tl.int32) << (cols % 8)
        packed = tl.sum(tl.reshape(bits, [BLOCK_B, BLOCK, BLOCK // 8, 8]), axis=3)
        groups = tl.arange(0, BLOCK // 8)[None, None, :]
        where = out_ptr + requests * n * num_bytes + rows * num_bytes + groups
        tl.store(where, packed.to(tl.uint8), mask=inside & (groups < num_bytes))
    else:
        where = out_ptr + requests * n * n + rows * n + cols
        tl.store(where, mask.to(tl.uint8), mask=inside & (cols < n))


def tree_mask(parents: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """`core.tree.ancestor_mask` (``packed=False``) or ``pack_mask(ancestor_mask(...))``.

    Shapes: ``parents [bs, N]`` -> ``[bs, N, N]`` bool, or ``[bs, N, ceil(N / 8)]`` uint8 packed.
    """
    bs, n = parents.shape
    num_bytes = triton.cdiv(n, 8)
    out = torch.empty(bs, n, num_bytes if packed else n, dtype=torch.uint8, device=parents.device)
    if bs and n:
        block_b = _requests_per_program(bs)
        _tree_mask_kernel[(triton.cdiv(bs, block_b),)](
            parents.contiguous(),
            out,
            bs,
            n,
            num_bytes,
            BLOCK_B=block_b,
            BLOCK=max(8, next_power_of_2(n)),
            PACKED=packed,
        )
    return out if packed else out.view(torch.bool)


@triton.jit
def _verify_greedy_kernel(
    tokens_ptr, parents_ptr, predict_ptr, index_ptr, len_ptr, bs, n, width, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr
):
    requests = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)  # [B]
    request_inside = requests < bs
    rows = tl.arange(0, BLOCK)[None, :]
    inside = request_inside[:, None] & (rows < n)
    base = requests * n
    tokens = tl.load(tokens_ptr + base[:, None] + rows, mask=inside, other=0)
    parents = tl.load(parents_ptr + base[:, None] + rows, mask=inside, other=-1)
    node = tl.zeros([BLOCK_B], dtype=tl.int32)
    length = tl.full([BLOCK_B], 1, dtype=tl.int32)
    tl.store(index_ptr + requests * width, base, mask=request_inside)
    for depth in range(1, width):
        wanted = tl.load(predict_ptr + base + node, mask=request_inside, other=0)
        matches = inside & (parents == node[:, None]) & (tokens == wanted[:, None])
        child = tl.min(tl.where(matches, rows, BLOCK), axis=1)
        found = (length == depth) & (child < BLOCK)  # still walking, and a child matches
        tl.store(index_ptr + requests * width + depth, tl.where(found, base + child, -1), mask=request_inside)
        node = tl.where(found, child, node)
        length += found.to(tl.int32)
    tl.store(len_ptr + requests, length.to(tl.int64), mask=request_inside)


def verify_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, predict: torch.Tensor, accept_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and shapes as `TorchBackend.verify_greedy`."""
    bs, n = tokens.shape
    accept_index = torch.empty(bs, accept_width, dtype=torch.long, device=tokens.device)
    accept_len = torch.empty(bs, dtype=torch.long, device=tokens.device)
    if bs:
        block_b = _requests_per_program(bs)
        _verify_greedy_kernel[(triton.cdiv(bs, block_b),)](
            tokens.contiguous(),
            parents.contiguous(),
            predict.contiguous(),
            accept_index,
            accept_len,
            bs,
            n,
            accept_width,
            BLOCK_B=block_b,
            BLOCK=next_power_of_2(n),
        )
    return accept_index, accept_len
