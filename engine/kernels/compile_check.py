"""Compile every Triton kernel of the project for a GPU target without the GPU: NVIDIA Hopper and AMD MI300.

The interpreter (how CI runs the kernels) checks what a kernel computes, not that the Triton compiler
accepts it. This compiles each kernel, at the block sizes the backend picks on a GPU, down to a cubin
for ``sm_90`` and a code object for ``gfx942`` (the ROCm backend's "kernels that port"), using the
compilers that ship inside the triton wheel. The cycle kernels' specs are the CUDA backend's own
(`backends.cuda.compile_specs.kernel_specs`); the fast engine path's kernels (`engine.kernels.attention_triton`,
`engine.kernels.fused_ops`, `engine.kernels.linear_triton`, ... and the fused cycle's bookkeeping, the CUDA backend's
`compile_specs.cycle_specs`: `engine_specs`) are compiled for ``sm_90`` too, at the
constexprs, dtypes and argument specializations of real models (SmolLM2-135M: 9 / 3 heads of 64;
Llama-3-8B: 32 / 8 of 128): the JIT marks 16-divisible pointers and integers and turns an integer equal
to 1 (``page_size`` 1) into a constant, and Triton's layout passes have failed on one combination and
not another. Run it without ``TRITON_INTERPRET``:

    python -m speccycle.engine.kernels.compile_check [cuda] [hip]
"""

from __future__ import annotations

import sys

import triton

from ...backends.cuda.compile_specs import TARGETS, compile_kernel, cycle_specs, kernel_specs, require_compiled
from . import attention_prefill as prefill
from . import attention_tiles as tiles
from . import attention_triton as attention
from . import decode_step, int8_linear, linear_triton
from . import fused_ops as fused


def engine_specs() -> list[tuple[object, dict[str, str], list[dict[str, object]], tuple[str, ...]]]:
    """The fast path's kernels: (kernel, types, constexpr sets, arguments the JIT marks 16-divisible).

    A constexpr set may fix a runtime argument (``page_size=1``): the JIT makes an integer 1 a constant.
    """
    i64, i32, f32 = "*i64", "i32", "*fp32"
    out = []
    for dt in ("fp32", "bf16"):
        p = "*" + dt
        strides = ("stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_ot",
                   "stride_oh", "stride_et", "stride_pt")  # fmt: skip
        row_keys = dict(prefix_ptr=i64, extra_ptr=i64)
        signature = dict(q_ptr=p, k_ptr=p, v_ptr=p, out_ptr=p, part_acc_ptr=f32, part_max_ptr=f32, part_sum_ptr=f32,
                         counter_ptr="*i32", row_request_ptr=i64, **row_keys, table_ptr=i64,
                         **{name: i32 for name in strides}, num_extra=i32, page_size=i32, table_width=i32,
                         num_heads=i32, chunk_bound=i32, scale="fp32")  # fmt: skip
        aligned = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_acc_ptr", "part_max_ptr", "part_sum_ptr", "counter_ptr",
                   "row_request_ptr", "prefix_ptr", "extra_ptr", "table_ptr", *strides[:8], "page_size",
                   "table_width", "chunk_bound")  # fmt: skip
        low = dt != "fp32"
        split = dict(CHUNK=attention.CHUNK, MAX_CHUNKS=attention.MAX_CHUNKS)
        combine_sets = []
        for heads, group, dim, block_m, page_one in (
            # SmolLM2-135M at page sizes 16 and 1, with 0-16 and 64 extra slots; Llama-3-8B at page size 16, with
            # 0-16 and 32 extra slots (a 32-node tree's verify)
            (9, 3, 64, 16, False), (9, 3, 64, 16, True), (9, 3, 64, 64, False), (32, 4, 128, 16, False),
            (32, 4, 128, 32, False),
        ):  # fmt: skip
            # the merge fused into the kernel (the default) and by the combine kernel (fused_combine=False)
            ce = dict(GROUP=group, BLOCK_G=16, HEAD_DIM=dim, BLOCK_D=dim, BLOCK_N=attention.BLOCK_N,
                      BLOCK_M=block_m, LOW_PRECISION=low, UPCAST=False, FUSED_COMBINE=True,
                      BLOCK_C=triton.next_power_of_2(attention.MAX_CHUNKS), PIPELINED_MERGE=True,
                      **split)  # fmt: skip
            sets = [{**ce, "page_size": 1} if page_one else ce]
            # the engine's launches: warps by head dim; one stage and the head-after-head merge (PIPELINED_MERGE=False)
            # for calls of more rows than page-table rows
            # (a call of more than 16 extra slots, block_m 32 or 64, is a verify's: only the first)
            if not page_one:
                warps = attention.default_num_warps(dim)
                launches = [{"num_warps": warps, "num_stages": 1, "PIPELINED_MERGE": False}]
                launches += [{"num_warps": warps}] if warps != 4 and block_m == 16 else []
                sets += [{**ce, **launch} for launch in launches]
            if not page_one:  # the single-pass kernel (max_chunks=1): one chunk, the JIT's constant chunk_bound 1
                sets.append({**ce, "FUSED_COMBINE": False})
                sets.append({**ce, "MAX_CHUNKS": 1, "chunk_bound": 1, "FUSED_COMBINE": False, "BLOCK_C": 1})
            # SmolLM2's 9 heads are not 16-divisible, Llama's 32 are: both specializations of num_heads
            out.append((attention._paged_attention_kernel, signature, sets,
                        (*aligned, "num_heads") if heads % 16 == 0 else aligned))  # fmt: skip
            # the tile kernel (engine/kernels/attention_tiles.py): decode tiles of one row (rows_per_tile, tail,
            # group_rows and tiles_per_group 1, constants to the JIT) and verify tiles
            tile_signature = {k: v for k, v in signature.items() if k != "counter_ptr"}
            tile_signature.update(num_rows=i32, rows_per_tile=i32, tail=i32, group_rows=i32, tiles_per_group=i32)
            tile = {k: v for k, v in ce.items() if k not in ("BLOCK_G", "FUSED_COMBINE", "BLOCK_C", "PIPELINED_MERGE")}
            tile.update(BLOCK_Q=tiles.TILE_LINES)
            one_row = {"rows_per_tile": 1, "tail": 1, "group_rows": 1, "tiles_per_group": 1}
            tile_sets = [{**tile, **one_row}, {**tile}]
            if page_one:
                tile_sets = [{**t, "page_size": 1} for t in tile_sets]
            tile_aligned = tuple(a for a in aligned if a != "counter_ptr")
            out.append((tiles._paged_attention_tile_kernel, tile_signature, tile_sets,
                        (*tile_aligned, "num_heads") if heads % 16 == 0 else tile_aligned))  # fmt: skip
            combine = dict(HEAD_DIM=dim, BLOCK_D=dim, BLOCK_C=triton.next_power_of_2(attention.MAX_CHUNKS),
                           BLOCK_M=block_m, CHUNK=attention.CHUNK, MAX_CHUNKS=attention.MAX_CHUNKS)  # fmt: skip
            combine = {**combine, "page_size": 1} if page_one else combine
            # the tile path's merge may drop the states from L2 once read (attention_tiles.DISCARD_STATES)
            combine_sets += [{**combine, "DISCARD": False}, {**combine, "DISCARD": True}]
        combine_signature = dict(out_ptr=p, part_acc_ptr=f32, part_max_ptr=f32, part_sum_ptr=f32, **row_keys,
                                 stride_ot=i32, stride_oh=i32, stride_et=i32, num_extra=i32, page_size=i32,
                                 table_width=i32, num_heads=i32, chunk_bound=i32)  # fmt: skip
        combine_aligned = ("out_ptr", "part_acc_ptr", "part_max_ptr", "part_sum_ptr", "prefix_ptr", "extra_ptr",
                           "stride_ot", "stride_oh", "page_size", "table_width", "chunk_bound")  # fmt: skip
        out.append((attention._paged_attention_combine_kernel, combine_signature, combine_sets, combine_aligned))
        # the prefill kernels (engine/kernels/attention_prefill.py) at SmolLM2's and Llama-3-8B's heads
        pre_strides = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot",
                       "stride_oh", "stride_table")  # fmt: skip
        pre_rows = dict(row_request_ptr=i64, prefix_lens_ptr=i64, table_ptr=i64, num_rows=i32)
        exact_signature = dict(q_ptr=p, k_ptr=p, v_ptr=p, out_ptr=p, part_acc_ptr=f32, part_max_ptr=f32,
                               part_sum_ptr=f32, counter_ptr="*i32", **pre_rows, **{n: i32 for n in pre_strides},
                               page_size=i32, table_width=i32, num_heads=i32, chunk_bound=i32,
                               scale="fp32")  # fmt: skip
        flash_signature = dict(q_ptr=p, k_ptr=p, v_ptr=p, out_ptr=p, **pre_rows, **{n: i32 for n in pre_strides},
                               page_size=i32, scale_log2="fp32")  # fmt: skip
        pre_aligned = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "row_request_ptr", "prefix_lens_ptr", "table_ptr",
                       *pre_strides[:8], "page_size")  # fmt: skip
        for group, dim in ((3, 64), (4, 128)):
            exact = dict(GROUP=group, HEAD_DIM=dim, BLOCK_D=dim, BLOCK_M=prefill.EXACT_BLOCK_M,
                         BLOCK_N=attention.BLOCK_N, CHUNK=attention.CHUNK, MAX_CHUNKS=attention.MAX_CHUNKS,
                         BLOCK_C=triton.next_power_of_2(attention.MAX_CHUNKS), LOW_PRECISION=low,
                         UPCAST=False)  # fmt: skip
            # and at the engine's launch: the rows kernel's warps by head dim
            warps = attention.default_num_warps(dim)
            exact_sets = [exact] + ([{**exact, "num_warps": warps}] if warps != 4 else [])
            out.append((prefill._prefill_attention_exact_kernel, exact_signature,
                        exact_sets, (*pre_aligned, "part_acc_ptr", "part_max_ptr", "part_sum_ptr",
                                     "counter_ptr")))  # fmt: skip
            flash = dict(GROUP=group, HEAD_DIM=dim, BLOCK_M=prefill.BLOCK_M, BLOCK_N=prefill.BLOCK_N,
                         IEEE=not low, UPCAST=False)  # fmt: skip
            out.append((prefill._prefill_attention_kernel, flash_signature, [flash], pre_aligned))
        rope_strides = ("stride_qkv", "stride_table", "stride_qt", "stride_qh", "stride_ks", "stride_kh",
                        "stride_vs", "stride_vh")  # fmt: skip
        out.append(
            (
                fused._rope_write_kv_kernel,
                dict(
                    qkv_ptr=p,
                    pos_ptr=i64,
                    cos_ptr=p,
                    sin_ptr=p,
                    slot_ptr=i64,
                    q_out_ptr=p,
                    k_ptr=p,
                    v_ptr=p,
                    **{name: i32 for name in rope_strides},
                    src_ptr=p,
                    stride_src=i32,
                    hidden=i32,
                    eps="fp32",
                    copy_ptr=p,
                    stride_copy=i32,
                ),
                # plain, with the folded input norm (`kernels.fused_ops.FoldedNormOps`) at SmolLM2's hidden size, and
                # with the feature copy of an EAGLE-3 target's feature layers
                # (SmolLM2: 3 heads a program, a masked fourth lane; Llama-3-8B: 8 heads of 128)
                [
                    dict(
                        NUM_HEADS=heads,
                        NUM_KV_HEADS=kv_heads,
                        HALF=half,
                        BLOCK_HALF=half,
                        NORM=norm,
                        BLOCK_H=block_h,
                        COPY=copy,
                        HEADS=per,
                        BLOCK_HEADS=triton.next_power_of_2(per),
                        enable_fp_fusion=False,
                    )
                    for heads, kv_heads, half in ((9, 3, 32), (32, 8, 64))
                    for per in (fused.rope_heads_per_program(heads, kv_heads),)
                    for norm, block_h, copy in ((False, 16, False), (True, 1024, False), (True, 1024, True))
                ],  # fmt: skip
                (
                    "qkv_ptr",
                    "cos_ptr",
                    "sin_ptr",
                    "q_out_ptr",
                    "k_ptr",
                    "v_ptr",
                    "src_ptr",
                    "copy_ptr",
                    "stride_copy",
                    *rope_strides,
                ),  # fmt: skip
            )
        )
        out.append(
            (
                fused._rms_norm_kernel,
                dict(
                    x_ptr=p,
                    r_ptr=p,
                    w_ptr=p,
                    sum_ptr=p,
                    y_ptr=p,
                    stride_x=i32,
                    stride_r=i32,
                    stride_s=i32,
                    stride_y=i32,
                    hidden=i32,
                    eps="fp32",
                ),
                [dict(HAS_RESIDUAL=False, BLOCK=1024), dict(HAS_RESIDUAL=True, BLOCK=1024)],
                ("x_ptr", "r_ptr", "w_ptr", "sum_ptr", "y_ptr", "stride_x", "stride_r", "stride_s", "stride_y"),
            )
        )
        out.append((fused._silu_mul_kernel,
                    dict(x_ptr=p, out_ptr=p, stride_x=i32, stride_o=i32, inter=i32, src_ptr=p, stride_src=i32,
                         hidden=i32, eps="fp32"),
                    [dict(BLOCK=1024, NORM=False, BLOCK_H=16), dict(BLOCK=1024, NORM=True, BLOCK_H=1024)],
                    ("x_ptr", "out_ptr", "stride_x", "stride_o", "inter", "src_ptr")))  # fmt: skip
    out += linear_triton.compile_specs()  # the row-invariant GEMMs at both models' tiles
    out += int8_linear.compile_specs()  # a draft head's int8 GEMMs at the 8B head's tiles
    # the decode step's bookkeeping (`engine.kernels.decode_step`), at a decode graph's 8 rows and 128 rows, page sizes
    # 16 and 1
    out.append((decode_step._decode_rows_kernel,
                dict(pos_ptr=i64, num_valid_ptr=i64, table_ptr=i64, request_ptr=i64, slot_ptr=i64, prefix_ptr=i64,
                     rows=i32, stride_t=i32, width=i32, page_size=i32),
                [dict(BLOCK=8), dict(BLOCK=128), dict(BLOCK=8, page_size=1)],
                ("pos_ptr", "num_valid_ptr", "table_ptr", "request_ptr", "slot_ptr", "prefix_ptr", "stride_t", "width",
                 "page_size")))  # fmt: skip
    out.append((decode_step._decode_advance_kernel,
                dict(next_ptr=i64, pos_ptr=i64, step_ptr=i64, num_valid_ptr=i64, ids_out_ptr=i64, pos_out_ptr=i64,
                     step_out_ptr=i64, history_ptr=i64, rows=i32, stride_h=i32),
                [dict(BLOCK=8), dict(BLOCK=128)],
                ("next_ptr", "pos_ptr", "ids_out_ptr", "pos_out_ptr", "history_ptr", "stride_h")))  # fmt: skip
    out += cycle_specs()  # the fused cycle's bookkeeping (`backends.cuda.cycle`)
    return out


def compile_all(target_names: list[str]) -> list[str]:
    """Compile every kernel for each named target; returns the failures (empty when all compile).

    The fast engine path's kernels are compiled for ``cuda`` only (that path runs on CUDA devices).
    """
    failures = []
    for name in target_names:
        target = TARGETS[name]
        entries = kernel_specs()
        if name == "cuda":
            entries += engine_specs()
        for kernel, signature, constexpr_sets, aligned in entries:
            require_compiled(kernel)
            for constexprs in constexpr_sets:
                try:
                    compile_kernel(kernel, signature, constexprs, aligned, target)
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
