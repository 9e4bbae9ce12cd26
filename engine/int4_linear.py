"""Weight-only int4 GEMMs for a draft model: ``a [T, K] @ W^T`` with ``W`` in 4-bit groups, half a byte a weight.

Why: `int8_linear` halved the bytes of an 8B-shaped EAGLE-3 head's step (281 -> 153 µs a draft level on an H100),
and at a decode's few rows the head's GEMMs still take the time it takes to read their weights. A chain of 4 drafts
four head steps a cycle (the extend and three levels), ~0.6 ms of int8 GEMMs against a ~6.3 ms verify; 4 bits a
weight halve them again. Coarser weights draft worse, and a draft may be approximate (the verify decides every
token, so the output is the target's whatever the draft computes): what int4 costs is acceptance, measured on the
real model (``bench/gpu_bench.py --parts real``, tau with each of the head's weight forms; docs/fast_engine.md).

**The format** (`Int4Grouped`): symmetric round-to-nearest over groups of ``group`` consecutive input columns of a
row (128 where ``K`` allows, else 64 or 32), one bfloat16 scale a group (``absmax / 7``; the integers -7..7, stored
as ``q + 8`` in a nibble). A group's ``group`` columns are two halves, ``j`` and ``j + group / 2`` sharing byte ``j``
(low and high nibble): a kernel unpacks a half with a mask or a shift and multiplies it by the matching half of the
activations, with no interleaving.

**The kernel.** Program ``(n block, m block, split)``: per group, the two halves' integers (widened exactly to the
activations' dtype) times the activations on the tensor cores, float32 accumulation, the group's product scaled
and added to the program's float32 accumulator; one split stores ``round(x + acc)``, more store float32 partials
that `int8_linear`'s sum kernel adds in split order (deterministic, no atomics). As `int8_linear`, the result is a
function of the inputs, not of a row alone (the tile depends on the row count): for draft models only.

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
    from .linear_triton import _mma
    from .splitk_linear import _store_partial, _tile_rows_cols
except ImportError:  # pragma: no cover - installs without triton use the torch reference
    triton = None

GROUPS = (128, 64, 32)  # group sizes, largest first: `Int4Grouped.from_weight` takes the first that divides K
QMAX = 7  # symmetric: the integers -7..7 (the nibble's -8 is never stored)


def group_size(k: int) -> int:
    """The largest of `GROUPS` dividing ``k``; refused (with what would do) if none does."""
    for g in GROUPS:
        if k % g == 0:
            return g
    raise ValueError(f"int4 weights need K divisible by {GROUPS[-1]}; got K={k} (use int8 or the head's dtype)")


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> ``(packed [N, K / 2] uint8, scale [K / group, N] bfloat16)``: symmetric per group, the
    integers rounded against the stored (bfloat16) scale; an all-zero group gets scale 1. The scales are stored a
    group's row at a time, so a program's columns read theirs in one coalesced load."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    scale = w.abs().amax(dim=2) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, :, None]).clamp_(-QMAX, QMAX).to(torch.int16) + 8  # 1..15
    half = group // 2
    packed = (q[:, :, :half] | (q[:, :, half:] << 4)).to(torch.uint8)  # byte j: columns j (low), j + half (high)
    return packed.reshape(n, k // 2).contiguous(), scale.t().contiguous()


@attrs.frozen(eq=False)
class Int4Grouped:
    """An ``[N, K]`` weight in 4-bit groups (`quantize_int4`): ``packed [N, K / 2]`` uint8 and a bfloat16 ``scale``
    ``[K / group, N]``."""

    packed: torch.Tensor
    scale: torch.Tensor
    group: int

    def __attrs_post_init__(self) -> None:
        p, s, g = self.packed, self.scale, self.group
        if g not in GROUPS:
            raise ValueError(f"Int4Grouped: group must be one of {GROUPS}; got {g}")
        if p.dtype != torch.uint8 or p.dim() != 2 or p.stride(1) != 1 or (2 * p.shape[1]) % g:
            raise ValueError(
                f"Int4Grouped: packed must be a 2-D uint8 tensor with a contiguous last dimension of "
                f"whole {g // 2}-byte groups; got {p.dtype} {tuple(p.shape)}, strides {p.stride()}"
            )
        want = (2 * p.shape[1] // g, p.shape[0])
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
        return torch.Size((self.packed.shape[0], 2 * self.packed.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.scale.numel()

    def integers(self) -> torch.Tensor:
        """The stored integers ``[N, K]`` (int8, -7..7)."""
        n, k = self.shape
        p = self.packed.reshape(n, k // self.group, self.group // 2).to(torch.int16)
        return (torch.cat([p & 15, p >> 4], dim=2) - 8).reshape(n, k).to(torch.int8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.integers().float().reshape(self.shape[0], -1, self.group)
        return (q * self.scale.float().t()[:, :, None]).reshape(self.shape).to(dtype)


@attrs.frozen
class Int4Config:
    """Tile and launch of one GEMM: a K step is ``groups`` whole groups; ``splits`` must cut ``K`` into whole steps."""

    block_m: int = 16
    block_n: int = 32
    groups: int = 2
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 4
    mode: int = 0


# As `int8_linear.int8_config`: wide launches (at least this many programs a row block) one split and short steps,
# narrow ones longer steps and K in two splits once it reaches `SPLIT_K` columns.
WIDE_PROGRAMS = 512
SPLIT_K = 8192


def int4_config(rows: int, n: int, k: int, group: int) -> Int4Config:
    """The tile for ``rows`` rows of an ``[N, K]`` weight in groups of ``group``: 32 columns a program, 16 / 32 / 64
    rows a block (`int8_config`'s rule); a K step of 256 columns (two groups of 128) where K allows."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = max(16, min(32, triton.next_power_of_2(n)))
    steps = k // group
    groups = next(g for g in (256 // group, 2, 1) if g >= 1 and steps % g == 0)
    programs = triton.cdiv(n, block_n)
    splits = 1
    if programs < WIDE_PROGRAMS and block_m < 64 and k >= SPLIT_K and steps % (2 * groups) == 0:
        splits = 2
    stages = 3 if programs >= WIDE_PROGRAMS else 5
    return Int4Config(block_m=block_m, block_n=block_n, groups=groups, splits=splits, num_warps=4,
                      num_stages=stages)  # fmt: skip


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
# Nibbles to bfloat16 on the GPU (Hopper's PTX), four bytes at a time: each byte's low and high nibble (stored as the
# integer + 8) become the bfloat16 values of the integer. prmt spreads bytes 0, 1 (2, 3) into the low bytes of a
# register's two 16-bit halves; lop3 keeps a nibble and ORs in 0x4300 (bfloat16 128, whose last mantissa bit is 1),
# giving 128 + nibble exactly; an fma subtracts 136. Outputs: $0, $1 the four low nibbles, $2, $3 the high ones.
_UNPACK_ASM = """
{
.reg .b32 z, m, c, one, off, t0, t1, h0, h1, u;
mov.b32 z, 0;
mov.b32 m, 0x000F000F;
mov.b32 c, 0x43004300;
mov.b32 one, 0x3F803F80;
mov.b32 off, 0xC308C308;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
lop3.b32 u, t0, m, c, 0xEA;
fma.rn.bf16x2 $0, u, one, off;
lop3.b32 u, t1, m, c, 0xEA;
fma.rn.bf16x2 $1, u, one, off;
shr.b32 h0, t0, 4;
shr.b32 h1, t1, 4;
lop3.b32 u, h0, m, c, 0xEA;
fma.rn.bf16x2 $2, u, one, off;
lop3.b32 u, h1, m, c, 0xEA;
fma.rn.bf16x2 $3, u, one, off;
}
"""

if triton is not None:
    UNPACK_ASM = tl.constexpr(_UNPACK_ASM)

    @triton.jit
    def _int4_linear_kernel(
        a_ptr, q_ptr, s_ptr, x_ptr, out_ptr, part_ptr, rows, N, stride_a, stride_q, stride_s, stride_x, stride_o,
        k_split, SPLITS: tl.constexpr, ADD: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr,
        ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
        MODE: tl.constexpr = 0,
    ):  # fmt: skip
        """Program ``(n block, m block, split)`` (``n`` fastest, as `int8_linear`'s): its split's ``k_split`` columns
        in steps of ``GROUPS`` groups, each group's two halves unpacked from one byte tile."""
        rows_m, mask_m, cols_n, mask_n = _tile_rows_cols(tl.program_id(1), tl.program_id(0), rows, N, BLOCK_M, BLOCK_N)
        split = tl.program_id(2)
        HALF: tl.constexpr = GROUP // 2
        offs = tl.arange(0, HALF)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_lo = split * k_split
        a_rows = a_ptr + rows_m[:, None] * stride_a
        q_cols = q_ptr + cols_n[None, :].to(tl.int64) * stride_q
        if MODE == 2:
            acc3 = tl.zeros([BLOCK_M, BLOCK_N, HALF], dtype=tl.float32)
            q_rows = q_ptr + cols_n[:, None].to(tl.int64) * stride_q
            for k0 in range(k_lo, k_lo + k_split, GROUP * GROUPS):
                for g in tl.static_range(GROUPS):
                    kg = k0 + g * GROUP
                    b = tl.load(q_rows + (kg // 2 + offs)[None, :], mask=mask_n[:, None], other=0x88)  # [BLOCK_N, HALF]
                    s = tl.load(s_ptr + (kg // GROUP) * stride_s + cols_n, mask=mask_n, other=0.0).to(tl.float32)
                    lo = ((b & 15).to(tl.float32) - 8.0) * s[:, None]
                    hi = ((b >> 4).to(tl.float32) - 8.0) * s[:, None]
                    a_lo = tl.load(a_rows + (kg + offs)[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)
                    a_hi = tl.load(a_rows + (kg + HALF + offs)[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)
                    acc3 += a_lo[:, None, :] * lo[None, :, :] + a_hi[:, None, :] * hi[None, :, :]
            acc = tl.sum(acc3, axis=2)
        for k0 in range(k_lo, k_lo + k_split * (MODE != 2), GROUP * GROUPS):
            for g in tl.static_range(GROUPS):
                kg = k0 + g * GROUP
                b = tl.load(q_cols + (kg // 2 + offs)[:, None], mask=mask_n[None, :], other=0x88)  # [HALF, BLOCK_N]
                a_lo = tl.load(a_rows + (kg + offs)[None, :], mask=mask_m[:, None], other=0.0)
                a_hi = tl.load(a_rows + (kg + HALF + offs)[None, :], mask=mask_m[:, None], other=0.0)
                if MODE >= 3:  # bfloat16 activations on a GPU: the nibbles unpacked by UNPACK_ASM
                    lo, hi = tl.inline_asm_elementwise(
                        UNPACK_ASM, "=r,=r,=r,=r,r", [b], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
                    )
                else:
                    lo = (b & 15).to(tl.int8) - 8
                    hi = (b >> 4).to(tl.int8) - 8
                    if INTERPRET:  # the interpreter's int -> bfloat16 cast is not exact: float32 (as `_mma` goes)
                        lo = lo.to(tl.float32)
                        hi = hi.to(tl.float32)
                    else:
                        lo = lo.to(a_lo.dtype)
                        hi = hi.to(a_lo.dtype)
                s = tl.load(s_ptr + (kg // GROUP) * stride_s + cols_n, mask=mask_n, other=0.0).to(tl.float32)
                if MODE == 1 or MODE == 4:
                    acc = _mma(a_lo, (lo.to(tl.float32) * s[None, :]).to(a_lo.dtype), acc, INTERPRET, IEEE)
                    acc = _mma(a_hi, (hi.to(tl.float32) * s[None, :]).to(a_lo.dtype), acc, INTERPRET, IEEE)
                else:
                    part = _mma(a_lo, lo, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET, IEEE)
                    part = _mma(a_hi, hi, part, INTERPRET, IEEE)
                    acc += part * s[None, :]
        if SPLITS == 1:
            _store_tile(acc, x_ptr, out_ptr, rows_m, mask_m, cols_n, mask_n, stride_x, stride_o, ADD, ACT)
        else:
            _store_partial(part_ptr, acc, split, rows, rows_m, mask_m, cols_n, mask_n, N)


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
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(rows, config.block_m), splits)
    _int4_linear_kernel[grid](
        a, weight.packed, weight.scale, out if x is None else x, out, part, rows, n, a.stride(0),
        weight.packed.stride(0), weight.scale.stride(0), 0 if x is None else x.stride(0), out.stride(0), k // splits,
        SPLITS=splits, ADD=x is not None, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        IEEE=a.dtype == torch.float32, ACT=ACT_CODES[a.dtype], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        GROUP=weight.group, GROUPS=config.groups, MODE=config.mode, num_warps=config.num_warps,
        num_stages=config.num_stages,
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
    """The kernel at an 8B-shaped EAGLE-3 head's tiles (`int4_config`, groups of 128) and SmolLM2's (groups of 64),
    one split and two, plain and adding, for `backends.cuda.compile_check`."""
    out = []
    for dt in ("bf16", "fp32"):
        p = "*" + dt
        strides = ("stride_a", "stride_q", "stride_s", "stride_x", "stride_o")
        signature = dict(a_ptr=p, q_ptr="*u8", s_ptr="*bf16", x_ptr=p, out_ptr=p, part_ptr="*fp32", rows="i32",
                         N="i32", **{name: "i32" for name in strides}, k_split="i32")  # fmt: skip
        aligned = ("a_ptr", "q_ptr", "s_ptr", "x_ptr", "out_ptr", "part_ptr", "N", "stride_a", "stride_q", "k_split")
        sets = []
        for rows, n, k, add in ((4, 6144, 8192, False), (4, 4096, 4096, True), (4, 28672, 4096, False),
                                (4, 4096, 14336, True), (1, 32000, 4096, False), (32, 4096, 12288, False),
                                (4, 576, 1728, False)):  # fmt: skip
            g = group_size(k)
            c = int4_config(rows, n, k, g)
            sets.append(dict(SPLITS=c.splits, ADD=add, INTERPRET=False, IEEE=dt == "fp32", ACT=1 if dt == "bf16" else 0,
                             BLOCK_M=c.block_m, BLOCK_N=c.block_n, GROUP=g, GROUPS=c.groups))  # fmt: skip
        out.append((_int4_linear_kernel, signature, sets, aligned))
        if dt == "bf16":  # the draft LM head's float32 logits
            c = int4_config(4, 32000, 4096, 128)
            wide = dict(signature, out_ptr="*fp32")
            lm_head = dict(SPLITS=1, ADD=False, INTERPRET=False, IEEE=False, ACT=1, BLOCK_M=c.block_m,
                           BLOCK_N=c.block_n, GROUP=128, GROUPS=c.groups)  # fmt: skip
            out.append((_int4_linear_kernel, wide, [lm_head], aligned))
        out.append((_int8_sum_kernel,  # the split partials, unscaled
                    dict(part_ptr="*fp32", s_ptr="*fp32", x_ptr=p, out_ptr=p, rows="i32", N="i32", stride_x="i32",
                         stride_o="i32"),
                    [dict(SPLITS=2, ADD=add, ACT=1 if dt == "bf16" else 0, BLOCK=SUM_BLOCK, SCALED=False)
                     for add in (False, True)],
                    ("part_ptr", "s_ptr", "x_ptr", "out_ptr", "N", "stride_x", "stride_o")))  # fmt: skip
    return out
