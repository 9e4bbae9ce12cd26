"""The reference backend: every op of the cycle in plain torch, on any device.

Fast backends (`speccycle.backends.cuda`, `speccycle.backends.rocm`) subclass `TorchBackend` and
replace ops one by one; each replacement is tested equal to the method it overrides.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...core import shapes, tree
from . import block, sampling, sampling_tree


class TorchBackend:
    """Reference ops. Shapes use the vocabulary of docs/index.md: ``bs``, ``N``, ``S``, ``K``, ``V``."""

    name = "torch"

    # ---- draft -------------------------------------------------------------------------------
    def select_topk(
        self,
        logits: torch.Tensor,
        topk: int,
        vocab_map: torch.Tensor | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``K`` draft candidates of each row.

        ``K == 1`` takes ``argmax`` of the logits and skips the full-vocabulary softmax: the chain's token
        needs no probability (a cut by ``draft_floor`` reads it apart, `top1_probability`), and argmax is exact in
        any dtype, where softmax + max in low precision can round two logits to one probability and pick the lower
        index.

        ``vocab_map [V]`` int64: the logits' columns are a draft vocabulary and the ids come back as
        ``vocab_map[column]`` (`ModelOutput.vocab_map`). ``out``: ``(probs, ids)`` tensors to write and
        return (a captured graph's static buffers) instead of new ones.

        Shapes: ``logits [R, V]`` -> ``probs [R, K]`` float32 (ones for ``K == 1``), ``ids [R, K]`` int64.
        """
        if topk == 1:
            ids = logits.argmax(dim=-1, keepdim=True)
            probs = torch.ones(ids.shape, dtype=torch.float32, device=logits.device)
        else:
            probs, ids = torch.softmax(logits.float(), dim=-1).topk(topk, dim=-1)
        if vocab_map is not None:
            ids = vocab_map[ids]
        return write_out(out, probs, ids)

    def top1_probability(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's probability of its top token, ``[R, V] -> [R]`` float32: ``exp(max - logsumexp)`` (0 for a row
        without a finite logit). The confidence `SpecConfig.draft_floor` reads (the token is the argmax's)."""
        x = logits.float()
        return torch.nan_to_num(torch.exp(x.amax(-1) - torch.logsumexp(x, -1)), nan=0.0)

    def expand_frontier(self, frontier_scores, child_p, child_ids, topk):
        """See `speccycle.core.tree.expand_frontier`."""
        return tree.expand_frontier(frontier_scores, child_p, child_ids, topk)

    def advance_frontier(self, frontier_scores, child_p, child_ids, frontier_cand, level_base, path_slots, hidden,
                         next_own, topk):  # fmt: skip
        """See `speccycle.core.tree.advance_frontier`."""
        return tree.advance_frontier(
            frontier_scores, child_p, child_ids, frontier_cand, level_base, path_slots, hidden, next_own, topk
        )

    def rerank_tree(self, root_tokens, cand_tokens, cand_scores, cand_parents, num_draft_tokens):
        """See `speccycle.core.tree.rerank_tree`."""
        return tree.rerank_tree(root_tokens, cand_tokens, cand_scores, cand_parents, num_draft_tokens)

    def tree_mask(self, parents: torch.Tensor) -> torch.Tensor:
        """Shapes: ``parents [bs, N]`` -> ``[bs, N, N]`` bool (ancestors and self)."""
        return tree.ancestor_mask(parents)

    def tree_mask_packed(self, parents: torch.Tensor) -> torch.Tensor:
        """The tree mask packed to bits, for attention kernels that read a packed mask (`core.tree.pack_mask`).

        Shapes: ``parents [bs, N]`` -> ``[bs, N, ceil(N / 8)]`` uint8, bit ``j % 8`` of byte ``j // 8``.
        """
        return tree.pack_mask(tree.ancestor_mask(parents))

    def slots_for_positions(
        self, page_table: torch.Tensor, positions: torch.Tensor, page_size: int, covered: bool = False
    ):
        """Slot of each position through the page table; `IndexError` for a position past its request's pages.

        Shapes: ``page_table [bs, max_pages]``, ``positions [bs, X]`` -> ``[bs, X]`` int64. ``covered``: the caller
        reserved every position on the host, so the check (a wait for the device) is skipped.
        """
        flat = positions.reshape(positions.shape[0], -1)
        pages = page_table.gather(1, flat if page_size == 1 else flat // page_size)
        if not covered and pages.numel() and pages.min().item() < 0:
            raise IndexError("a position lies past the pages its request holds; reserve before assigning slots")
        slots = pages if page_size == 1 else torch.add(flat % page_size, pages, alpha=page_size)
        return slots.reshape(positions.shape)

    def apply_token_mask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, vocab_map: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits with every token a grammar refuses at ``-inf`` (docs: constrained); a new tensor.

        ``bitmask`` holds bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed. ``vocab_map [V]``:
        the logits' columns are a draft vocabulary, column ``c`` is target token ``vocab_map[c]``.

        Shapes: ``logits [R, V]``, ``bitmask [R, W]`` int32 (``32 W >=`` the target vocabulary) -> ``[R, V]``.
        """
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bitmask.to(logits.device)[:, :, None] >> bits) & 1).bool().flatten(1)  # [R, 32 W]
        allowed = allowed[:, : logits.shape[-1]] if vocab_map is None else allowed.index_select(1, vocab_map)
        return logits.masked_fill(~allowed, float("-inf"))

    # ---- verify ------------------------------------------------------------------------------
    def greedy_predict(self, logits: torch.Tensor) -> torch.Tensor:
        """Shapes: ``logits [R, V]`` -> ``[R]`` int64."""
        return logits.argmax(dim=-1)

    def verify_greedy(
        self, tokens: torch.Tensor, parents: torch.Tensor, predict: torch.Tensor, accept_width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Walk each tree while the draft token equals the target's prediction at its parent.

        Where siblings repeat a token the walk follows the first (lowest row). Shapes: ``tokens``,
        ``parents``, ``predict`` ``[bs, N]`` -> ``accept_index [bs, S + 1]`` (flat row indices into
        ``bs * N``, -1 padded), ``accept_len [bs]``.
        """
        bs, n = tokens.shape
        device = tokens.device
        idx = shapes.arange(n, device)
        safe_parents = parents.clamp(min=0)
        matches = (tokens == predict.gather(1, safe_parents)) & (parents >= 0)
        # Only the first matching child of a parent can be on the greedy path.
        earlier = (parents[:, :, None] == parents[:, None, :]) & shapes.strictly_lower(n, device)
        first_match = matches & ~(earlier & matches[:, None, :]).any(-1)
        root = idx == 0
        on_path = root.expand(bs, n)
        for _ in range(min(accept_width, n) - 1):  # a path has at most n rows: later rounds change nothing
            on_path = root | (first_match & on_path.gather(1, safe_parents))
        accept_len = on_path.sum(-1)
        order = torch.where(on_path, idx, idx + n).sort(dim=-1).values
        width = min(accept_width, n)
        rows = order[:, :width]
        flat = rows + shapes.block_starts(bs, n, device)
        keep = shapes.arange(width, device) < accept_len[:, None]
        accept_index = torch.full((bs, accept_width), -1, dtype=torch.long, device=tokens.device)
        accept_index[:, :width] = torch.where(keep, flat, -1)
        return accept_index, accept_len

    def verify_greedy_chain(
        self, tokens: torch.Tensor, predict: torch.Tensor, accept_width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`verify_greedy` of a chain (row ``i``'s parent is row ``i - 1``): the leading run of draft tokens
        equal to the target's prediction one row up. The same outputs, in a dozen ops instead of ``S`` rounds.

        Shapes: ``tokens``, ``predict`` ``[bs, n]`` -> ``accept_index [bs, S + 1]``, ``accept_len [bs]``.
        """
        bs, n = tokens.shape
        device = tokens.device
        accept_len = (tokens[:, 1:] == predict[:, :-1]).cumprod(dim=1).sum(dim=1) + 1
        if n > accept_width:
            accept_len = accept_len.clamp(max=accept_width)
        depth = shapes.arange(accept_width, device)
        flat = depth + shapes.block_starts(bs, n, device)
        return torch.where(depth < accept_len[:, None], flat, -1), accept_len

    def verify_block(self, candidates: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block drafts (DFlash): ``correct_len = cumprod(candidates[:, 1:] == target[:, :-1]).sum()``, ``bonus``.

        See `speccycle.backends.torch.block.verify_block`. Shapes: ``[bs, B]`` each -> ``[bs]``, ``[bs]``.
        """
        return block.verify_block(candidates, target)

    # ---- sampling (docs: sampling) -----------------------------------------------------------
    def process_logits(self, logits, temperature, top_k, top_p, min_p=0.0) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p per row. See `sampling.process_logits`. Shapes: ``[R, V]`` -> ``[R, V]``."""
        return sampling.process_logits(logits, temperature, top_k, top_p, min_p)

    def sample_without_replacement(self, probs: torch.Tensor, k: int, uniforms: torch.Tensor) -> torch.Tensor:
        """``k`` distinct tokens per row in draw order, -1 padded. See `sampling.sample_without_replacement`."""
        return sampling.sample_without_replacement(probs, k, uniforms)

    def uniforms_from_keys(self, keys: torch.Tensor, count: int) -> torch.Tensor:
        """``count`` keyed uniforms per key (splitmix64). See `sampling.keyed_uniforms`. Shapes: ``[m]`` ->
        ``[m, count]`` float32."""
        return sampling.keyed_uniforms(keys, count)

    def verify_chain_sampling(self, draft_tokens, draft_probs, target_probs, uniforms, sample_uniforms):
        """Speculative sampling over chains. See `sampling.verify_chain_sampling` (unvalidated, as kernels run)."""
        return sampling.verify_chain_sampling(
            draft_tokens, draft_probs, target_probs, uniforms, sample_uniforms, validate=False
        )

    def verify_tree_sampling(self, tokens, parents, draft_probs, target_probs, accept_width, uniforms, sample_uniforms):
        """Recursive rejection sampling over trees. See `sampling_tree.verify_tree_sampling` (unvalidated)."""
        return sampling_tree.verify_tree_sampling(
            tokens, parents, draft_probs, target_probs, accept_width, uniforms, sample_uniforms, validate=False
        )

    # ---- accept ------------------------------------------------------------------------------
    def gather_accepted(self, rows: torch.Tensor, accept_index: torch.Tensor) -> torch.Tensor:
        """Gather the accepted path of every request to the front.

        Shapes: ``rows [bs * N, ...]``, ``accept_index [bs, S + 1]`` -> ``[bs, S + 1, ...]``; entries
        past ``accept_len`` are zero.
        """
        out = rows.index_select(0, accept_index.clamp(min=0).view(-1)).view(*accept_index.shape, *rows.shape[1:])
        invalid = accept_index < 0
        if rows.dim() > 1:
            invalid = invalid.view(*invalid.shape, *([1] * (rows.dim() - 1)))
        return out.masked_fill_(invalid, 0)

    def fill_bonus(self, accept_tokens: torch.Tensor, accept_len: torch.Tensor, stride: int) -> torch.Tensor:
        """The bonus token: ``accept_tokens.flat[b * stride + accept_len - 1]``.

        ``stride`` is the width of ``accept_index``, ``S + 1`` (SGLang PR 26866 read it at ``N``).
        Shapes: ``accept_tokens [bs * (S + 1)]`` (or ``[bs, S + 1]``), ``accept_len [bs]`` -> ``[bs]``.
        """
        flat = accept_tokens.reshape(-1)
        bs = accept_len.shape[0]
        if flat.numel() != bs * stride:
            raise ValueError(f"accept_tokens holds {flat.numel()} entries, expected bs * stride = {bs * stride}")
        return flat.index_select(0, shapes.block_starts(bs, stride, flat.device)[:, 0] + (accept_len - 1))

    # ---- compact -----------------------------------------------------------------------------
    def plan_kv_move(
        self, accept_index: torch.Tensor, accept_len: torch.Tensor, verify_slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots to copy so the accepted path of request b lands at positions ``[L, L + accept_len)``.

        Accepted row ``a_d`` sits at the slot of ``L + a_d``; it moves to the slot of ``L + d``. A move
        reads only its request's verify slots; at most ``bs * (S + 1)`` moves, rows already in place
        (every chain) skipped. Shapes: -> ``src [M]``, ``dst [M]``.
        """
        bs, n = verify_slots.shape
        width = accept_index.shape[1]
        device = accept_index.device
        rows = accept_index - shapes.block_starts(bs, n, device)
        depth = shapes.arange(width, device)
        valid = (depth < accept_len[:, None]) & (rows != depth) & (accept_index >= 0)
        src = verify_slots.gather(1, rows.clamp(0, n - 1))
        dst = verify_slots.gather(1, depth.clamp(max=n - 1).expand(bs, -1))
        return src[valid], dst[valid]

    def move_kv(self, buffers: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slot ``src[m]`` to ``dst[m]`` in every buffer, all reads before any write.

        A tree path can move row 3 to 2 while row 2 moves to 1: gathering first keeps that safe.
        """
        if src.numel() == 0:
            return
        for buf in buffers:
            buf[dst] = buf[src]

    def last_correct_step_indices(self, accept_index: torch.Tensor, accept_len: torch.Tensor, n: int):
        """Index inside the request's ``N``-block of its last accepted row. Shapes: -> ``[bs]``."""
        bs = accept_len.shape[0]
        last = accept_index.gather(1, (accept_len - 1)[:, None])
        return (last - shapes.block_starts(bs, n, last.device))[:, 0]


def write_out(out: tuple[torch.Tensor, ...] | None, *results: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``results``, or each copied into the matching tensor of ``out`` and ``out`` returned."""
    if out is None:
        return results
    if len(out) != len(results) or any(o.shape != r.shape for o, r in zip(out, results)):
        raise ValueError(
            f"out= needs {len(results)} tensors of shapes {[tuple(r.shape) for r in results]}, "
            f"got {[tuple(o.shape) for o in out]}"
        )
    for o, r in zip(out, results):
        o.copy_(r)
    return tuple(out)
