"""Weight-only int8 GEMMs for a draft model: ``a [T, K] @ (q [N, K] * scale [N, 1])^T`` reading one byte a weight.

Why: at the Llama-3-8B shape an EAGLE-3 head's step is five GEMMs over ~0.55 GB of bfloat16 weights (QKV, O,
gate-up, down, a 32,000-row LM head) and little else, at a decode's few rows: the head's time is the time it
takes to read its weights. A 32-node tree drafts 5 levels a cycle, so on an H100 the head takes ~1.5 ms of a
~8.5 ms cycle whose verify is a ~6.3 ms decode step (bench/results/scale_profile-H100-20261126-eefbb4f). Stored as int8
the weights are half the bytes. A draft may be approximate (the verify decides every token, so the output is
the target's whatever the draft computes); what int8 costs is acceptance, which the real model measures
(``bench/gpu_bench.py --parts real``: tau with the head in its dtype and in int8).

**The format** is `drafters.eagle_storage`'s ``int8-rowwise`` storage (symmetric, one float32 scale per output
row), so a head shipped in that storage runs on about the integers it was stored as: `Int8Rowwise.from_weight`
quantizes the head's loaded (dequantized, bfloat16) weight again, which gives back the stored integers but where
bfloat16's rounding (2^-9 of a value and of its row's largest) crosses half a step: one step off, on ~4 values in
10,000 (tests/kernels/test_int8_linear.py).

**The kernel.** Program ``(n block, m block, split)`` loads its rows' activations and the weight's int8 tile,
widens the integers to the activations' dtype (every int8 is exact in bfloat16, float16 and float32), multiplies
on the tensor cores (float32 activations: IEEE products, as `linear_triton`) with float32 accumulation over its
split's ``K / SPLITS`` columns, and either (one split) applies the rows' scales, adds into ``x`` when asked and
rounds once, or stores the float32 partial for a second kernel (the partials summed in split order, then
scaled, added, rounded). No atomics: the result is a function of the inputs (deterministic),
though not of a row alone (the tile depends on the row count: a draft's rows need not agree with themselves in
other batches; the target's must, and never come here).

The torch reference (`int8_linear_torch`): float32 products of the widened integers, scaled, rounded to the
activations' dtype; the kernel agrees with it within float32 summation order.
"""

from __future__ import annotations

import os

import attrs
import torch

from ..drafters.eagle_storage import quantize_rowwise

try:
    import triton
    import triton.language as tl

    from .linear_triton import _mma, _round
except ImportError:  # pragma: no cover - installs without triton use the torch reference
    triton = None

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activations (every int8 value is exact in each)


@attrs.frozen(eq=False)
class Int8Rowwise:
    """An ``[N, K]`` weight as int8 ``q`` and a float32 ``scale`` per output row: ``W ~= q * scale[:, None]``."""

    q: torch.Tensor
    scale: torch.Tensor

    def __attrs_post_init__(self) -> None:
        if self.q.dtype != torch.int8 or self.q.dim() != 2 or self.q.stride(1) != 1:
            raise ValueError(f"Int8Rowwise: q must be a 2-D int8 tensor with a contiguous last dimension; got "
                             f"{self.q.dtype} {tuple(self.q.shape)} strides {self.q.stride()}")  # fmt: skip
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.q.shape[0],):
            raise ValueError(f"Int8Rowwise: scale must be float32 [{self.q.shape[0]}]; got {self.scale.dtype} "
                             f"{tuple(self.scale.shape)}")  # fmt: skip
        if self.scale.device != self.q.device:
            raise ValueError(f"Int8Rowwise: q on {self.q.device}, scale on {self.scale.device}")

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Int8Rowwise:
        """`eagle_storage.quantize_rowwise` of a floating ``[N, K]`` weight, on its device."""
        q, scale = quantize_rowwise(weight)
        return cls(q, scale)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)


@attrs.frozen
class Int8Config:
    """Tile and launch of one GEMM: ``splits`` must cut ``K`` into whole ``block_k`` steps."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 4


# Launches of at least this many programs (one row block) stream the weight in 128-column K steps, 3 stages, one split;
# fewer programs take 256-column steps, 5 stages, and K in 2 splits once it reaches `SPLIT_K` columns.
WIDE_PROGRAMS = 512
SPLIT_K = 8192


def int8_config(rows: int, n: int, k: int) -> Int8Config:
    """The tile for ``rows`` rows of an ``[N, K]`` weight: 32 columns a program; 16 rows a block up to 16 (a draft's
    steps), 32 up to 32, 64 above (a prefill's extend).

    From `bench/int8_linear_bench.py --sweep` on an H100 (an 8B-shaped EAGLE-3 head, cold weights, 1 and 4 rows; 108
    tiles of ``block_n`` 32 / 64 / 128, ``block_k`` 128 / 256 / 512, 1 / 2 / 4 splits, 4 / 8 warps, 3 / 5 stages;
    bench/results/int8_linear_bench-H100-4585721-sweep-*): the wide weights (gate-up 896 programs, the LM head 1,000)
    were fastest at 32 x 128 with 3 stages (44.9 / 49.4 µs against 60 / 61 at 32 x 256), the narrow ones (128-192
    programs) at 32 x 256 with 5 stages, K split in 2 for the QKV (K 8,192), the down (14,336) and the fc (12,288):
    23.8 / 25.8 / 23.3 µs; the O (K 4,096) unsplit: 9.9 µs. Each within 1 µs of its best tile.
    """
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = max(16, min(32, triton.next_power_of_2(n)))
    programs = triton.cdiv(n, block_n)
    if programs >= WIDE_PROGRAMS or block_m == 64:
        block_k, stages, splits = 128, 3, 1
    else:
        block_k, stages = 256, 5
        splits = 2 if k >= SPLIT_K and k % (2 * block_k) == 0 else 1
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    return Int8Config(block_m=block_m, block_n=block_n, block_k=block_k, splits=splits, num_warps=4,
                      num_stages=stages)  # fmt: skip


# ---- the torch reference -------------------------------------------------------------------------
def int8_linear_torch(
    a: torch.Tensor, weight: Int8Rowwise, out_dtype: torch.dtype | None = None, x: torch.Tensor | None = None
) -> torch.Tensor:
    """``round(x + (a @ q^T) * scale)`` in ``a``'s dtype (``x``: added in float32 before the one rounding, and
    written in place), widened to ``out_dtype`` when given."""
    y = (a.float() @ weight.q.float().t()) * weight.scale
    if x is not None:
        return x.copy_((x.float() + y).to(x.dtype))
    y = y.to(a.dtype)
    return y if out_dtype is None else y.to(out_dtype)


# ---- the kernels ---------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _tile_rows_cols(pid_m, pid_n, rows, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A program's rows and output columns, with their masks."""
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

    @triton.jit
    def _to_activation(y, ACT: tl.constexpr):
        """``y`` rounded to the activations' dtype (``ACT``: 0 float32, 1 bfloat16, 2 float16), kept in float32: a
        float32 output (an LM head's logits) is the activations' rounding widened, written by this kernel."""
        if ACT == 1:
            return _round(y, tl.bfloat16).to(tl.float32)
        elif ACT == 2:
            return y.to(tl.float16).to(tl.float32)
        else:
            return y

    @triton.jit
    def _int8_linear_kernel(
        a_ptr, q_ptr, s_ptr, x_ptr, out_ptr, part_ptr, rows, N, K, stride_a, stride_q, stride_x, stride_o, k_split,
        SPLITS: tl.constexpr, ADD: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr,
        ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Program ``(n block, m block, split)`` (``n`` fastest: the programs of one weight slab's rows run
        side by side, and a launch of one row block streams the weight in order)."""
        rows_m, mask_m, cols_n, mask_n = _tile_rows_cols(tl.program_id(1), tl.program_id(0), rows, N, BLOCK_M, BLOCK_N)
        split = tl.program_id(2)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_lo = split * k_split
        for k0 in range(k_lo, k_lo + k_split, BLOCK_K):
            cols_k = k0 + offs_k
            if EVEN_K:
                a = tl.load(a_ptr + rows_m[:, None] * stride_a + cols_k[None, :], mask=mask_m[:, None], other=0.0)
                w = tl.load(q_ptr + cols_n[None, :] * stride_q + cols_k[:, None], mask=mask_n[None, :], other=0)
            else:
                mask_k = cols_k < K
                a = tl.load(a_ptr + rows_m[:, None] * stride_a + cols_k[None, :],
                            mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
                w = tl.load(q_ptr + cols_n[None, :] * stride_q + cols_k[:, None],
                            mask=mask_n[None, :] & mask_k[:, None], other=0)  # fmt: skip
            if INTERPRET:  # the interpreter's int8 -> bfloat16 cast is not exact: float32 (as `_mma` goes anyway)
                w = w.to(tl.float32)
            else:
                w = w.to(a.dtype)
            acc = _mma(a, w, acc, INTERPRET, IEEE)  # [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]
        if SPLITS == 1:
            y = acc * tl.load(s_ptr + cols_n, mask=mask_n, other=0.0)[None, :]
            mask = mask_m[:, None] & mask_n[None, :]
            if ADD:
                x = tl.load(x_ptr + rows_m[:, None].to(tl.int64) * stride_x + cols_n[None, :], mask=mask, other=0.0)
                y = x.to(tl.float32) + y
            tl.store(out_ptr + rows_m[:, None].to(tl.int64) * stride_o + cols_n[None, :],
                     _round(_to_activation(y, ACT), out_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        else:
            _store_partial(part_ptr, acc, split, rows, rows_m, mask_m, cols_n, mask_n, N)

    @triton.jit
    def _int8_sum_kernel(part_ptr, s_ptr, x_ptr, out_ptr, rows, N, stride_x, stride_o, SPLITS: tl.constexpr,
                         ADD: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """``out[r, c] = round(x[r, c] + (part[0, r, c] + ... + part[SPLITS - 1, r, c]) * scale[c])``."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        y = _sum_partials(part_ptr, rows, row, N, cols, mask, SPLITS) * tl.load(s_ptr + cols, mask=mask, other=0.0)
        if ADD:
            y = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32) + y
        y = _round(_to_activation(y, ACT), out_ptr.dtype.element_ty)
        tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, y, mask=mask)


SUM_BLOCK = 1024  # columns a program of the sum kernel takes
ACT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernels' ``ACT``


def _check(a: torch.Tensor, weight: Int8Rowwise, config: Int8Config, what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what} needs triton (pip install triton); use int8_linear_torch without it")
    if not isinstance(weight, Int8Rowwise):
        raise TypeError(f"{what}: the weight must be an Int8Rowwise, not {type(weight).__name__}")
    if a.dim() != 2 or a.shape[1] != weight.shape[1]:
        raise ValueError(f"{what}: a must be [T, {weight.shape[1]}] for an {list(weight.shape)} weight; got "
                         f"{tuple(a.shape)}")  # fmt: skip
    if a.dtype not in DTYPES:
        raise ValueError(f"{what}: activations must be one of {DTYPES}; got {a.dtype}")
    if a.device != weight.device:
        raise ValueError(f"{what}: activations on {a.device}, weight on {weight.device}")
    k = weight.shape[1]
    if config.splits > 1 and k % (config.splits * config.block_k):
        raise ValueError(f"{what}: K={k} is not {config.splits} splits of whole {config.block_k}-column steps")


def check_add_target(x: torch.Tensor, a: torch.Tensor, n: int, what: str) -> None:
    """``x`` of an in-place ``x += a @ W^T`` (``W``: ``n`` rows): ``[T, n]`` in ``a``'s dtype, contiguous rows."""
    if x.shape != (a.shape[0], n) or x.dtype != a.dtype or x.stride(1) != 1:
        raise ValueError(
            f"{what}: x must be a [{a.shape[0]}, {n}] {a.dtype} tensor with a contiguous last dimension; got "
            f"{tuple(x.shape)} {x.dtype} with strides {x.stride()}"
        )


def _run(a, weight: Int8Rowwise, x, out, config: Int8Config) -> None:
    rows, k = a.shape
    n = weight.shape[0]
    if rows == 0:
        return
    a = a if a.stride(1) == 1 else a.contiguous()
    splits = config.splits
    part = torch.empty((splits, rows, n), dtype=torch.float32, device=a.device) if splits > 1 else out
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(rows, config.block_m), splits)
    k_split = k // splits if splits > 1 else triton.cdiv(k, config.block_k) * config.block_k
    _int8_linear_kernel[grid](
        a, weight.q, weight.scale, out if x is None else x, out, part, rows, n, k, a.stride(0), weight.q.stride(0),
        0 if x is None else x.stride(0), out.stride(0), k_split,
        SPLITS=splits, ADD=x is not None, EVEN_K=k % config.block_k == 0,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", IEEE=a.dtype == torch.float32, ACT=ACT_CODES[a.dtype],
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        _int8_sum_kernel[(rows, triton.cdiv(n, SUM_BLOCK))](
            part, weight.scale, out if x is None else x, out, rows, n, 0 if x is None else x.stride(0), out.stride(0),
            SPLITS=splits, ADD=x is not None, ACT=ACT_CODES[a.dtype], BLOCK=SUM_BLOCK, num_warps=4,
        )  # fmt: skip


def int8_linear_triton(
    a: torch.Tensor, weight: Int8Rowwise, out_dtype: torch.dtype | None = None, *, config: Int8Config | None = None
) -> torch.Tensor:
    """``a [T, K] @ W^T -> [T, N]``, rounded to ``a``'s dtype and stored as ``out_dtype`` (that dtype, the default,
    or float32: the rounding widened, by the kernel)."""
    config = config or int8_config(a.shape[0], weight.shape[0], weight.shape[1])
    _check(a, weight, config, "int8_linear")
    if out_dtype not in (None, a.dtype, torch.float32):
        raise ValueError(f"int8_linear: out_dtype must be the activations' dtype or float32; got {out_dtype}")
    out = torch.empty((a.shape[0], weight.shape[0]), dtype=out_dtype or a.dtype, device=a.device)
    _run(a, weight, None, out, config)
    return out


def int8_linear_add_triton(
    x: torch.Tensor, a: torch.Tensor, weight: Int8Rowwise, *, config: Int8Config | None = None
) -> torch.Tensor:
    """``x += a @ W^T`` in place, the sum rounded once (`kernels.fused_ops.linear_add`'s contract); returns ``x``."""
    config = config or int8_config(a.shape[0], weight.shape[0], weight.shape[1])
    _check(a, weight, config, "int8_linear_add")
    check_add_target(x, a, weight.shape[0], "int8_linear_add")
    _run(a, weight, x, x, config)
    return x


def _triton_here(a: torch.Tensor) -> bool:
    return triton is not None and (a.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def int8_linear(a: torch.Tensor, weight: Int8Rowwise, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The kernel on CUDA (or under the interpreter), the torch reference elsewhere."""
    if _triton_here(a):
        return int8_linear_triton(a, weight, out_dtype)
    return int8_linear_torch(a, weight, out_dtype)


def int8_linear_add(x: torch.Tensor, a: torch.Tensor, weight: Int8Rowwise) -> torch.Tensor:
    """``x += a @ W^T`` in place: the kernel on CUDA (or under the interpreter), the torch reference elsewhere."""
    if _triton_here(a):
        return int8_linear_add_triton(x, a, weight)
    return int8_linear_torch(a, weight, x=x)


def compile_specs() -> list[tuple[object, dict[str, str], list[dict[str, object]], tuple[str, ...]]]:
    """The kernels at an 8B-shaped EAGLE-3 head's tiles (`int8_config`), one split and two, plain and adding, for
    `engine.kernels.compile_check`: (kernel, argument types, constexpr sets, arguments the JIT marks 16-divisible)."""
    out = []
    for dt in ("bf16", "fp32"):
        p = "*" + dt
        strides = ("stride_a", "stride_q", "stride_x", "stride_o")
        signature = dict(a_ptr=p, q_ptr="*i8", s_ptr="*fp32", x_ptr=p, out_ptr=p, part_ptr="*fp32", rows="i32",
                         N="i32", K="i32", **{name: "i32" for name in strides}, k_split="i32")  # fmt: skip
        aligned = ("a_ptr", "q_ptr", "s_ptr", "x_ptr", "out_ptr", "part_ptr", "N", "K", *strides, "k_split")
        sets = []
        for rows, n, k, add in ((4, 6144, 8192, False), (4, 4096, 4096, True), (4, 28672, 4096, False),
                                (4, 4096, 14336, True), (1, 32000, 4096, False), (32, 4096, 12288, False)):  # fmt: skip
            c = int8_config(rows, n, k)
            sets.append(dict(SPLITS=c.splits, ADD=add, EVEN_K=True, INTERPRET=False, IEEE=dt == "fp32",
                             ACT=1 if dt == "bf16" else 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                             BLOCK_K=c.block_k))  # fmt: skip
        out.append((_int8_linear_kernel, signature, sets, aligned))
        if dt == "bf16":  # the draft LM head's float32 logits
            c = int8_config(4, 32000, 4096)
            wide = dict(signature, out_ptr="*fp32", part_ptr="*fp32")
            lm_head = dict(SPLITS=1, ADD=False, EVEN_K=True, INTERPRET=False, IEEE=False, ACT=1, BLOCK_M=c.block_m,
                           BLOCK_N=c.block_n, BLOCK_K=c.block_k)  # fmt: skip
            out.append((_int8_linear_kernel, wide, [lm_head], aligned))
        out.append((_int8_sum_kernel,
                    dict(part_ptr="*fp32", s_ptr="*fp32", x_ptr=p, out_ptr=p, rows="i32", N="i32", stride_x="i32",
                         stride_o="i32"),
                    [dict(SPLITS=2, ADD=add, ACT=1 if dt == "bf16" else 0, BLOCK=SUM_BLOCK) for add in (False, True)],
                    ("part_ptr", "s_ptr", "x_ptr", "out_ptr", "N", "stride_x", "stride_o")))  # fmt: skip
    return out
