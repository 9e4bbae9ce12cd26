"""The CUDA backend's kernels at a GPU's block sizes, and how to compile one for a GPU target without the GPU.

The interpreter (how CI runs the kernels) checks what a kernel computes, not that the Triton compiler
accepts it. `kernel_specs` lists each kernel of this backend with its argument types and the constexpr
sets the backend picks on a GPU (a real vocabulary and tree); `compile_kernel` compiles one of them down
to a cubin for ``sm_90`` or a code object for ``gfx942`` (`TARGETS`; the ROCm backend's "kernels that
port"), with the compilers that ship inside the triton wheel. `engine.kernels.compile_check` compiles these and
the fast engine path's kernels (whose specs sit in the engine) for both targets:

    python -m speccycle.engine.kernels.compile_check [cuda] [hip]
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import accept, argmax, cycle, dflash, kv, sampling, topk, tree

NONE = 2147483647
TARGETS = {"cuda": GPUTarget("cuda", 90, 32), "hip": GPUTarget("hip", "gfx942", 64)}


def kernel_specs() -> list[tuple[object, dict[str, str], list[dict[str, object]], tuple[str, ...]]]:
    """(kernel, pointer and scalar types, constexpr sets, arguments the JIT marks 16-divisible: none here) at the
    shapes of a real vocabulary and tree."""
    i64, i32, f32 = "*i64", "i32", "*fp32"
    specs = [
        (argmax._argmax_chunk_kernel,
         dict(logits_ptr="*bf16", num_rows=i32, row_stride=i32, vocab_size=i32, chunk=i32, value_ptr=f32,
              index_ptr="*i32", num_chunks=i32),
         [dict(BLOCK_R=1, BLOCK=1024, NONE=NONE), dict(BLOCK_R=32, BLOCK=32, NONE=NONE)]),
        (argmax._argmax_reduce_kernel,
         dict(value_ptr=f32, index_ptr="*i32", out_ptr=i64, num_rows=i32, num_chunks=i32),
         [dict(BLOCK_R=16, BLOCK=64, NONE=NONE)]),
        (argmax._top1_probability_kernel,
         dict(logits_ptr="*bf16", num_rows=i32, row_stride=i32, vocab_size=i32, out_ptr=f32),
         [dict(BLOCK_R=1, BLOCK=1024), dict(BLOCK_R=32, BLOCK=32)]),
        (topk._topk_block_kernel,
         dict(logits_ptr="*bf16", num_rows=i32, row_stride=i32, vocab_size=i32, max_ptr=f32, sum_ptr=f32,
              cand_value_ptr=f32, cand_index_ptr="*i32", num_blocks=i32),
         [dict(K=4, BLOCK_R=1, BLOCK=2048, NONE=NONE)]),
        (topk._topk_merge_kernel,
         dict(max_ptr=f32, sum_ptr=f32, cand_value_ptr=f32, cand_index_ptr="*i32", probs_ptr=f32, ids_ptr=i64,
              map_ptr=i64, num_rows=i32, num_blocks=i32),
         [dict(K=4, BLOCK_R=8, BLOCK_B=32, BLOCK_C=128, NONE=NONE, HAS_MAP=has_map) for has_map in (False, True)]),
        (tree._expand_frontier_kernel,
         dict(frontier_ptr=f32, child_p_ptr=f32, child_ids_ptr=i64, cum_ptr=f32, keep_ptr=i64, new_scores_ptr=f32,
              new_tokens_ptr=i64, bs=i32),
         [dict(K=8, BLOCK_B=1, BLOCK=64, INNER=32)]),
        (tree._advance_frontier_kernel,
         dict(frontier_ptr=f32, child_p_ptr=f32, child_ids_ptr=i64, frontier_cand_ptr=i64, path_ptr=i64,
              next_own_ptr=i64, hidden_ptr="*bf16", cum_ptr=f32, parents_ptr=i64, scores_ptr=f32, tokens_ptr=i64,
              cand_ptr=i64, new_path_ptr=i64, new_hidden_ptr="*bf16", level_base=i32, depth=i32, stride_own=i32,
              width=i32),
         [dict(K=4, BLOCK=16, INNER=16, BLOCK_D=8, BLOCK_H=256, HAS_NEXT=True),
          dict(K=8, BLOCK=64, INNER=32, BLOCK_D=8, BLOCK_H=256, HAS_NEXT=False)]),
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
         [dict(BLOCK_E=4, BLOCK_F=1024), dict(BLOCK_E=4096 // accept.NARROW_FEATURES, BLOCK_F=accept.NARROW_FEATURES)]),
        (accept._fill_bonus_kernel,
         dict(tokens_ptr=i64, accept_len_ptr=i64, out_ptr=i64, bs=i32, stride=i32),
         [dict(BLOCK=accept.FILL_BONUS_BLOCK)]),
        (kv._slots_kernel,
         dict(page_table_ptr=i64, table_stride=i32, max_pages=i32, positions_ptr=i64, out_ptr=i64, bs=i32,
              width=i32, page_size=i32),
         [dict(BLOCK_R=kv.SLOTS_BLOCK_R, BLOCK=kv.SLOTS_BLOCK)]),
        (kv._plan_kernel,
         dict(accept_index_ptr=i64, accept_len_ptr=i64, slots_ptr=i64, src_ptr=i64, dst_ptr=i64, n=i32, width=i32),
         [dict(BLOCK=16)]),
        (dflash._verify_block_kernel,
         dict(cand_ptr=i64, target_ptr=i64, correct_ptr=i64, bonus_ptr=i64, block_size=i32),
         [dict(BLOCK=8)]),
        (sampling._chain_kernel,
         dict(tokens_ptr=i64, q_ptr=f32, p_ptr=f32, coins_ptr=f32, noise_ptr=f32, accept_len_ptr=i64,
              predict_ptr=i64, num_steps=i32, vocab=i32),
         [dict(POINT_MASS=point_mass, BLOCK_V=1024) for point_mass in (False, True)]),
        (sampling._tree_kernel,
         dict(tokens_ptr=i64, parents_ptr=i64, q_ptr=f32, p_ptr=f32, coins_ptr=f32, noise_ptr=f32, p_state_ptr=f32,
              q_state_ptr=f32, accept_index_ptr=i64, accept_len_ptr=i64, predict_ptr=i64, n=i32, vocab=i32,
              width=i32),
         [dict(POINT_MASS=point_mass, BLOCK_V=1024) for point_mass in (False, True)]),
        (sampling._keyed_uniforms_kernel,
         dict(keys_ptr=i64, out_ptr=f32, count=i32, tiny="fp32", below_one="fp32"),
         [dict(BLOCK=sampling.KEYED_BLOCK, GAMMA_HI=sampling._GAMMA_HI, GAMMA_LO=sampling._GAMMA_LO,
               MUL1_HI=sampling._MUL1_HI, MUL1_LO=sampling._MUL1_LO, MUL2_HI=sampling._MUL2_HI,
               MUL2_LO=sampling._MUL2_LO)]),
        (kv._move_kv_kernel,
         dict(buf_ptr="*i16", src_ptr=i64, dst_ptr=i64, num_moves=i32, slot_stride=i32, group_stride="i64",
              inner=i32, row_numel=i32),
         [dict(BLOCK_M=512, BLOCK_E=16)]),
    ]  # fmt: skip
    return [(*spec, ()) for spec in specs]


def cycle_specs() -> list[tuple[object, dict[str, str], list[dict[str, object]], tuple[str, ...]]]:
    """The fused cycle's bookkeeping kernels (`cycle`): a chain and a tree at SmolLM2's defaults, with the
    arguments the JIT marks 16-divisible. They run on CUDA devices only (the fused cycle is a CUDA graph):
    `engine.kernels.compile_check` compiles them for ``cuda``, beside the fast path's kernels."""
    i64, i32 = "*i64", "i32"
    out = []
    out.append((cycle._cycle_slots_kernel,
                dict(table_ptr=i64, table_stride=i32, table_width=i32, L_ptr=i64, done_ptr="*i1", offsets_ptr=i64,
                     out_ptr=i64, C=i32, page_size=i32),
                [dict(BLOCK_C=32)], ("table_ptr", "L_ptr", "offsets_ptr", "out_ptr", "page_size")))  # fmt: skip
    rows_signature = dict(tokens_ptr=i64, parents_ptr=i64, L_ptr=i64, slots_ptr=i64, ids_ptr=i64, positions_ptr=i64,
                          out_slots_ptr=i64, prefix_ptr=i64, extra_ptr=i64, extra_stride=i32, N=i32,
                          widths_ptr=i64)  # fmt: skip
    out.append((cycle._verify_rows_kernel, rows_signature,
                [dict(ROUNDS=5, TREE=False, BLOCK_N=8, WIDTHS=False),
                 dict(ROUNDS=5, TREE=False, BLOCK_N=8, WIDTHS=True),
                 dict(ROUNDS=5, TREE=True, BLOCK_N=16, WIDTHS=False),
                 dict(ROUNDS=6, TREE=True, BLOCK_N=32, WIDTHS=False)],
                ("tokens_ptr", "L_ptr", "extra_ptr", "extra_stride", "widths_ptr")))  # fmt: skip
    accept_signature = dict(
        tokens_ptr=i64, parents_ptr=i64, predict_ptr=i64, walk_ptr=i64, slots_ptr=i64, L_ptr=i64, done_ptr="*i1",
        out_len_ptr=i64, cycle_ptr=i64, max_new_ptr=i64, stops_ptr=i64, num_stops=i32, out_ptr=i64, out_stride=i32,
        hist_ptr=i64, next_L_ptr=i64, next_root_ptr=i64, next_done_ptr="*i1", next_out_len_ptr=i64,
        next_cycle_ptr=i64, next_all_done_ptr="*i1", ext_ids_ptr=i64, ext_positions_ptr=i64, ext_slots_ptr=i64,
        ext_prefix_ptr=i64, ext_rows_ptr=i64, last_ptr=i64, src_ptr=i64, dst_ptr=i64, B=i32, N=i32, W=i32,
    )  # fmt: skip
    out.append((cycle._accept_commit_kernel, accept_signature,
                [dict(TREE=False, BLOCK_B=2, BLOCK_N=8, BLOCK_W=8, BLOCK_X=8),
                 dict(TREE=True, BLOCK_B=2, BLOCK_N=16, BLOCK_W=8, BLOCK_X=8),
                 dict(TREE=True, BLOCK_B=64, BLOCK_N=32, BLOCK_W=8, BLOCK_X=8)],
                ("tokens_ptr", "out_ptr")))  # fmt: skip
    out.append((cycle._flag_to_host_kernel, dict(src_ptr="*i1", dst_ptr="*i1"), [{}], ()))
    return out


def require_compiled(kernel) -> None:
    """Refuse a kernel imported under ``TRITON_INTERPRET=1`` (the interpreter's, which never compiles)."""
    if type(kernel).__name__ == "InterpretedFunction":
        raise RuntimeError("TRITON_INTERPRET=1 was set when the kernels were imported: they are interpreted, there is "
                           "nothing to compile; run in a fresh process without it")  # fmt: skip


def compile_kernel(kernel, signature, constexprs, aligned, target, **launch):
    """Compile one specialization and return Triton's compiled kernel; ``enable_fp_fusion``, ``num_warps`` and
    ``num_stages`` in ``constexprs`` are the launch options of those names (a set that fixes the launch the engine
    uses), ``launch`` more launch options (``num_warps``, ``num_stages``, ``maxnreg``)."""
    options = {k: constexprs[k] for k in ("enable_fp_fusion", "num_warps", "num_stages") if k in constexprs}
    constexprs = {k: v for k, v in constexprs.items() if k not in options}
    full = {**signature, **{key: "constexpr" for key in constexprs}}
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned if a not in constexprs}
    source = ASTSource(kernel, signature=full, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options={**options, **launch})
