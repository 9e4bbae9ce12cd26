"""Weight-only int4 GEMVs for a draft model: ``a [T, K] @ W^T`` with ``W`` in 4-bit groups, half a byte a weight.

Why: `int8_linear` halved the bytes of an 8B-shaped EAGLE-3 head's step (281 -> 153 µs a draft level on an H100),
and at a chain's one row a draft level still takes the time it takes to read its weights. A chain of 4 drafts
four head steps a cycle (the extend and three levels), ~0.6 ms of int8 GEMMs against a ~6.3 ms verify; 4 bits a
weight halve them again. Coarser weights draft worse, and a draft may be approximate (the verify decides every
token, so the output is the target's whatever the draft computes): what int4 costs is acceptance, measured on the
real model (docs/fast_engine.md).

**The format** (`Int4Grouped`): symmetric round-to-nearest over groups of ``group`` consecutive input columns of a
row (128 where ``K`` allows, else 64 or 32), one bfloat16 scale a group (``absmax / 7``; the integers -7..7, stored
as ``q + 8`` in a nibble). A group of ``G`` columns is ``G / 8`` int32 words; word ``w`` of a group holds columns
``j * G / 8 + w`` for ``j = 0..7`` in its nibbles ``j`` (bits ``4j..4j+3``), so the ``j``-th values of a program's
words meet ``G / 8`` consecutive activations (one vector load).

**The kernel** (CUDA cores, no tensor cores): program ``(n block, split, row block)`` loads a ``[BLOCK_N, G / 8]``
tile of words a group and unpacks each word into eight float32 values ``128 + nibble`` (on a GPU by PTX: a shift
and a ``lop3`` that puts the nibble into the mantissa of float32 128; under the interpreter by shifts and masks, the
same values). Each of up to four rows multiplies them by its activations in float32, subtracts ``136 * (sum of the
group's activations)`` (the ``128 + 8`` offset), scales by the group's scale and accumulates. The weights stay in
registers: the tensor-core forms tried before (session 21) spent their time moving unpacked tiles through shared
memory. One split stores ``round(x + acc)``, more store float32 partials that `int8_linear`'s sum kernel adds in
split order (deterministic, no atomics). Rows past four take more row blocks, each reading the weights again: for
a chain's draft (one row a level) and its extends (a few), not for trees.

The torch reference (`int4_linear_torch`): the same group-by-group float32 products, scaled and summed in group
order, rounded once; the kernel agrees with it within float32 summation order.
"""

from __future__ import annotations

import os

import attrs
import torch

from .int8_linear import ACT_CODES, DTYPES, SUM_BLOCK
from .splitk_linear import check_add_target

try:
    import triton
    import triton.language as tl

    from .int8_linear import _int8_sum_kernel, _store_tile
    from .splitk_linear import _store_partial
except ImportError:  # pragma: no cover - installs without triton use the torch reference
    triton = None

GROUPS = (128, 64, 32)  # group sizes, largest first: `Int4Grouped.from_weight` takes the first that divides K
QMAX = 7  # symmetric: the integers -7..7 (the nibble's -8 is never stored)
MAX_ROWS = 4  # rows a program multiplies (more rows: more row blocks)


def group_size(k: int) -> int:
    """The largest of `GROUPS` dividing ``k``; refused (with what would do) if none does."""
    for g in GROUPS:
        if k % g == 0:
            return g
    raise ValueError(f"int4 weights need K divisible by {GROUPS[-1]}; got K={k} (use int8 or the head's dtype)")


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> ``(packed [N, K / 8] int32, scale [K / group, N] bfloat16)``: symmetric per group, the
    integers rounded against the stored (bfloat16) scale; an all-zero group gets scale 1. The scales are stored a
    group's row at a time, so a program's columns read theirs in one coalesced load."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    scale = w.abs().amax(dim=2) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, :, None]).clamp_(-QMAX, QMAX).to(torch.int64) + 8  # 1..15
    nibbles = q.reshape(n, k // group, 8, group // 8)  # [.., j, word]: column j * G / 8 + word
    shifts = (4 * torch.arange(8, device=q.device, dtype=torch.int64))[None, None, :, None]
    words = (nibbles << shifts).sum(dim=2)  # [N, K / G, G / 8], 0 .. 2^32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.reshape(n, k // 8).contiguous(), scale.t().contiguous()


@attrs.frozen(eq=False)
class Int4Grouped:
    """An ``[N, K]`` weight in 4-bit groups (`quantize_int4`): ``packed [N, K / 8]`` int32 words and a bfloat16
    ``scale`` ``[K / group, N]``."""

    packed: torch.Tensor
    scale: torch.Tensor
    group: int

    def __attrs_post_init__(self) -> None:
        p, s, g = self.packed, self.scale, self.group
        if g not in GROUPS:
            raise ValueError(f"Int4Grouped: group must be one of {GROUPS}; got {g}")
        if p.dtype != torch.int32 or p.dim() != 2 or p.stride(1) != 1 or (8 * p.shape[1]) % g:
            raise ValueError(
                f"Int4Grouped: packed must be a 2-D int32 tensor with a contiguous last dimension of "
                f"whole {g // 8}-word groups; got {p.dtype} {tuple(p.shape)}, strides {p.stride()}"
            )
        want = (8 * p.shape[1] // g, p.shape[0])
        if s.dtype != torch.bfloat16 or tuple(s.shape) != want or s.stride(1) != 1:
            raise ValueError(f"Int4Grouped: scale must be bfloat16 {list(want)}, contiguous; got {s.dtype} "
                             f"{tuple(s.shape)}")  # fmt: skip
        if s.device != p.device:
            raise ValueError(f"Int4Grouped: packed on {p.device}, scale on {s.device}")

    @classmethod
    def from_weight(cls, weight: torch.Tensor, group: int | None = None) -> Int4Grouped:
        """`quantize_int4` of a floating ``[N, K]`` weight, on its device (``group``: `group_size` of K unless
        given)."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"int4 quantization takes a 2-D float weight, not {weight.dtype} {list(weight.shape)}")
        group = group or group_size(weight.shape[1])
        if weight.shape[1] % group:
            raise ValueError(f"int4 groups of {group} do not divide K={weight.shape[1]}")
        return cls(*quantize_int4(weight, group), group)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], 8 * self.packed.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return 4 * self.packed.numel() + 2 * self.scale.numel()

    def integers(self) -> torch.Tensor:
        """The stored integers ``[N, K]`` (int8, -7..7)."""
        n, k = self.shape
        g = self.group
        words = self.packed.to(torch.int64).reshape(n, k // g, 1, g // 8)
        shifts = (4 * torch.arange(8, device=words.device, dtype=torch.int64))[None, None, :, None]
        return (((words >> shifts) & 15) - 8).reshape(n, k).to(torch.int8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.integers().float().reshape(self.shape[0], -1, self.group)
        return (q * self.scale.float().t()[:, :, None]).reshape(self.shape).to(dtype)


@attrs.frozen
class Int4Config:
    """Launch of one GEMV: ``block_n`` output columns a program, a K step of ``groups`` whole groups, ``splits`` of
    K (each whole steps)."""

    block_n: int = 64
    groups: int = 1
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 1
    prefetch: bool = False


# Programs a launch wants before K is split: fewer column blocks than this take 2, 4 or 8 splits of K.
WIDE_PROGRAMS = 264  # two a multiprocessor on an H100


def int4_config(rows: int, n: int, k: int, group: int) -> Int4Config:
    """The launch for ``rows`` rows of an ``[N, K]`` weight in groups of ``group``: 64 columns a program (32 for
    narrow N), K split until the launch has `WIDE_PROGRAMS` programs or a split would hold under 8 groups."""
    block_n = 64 if n >= 64 * WIDE_PROGRAMS // 4 else 32
    steps = k // group
    splits = 1
    while triton.cdiv(n, block_n) * splits < WIDE_PROGRAMS and steps % (2 * splits) == 0 and steps // (2 * splits) >= 8:
        splits *= 2
    return Int4Config(block_n=block_n, groups=1, splits=splits)


# ---- the torch reference -------------------------------------------------------------------------
def int4_linear_torch(
    a: torch.Tensor, weight: Int4Grouped, out_dtype: torch.dtype | None = None, x: torch.Tensor | None = None
) -> torch.Tensor:
    """``round(x + sum_g (a_g @ q_g^T) * scale_g)`` in ``a``'s dtype, group by group in float32 (``x``: added in
    float32 before the one rounding, and written in place), widened to ``out_dtype`` when given."""
    n, k = weight.shape
    g = weight.group
    q = weight.integers().float().reshape(n, k // g, g)
    a_g = a.float().reshape(a.shape[0], k // g, g)
    y = (torch.einsum("tgk,ngk->tgn", a_g, q) * weight.scale.float()[None]).sum(dim=1)
    if x is not None:
        return x.copy_((x.float() + y).to(x.dtype))
    y = y.to(a.dtype)
    return y if out_dtype is None else y.to(out_dtype)


# ---- the kernel ----------------------------------------------------------------------------------
# A word's eight nibbles to float32 ``128 + nibble`` on the GPU: nibble j is shifted to bits 16..19 and lop3 keeps
# it and ORs in 0x43000000 (float32 128, whose mantissa bit 16 weighs 1): exact, 15 instructions for 8 weights.
_UNPACK_ASM = """
{
.reg .b32 m, c, t;
mov.b32 m, 0x000F0000;
mov.b32 c, 0x43000000;
shl.b32 t, $8, 16;
lop3.b32 $0, t, m, c, 0xEA;
shl.b32 t, $8, 12;
lop3.b32 $1, t, m, c, 0xEA;
shl.b32 t, $8, 8;
lop3.b32 $2, t, m, c, 0xEA;
shl.b32 t, $8, 4;
lop3.b32 $3, t, m, c, 0xEA;
lop3.b32 $4, $8, m, c, 0xEA;
shr.b32 t, $8, 4;
lop3.b32 $5, t, m, c, 0xEA;
shr.b32 t, $8, 8;
lop3.b32 $6, t, m, c, 0xEA;
shr.b32 t, $8, 12;
lop3.b32 $7, t, m, c, 0xEA;
}
"""

if triton is not None:
    UNPACK_ASM = tl.constexpr(_UNPACK_ASM)

    @triton.jit
    def _unpack(w, ASM: tl.constexpr):
        """A ``[BLOCK_N, WG]`` tile of words -> its eight float32 tiles ``128 + nibble j``."""
        if ASM:
            return tl.inline_asm_elementwise(
                UNPACK_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 8, is_pure=True, pack=1
            )
        else:
            return (
                (w & 15).to(tl.float32) + 128.0,
                ((w >> 4) & 15).to(tl.float32) + 128.0,
                ((w >> 8) & 15).to(tl.float32) + 128.0,
                ((w >> 12) & 15).to(tl.float32) + 128.0,
                ((w >> 16) & 15).to(tl.float32) + 128.0,
                ((w >> 20) & 15).to(tl.float32) + 128.0,
                ((w >> 24) & 15).to(tl.float32) + 128.0,
                ((w >> 28) & 15).to(tl.float32) + 128.0,
            )

    @triton.jit
    def _group_row(a_row, kg, offs, ok, v0, v1, v2, v3, v4, v5, v6, v7, WG: tl.constexpr):
        """One row's products with a group's unpacked words: ``[BLOCK_N, WG]`` float32, the offset taken off."""
        x0 = tl.load(a_row + kg + offs, mask=ok, other=0.0).to(tl.float32)
        x1 = tl.load(a_row + kg + WG + offs, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(a_row + kg + 2 * WG + offs, mask=ok, other=0.0).to(tl.float32)
        x3 = tl.load(a_row + kg + 3 * WG + offs, mask=ok, other=0.0).to(tl.float32)
        x4 = tl.load(a_row + kg + 4 * WG + offs, mask=ok, other=0.0).to(tl.float32)
        x5 = tl.load(a_row + kg + 5 * WG + offs, mask=ok, other=0.0).to(tl.float32)
        x6 = tl.load(a_row + kg + 6 * WG + offs, mask=ok, other=0.0).to(tl.float32)
        x7 = tl.load(a_row + kg + 7 * WG + offs, mask=ok, other=0.0).to(tl.float32)
        t = v0 * x0[None, :] + v1 * x1[None, :] + v2 * x2[None, :] + v3 * x3[None, :]
        t += v4 * x4[None, :] + v5 * x5[None, :] + v6 * x6[None, :] + v7 * x7[None, :]
        return t - 136.0 * (((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)))[None, :]

    @triton.jit
    def _group_step(a0, kg, offs, ok0, ok1, ok2, ok3, w, s, stride_a, acc0, acc1, acc2, acc3, ASM: tl.constexpr,
                    ROWS: tl.constexpr, WG: tl.constexpr):  # fmt: skip
        """A group's words ``w`` and scales ``s`` into the block's (up to four) rows' accumulators."""
        v0, v1, v2, v3, v4, v5, v6, v7 = _unpack(w, ASM)
        acc0 += _group_row(a0, kg, offs, ok0, v0, v1, v2, v3, v4, v5, v6, v7, WG) * s[:, None]
        if ROWS > 1:
            acc1 += _group_row(a0 + stride_a, kg, offs, ok1, v0, v1, v2, v3, v4, v5, v6, v7, WG) * s[:, None]
        if ROWS > 2:
            acc2 += _group_row(a0 + 2 * stride_a, kg, offs, ok2, v0, v1, v2, v3, v4, v5, v6, v7, WG) * s[:, None]
            acc3 += _group_row(a0 + 3 * stride_a, kg, offs, ok3, v0, v1, v2, v3, v4, v5, v6, v7, WG) * s[:, None]
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _row_out(acc, r, rows, cols_n, mask_n, x_ptr, out_ptr, part_ptr, split, N, stride_x, stride_o,
                 SPLITS: tl.constexpr, ADD: tl.constexpr, ACT: tl.constexpr):  # fmt: skip
        y = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
        rows_m = r + tl.arange(0, 1)
        mask_m = rows_m < rows
        if SPLITS == 1:
            _store_tile(y, x_ptr, out_ptr, rows_m, mask_m, cols_n, mask_n, stride_x, stride_o, ADD, ACT)
        else:
            _store_partial(part_ptr, y, split, rows, rows_m, mask_m, cols_n, mask_n, N)

    @triton.jit
    def _int4_gemv_kernel(
        a_ptr, q_ptr, s_ptr, x_ptr, out_ptr, part_ptr, rows, N, stride_a, stride_q, stride_s, stride_x, stride_o,
        k_split, SPLITS: tl.constexpr, ADD: tl.constexpr, ASM: tl.constexpr, ACT: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr, PREFETCH: tl.constexpr,
    ):  # fmt: skip
        """Program ``(n block, split, row block)``: its split's ``k_split`` columns in steps of ``GROUPS`` groups, up
        to ``ROWS`` (1..4) rows from ``row block * ROWS``."""
        WG: tl.constexpr = GROUP // 8
        cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = cols_n < N
        split = tl.program_id(1)
        r0 = tl.program_id(2) * ROWS
        offs = tl.arange(0, WG)
        q_rows = q_ptr + cols_n[:, None].to(tl.int64) * stride_q + offs[None, :]
        a0 = a_ptr + r0.to(tl.int64) * stride_a
        ok0 = offs * 0 + r0 < rows  # [WG]: row 0 of the block is a row
        ok1 = offs * 0 + r0 + 1 < rows  # [WG]: row 1 of the block is a row
        ok2 = offs * 0 + r0 + 2 < rows  # [WG]: row 2 of the block is a row
        ok3 = offs * 0 + r0 + 3 < rows  # [WG]: row 3 of the block is a row
        acc0 = tl.zeros([BLOCK_N, WG], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, WG], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, WG], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, WG], dtype=tl.float32)
        k_lo = split * k_split
        k_hi = k_lo + k_split
        if PREFETCH:  # one group a step, the next step's words and scales loaded before this step's products
            w = tl.load(q_rows + k_lo // 8, mask=mask_n[:, None], other=0)
            s = tl.load(s_ptr + (k_lo // GROUP) * stride_s + cols_n, mask=mask_n, other=0.0)
            for kg in range(k_lo, k_hi, GROUP):
                more = cols_n * 0 + kg + GROUP < k_hi  # [BLOCK_N]: a next step
                w_next = tl.load(q_rows + (kg + GROUP) // 8, mask=(mask_n & more)[:, None], other=0)
                s_next = tl.load(s_ptr + (kg // GROUP + 1) * stride_s + cols_n, mask=mask_n & more, other=0.0)
                acc0, acc1, acc2, acc3 = _group_step(a0, kg, offs, ok0, ok1, ok2, ok3, w, s.to(tl.float32), stride_a,
                                                     acc0, acc1, acc2, acc3, ASM, ROWS, WG)  # fmt: skip
                w, s = w_next, s_next
        else:
            for k0 in range(k_lo, k_hi, GROUP * GROUPS):
                for g in tl.static_range(GROUPS):
                    kg = k0 + g * GROUP
                    w = tl.load(q_rows + kg // 8, mask=mask_n[:, None], other=0)
                    s = tl.load(s_ptr + (kg // GROUP) * stride_s + cols_n, mask=mask_n, other=0.0).to(tl.float32)
                    acc0, acc1, acc2, acc3 = _group_step(a0, kg, offs, ok0, ok1, ok2, ok3, w, s, stride_a, acc0, acc1,
                                                         acc2, acc3, ASM, ROWS, WG)  # fmt: skip
        _row_out(acc0, r0, rows, cols_n, mask_n, x_ptr, out_ptr, part_ptr, split, N, stride_x, stride_o, SPLITS, ADD,
                 ACT)  # fmt: skip
        if ROWS > 1:
            _row_out(acc1, r0 + 1, rows, cols_n, mask_n, x_ptr, out_ptr, part_ptr, split, N, stride_x, stride_o,
                     SPLITS, ADD, ACT)  # fmt: skip
        if ROWS > 2:
            _row_out(acc2, r0 + 2, rows, cols_n, mask_n, x_ptr, out_ptr, part_ptr, split, N, stride_x, stride_o,
                     SPLITS, ADD, ACT)  # fmt: skip
            _row_out(acc3, r0 + 3, rows, cols_n, mask_n, x_ptr, out_ptr, part_ptr, split, N, stride_x, stride_o,
                     SPLITS, ADD, ACT)  # fmt: skip


def _check(a: torch.Tensor, weight: Int4Grouped, config: Int4Config | None, what: str) -> Int4Config:
    """``config`` (`int4_config`'s when None) once ``a`` and ``weight`` are shown fit for it."""
    if triton is None:
        raise RuntimeError(f"{what} needs triton (pip install triton); use int4_linear_torch without it")
    if not isinstance(weight, Int4Grouped):
        raise TypeError(f"{what}: the weight must be an Int4Grouped, not {type(weight).__name__}")
    if a.dim() != 2 or a.shape[1] != weight.shape[1]:
        raise ValueError(f"{what}: a must be [T, {weight.shape[1]}] for an {list(weight.shape)} weight; got "
                         f"{tuple(a.shape)}")  # fmt: skip
    if a.dtype not in DTYPES:
        raise ValueError(f"{what}: activations must be one of {DTYPES}; got {a.dtype}")
    if a.device != weight.device:
        raise ValueError(f"{what}: activations on {a.device}, weight on {weight.device}")
    config = config or int4_config(a.shape[0], weight.shape[0], weight.shape[1], weight.group)
    step = config.groups * weight.group
    if weight.shape[1] % (config.splits * step):
        raise ValueError(f"{what}: K={weight.shape[1]} is not {config.splits} splits of whole {step}-column steps "
                         f"({config.groups} groups of {weight.group})")  # fmt: skip
    return config


def _run(a, weight: Int4Grouped, x, out, config: Int4Config) -> None:
    rows, k = a.shape
    n = weight.shape[0]
    if rows == 0:
        return
    a = a if a.stride(1) == 1 else a.contiguous()
    splits = config.splits
    part = torch.empty((splits, rows, n), dtype=torch.float32, device=a.device) if splits > 1 else out
    block_rows = 1 if rows == 1 else 2 if rows == 2 else MAX_ROWS
    grid = (triton.cdiv(n, config.block_n), splits, triton.cdiv(rows, block_rows))
    _int4_gemv_kernel[grid](
        a, weight.packed, weight.scale, out if x is None else x, out, part, rows, n, a.stride(0),
        weight.packed.stride(0), weight.scale.stride(0), 0 if x is None else x.stride(0), out.stride(0), k // splits,
        SPLITS=splits, ADD=x is not None, ASM=a.is_cuda and os.environ.get("TRITON_INTERPRET") != "1",
        ACT=ACT_CODES[a.dtype], ROWS=block_rows, BLOCK_N=config.block_n, GROUP=weight.group, GROUPS=config.groups,
        PREFETCH=config.prefetch, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        _int8_sum_kernel[(rows, triton.cdiv(n, SUM_BLOCK))](
            part, part, out if x is None else x, out, rows, n, 0 if x is None else x.stride(0), out.stride(0),
            SPLITS=splits, ADD=x is not None, ACT=ACT_CODES[a.dtype], BLOCK=SUM_BLOCK, SCALED=False, num_warps=4,
        )  # fmt: skip


def int4_linear_triton(
    a: torch.Tensor, weight: Int4Grouped, out_dtype: torch.dtype | None = None, *, config: Int4Config | None = None
) -> torch.Tensor:
    """``a [T, K] @ W^T -> [T, N]``, rounded to ``a``'s dtype and stored as ``out_dtype`` (that dtype, the default,
    or float32: the rounding widened, by the kernel)."""
    config = _check(a, weight, config, "int4_linear")
    if out_dtype not in (None, a.dtype, torch.float32):
        raise ValueError(f"int4_linear: out_dtype must be the activations' dtype or float32; got {out_dtype}")
    out = torch.empty((a.shape[0], weight.shape[0]), dtype=out_dtype or a.dtype, device=a.device)
    _run(a, weight, None, out, config)
    return out


def int4_linear_add_triton(
    x: torch.Tensor, a: torch.Tensor, weight: Int4Grouped, *, config: Int4Config | None = None
) -> torch.Tensor:
    """``x += a @ W^T`` in place, the sum rounded once (`kernels.linear_add`'s contract); returns ``x``."""
    config = _check(a, weight, config, "int4_linear_add")
    check_add_target(x, a, weight.shape[0], "int4_linear_add")
    _run(a, weight, x, x, config)
    return x


def _triton_here(a: torch.Tensor) -> bool:
    return triton is not None and (a.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def int4_linear(a: torch.Tensor, weight: Int4Grouped, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The kernel on CUDA (or under the interpreter), the torch reference elsewhere."""
    if _triton_here(a):
        return int4_linear_triton(a, weight, out_dtype)
    return int4_linear_torch(a, weight, out_dtype)


def int4_linear_add(x: torch.Tensor, a: torch.Tensor, weight: Int4Grouped) -> torch.Tensor:
    """``x += a @ W^T`` in place: the kernel on CUDA (or under the interpreter), the torch reference elsewhere."""
    if _triton_here(a):
        return int4_linear_add_triton(x, a, weight)
    return int4_linear_torch(a, weight, x=x)


def compile_specs() -> list[tuple[object, dict[str, str], list[dict[str, object]], tuple[str, ...]]]:
    """The kernel at an 8B-shaped EAGLE-3 head's launches (`int4_config`, groups of 128) and SmolLM2's (groups of
    64), 1 / 2 / 4 rows a program, one split and more, plain and adding, for `backends.cuda.compile_check`."""
    out = []
    for dt in ("bf16", "fp32"):
        p = "*" + dt
        strides = ("stride_a", "stride_q", "stride_s", "stride_x", "stride_o")
        signature = dict(a_ptr=p, q_ptr="*i32", s_ptr="*bf16", x_ptr=p, out_ptr=p, part_ptr="*fp32", rows="i32",
                         N="i32", **{name: "i32" for name in strides}, k_split="i32")  # fmt: skip
        aligned = ("a_ptr", "q_ptr", "s_ptr", "x_ptr", "out_ptr", "part_ptr", "N", "stride_a", "stride_q", "k_split")
        sets = []
        for rows, n, k, add in ((1, 6144, 8192, False), (1, 4096, 4096, True), (1, 28672, 4096, False),
                                (4, 4096, 14336, True), (2, 4096, 12288, False), (1, 576, 1728, False)):  # fmt: skip
            g = group_size(k)
            c = int4_config(rows, n, k, g)
            sets.append(dict(SPLITS=c.splits, ADD=add, ASM=True, ACT=1 if dt == "bf16" else 0, ROWS=rows,
                             BLOCK_N=c.block_n, GROUP=g, GROUPS=c.groups, PREFETCH=c.prefetch))  # fmt: skip
        out.append((_int4_gemv_kernel, signature, sets, aligned))
        if dt == "bf16":  # the draft LM head's float32 logits
            c = int4_config(1, 32000, 4096, 128)
            wide = dict(signature, out_ptr="*fp32")
            lm_head = dict(SPLITS=c.splits, ADD=False, ASM=True, ACT=1, ROWS=1, BLOCK_N=c.block_n, GROUP=128,
                           GROUPS=c.groups, PREFETCH=c.prefetch)  # fmt: skip
            out.append((_int4_gemv_kernel, wide, [lm_head], aligned))
        out.append((_int8_sum_kernel,  # the split partials, unscaled
                    dict(part_ptr="*fp32", s_ptr="*fp32", x_ptr=p, out_ptr=p, rows="i32", N="i32", stride_x="i32",
                         stride_o="i32"),
                    [dict(SPLITS=s, ADD=add, ACT=1 if dt == "bf16" else 0, BLOCK=SUM_BLOCK, SCALED=False)
                     for s in (2, 4, 8) for add in (False, True)],
                    ("part_ptr", "s_ptr", "x_ptr", "out_ptr", "N", "stride_x", "stride_o")))  # fmt: skip
    return out
