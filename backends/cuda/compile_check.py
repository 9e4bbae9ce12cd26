"""Compile every cycle kernel for a GPU target without the GPU: NVIDIA Hopper and AMD MI300.

The interpreter (how CI runs the kernels) checks what a kernel computes, not that the Triton compiler
accepts it. This compiles each kernel, at the block sizes the backend picks on a GPU, down to a cubin
for ``sm_90`` and a code object for ``gfx942`` (the ROCm backend's "kernels that port"), using the
compilers that ship inside the triton wheel. Run it without ``TRITON_INTERPRET``:

    python -m speccycle.backends.cuda.compile_check [cuda] [hip]
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import accept, argmax, dflash, kv, topk, tree

NONE = 2147483647
TARGETS = {"cuda": GPUTarget("cuda", 90, 32), "hip": GPUTarget("hip", "gfx942", 64)}


def _kernels() -> list[tuple[object, dict[str, str], list[dict[str, object]]]]:
    """(kernel, pointer and scalar types, constexpr sets) at the shapes of a real vocabulary and tree."""
    i64, i32, f32 = "*i64", "i32", "*fp32"
    return [
        (argmax._argmax_chunk_kernel,
         dict(logits_ptr="*bf16", num_rows=i32, row_stride=i32, vocab_size=i32, chunk=i32, value_ptr=f32,
              index_ptr="*i32", num_chunks=i32),
         [dict(BLOCK_R=1, BLOCK=1024, NONE=NONE), dict(BLOCK_R=32, BLOCK=32, NONE=NONE)]),
        (argmax._argmax_reduce_kernel,
         dict(value_ptr=f32, index_ptr="*i32", out_ptr=i64, num_rows=i32, num_chunks=i32),
         [dict(BLOCK_R=16, BLOCK=64, NONE=NONE)]),
        (topk._topk_block_kernel,
         dict(logits_ptr="*bf16", num_rows=i32, row_stride=i32, vocab_size=i32, max_ptr=f32, sum_ptr=f32,
              cand_value_ptr=f32, cand_index_ptr="*i32", num_blocks=i32),
         [dict(K=4, BLOCK_R=1, BLOCK=2048, NONE=NONE)]),
        (topk._topk_merge_kernel,
         dict(max_ptr=f32, sum_ptr=f32, cand_value_ptr=f32, cand_index_ptr="*i32", probs_ptr=f32, ids_ptr=i64,
              num_rows=i32, num_blocks=i32),
         [dict(K=4, BLOCK_R=8, BLOCK_B=32, BLOCK_C=128, NONE=NONE)]),
        (tree._expand_frontier_kernel,
         dict(frontier_ptr=f32, child_p_ptr=f32, child_ids_ptr=i64, cum_ptr=f32, keep_ptr=i64, new_scores_ptr=f32,
              new_tokens_ptr=i64, bs=i32),
         [dict(K=8, BLOCK_B=1, BLOCK=64, INNER=32)]),
        (tree._rerank_kernel,
         dict(root_ptr=i64, cand_tokens_ptr=i64, cand_scores_ptr=f32, cand_parents_ptr=i64, row_of_ptr="*i32",
              tokens_ptr=i64, parents_ptr=i64, scores_ptr=f32, bs=i32, num_cands=i32, num_rows=i32),
         [dict(BLOCK_B=1, BLOCK=128, INNER=32)]),
        (tree._tree_mask_kernel,
         dict(parents_ptr=i64, out_ptr="*u8", bs=i32, n=i32, num_bytes=i32),
         [dict(BLOCK_B=1, BLOCK=64, PACKED=False), dict(BLOCK_B=1, BLOCK=64, PACKED=True)]),
        (tree._verify_greedy_kernel,
         dict(tokens_ptr=i64, parents_ptr=i64, predict_ptr=i64, index_ptr=i64, len_ptr=i64, bs=i32, n=i32,
              width=i32),
         [dict(BLOCK_B=1, BLOCK=64)]),
        (accept._gather_accepted_kernel,
         dict(rows_ptr="*bf16", accept_index_ptr=i64, out_ptr="*bf16", num_entries=i32, features=i32),
         [dict(BLOCK_E=4, BLOCK_F=1024)]),
        (accept._fill_bonus_kernel,
         dict(tokens_ptr=i64, accept_len_ptr=i64, out_ptr=i64, bs=i32, stride=i32),
         [dict(BLOCK=64)]),
        (kv._slots_kernel,
         dict(page_table_ptr=i64, table_stride=i32, max_pages=i32, positions_ptr=i64, out_ptr=i64, bs=i32,
              width=i32, page_size=i32),
         [dict(BLOCK_R=16, BLOCK=64)]),
        (kv._plan_kernel,
         dict(accept_index_ptr=i64, accept_len_ptr=i64, slots_ptr=i64, src_ptr=i64, dst_ptr=i64, n=i32, width=i32),
         [dict(BLOCK=16)]),
        (dflash._verify_block_kernel,
         dict(cand_ptr=i64, target_ptr=i64, correct_ptr=i64, bonus_ptr=i64, block_size=i32),
         [dict(BLOCK=8)]),
        (kv._move_kv_kernel,
         dict(buf_ptr="*i16", src_ptr=i64, dst_ptr=i64, num_moves=i32, slot_stride=i32, group_stride="i64",
              inner=i32, row_numel=i32),
         [dict(BLOCK_M=512, BLOCK_E=16)]),
    ]  # fmt: skip


def compile_all(target_names: list[str]) -> list[str]:
    """Compile every kernel for each named target; returns the failures (empty when all compile)."""
    failures = []
    for name in target_names:
        target = TARGETS[name]
        for kernel, signature, constexpr_sets in _kernels():
            if type(kernel).__name__ == "InterpretedFunction":
                raise RuntimeError(
                    "TRITON_INTERPRET=1 is set: the kernels are interpreted, there is nothing to compile"
                )
            for constexprs in constexpr_sets:
                full = {**signature, **{key: "constexpr" for key in constexprs}}
                try:
                    triton.compile(ASTSource(kernel, signature=full, constexprs=constexprs), target=target)
                except Exception as err:  # every failure is reported, not just the first
                    failures.append(f"{name} {kernel.__name__} {constexprs}: {type(err).__name__}: {err}")
    return failures


def main() -> None:
    names = [a for a in sys.argv[1:] if a in TARGETS] or list(TARGETS)
    failures = compile_all(names)
    for failure in failures:
        print(failure)
    print(f"{len(failures)} failures compiling the cycle kernels for {names}")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
