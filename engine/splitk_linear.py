"""Split-K GEMMs for few rows: ``x += a [T, K] @ w[N, K]^T`` with the weight read once, by many programs.

Why: at a verify's 32 rows cuBLAS runs the Llama-3-8B O projection (4096 x 4096, 32 MB) as one program per
output tile, 64 x 16 columns, the whole K loop each (``nvjet_sm90_tst_64x16_64x16_1x2_h_badd``): 14.8-18.1 µs
where reading 32 MB takes ~11 µs at the bandwidth a decode step reads
(bench/results/scale_profile-H100-20261126-54b6fcf, the tree-32 timelines); at 5 rows it takes a split-K kernel and
~12.6 µs. Splitting K gives ``SPLITS`` times the programs, each streaming a ``[BLOCK_N, K / SPLITS]`` slab of the
weight.

**Deterministic and row-invariant.** Program ``(m block, n block, split)`` multiplies its rows' ``K / SPLITS``
columns in one fixed order and stores the float32 partial; a second kernel sums each output's ``SPLITS``
partials in split order, adds ``x`` (when adding) and rounds once (cuBLAS's ``beta = 1`` rounds once too). No
atomics; the tile (`SplitKConfig`) is a function of ``(N, K)`` only, never of the row count, and the row count
is not specialized by the JIT. A row's bits are therefore a function of that row and the weight alone: row
``r`` of a ``T``-row call is bitwise the one-row call on it, for every ``T`` (tested under ``TRITON_INTERPRET=1``;
on a GPU by ``bench/blas_rows_bench.py``'s invariance count).

The torch reference is ``x.addmm_(a, w.t())`` (`kernels.linear_add`); the two agree within the dtype's
rounding, not bitwise (cuBLAS sums K in another order).

**Measured, and not used.** Timed with cold weights (one copy per layer, `bench/blas_rows_bench.py`, H100, bfloat16,
bench/results/blas_rows_bench-H100-cold-*), the premise did not hold: cuBLAS's O projection takes 16.4 µs at one
row and 14.4-14.7 at 32 (the 18.1 of the 54b6fcf timeline was the verify's context, see
bench/neighbour_bench.py), and the best of 36 split-K tiles 15.2 / 16.3 µs; the down projection 44.3 / 46.0 µs
(cuBLASLt 42.6 at 32 rows) against 43.2 / 45.6. No op set calls it; the benchmark's ``splitk`` part measures it
again.
"""

from __future__ import annotations

import os

import attrs
import torch

from .linear_triton import _check as check_linear

try:
    import triton
    import triton.language as tl

    from .linear_triton import _mma, _round
except ImportError:  # pragma: no cover - installs without triton use the torch reference
    triton = None

MAX_ROWS = 64  # the fast path's decode and verify row counts; prefills keep cuBLAS


@attrs.frozen
class SplitKConfig:
    """Tile and launch of one weight shape (never a function of the row count): ``splits`` must divide ``K``
    into whole ``block_k`` steps."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    splits: int = 4
    num_warps: int = 4
    num_stages: int = 4


def splitk_config(n: int, k: int, dtype: torch.dtype) -> SplitKConfig:
    """The tile for an ``[N, K]`` weight: ``splits`` the largest of 8, 4, 2, 1 that cuts ``K`` into whole
    ``block_k`` steps. Float32 takes half the K step (registers and shared memory)."""
    block_k = 64 if dtype == torch.float32 else 128
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    splits = next((s for s in (4, 2, 1) if k % (s * block_k) == 0), 1)
    return SplitKConfig(block_n=max(16, min(64, triton.next_power_of_2(n))), block_k=block_k, splits=splits)


if triton is not None:

    @triton.jit
    def _tile_rows_cols(pid_m, pid_n, rows, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A program's rows and output columns, with their masks (this module's and `int8_linear`'s GEMMs)."""
        rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        return rows_m, rows_m < rows, cols_n, cols_n < N

    @triton.jit
    def _store_partial(part_ptr, acc, split, rows, rows_m, mask_m, cols_n, mask_n, N):
        """A split's float32 partial at ``part[split, rows, cols]`` (``[SPLITS, rows, N]``)."""
        part = (split * rows + rows_m[:, None]).to(tl.int64) * N + cols_n[None, :]
        tl.store(part_ptr + part, acc, mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _sum_partials(part_ptr, rows, row, N, cols, mask, SPLITS: tl.constexpr):
        """``part[0, row, cols] + ... + part[SPLITS - 1, row, cols]``, in split order, float32."""
        total = tl.load(part_ptr + row.to(tl.int64) * N + cols, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLITS):
            total += tl.load(part_ptr + (s * rows + row).to(tl.int64) * N + cols, mask=mask, other=0.0)
        return total

    @triton.jit(do_not_specialize=["rows"])
    def _splitk_partial_kernel(
        a_ptr, w_ptr, part_ptr, rows, N, K, stride_a, stride_w,
        K_SPLIT: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Program ``(m block, n block, split)``: ``a[rows, ks] @ w[cols, ks]^T`` over its split's K columns,
        float32, stored at ``part[split, rows, cols]`` (``[SPLITS, rows, N]``)."""
        # program 0 fastest: the row blocks of one weight slab run side by side (L2)
        rows_m, mask_m, cols_n, mask_n = _tile_rows_cols(tl.program_id(0), tl.program_id(1), rows, N, BLOCK_M, BLOCK_N)
        split = tl.program_id(2)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_lo = split * K_SPLIT
        for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
            cols_k = k0 + offs_k
            a = tl.load(a_ptr + rows_m[:, None] * stride_a + cols_k[None, :], mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptr + cols_n[None, :] * stride_w + cols_k[:, None], mask=mask_n[None, :], other=0.0)
            acc = _mma(a, w, acc, INTERPRET, IEEE)  # [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]
        _store_partial(part_ptr, acc, split, rows, rows_m, mask_m, cols_n, mask_n, N)

    @triton.jit(do_not_specialize=["rows"])
    def _splitk_sum_kernel(part_ptr, x_ptr, out_ptr, rows, N, stride_x, stride_o, SPLITS: tl.constexpr,
                           ADD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """``out[r, c] = round(x[r, c] + part[0, r, c] + ... + part[SPLITS - 1, r, c])`` (``x`` with ``ADD``), the
        partials summed in split order in float32, one rounding."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        total = _sum_partials(part_ptr, rows, row, N, cols, mask, SPLITS)
        if ADD:
            total = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32) + total
        y = _round(total, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, y, mask=mask)


SUM_BLOCK = 1024  # columns a program of the sum kernel takes


def _check(a: torch.Tensor, weight: torch.Tensor, config: SplitKConfig, what: str) -> None:
    check_linear(a, weight, what)  # `linear_triton`'s: triton present, shapes, one dtype, a contiguous weight
    k = weight.shape[1]
    if k % (config.splits * config.block_k):
        raise ValueError(
            f"{what}: K={k} is not {config.splits} splits of whole {config.block_k}-column steps; pass a SplitKConfig "
            "whose splits * block_k divides K"
        )


def _run(a: torch.Tensor, weight: torch.Tensor, x: torch.Tensor | None, out: torch.Tensor, config: SplitKConfig):
    rows, k = a.shape
    n = weight.shape[0]
    if rows == 0:
        return
    a = a if a.stride(1) == 1 else a.contiguous()
    part = torch.empty((config.splits, rows, n), dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(rows, config.block_m), triton.cdiv(n, config.block_n), config.splits)
    _splitk_partial_kernel[grid](
        a, weight, part, rows, n, k, a.stride(0), weight.stride(0),
        K_SPLIT=k // config.splits, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", IEEE=a.dtype == torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    _splitk_sum_kernel[(rows, triton.cdiv(n, SUM_BLOCK))](
        part, out if x is None else x, out, rows, n, 0 if x is None else x.stride(0), out.stride(0),
        SPLITS=config.splits, ADD=x is not None, BLOCK=SUM_BLOCK, num_warps=4,
    )  # fmt: skip


def splitk_linear(a: torch.Tensor, weight: torch.Tensor, *, config: SplitKConfig | None = None) -> torch.Tensor:
    """``a [T, K] @ weight[N, K]^T -> [T, N]`` in ``a``'s dtype, each row bitwise independent of ``T``."""
    config = config or splitk_config(weight.shape[0], weight.shape[1], weight.dtype)
    _check(a, weight, config, "splitk_linear")
    out = torch.empty((a.shape[0], weight.shape[0]), dtype=a.dtype, device=a.device)
    _run(a, weight, None, out, config)
    return out


def splitk_linear_add(
    x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, *, config: SplitKConfig | None = None
) -> torch.Tensor:
    """``x += a @ weight^T`` in place (`kernels.linear_add`'s contract: the sum rounded once), returns ``x``."""
    config = config or splitk_config(weight.shape[0], weight.shape[1], weight.dtype)
    _check(a, weight, config, "splitk_linear_add")
    check_add_target(x, a, weight.shape[0], "splitk_linear_add")
    _run(a, weight, x, x, config)
    return x


def check_add_target(x: torch.Tensor, a: torch.Tensor, n: int, what: str) -> None:
    """``x`` of an in-place ``x += a @ W^T`` (``W``: ``n`` rows): ``[T, n]`` in ``a``'s dtype, contiguous rows."""
    if x.shape != (a.shape[0], n) or x.dtype != a.dtype or x.stride(1) != 1:
        raise ValueError(
            f"{what}: x must be a [{a.shape[0]}, {n}] {a.dtype} tensor with a contiguous last dimension; got "
            f"{tuple(x.shape)} {x.dtype} with strides {x.stride()}"
        )
