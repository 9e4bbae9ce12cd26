"""Row-invariant GEMMs for the fast forward: ``x [T, K] @ w[N, K]^T`` whose rows never depend on ``T``.

Why: greedy speculative decoding reproduces autoregressive decoding only if a verify row computes
bitwise the logits a decode step computes for the same token. cuBLAS picks its kernel (tile, split-K,
reduction order) from the GEMM's shape, so one row alone and the same row among ``T`` rows may round
differently, and in bfloat16 an argmax can flip. Here every row's result is a function of that row and
the weight only:

* a fixed tile: ``BLOCK_M = 16`` rows (a call with fewer rows pads with masked rows), ``BLOCK_N`` and
  ``BLOCK_K`` chosen from ``(N, K, dtype)`` alone (`row_linear_config`), never from ``T``;
* one program per ``(column block, row block)``, a K loop in one fixed order, float32 accumulation, no
  split-K, no atomics, no autotuning keyed on ``T``; the row count is not specialized by the JIT
  (``do_not_specialize``), so one compiled kernel serves every ``T``;
* each program owns its output tile: a row's bits do not depend on its neighbours or on which block of
  rows it falls in (the tensor-core MMA treats every row of the tile alike).

So row ``r`` of a ``T``-row call is bitwise the one-row call on that row, for any ``T`` (tested under
``TRITON_INTERPRET=1`` and by ``bench/row_linear_bench.py`` on a GPU).

Fused variants, to cut the launches of a Llama layer from 9 to 5 (QKV + RoPE + KV write, attention,
O, gate-up, down):

* `norm_linear`: RMSNorm prologue. Optionally the residual add first (``h = x + r`` in the dtype, as
  the reference adds; the programs of column block 0 write ``h`` once, and a copy to ``sum_out`` when
  asked, e.g. a features column block). Every program recomputes its rows' mean of squares from the
  whole row (``K`` = 576 for SmolLM2: cheap) in a fixed blocked order, then feeds
  ``weight * (h * rstd)`` with the reference's roundings (`kernels.fused_ops.rms_norm_torch`) to the MMA.
* `norm_gate_up_silu`: the same prologue, the gate and up column blocks of one program side by side
  (two accumulators over one A tile) and the SiLU-and-mul epilogue (`kernels.fused_ops.silu_mul_torch`'s
  roundings): ``[T, K] -> [T, I]`` without the ``[T, 2I]`` intermediate.
* `norm_qkv_rope`: the same prologue (or none), a program per (16 columns of a head's first half, row
  block) computing them and their RoPE partners in the second half side by side, then RoPE on Q and
  K (`kernels.fused_ops.rope_write_kv_torch`'s roundings) and the K and V writes at the rows' slots (-1: none):
  returns the rotated Q; the QKV never exists.
* ``out_dtype``: the output stored as the dtype's rounding, widened (the LM head writes float32
  logits directly: the reference's ``F.linear(...).float()``, one kernel fewer).

The torch references are ``F.linear`` (`linear_torch`, here) and, for the fused variants, ``F.linear``
around `engine.kernels.fused_ops`' torch ops (`kernels.fused_ops.norm_linear_torch`,
`kernels.fused_ops.norm_gate_up_silu_torch`, `kernels.fused_ops.norm_qkv_rope_torch`, beside the ops they compose). They
are not bitwise the kernels (cuBLAS or MKL reduce in another order), so the kernels are tested equal to them within a
tolerance and row-invariant bitwise.

`TritonOps` (in `engine.kernels.fused_ops`, through `linear_rows` and `kernels.fused_ops.norm_linear_rows` and its kin)
uses these up to `MAX_ROWS` rows and ``F.linear`` (plus the unfused Triton ops) above, where cuBLAS is faster;
`BatchInvariantOps` uses them for any row count (a parity run over a large ragged batch, see
``bench/lossless_sweep.py``).
"""

from __future__ import annotations

import os

import attrs
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without triton use the torch references
    triton = None

BLOCK_M = 16  # tl.dot's smallest M; fixed, whatever the row count
MAX_ROWS = 64  # TritonOps: above this many rows F.linear (cuBLAS) is faster and is used instead
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@attrs.frozen
class RowLinearConfig:
    """Tile and launch parameters of one weight shape (never a function of the row count)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def row_linear_config(n: int, k: int, dtype: torch.dtype) -> RowLinearConfig:
    """The tile for an ``[N, K]`` weight (``N``: output columns): enough programs to spread over the SMs,
    a short K loop. Not yet tuned on a GPU (``bench/row_linear_bench.py --parts configs`` sweeps tiles).

    At batch 1 these GEMMs are tiny (SmolLM2's QKV weight is 1.1 MB): their time is launch plus the K
    loop's latency, not bandwidth. Narrow outputs get 16 columns a program (SmolLM2's O and down: 36
    programs), middling ones 32 (its gate-up: 48 programs of 2 x 32), wide ones 64 (an LM head: 768);
    a long K takes 128 a step (SmolLM2's down: 12 steps). 16 columns keep 2 warps busy, wider tiles 4.
    """
    block_n = 16 if n <= 1024 else 32 if n < 8192 else 64
    block_k = 128 if k >= 1024 else 64
    if dtype == torch.float32:  # float32 tiles take twice the registers and shared memory
        block_k = min(block_k, 32)
    cap = lambda size, block: max(16, min(block, triton.next_power_of_2(size)))  # noqa: E731
    block_n, block_k = cap(n, block_n), cap(k, block_k)
    return RowLinearConfig(block_n=block_n, block_k=block_k, num_warps=2 if block_n <= 16 else 4)


# ---- torch references ---------------------------------------------------------------------------
def linear_torch(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (``[T, K] x [N, K] -> [T, N]``), widened to ``out_dtype`` when given."""
    y = F.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)


# ---- the Triton kernel ----------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _round(x, DTYPE: tl.constexpr):
        """float32 -> DTYPE; bfloat16 rounds to nearest even in integer arithmetic.

        As `kernels.fused_ops._round_to_bfloat16` (why: the interpreter's cast truncates, and on a GPU LLVM may
        contract a product into a bfloat16 FMA and skip its rounding). Defined here again so this module
        does not import `engine.kernels.fused_ops` (which imports it).
        """
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True)).to(tl.bfloat16)
        else:
            return x.to(DTYPE)

    @triton.jit
    def _mma(a, b, acc, INTERPRET: tl.constexpr, IEEE: tl.constexpr):
        """``acc + a @ b`` in float32. Under the interpreter as a product-and-sum: its ``tl.dot`` is numpy's
        matmul, whose OpenBLAS kernels round a row differently with different neighbours (seen: 10 of 32
        rows of a 16 x 64 x 32 product), and it multiplies bfloat16 bit patterns."""
        if INTERPRET:
            a32 = a.to(tl.float32)
            b32 = b.to(tl.float32)
            return acc + tl.sum(a32[:, :, None] * b32[None, :, :], axis=1)
        elif IEEE:  # float32 models: IEEE products, not TF32 (F.linear's default)
            return tl.dot(a, b, acc, input_precision="ieee")
        else:  # bfloat16 / float16 tensor cores, float32 accumulation
            return tl.dot(a, b, acc)

    @triton.jit
    def _load_h(x_ptr, r_ptr, rows_m, cols_k, mask, stride_x, stride_r, RESIDUAL: tl.constexpr, DTYPE: tl.constexpr):
        """The ``[BLOCK_M, BLOCK_K]`` tile of ``h = x (+ r)``, the add rounded to the dtype as torch's."""
        x = tl.load(x_ptr + rows_m[:, None] * stride_x + cols_k[None, :], mask=mask, other=0.0)
        if RESIDUAL:
            r = tl.load(r_ptr + rows_m[:, None] * stride_r + cols_k[None, :], mask=mask, other=0.0)
            x = _round(x.to(tl.float32) + r.to(tl.float32), DTYPE)
        return x

    @triton.jit
    def _rstd(x_ptr, r_ptr, h_ptr, s_ptr, rows_m, mask_m, K, stride_x, stride_r, stride_h, stride_s, eps, writer,
              RESIDUAL: tl.constexpr, STORE_H: tl.constexpr, STORE_SUM: tl.constexpr, DTYPE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """``1 / sqrt(mean(h^2) + eps)`` of the rows, over the whole row in one fixed blocked order (every
        program alike); the ``writer`` program stores ``h`` (and its copy) on the way."""
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            cols_k = k0 + offs_k
            mask = mask_m[:, None] & (cols_k < K)[None, :]
            h = _load_h(x_ptr, r_ptr, rows_m, cols_k, mask, stride_x, stride_r, RESIDUAL, DTYPE)
            if writer:
                if STORE_H:
                    tl.store(h_ptr + rows_m[:, None] * stride_h + cols_k[None, :], h, mask=mask)
                if STORE_SUM:
                    tl.store(s_ptr + rows_m[:, None] * stride_s + cols_k[None, :], h, mask=mask)
            h32 = h.to(tl.float32)
            squares += tl.sum(h32 * h32, axis=1)
        return 1.0 / tl.sqrt(squares / K + eps)

    @triton.jit
    def _gemm(x_ptr, r_ptr, nw_ptr, w_ptr, rows_m, mask_m, cols_n, mask_n, second, K, stride_x, stride_r, stride_w,
              rstd, NORM: tl.constexpr, RESIDUAL: tl.constexpr, TWO: tl.constexpr, INTERPRET: tl.constexpr,
              IEEE: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):  # fmt: skip
        """``A @ W[cols_n]^T`` (and with ``TWO`` ``A @ W[cols_n + second]^T`` over the same A tiles), float32,
        the K loop in one fixed order. ``A``: the rows of ``x``, or with ``NORM`` ``rms_norm(x (+ r))`` with
        `kernels.fused_ops.rms_norm_torch`'s roundings: ``weight * (h32 * rstd).to(dtype)``, the product rounded."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            cols_k = k0 + offs_k
            mask_k = cols_k < K
            mask = mask_m[:, None] & mask_k[None, :]
            if NORM:
                h = _load_h(x_ptr, r_ptr, rows_m, cols_k, mask, stride_x, stride_r, RESIDUAL, DTYPE)
                normed = _round(h.to(tl.float32) * rstd[:, None], DTYPE)
                nw = tl.load(nw_ptr + cols_k, mask=mask_k, other=0.0)
                a = _round(nw.to(tl.float32)[None, :] * normed.to(tl.float32), DTYPE)
            else:
                a = tl.load(x_ptr + rows_m[:, None] * stride_x + cols_k[None, :], mask=mask, other=0.0)
            w_mask = mask_k[:, None] & mask_n[None, :]
            w_tile = tl.load(w_ptr + cols_n[None, :] * stride_w + cols_k[:, None], mask=w_mask, other=0.0)
            acc = _mma(a, w_tile, acc, INTERPRET, IEEE)  # [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]
            if TWO:
                w2 = tl.load(w_ptr + (cols_n[None, :] + second) * stride_w + cols_k[:, None], mask=w_mask, other=0.0)
                acc2 = _mma(a, w2, acc2, INTERPRET, IEEE)
        return acc, acc2

    @triton.jit(do_not_specialize=["rows"])
    def _row_linear_kernel(
        x_ptr,  # [T, K] activations (model dtype)
        r_ptr,  # [T, K] residual (RESIDUAL)
        nw_ptr,  # [K] RMSNorm weight (NORM)
        h_ptr,  # [T, K] out: x + r (STORE_H)
        s_ptr,  # [T, K] out: a second copy of h, e.g. a features column block (STORE_SUM)
        w_ptr,  # [N, K] weight ([2N, K] with SILU: gate rows, then up rows)
        out_ptr,  # [T, N]
        rows,
        N,
        K,
        stride_x,
        stride_r,
        stride_h,
        stride_s,
        stride_w,
        stride_o,
        eps,
        NORM: tl.constexpr,
        RESIDUAL: tl.constexpr,
        STORE_H: tl.constexpr,
        STORE_SUM: tl.constexpr,
        SILU: tl.constexpr,
        INTERPRET: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        DTYPE: tl.constexpr = x_ptr.dtype.element_ty
        rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows_m < rows
        cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = cols_n < N
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM:
            rstd = _rstd(x_ptr, r_ptr, h_ptr, s_ptr, rows_m, mask_m, K, stride_x, stride_r, stride_h, stride_s, eps,
                         pid_n == 0, RESIDUAL, STORE_H, STORE_SUM, DTYPE, BLOCK_M, BLOCK_K)  # fmt: skip
        acc, acc_up = _gemm(x_ptr, r_ptr, nw_ptr, w_ptr, rows_m, mask_m, cols_n, mask_n, N, K, stride_x, stride_r,
                            stride_w, rstd, NORM, RESIDUAL, SILU, INTERPRET, IEEE, DTYPE, BLOCK_M, BLOCK_N,
                            BLOCK_K)  # fmt: skip
        if SILU:  # silu_mul_torch: gate and up rounded to the dtype, silu rounded, the product rounded
            gate = _round(acc, DTYPE).to(tl.float32)
            up = _round(acc_up, DTYPE).to(tl.float32)
            silu = _round(gate / (1.0 + tl.exp(-gate)), DTYPE).to(tl.float32)
            y = _round(silu * up, DTYPE)
        else:
            y = _round(acc, DTYPE)
        out_mask = mask_m[:, None] & mask_n[None, :]
        tl.store(out_ptr + rows_m[:, None] * stride_o + cols_n[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _rotate(a, b, c1, c2, s1, s2, DTYPE: tl.constexpr):
        """`kernels.fused_ops.rope_write_kv_torch`'s RoPE of one head's halves ``(a, b)``:
        ``x * cos + cat(-b, a) * sin``, each product and each sum rounded to the dtype (as
        `kernels.fused_ops._rope_write_kv_kernel`)."""
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        p1 = _round(a * c1, DTYPE).to(tl.float32)
        p2 = _round(-b * s1, DTYPE).to(tl.float32)
        p3 = _round(b * c2, DTYPE).to(tl.float32)
        p4 = _round(a * s2, DTYPE).to(tl.float32)
        return _round(p1 + p2, DTYPE), _round(p3 + p4, DTYPE)

    @triton.jit(do_not_specialize=["rows"])
    def _qkv_rope_kernel(
        x_ptr,  # [T, K] activations
        r_ptr,  # [T, K] residual (RESIDUAL)
        nw_ptr,  # [K] RMSNorm weight (NORM)
        h_ptr,  # [T, K] out: x + r (STORE_H)
        s_ptr,  # [T, K] out: a copy of h (STORE_SUM)
        w_ptr,  # [(H + 2 Hkv) D, K] the concatenated Q/K/V weight
        pos_ptr,  # [T] positions
        cos_ptr,  # [max_position, D] (model dtype)
        sin_ptr,
        slot_ptr,  # [T] KV slots, -1: write nothing
        q_ptr,  # [T, H, D] out: rotated Q
        k_ptr,  # [num_slots, Hkv, D] K cache
        v_ptr,  # [num_slots, Hkv, D] V cache
        rows,
        K,
        stride_x,
        stride_r,
        stride_h,
        stride_s,
        stride_w,
        stride_table,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        eps,
        NORM: tl.constexpr,
        RESIDUAL: tl.constexpr,
        STORE_H: tl.constexpr,
        STORE_SUM: tl.constexpr,
        INTERPRET: tl.constexpr,
        IEEE: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        SPLIT: tl.constexpr = (HALF + BLOCK_HALF - 1) // BLOCK_HALF  # programs per head
        pid = tl.program_id(0)
        head = pid // SPLIT  # 0..H-1: Q, H..H+Hkv-1: K, then V
        pid_m = tl.program_id(1)
        DTYPE: tl.constexpr = x_ptr.dtype.element_ty
        rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows_m < rows
        j = (pid % SPLIT) * BLOCK_HALF + tl.arange(0, BLOCK_HALF)  # RoPE pairs column j with j + HALF
        mask_j = j < HALF
        cols = head * (2 * HALF) + j  # in the head's first half; the partners HALF columns on
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM:
            rstd = _rstd(x_ptr, r_ptr, h_ptr, s_ptr, rows_m, mask_m, K, stride_x, stride_r, stride_h, stride_s, eps,
                         pid == 0, RESIDUAL, STORE_H, STORE_SUM, DTYPE, BLOCK_M, BLOCK_K)  # fmt: skip
        acc1, acc2 = _gemm(x_ptr, r_ptr, nw_ptr, w_ptr, rows_m, mask_m, cols, mask_j, HALF, K, stride_x, stride_r,
                           stride_w, rstd, NORM, RESIDUAL, True, INTERPRET, IEEE, DTYPE, BLOCK_M, BLOCK_HALF,
                           BLOCK_K)  # fmt: skip
        x1 = _round(acc1, DTYPE)  # the QKV GEMM's output, as the unfused path stores it
        x2 = _round(acc2, DTYPE)
        mask = mask_m[:, None] & mask_j[None, :]
        slot = tl.load(slot_ptr + rows_m, mask=mask_m, other=-1)
        write = mask & (slot >= 0)[:, None]
        safe = tl.maximum(slot, 0).to(tl.int64)
        if head >= NUM_HEADS + NUM_KV_HEADS:  # V: written as is
            dst = v_ptr + safe[:, None] * stride_vs + (head - NUM_HEADS - NUM_KV_HEADS) * stride_vh + j[None, :]
            tl.store(dst, x1.to(v_ptr.dtype.element_ty), mask=write)
            tl.store(dst + HALF, x2.to(v_ptr.dtype.element_ty), mask=write)
        else:
            pos = tl.load(pos_ptr + rows_m, mask=mask_m, other=0)
            table = pos[:, None] * stride_table + j[None, :]
            c1 = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
            out1, out2 = _rotate(x1, x2, c1, c2, s1, s2, DTYPE)
            if head < NUM_HEADS:
                dst = q_ptr + rows_m[:, None] * stride_qt + head * stride_qh + j[None, :]
                tl.store(dst, out1, mask=mask)
                tl.store(dst + HALF, out2, mask=mask)
            else:
                dst = k_ptr + safe[:, None] * stride_ks + (head - NUM_HEADS) * stride_kh + j[None, :]
                tl.store(dst, out1.to(k_ptr.dtype.element_ty), mask=write)
                tl.store(dst + HALF, out2.to(k_ptr.dtype.element_ty), mask=write)


def _check(x: torch.Tensor, weight: torch.Tensor, what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what} needs triton (pip install triton); use the torch reference without it")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{what}: x must be [T, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"{what}: x and weight must share one dtype of {DTYPES}; got {x.dtype} and {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError(f"{what}: the weight needs a contiguous last dimension (call .contiguous() once at load)")


def _launch(
    x, residual, norm_weight, h, sum_out, weight, out, n, eps, *, norm, silu, config: RowLinearConfig | None
) -> None:
    rows, k = x.shape
    config = config or row_linear_config(weight.shape[0], k, x.dtype)
    dummy = x
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(rows, BLOCK_M))
    _row_linear_kernel[grid](
        x, dummy if residual is None else residual, dummy if norm_weight is None else norm_weight,
        dummy if h is None else h, dummy if sum_out is None else sum_out, weight, out,
        rows, n, k,
        x.stride(0), 0 if residual is None else residual.stride(0), 0 if h is None else h.stride(0),
        0 if sum_out is None else sum_out.stride(0), weight.stride(0), out.stride(0),
        eps,
        NORM=norm, RESIDUAL=residual is not None, STORE_H=h is not None, STORE_SUM=sum_out is not None, SILU=silu,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    config: RowLinearConfig | None = None,
) -> torch.Tensor:
    """``x [T, K] @ weight[N, K]^T -> [T, N]``, each row bitwise independent of ``T`` and the other rows.

    bfloat16, float16 or float32 (one dtype for both); float32 accumulation, the output rounded to the
    dtype and stored as ``out_dtype`` (default the dtype). ``config``: override the tile (benchmarks).
    """
    _check(x, weight, "row_linear")
    x = _contiguous_rows(x)
    rows, n = x.shape[0], weight.shape[0]
    out = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    if rows:
        _launch(x, None, None, None, None, weight, out, n, 0.0, norm=False, silu=False, config=config)
    return out


def _norm_args(x, residual, norm_weight, sum_out, what):
    x = _contiguous_rows(x)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"{what}: the residual must match x ({tuple(x.shape)}, {x.dtype})")
        residual = _contiguous_rows(residual)
    if norm_weight.shape != (x.shape[1],):
        raise ValueError(f"{what}: the norm weight must be [{x.shape[1]}]; got {tuple(norm_weight.shape)}")
    if sum_out is not None and (sum_out.shape != x.shape or sum_out.stride(-1) != 1):
        raise ValueError(f"{what}: sum_out must be a [T, K] view with a contiguous last dimension")
    h = None if residual is None else torch.empty_like(x)
    return x, residual, norm_weight.contiguous(), h


def norm_linear_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    sum_out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    config: RowLinearConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.fused_ops.norm_linear_torch` in one kernel, row-invariant: ``(h, [T, N])``; ``h`` is ``x`` without a
    residual."""
    _check(x, weight, "norm_linear")
    x, residual, norm_weight, h = _norm_args(x, residual, norm_weight, sum_out, "norm_linear")
    rows, n = x.shape[0], weight.shape[0]
    out = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    if rows:
        _launch(x, residual, norm_weight, h, sum_out, weight, out, n, eps, norm=True, silu=False, config=config)
    return (x if h is None else h), out


def norm_gate_up_silu_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    sum_out: torch.Tensor | None = None,
    *,
    config: RowLinearConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.fused_ops.norm_gate_up_silu_torch` in one kernel, row-invariant: ``(h, [T, I])`` for a ``[2I, K]``
    weight."""
    _check(x, weight, "norm_gate_up_silu")
    if weight.shape[0] % 2:
        raise ValueError(f"norm_gate_up_silu: the gate/up weight needs an even row count; got {weight.shape[0]}")
    x, residual, norm_weight, h = _norm_args(x, residual, norm_weight, sum_out, "norm_gate_up_silu")
    rows, inter = x.shape[0], weight.shape[0] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows:
        config = config or row_linear_config(inter, x.shape[1], x.dtype)
        _launch(x, residual, norm_weight, h, sum_out, weight, out, inter, eps, norm=True, silu=True, config=config)
    return (x if h is None else h), out


def norm_qkv_rope_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    sum_out: torch.Tensor | None,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    out_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    block_k: int | None = None,
    block_half: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.fused_ops.norm_qkv_rope_torch` in one kernel, row-invariant: a program per (``block_half`` columns of a
    head's first half, row block) computes them and their partners in the second half (two accumulators),
    rotates Q and K (`kernels.fused_ops.rope_write_kv_triton`'s roundings) and writes Q, and K and V into the
    caches; the ``[T, (H + 2 Hkv) D]`` QKV never exists. ``block_k``, ``block_half``: tile overrides."""
    _check(x, weight, "norm_qkv_rope")
    head_dim = cos_table.shape[1]
    if weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(
            f"norm_qkv_rope: the weight has {weight.shape[0]} rows; (H + 2 Hkv) D = "
            f"({num_heads} + 2 x {num_kv_heads}) x {head_dim} expected, D even"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cos_table", cos_table), ("sin_table", sin_table)):
        if t.stride(-1) != 1:
            raise ValueError(f"norm_qkv_rope: {name} needs a contiguous last dimension")
    if norm_weight is None:
        if residual is not None or sum_out is not None:
            raise ValueError("norm_qkv_rope: a residual or sum_out needs the norm (norm_weight)")
        x, h = _contiguous_rows(x), None
    else:
        x, residual, norm_weight, h = _norm_args(x, residual, norm_weight, sum_out, "norm_qkv_rope")
    rows, k = x.shape
    q = torch.empty((rows, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if rows:
        half = head_dim // 2
        block_k = block_k or row_linear_config(weight.shape[0], k, x.dtype).block_k
        dummy = x
        block_half = max(16, min(block_half, triton.next_power_of_2(half)))
        split = triton.cdiv(half, block_half)
        positions, out_slots = positions.contiguous(), out_slots.contiguous()  # read at `ptr + row`
        _qkv_rope_kernel[((num_heads + 2 * num_kv_heads) * split, triton.cdiv(rows, BLOCK_M))](
            x, dummy if residual is None else residual, dummy if norm_weight is None else norm_weight,
            dummy if h is None else h, dummy if sum_out is None else sum_out, weight,
            positions, cos_table, sin_table, out_slots, q, k_cache, v_cache,
            rows, k,
            x.stride(0), 0 if residual is None else residual.stride(0), 0 if h is None else h.stride(0),
            0 if sum_out is None else sum_out.stride(0), weight.stride(0), cos_table.stride(0),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            eps,
            NORM=norm_weight is not None, RESIDUAL=residual is not None, STORE_H=h is not None,
            STORE_SUM=sum_out is not None, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
            IEEE=x.dtype == torch.float32, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
            BLOCK_M=BLOCK_M, BLOCK_HALF=block_half, BLOCK_K=block_k,
            num_warps=2 if block_half <= 16 else 4, num_stages=3, enable_fp_fusion=False,
        )  # fmt: skip
    return (x if h is None else h), q


# ---- what the op sets call: the kernel up to a row bound, F.linear above (the fused GEMMs':
# `engine.kernels.fused_ops`) ---
def rows_fit(x: torch.Tensor, weight: torch.Tensor, max_rows: int | None) -> bool:
    """Whether the row-invariant kernels take this GEMM: at most ``max_rows`` rows (None: any), one of `DTYPES`."""
    return (max_rows is None or x.shape[0] <= max_rows) and x.dtype == weight.dtype and x.dtype in DTYPES


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None, *, max_rows: int | None = MAX_ROWS
) -> torch.Tensor:
    """`row_linear` up to ``max_rows`` rows (None: any), ``F.linear`` above."""
    if rows_fit(x, weight, max_rows):
        return row_linear(x, weight, out_dtype)
    return linear_torch(x, weight, out_dtype)


def compile_specs() -> list[tuple[object, dict[str, str], list[dict[str, object]], tuple[str, ...]]]:
    """The kernels at SmolLM2-135M's and Llama-3-8B's tiles (and an EAGLE-3 QKV), for `engine.kernels.compile_check`.

    (kernel, argument types, constexpr sets, arguments the JIT marks 16-divisible); ``rows`` is never
    specialized (``do_not_specialize``), so one compiled kernel serves every row count.
    """
    out = []
    for dt in ("fp32", "bf16"):
        p = "*" + dt
        strides = ("stride_x", "stride_r", "stride_h", "stride_s", "stride_w", "stride_o")
        signature = dict(x_ptr=p, r_ptr=p, nw_ptr=p, h_ptr=p, s_ptr=p, w_ptr=p, out_ptr=p, rows="i32", N="i32",
                         K="i32", **{name: "i32" for name in strides}, eps="fp32")  # fmt: skip
        aligned = ("x_ptr", "r_ptr", "nw_ptr", "h_ptr", "s_ptr", "w_ptr", "out_ptr", "N", "K", *strides)
        sets = []
        shapes = ((960, 576, True, True, False), (576, 576, False, False, False), (1536, 576, True, True, True),
                  (576, 1536, False, False, False), (49152, 576, False, False, False), (6144, 4096, True, False, False),
                  (14336, 4096, True, True, True), (4096, 14336, False, False, False))  # fmt: skip
        for n, k, norm, residual, silu in shapes:  # (N: columns out, K, norm prologue, residual add, SiLU-mul)
            config = row_linear_config(n, k, torch.float32 if dt == "fp32" else torch.bfloat16)
            sets.append(dict(NORM=norm, RESIDUAL=residual, STORE_H=residual, STORE_SUM=residual, SILU=silu,
                             INTERPRET=False, IEEE=dt == "fp32", BLOCK_M=BLOCK_M, BLOCK_N=config.block_n,
                             BLOCK_K=config.block_k))  # fmt: skip
        out.append((_row_linear_kernel, signature, sets, aligned))
        rope_strides = ("stride_x", "stride_r", "stride_h", "stride_s", "stride_w", "stride_table", "stride_qt",
                        "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh")  # fmt: skip
        signature = dict(x_ptr=p, r_ptr=p, nw_ptr=p, h_ptr=p, s_ptr=p, w_ptr=p, pos_ptr="*i64", cos_ptr=p, sin_ptr=p,
                         slot_ptr="*i64", q_ptr=p, k_ptr=p, v_ptr=p, rows="i32", K="i32",
                         **{name: "i32" for name in rope_strides}, eps="fp32")  # fmt: skip
        aligned = ("x_ptr", "r_ptr", "nw_ptr", "h_ptr", "s_ptr", "w_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr",
                   "v_ptr", "K", *rope_strides)  # fmt: skip
        sets = []
        models = ((9, 3, 32, 576, True, True), (9, 3, 32, 576, True, False), (9, 3, 32, 1152, False, False),
                  (32, 8, 64, 4096, True, True))  # fmt: skip
        for heads, kv_heads, half, k, norm, residual in models:  # (H, Hkv, D / 2, K, norm prologue, residual add)
            dtype = torch.float32 if dt == "fp32" else torch.bfloat16
            block_k = row_linear_config((heads + 2 * kv_heads) * 2 * half, k, dtype).block_k
            sets.append(dict(NORM=norm, RESIDUAL=residual, STORE_H=residual, STORE_SUM=residual, INTERPRET=False,
                             IEEE=dt == "fp32", NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HALF=half, BLOCK_M=BLOCK_M,
                             BLOCK_HALF=16, BLOCK_K=block_k, enable_fp_fusion=False))  # fmt: skip
        out.append((_qkv_rope_kernel, signature, sets, aligned))
    return out
