"""The CUDA backend: the cycle's ops as Triton kernels, the torch reference for the rest.

`CudaBackend` subclasses `TorchBackend` and overrides, each with a kernel tested equal to the method
it replaces (exactly for integer outputs; float32 rounding for probabilities):

| op | kernel | replaces |
| --- | --- | --- |
| `select_topk`, ``K == 1`` | `argmax.vocab_argmax`: split-vocabulary argmax, two-stage reduce | ``argmax`` |
| `select_topk`, ``K > 1`` | `topk.softmax_topk`: top-K logits, online softmax, ids mapped in merge | softmax, topk |
| `greedy_predict` | `argmax.vocab_argmax` | ``argmax`` |
| `expand_frontier` | `tree.expand_frontier`: one program per request | mul, stable sort, gathers |
| `advance_frontier` | `tree.advance_frontier`: the expand plus the level's bookkeeping | expand, copy, div, gathers |
| `rerank_tree` | `tree.rerank_tree`: rank, running count, parent rows | two sorts, scatter, gathers, cats |
| `tree_mask`, `tree_mask_packed` | `tree.tree_mask`: ancestor walk in registers | ``N - 1`` rounds of gathers |
| `verify_greedy` | `tree.verify_greedy`: the walk from the root | ``S`` rounds over ``[bs, N, N]`` |
| `verify_greedy_chain` | `tree.verify_greedy` over the chain's parents | cumprod, sum, where |
| `gather_accepted` | `accept.gather_accepted` | gather, reshape, multiply |
| `fill_bonus` | `accept.fill_bonus` | four small ops |
| `slots_for_positions` | `kv.slots_for_positions` (``P == 1`` and ``P > 1``) | gather, div, mod |
| `plan_kv_move` | `kv.plan_kv_move` | ten small ops |
| `move_kv` | `kv.move_kv`: gather-then-scatter in one launch, bitwise | ``buf[dst] = buf[src]`` |
| `verify_block` | `dflash.verify_block`: leading matches of the block | cumprod, sum, gather |
| `verify_chain_sampling`, `verify_tree_sampling` | `sampling` (the `SamplingKernels` mixin) | the torch walks |
| `uniforms_from_keys` | `sampling.keyed_uniforms` (the mixin): one launch, the same bits | ~15 int64 ops |

Kept in torch: `last_correct_step_indices` (one gather; a kernel saves nothing); not fused yet:
`process_logits` and `sample_without_replacement`.

Why the tree build is fused although its tensors are tiny: each of those ops is a chain of 6 to 15
launches of a few microseconds of work each, on the critical path of every draft step; one launch
per op is what a kernel buys there (``bench/kernels.py`` measures it against the reference on a GPU;
no GPU timing of these kernels is recorded yet).

Every op runs its kernel on CUDA tensors, and on CPU tensors when Triton interprets
(``TRITON_INTERPRET=1``, how CI tests them); otherwise, and for inputs a kernel does not take
(float64 logits, more than `tree.MAX_CANDIDATES` candidates, a buffer without a strided slot layout,
more than `kv.MAX_MOVES` moves), it calls the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..registry import register_backend
from ..torch import TorchBackend
from ..torch.ops import write_out
from . import accept, argmax, dflash, kv, tree
from . import topk as topk_ops
from .launch import runs_triton
from .sampling import SamplingKernels

FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
KERNEL_LOGITS = (torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES)


class CudaBackend(SamplingKernels, TorchBackend):
    """Triton kernels for the cycle's ops; see the module docstring for which ops are fused."""

    name = "cuda"

    # ---- draft -------------------------------------------------------------------------------
    def select_topk(self, logits, topk, vocab_map=None, out=None):
        """Top-``K`` draft candidates: the vocabulary argmax for ``K == 1`` (no softmax), else fused
        softmax top-K, a ``vocab_map`` applied in its merge kernel. Shapes: ``logits [R, V]`` -> ``probs
        [R, K]`` float32, ``ids [R, K]`` int64 (`TorchBackend.select_topk`, ``vocab_map`` and ``out`` too)."""
        if logits.dtype not in KERNEL_LOGITS or not runs_triton(logits):
            return super().select_topk(logits, topk, vocab_map, out)
        if topk == 1:
            ids = argmax.vocab_argmax(logits)[:, None]
            if vocab_map is not None:
                ids = vocab_map[ids]
            return write_out(out, torch.ones(ids.shape, dtype=torch.float32, device=logits.device), ids)
        if out is not None and not all(t.is_contiguous() for t in out):
            return write_out(out, *topk_ops.softmax_topk(logits, topk, vocab_map))
        return topk_ops.softmax_topk(logits, topk, vocab_map, out)

    def top1_probability(self, logits):
        """`TorchBackend.top1_probability` in one launch (`argmax.vocab_top1_probability`)."""
        if logits.dtype not in KERNEL_LOGITS or not runs_triton(logits):
            return super().top1_probability(logits)
        return argmax.vocab_top1_probability(logits)

    def expand_frontier(self, frontier_scores, child_p, child_ids, topk):
        """See `speccycle.core.tree.expand_frontier`."""
        if not (
            frontier_scores.dtype == child_p.dtype == torch.float32 and runs_triton(frontier_scores, child_p, child_ids)
        ):
            return super().expand_frontier(frontier_scores, child_p, child_ids, topk)
        return tree.expand_frontier(frontier_scores, child_p, child_ids, topk)

    # benchmarks: False takes `TorchBackend.advance_frontier` (seven launches a level instead of one)
    fused_frontier = True

    def advance_frontier(self, frontier_scores, child_p, child_ids, frontier_cand, level_base, path_slots, hidden,
                         next_own, topk):  # fmt: skip
        """See `speccycle.core.tree.advance_frontier`: one launch (`tree.advance_frontier`)."""
        tensors = [frontier_scores, child_p, child_ids, frontier_cand, path_slots]
        if not (
            self.fused_frontier
            and frontier_scores.dtype == child_p.dtype == torch.float32
            and child_ids.dtype == frontier_cand.dtype == path_slots.dtype == torch.long
            and (next_own is None or next_own.dtype == torch.long)
            and runs_triton(*tensors, *[t for t in (hidden, next_own) if t is not None])
        ):
            return super().advance_frontier(frontier_scores, child_p, child_ids, frontier_cand, level_base, path_slots,
                                            hidden, next_own, topk)  # fmt: skip
        return tree.advance_frontier(frontier_scores, child_p, child_ids, frontier_cand, level_base, path_slots,
                                     hidden, next_own, topk)  # fmt: skip

    def rerank_tree(self, root_tokens, cand_tokens, cand_scores, cand_parents, num_draft_tokens):
        """See `speccycle.core.tree.rerank_tree`."""
        if not (
            root_tokens.dtype == cand_tokens.dtype == cand_parents.dtype == torch.long
            and cand_scores.dtype == torch.float32
            and cand_tokens.shape[1] <= tree.MAX_CANDIDATES
            and runs_triton(root_tokens, cand_tokens, cand_scores, cand_parents)
        ):
            return super().rerank_tree(root_tokens, cand_tokens, cand_scores, cand_parents, num_draft_tokens)
        return tree.rerank_tree(root_tokens, cand_tokens, cand_scores, cand_parents, num_draft_tokens)

    def tree_mask(self, parents: torch.Tensor) -> torch.Tensor:
        """Shapes: ``parents [bs, N]`` -> ``[bs, N, N]`` bool (ancestors and self)."""
        if not runs_triton(parents):
            return super().tree_mask(parents)
        return tree.tree_mask(parents)

    def tree_mask_packed(self, parents: torch.Tensor) -> torch.Tensor:
        """Shapes: ``parents [bs, N]`` -> ``[bs, N, ceil(N / 8)]`` uint8 (bit ``j % 8`` of byte ``j // 8``)."""
        if not runs_triton(parents):
            return super().tree_mask_packed(parents)
        return tree.tree_mask(parents, packed=True)

    def slots_for_positions(
        self, page_table: torch.Tensor, positions: torch.Tensor, page_size: int, covered: bool = False
    ):
        """Slot of each position through the page table. Shapes: ``[bs, max_pages]``, ``[bs, X]`` -> ``[bs, X]``;
        ``covered``: the host reserved every position (no device-to-host check)."""
        if not runs_triton(page_table, positions):
            return super().slots_for_positions(page_table, positions, page_size, covered)
        return kv.slots_for_positions(page_table, positions, page_size, covered)

    # ---- verify ------------------------------------------------------------------------------
    def greedy_predict(self, logits: torch.Tensor) -> torch.Tensor:
        """Shapes: ``logits [R, V]`` -> ``[R]`` int64."""
        if logits.dtype not in KERNEL_LOGITS or not runs_triton(logits):
            return super().greedy_predict(logits)
        return argmax.vocab_argmax(logits)

    def verify_greedy(self, tokens, parents, predict, accept_width):
        """Walk each tree while the draft token equals the target's prediction at its parent."""
        if not runs_triton(tokens, parents, predict):
            return super().verify_greedy(tokens, parents, predict, accept_width)
        return tree.verify_greedy(tokens, parents, predict, accept_width)

    def verify_greedy_chain(self, tokens, predict, accept_width):
        """A chain's walk: the tree kernel over the chain's parents (one launch)."""
        if not runs_triton(tokens, predict):
            return super().verify_greedy_chain(tokens, predict, accept_width)
        bs, n = tokens.shape
        parents = torch.arange(-1, n - 1, device=tokens.device).expand(bs, n).contiguous()
        return tree.verify_greedy(tokens, parents, predict, accept_width)

    def verify_block(self, candidates: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block drafts (DFlash): ``correct_len`` and ``bonus``. Shapes: ``[bs, B]`` each -> ``[bs]``, ``[bs]``."""
        if not runs_triton(candidates, target):
            return super().verify_block(candidates, target)
        return dflash.verify_block(candidates, target)

    # ---- accept ------------------------------------------------------------------------------
    def gather_accepted(self, rows: torch.Tensor, accept_index: torch.Tensor) -> torch.Tensor:
        """Shapes: ``rows [bs * N, ...]``, ``accept_index [bs, S + 1]`` -> ``[bs, S + 1, ...]``."""
        if rows.dtype not in accept.GATHER_DTYPES or not runs_triton(rows, accept_index):
            return super().gather_accepted(rows, accept_index)
        return accept.gather_accepted(rows, accept_index)

    def fill_bonus(self, accept_tokens: torch.Tensor, accept_len: torch.Tensor, stride: int) -> torch.Tensor:
        """The bonus token ``accept_tokens.flat[b * stride + accept_len - 1]``, ``stride = S + 1``."""
        if not runs_triton(accept_tokens, accept_len):
            return super().fill_bonus(accept_tokens, accept_len, stride)
        return accept.fill_bonus(accept_tokens, accept_len, stride)

    # ---- compact -----------------------------------------------------------------------------
    def plan_kv_move(self, accept_index, accept_len, verify_slots):
        """Slots to copy so the accepted path lands at ``[L, L + accept_len)``. Shapes: -> ``src [M]``, ``dst [M]``."""
        if not runs_triton(accept_index, accept_len, verify_slots):
            return super().plan_kv_move(accept_index, accept_len, verify_slots)
        return kv.plan_kv_move(accept_index, accept_len, verify_slots)

    def move_kv(self, buffers: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slot ``src[m]`` to ``dst[m]`` in every buffer, all reads before any write."""
        if src.numel() == 0:
            return
        fast = [b for b in buffers if kv.movable(b) and runs_triton(b, src, dst)]
        slow = [b for b in buffers if not any(b is f for f in fast)]
        if src.numel() > kv.MAX_MOVES:
            fast, slow = [], list(buffers)
        if fast:
            kv.move_kv(fast, src, dst)
        if slow:
            super().move_kv(slow, src, dst)


register_backend("cuda", CudaBackend)
