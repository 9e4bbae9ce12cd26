"""Fused elementwise ops of the fast Llama forward: a plain-torch reference and a Triton kernel each.

Every op reproduces the rounding of `engine.models.llama`'s reference ops (float32 math where the reference
computes in float32, a rounding to the model dtype wherever the reference's tensor is in that dtype),
so the fast forward tracks the reference closely; the only differences are reduction orders (RMSNorm's
mean of squares) and ``exp``. RoPE and the residual add are bitwise torch's: their bfloat16 roundings
are done in integer arithmetic (`_round_to_bfloat16`) and the RoPE kernel is compiled without
multiply-add contraction, so no rounding of torch's is skipped on a GPU. Each op works row by row
with a block size that does not depend on the number of rows, so a row's result never depends on the
other rows of the batch (what keeps the verify and the decode forwards of one token bitwise equal).

* `rms_norm(x, w, eps)` and `add_rms_norm(x, r, w, eps) -> (x + r, norm(x + r))`: RMSNorm like
  `llama.RMSNorm` (the fused one also returns the residual sum, written where asked).
* `rope_write_kv(qkv, positions, cos, sin, out_slots, k_cache, v_cache, H, Hkv)`: RoPE on Q and K
  (Hugging Face's rotate-half, `llama.apply_rope`'s roundings), K and V written at ``out_slots``
  (rows with slot ``-1`` write nothing: padding rows of a captured batch); returns the rotated Q.
* `silu_mul(gate_up) -> silu(gate) * up`.

`Ops` bundles them with the attention and the GEMMs (``linear``, ``norm_linear``: RMSNorm, optionally
after the residual add, then a GEMM; ``norm_gate_up_silu``: that with the gate/up weight and SiLU-mul;
``norm_qkv_rope``: that with the Q/K/V weight, then RoPE and the KV write);
`TorchOps` runs anywhere (``F.linear``), `TritonOps` on CUDA (or on CPU tensors under
``TRITON_INTERPRET=1``, as the tests do) with the row-invariant fused GEMMs of `engine.kernels.linear_triton`
up to its ``MAX_ROWS`` rows, `BatchInvariantOps` with them at any row count.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from .attention_prefill import paged_attention_prefill_exact, paged_attention_prefill_triton
from .attention_tiles import paged_attention_tiles_triton
from .attention_triton import paged_attention_rows_torch, paged_attention_rows_triton
from .linear_triton import (
    MAX_ROWS,
    linear_rows,
    linear_torch,
    norm_gate_up_silu_triton,
    norm_linear_triton,
    norm_qkv_rope_triton,
    rows_fit,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without triton use TorchOps
    triton = None

# Heads one program of the RoPE/KV-write kernel takes at most (`rope_heads_per_program`). One head a program
# recomputed the folded norm's RMS of the row (4,096 values at the Llama-3-8B shape) 48 times a row.
ROPE_HEADS = 8


# ---- torch references ---------------------------------------------------------------------------
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`llama.RMSNorm`: ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)``. Shapes: ``[T, H]``."""
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def add_rms_norm_torch(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    sum_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (in the dtype, as the reference adds), then RMSNorm of ``h``: ``(h, norm(h))``.

    ``sum_out``: where to write ``h`` (a ``[T, H]`` view, e.g. a column block of the features buffer).
    """
    h = x + residual
    if sum_out is not None:
        sum_out.copy_(h)
        h = sum_out
    return h, rms_norm_torch(h, weight, eps)


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`llama.apply_rope`. Shapes: ``x [T, heads, D]``, ``cos, sin [T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rms_scale_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(x32^2) + eps)`` per row of ``x [T, H]``: ``[T, 1]`` float32 (RMSNorm's factor)."""
    x32 = x.float()
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def scale_rows_torch(y: torch.Tensor, norm_src: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``y`` times its row's `rms_scale_torch` of ``norm_src``, rounded to ``y``'s dtype (``norm_src`` None: ``y``).

    The folded norm (`FoldedNormOps`): ``F.linear(rms_norm(h), W) == F.linear(h, W * g) * rms_scale(h)`` up
    to roundings, so the GEMM reads the residual stream ``h`` itself and the scale is applied after it.
    """
    if norm_src is None:
        return y
    return (y.float() * rms_scale_torch(norm_src, eps)).to(y.dtype)


def rope_write_kv_torch(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    out_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    norm_src: torch.Tensor | None = None,
    eps: float = 0.0,
    copy_src_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE on Q and K, K and V written at ``out_slots`` (slot -1: not written); returns Q ``[T, H, D]``.

    ``norm_src [T, hidden]``: first scale every row of ``qkv`` by ``norm_src``'s RMS factor
    (`scale_rows_torch`: the folded input norm). ``copy_src_to [T, hidden]`` (a view, any row stride): also
    receives ``norm_src`` as it is (the residual stream entering a layer: EAGLE-3's features), written by the
    kernel that reads it anyway instead of by a copy launch.

    Shapes: ``qkv [T, (H + 2 Hkv) D]``, ``positions, out_slots [T]``, tables ``[max_position, D]`` in the
    model dtype, caches ``[num_slots, Hkv, D]``. Without host syncs: a row that writes nothing writes
    the value of the first writing row at that row's slot instead, the same bits at the same place;
    when no row writes, every row writes slot 0's own value back.
    """
    _check_copy(norm_src, copy_src_to)
    if copy_src_to is not None:
        copy_src_to.copy_(norm_src)
    qkv = scale_rows_torch(qkv, norm_src, eps)
    rows = qkv.shape[0]
    head_dim = cos_table.shape[1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    cos, sin = cos_table[positions], sin_table[positions]
    q = rotate_torch(q.reshape(rows, num_heads, head_dim), cos, sin)
    k = rotate_torch(k.reshape(rows, num_kv_heads, head_dim), cos, sin)
    v = v.reshape(rows, num_kv_heads, head_dim)
    if rows:
        valid = out_slots >= 0
        src = torch.where(valid, torch.arange(rows, device=qkv.device), valid.long().argmax())
        slots = out_slots[src]
        none = (slots < 0)[:, None, None]  # no row writes (a batch of finished requests)
        slots = slots.clamp(min=0)
        k_cache.index_copy_(0, slots, torch.where(none, k_cache[slots], k[src].to(k_cache.dtype)))
        v_cache.index_copy_(0, slots, torch.where(none, v_cache[slots], v[src].to(v_cache.dtype)))
    return q


def silu_mul_torch(gate_up: torch.Tensor, norm_src: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate first) -> ``[T, I]``; ``norm_src``: ``gate_up``'s rows
    first scaled by its RMS factor (`scale_rows_torch`: the folded post-attention norm)."""
    gate, up = scale_rows_torch(gate_up, norm_src, eps).chunk(2, dim=-1)
    return F.silu(gate) * up


def eagle_input_torch(
    input_ids: torch.Tensor,
    embed_weight: torch.Tensor,
    hidden: torch.Tensor,
    embed_gain: torch.Tensor,
    hidden_gain: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An EAGLE-3 head's layer input and residual stream: ``(cat(rms_norm(embed[ids]) g_e, rms_norm(hidden) g_h),
    a copy of hidden)``. Shapes: ``input_ids [T]``, ``embed_weight [V, H]``, ``hidden [T, H]`` ->
    ``[T, 2H]``, ``[T, H]``. The copy is a fresh tensor the head's O and down GEMMs may add into in place
    (`FoldedNormOps.linear_add`): ``hidden`` itself may be another forward's output. Everything comes out in
    ``hidden``'s dtype (the head's), the embedding rounded to it first where the target's dtype differs."""
    embed = F.embedding(input_ids, embed_weight).to(hidden.dtype)
    normed = torch.cat([rms_norm_torch(embed, embed_gain, eps), rms_norm_torch(hidden, hidden_gain, eps)], -1)
    return normed, hidden.clone()


# ---- Triton kernels ----------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _round_to_bfloat16(x):
        """float32 -> bfloat16, round to nearest even, in integer arithmetic.

        Why not ``x.to(tl.bfloat16)``: on a GPU, LLVM narrows ``fptrunc(fmul(fpext a, fpext b))`` to a
        bfloat16 multiply and then contracts it with the following add into ``fma.rn.bf16``, which skips
        the product's rounding that torch does (seen on an H100, Triton 3.6: RoPE's Q off by an ulp);
        and Triton's interpreter truncates instead of rounding. Integer rounding is opaque to both, so
        the kernel gives torch's bits on a GPU and under ``TRITON_INTERPRET=1`` alike. NaN stays NaN.
        """
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True)).to(tl.bfloat16)

    @triton.jit
    def _norm_row(x, w_ptr, cols, mask, hidden, eps, dtype: tl.constexpr):
        """RMSNorm of one loaded row (`rms_norm_torch`'s roundings): normalized in float32, rounded to the
        row's dtype, times the gain, rounded to ``dtype``."""
        x32 = x.to(tl.float32)
        mean_square = tl.sum(x32 * x32, axis=0) / hidden
        normed = (x32 * (1.0 / tl.sqrt(mean_square + eps))).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        return (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        r_ptr,
        w_ptr,
        sum_ptr,
        y_ptr,
        stride_x,
        stride_r,
        stride_s,
        stride_y,
        hidden,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
            if x_ptr.dtype.element_ty == tl.bfloat16:  # the reference's dtype add
                x = _round_to_bfloat16(x.to(tl.float32) + r.to(tl.float32))
            else:
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
        tl.store(y_ptr + row * stride_y + cols, _norm_row(x, w_ptr, cols, mask, hidden, eps, y_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip

    @triton.jit
    def _rms_scale(src_ptr, stride_src, row, hidden, eps, BLOCK_H: tl.constexpr):
        """``rsqrt(mean(src[row]^2) + eps)`` in float32, the row read in ``BLOCK_H`` blocks."""
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            x = tl.load(src_ptr + row * stride_src + cols, mask=cols < hidden, other=0.0).to(tl.float32)
            acc += x * x
        return 1.0 / tl.sqrt(tl.sum(acc, axis=0) / hidden + eps)

    @triton.jit
    def _scaled(x, scale, dtype: tl.constexpr):
        """``x * scale`` rounded to ``dtype`` (bfloat16 in integer arithmetic, as `_round_to_bfloat16`)."""
        if dtype == tl.bfloat16:
            return _round_to_bfloat16(x.to(tl.float32) * scale)
        return (x.to(tl.float32) * scale).to(dtype)

    @triton.jit
    def _rope_write_kv_kernel(
        qkv_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        q_out_ptr,
        k_ptr,
        v_ptr,
        stride_qkv,
        stride_table,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        src_ptr,
        stride_src,
        hidden,
        eps,
        copy_ptr,
        stride_copy,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        NORM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        COPY: tl.constexpr,
        HEADS: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
    ):
        row = tl.program_id(0)
        # heads head0 .. head0 + HEADS - 1, all of one kind (HEADS divides H and Hkv): 0..H-1 Q, H..H+Hkv-1 K,
        # then V. Elementwise but for the folded norm's RMS, computed once a program (it was once a head).
        head0 = tl.program_id(1) * HEADS
        if COPY:  # the norm source's row copied out (EAGLE-3's features) by the row's first program
            if head0 == 0:
                for start in range(0, hidden, BLOCK_H):
                    cols = start + tl.arange(0, BLOCK_H)
                    inside = cols < hidden
                    value = tl.load(src_ptr + row * stride_src + cols, mask=inside, other=0.0)
                    tl.store(copy_ptr + row * stride_copy + cols, value, mask=inside)
        i = tl.arange(0, BLOCK_HALF)
        j = tl.arange(0, BLOCK_HEADS)
        mask = (j[:, None] < HEADS) & (i[None, :] < HALF)
        base = qkv_ptr + row * stride_qkv + (head0 + j)[:, None] * (2 * HALF) + i[None, :]
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        dtype = qkv_ptr.dtype.element_ty
        if NORM:  # the folded input norm: the row's RMS factor of the residual stream, then the dtype
            scale = _rms_scale(src_ptr, stride_src, row, hidden, eps, BLOCK_H)
            x1 = _scaled(x1, scale, dtype)
            x2 = _scaled(x2, scale, dtype)
        slot = tl.load(slot_ptr + row)
        if head0 >= NUM_HEADS + NUM_KV_HEADS:  # V: copied as is
            kv = head0 - NUM_HEADS - NUM_KV_HEADS + j
            if slot >= 0:
                dst = v_ptr + slot * stride_vs + kv[:, None] * stride_vh + i[None, :]
                tl.store(dst, x1.to(v_ptr.dtype.element_ty), mask=mask)
                tl.store(dst + HALF, x2.to(v_ptr.dtype.element_ty), mask=mask)
        else:
            pos = tl.load(pos_ptr + row)
            half = i < HALF
            c1 = tl.load(cos_ptr + pos * stride_table + i, mask=half, other=0.0).to(tl.float32)[None, :]
            c2 = tl.load(cos_ptr + pos * stride_table + HALF + i, mask=half, other=0.0).to(tl.float32)[None, :]
            s1 = tl.load(sin_ptr + pos * stride_table + i, mask=half, other=0.0).to(tl.float32)[None, :]
            s2 = tl.load(sin_ptr + pos * stride_table + HALF + i, mask=half, other=0.0).to(tl.float32)[None, :]
            a1 = x1.to(tl.float32)
            a2 = x2.to(tl.float32)
            # x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype
            if dtype == tl.bfloat16:
                p1 = _round_to_bfloat16(a1 * c1).to(tl.float32)
                p2 = _round_to_bfloat16(-a2 * s1).to(tl.float32)
                p3 = _round_to_bfloat16(a2 * c2).to(tl.float32)
                p4 = _round_to_bfloat16(a1 * s2).to(tl.float32)
                out1 = _round_to_bfloat16(p1 + p2)
                out2 = _round_to_bfloat16(p3 + p4)
            else:
                p1 = (a1 * c1).to(dtype).to(tl.float32)
                p2 = (-a2 * s1).to(dtype).to(tl.float32)
                p3 = (a2 * c2).to(dtype).to(tl.float32)
                p4 = (a1 * s2).to(dtype).to(tl.float32)
                out1 = (p1 + p2).to(dtype)
                out2 = (p3 + p4).to(dtype)
            if head0 < NUM_HEADS:
                dst = q_out_ptr + row * stride_qt + (head0 + j)[:, None] * stride_qh + i[None, :]
                tl.store(dst, out1, mask=mask)
                tl.store(dst + HALF, out2, mask=mask)
            elif slot >= 0:
                kv = head0 - NUM_HEADS + j
                dst = k_ptr + slot * stride_ks + kv[:, None] * stride_kh + i[None, :]
                tl.store(dst, out1.to(k_ptr.dtype.element_ty), mask=mask)
                tl.store(dst + HALF, out2.to(k_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(
        x_ptr, out_ptr, stride_x, stride_o, inter, src_ptr, stride_src, hidden, eps,
        BLOCK: tl.constexpr, NORM: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
        if NORM:  # the folded post-attention norm
            scale = _rms_scale(src_ptr, stride_src, row, hidden, eps, BLOCK_H)
            gate = _scaled(gate, scale, x_ptr.dtype.element_ty)
            up = _scaled(up, scale, x_ptr.dtype.element_ty)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)

    @triton.jit
    def _eagle_input_kernel(
        ids_ptr, embed_ptr, hidden_ptr, embed_gain_ptr, hidden_gain_ptr, out_ptr, res_ptr,
        stride_e, stride_h, stride_o, stride_r, hidden, eps, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One program per row: the token's embedding row and the hidden row, each RMS-normed with its gain
        into the two halves of ``out``, and the hidden row copied to ``res`` (`eagle_input_torch`)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        token = tl.load(ids_ptr + row).to(tl.int64)
        e = tl.load(embed_ptr + token * stride_e + cols, mask=mask, other=0.0)
        h = tl.load(hidden_ptr + row * stride_h + cols, mask=mask, other=0.0)
        tl.store(res_ptr + row * stride_r + cols, h, mask=mask)
        dtype = out_ptr.dtype.element_ty
        tl.store(
            out_ptr + row * stride_o + cols, _norm_row(e, embed_gain_ptr, cols, mask, hidden, eps, dtype), mask=mask
        )
        tl.store(
            out_ptr + row * stride_o + hidden + cols,
            _norm_row(h, hidden_gain_ptr, cols, mask, hidden, eps, dtype),
            mask=mask,
        )


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("the Triton ops need triton (pip install triton); use TorchOps without it")


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    _need_triton()
    rows, hidden = x.shape
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device) if out is None else out
    if rows:
        _rms_norm_kernel[(rows,)](
            x, x, weight, x, y, x.stride(0), 0, 0, y.stride(0), hidden, eps,
            HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(hidden),
        )  # fmt: skip
    return y


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    sum_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _need_triton()
    rows, hidden = x.shape
    h = torch.empty((rows, hidden), dtype=x.dtype, device=x.device) if sum_out is None else sum_out
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](
            x, residual, weight, h, y, x.stride(0), residual.stride(0), h.stride(0), y.stride(0), hidden, eps,
            HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(hidden),
        )  # fmt: skip
    return h, y


@functools.cache
def rope_heads_per_program(num_heads: int, num_kv_heads: int) -> int:
    """Heads one program of `rope_write_kv_triton` takes: the largest divisor of both head counts up to
    `ROPE_HEADS`, so a program's heads are all Q, all K or all V. Speed only (a head's values are
    elementwise; the folded norm's RMS is the same per-row reduction in every program)."""
    return max(d for d in range(1, min(ROPE_HEADS, num_heads, num_kv_heads) + 1)
               if num_heads % d == 0 and num_kv_heads % d == 0)  # fmt: skip


def rope_write_kv_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    out_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    norm_src: torch.Tensor | None = None,
    eps: float = 0.0,
    copy_src_to: torch.Tensor | None = None,
) -> torch.Tensor:
    _need_triton()
    _check_copy(norm_src, copy_src_to)
    if copy_src_to is not None and copy_src_to.stride(-1) != 1:
        raise ValueError("copy_src_to needs a contiguous last dimension")
    rows = qkv.shape[0]
    head_dim = cos_table.shape[1]
    q = torch.empty((rows, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if rows:
        half = head_dim // 2
        # read at `ptr + row`: views of other strides (an expanded or sliced index tensor) made contiguous
        positions, out_slots = positions.contiguous(), out_slots.contiguous()
        heads = rope_heads_per_program(num_heads, num_kv_heads)
        _rope_write_kv_kernel[(rows, (num_heads + 2 * num_kv_heads) // heads)](
            qkv, positions, cos_table, sin_table, out_slots, q, k_cache, v_cache,
            qkv.stride(0), cos_table.stride(0), q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            *_norm_args(qkv, norm_src, eps),
            qkv if copy_src_to is None else copy_src_to, 0 if copy_src_to is None else copy_src_to.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
            NORM=norm_src is not None, BLOCK_H=_block_h(norm_src), COPY=copy_src_to is not None,
            HEADS=heads, BLOCK_HEADS=triton.next_power_of_2(heads), enable_fp_fusion=False,
        )  # fmt: skip
    return q


def _check_copy(norm_src: torch.Tensor | None, copy_src_to: torch.Tensor | None) -> None:
    if copy_src_to is None:
        return
    if norm_src is None or copy_src_to.shape != norm_src.shape or copy_src_to.dtype != norm_src.dtype:
        raise ValueError(
            "copy_src_to receives norm_src: pass norm_src and a tensor of its shape and dtype, got "
            f"{None if norm_src is None else (tuple(norm_src.shape), norm_src.dtype)} and "
            f"{(tuple(copy_src_to.shape), copy_src_to.dtype)}"
        )


def _norm_args(like: torch.Tensor, norm_src: torch.Tensor | None, eps: float) -> tuple:
    """The kernels' ``(src_ptr, stride_src, hidden, eps)`` for a folded norm's source (None: unused)."""
    if norm_src is None:
        return like, 0, 1, 0.0
    if norm_src.stride(-1) != 1:
        raise ValueError("norm_src needs a contiguous last dimension")
    return norm_src, norm_src.stride(0), norm_src.shape[1], float(eps)


def _block_h(norm_src: torch.Tensor | None) -> int:
    return 16 if norm_src is None else min(1024, triton.next_power_of_2(norm_src.shape[1]))


def silu_mul_triton(gate_up: torch.Tensor, norm_src: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    _need_triton()
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, *_norm_args(gate_up, norm_src, eps),
            BLOCK=block, NORM=norm_src is not None, BLOCK_H=_block_h(norm_src),
        )  # fmt: skip
    return out


def eagle_input_triton(
    input_ids: torch.Tensor,
    embed_weight: torch.Tensor,
    hidden: torch.Tensor,
    embed_gain: torch.Tensor,
    hidden_gain: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`eagle_input_torch` in one kernel (four before: the embedding, two norms, the concatenation). Mixed
    dtypes (an embedding in another dtype than the hidden rows) take the twin."""
    _need_triton()
    rows, width = hidden.shape
    if embed_weight.dtype != hidden.dtype or hidden.stride(-1) != 1 or embed_weight.stride(-1) != 1:
        return eagle_input_torch(input_ids, embed_weight, hidden, embed_gain, hidden_gain, eps)
    out = torch.empty((rows, 2 * width), dtype=hidden.dtype, device=hidden.device)
    res = torch.empty((rows, width), dtype=hidden.dtype, device=hidden.device)
    if rows:
        _eagle_input_kernel[(rows,)](
            input_ids.contiguous(), embed_weight, hidden, embed_gain, hidden_gain, out, res,
            embed_weight.stride(0), hidden.stride(0), out.stride(0), res.stride(0), width, eps,
            BLOCK=triton.next_power_of_2(width),
        )  # fmt: skip
    return out, res


# ---- the fused GEMMs (`engine.kernels.linear_triton`'s kernels): torch references, and what the op sets call --------
# The references are ``F.linear`` around this module's torch ops; the op sets take the kernels up to a row
# bound and the unfused Triton ops with ``F.linear`` above it.
def norm_linear_torch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    sum_out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x (+ residual)``, then ``F.linear(rms_norm(h), weight)``: ``(h, [T, N])``.

    ``sum_out``: a ``[T, K]`` view that also receives ``h`` (a features column block).
    """
    if residual is None:
        h = x
        if sum_out is not None:
            sum_out.copy_(x)
        y = rms_norm_torch(x, norm_weight, eps)
    else:
        h, y = add_rms_norm_torch(x, residual, norm_weight, eps, sum_out)
    return h, linear_torch(y, weight, out_dtype)


def norm_gate_up_silu_torch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    sum_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_linear_torch` with the concatenated ``[2I, K]`` gate/up weight, then SiLU-and-mul: ``(h, [T, I])``."""
    h, gate_up = norm_linear_torch(x, residual, norm_weight, eps, weight, sum_out)
    return h, silu_mul_torch(gate_up)


def norm_qkv_rope_torch(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_linear_torch` with the Q/K/V weight, then `kernels.fused_ops.rope_write_kv_torch`: ``(h, q [T, H, D])``.

    ``norm_weight`` None: no norm (``x`` is the GEMM's input, ``h`` is ``x``); K and V go to the caches at
    ``out_slots`` (-1: not written).
    """
    if norm_weight is None:
        if residual is not None or sum_out is not None:
            raise ValueError("norm_qkv_rope: a residual or sum_out needs the norm (norm_weight)")
        h, qkv = x, linear_torch(x, weight)
    else:
        h, qkv = norm_linear_torch(x, residual, norm_weight, eps, weight, sum_out)
    q = rope_write_kv_torch(qkv, positions, cos_table, sin_table, out_slots, k_cache, v_cache, num_heads, num_kv_heads)
    return h, q


def norm_linear_rows(x, residual, norm_weight, eps, weight, sum_out=None, out_dtype=None, *, max_rows=MAX_ROWS):
    """`norm_linear_triton` up to ``max_rows`` rows, else the Triton (add +) RMSNorm and ``F.linear``."""
    if rows_fit(x, weight, max_rows):
        return norm_linear_triton(x, residual, norm_weight, eps, weight, sum_out, out_dtype)
    if residual is None:
        if sum_out is not None:
            sum_out.copy_(x)
        h, y = x, rms_norm_triton(x, norm_weight, eps)
    else:
        h, y = add_rms_norm_triton(x, residual, norm_weight, eps, sum_out)
    return h, linear_torch(y, weight, out_dtype)


def norm_gate_up_silu_rows(x, residual, norm_weight, eps, weight, sum_out=None, *, max_rows=MAX_ROWS):
    """`norm_gate_up_silu_triton` up to ``max_rows`` rows, else the unfused Triton ops and ``F.linear``."""
    if rows_fit(x, weight, max_rows):
        return norm_gate_up_silu_triton(x, residual, norm_weight, eps, weight, sum_out)
    h, gate_up = norm_linear_rows(x, residual, norm_weight, eps, weight, sum_out, max_rows=max_rows)
    return h, silu_mul_triton(gate_up)


def norm_qkv_rope_rows(x, residual, norm_weight, eps, weight, sum_out, positions, cos_table, sin_table, out_slots,
                       k_cache, v_cache, num_heads, num_kv_heads, *, max_rows=MAX_ROWS):  # fmt: skip
    """`norm_qkv_rope_triton` up to ``max_rows`` rows, else `norm_linear_rows` and the RoPE + KV-write kernel."""
    if rows_fit(x, weight, max_rows):
        return norm_qkv_rope_triton(x, residual, norm_weight, eps, weight, sum_out, positions, cos_table, sin_table,
                                    out_slots, k_cache, v_cache, num_heads, num_kv_heads)  # fmt: skip
    if norm_weight is None:
        h, qkv = x, linear_rows(x, weight, max_rows=max_rows)
    else:
        h, qkv = norm_linear_rows(x, residual, norm_weight, eps, weight, sum_out, max_rows=max_rows)
    q = rope_write_kv_triton(qkv, positions, cos_table, sin_table, out_slots, k_cache, v_cache, num_heads,
                             num_kv_heads)  # fmt: skip
    return h, q


# ---- op sets -----------------------------------------------------------------------------------
ATTENTION_KERNELS = ("auto", "tiles", "rows")
# `auto` takes tiles from this head size up. Measured on an H100, bf16, batch 1 (5fa3480): at the
# Llama-3-8B shape (heads of 128) a 32-row verify's attention fell from 65 to 39 us (512 keys) and 172 to 70
# (2,048), fused 32-node tree cycles went from 333.6 to 376.6 tokens/s and a decode step lost nothing
# (bench/results/gpu_bench-H100-scale-tiles-all-*.json against -scale-rows-b-*); with SmolLM2's heads of 64
# a decode step got ~4% slower (a second launch merges the chunks) and fused cycles 1% slower in tokens/s
# (fused_bench-H100-attn-tiles-* against -attn-rows-*).
TILES_MIN_HEAD_DIM = 128


def paged_attention_auto(q, k_cache, v_cache, row_request, prefix_lens, extra_slots, page_table, page_size,
                         kv_bound=None):  # fmt: skip
    """`attention_tiles` for heads of `TILES_MIN_HEAD_DIM` or more, `attention_triton`'s rows kernel below:
    a function of the model's shape, so every forward of an engine (decode and verify) takes the same one."""
    kernel = paged_attention_tiles_triton if q.shape[-1] >= TILES_MIN_HEAD_DIM else paged_attention_rows_triton
    return kernel(q, k_cache, v_cache, row_request, prefix_lens, extra_slots, page_table, page_size, kv_bound)


def triton_attention():
    """The fast path's paged attention for decodes and verifies (a prefill's rows: `triton_prefill_attention`):
    ``SPECCYCLE_ATTENTION=auto`` (the default,
    `paged_attention_auto`), ``tiles`` (`attention_tiles`: a verify's rows share their request's prefix
    blocks) or ``rows`` (`attention_triton`: programs per row); read once, at import. Each keeps a verify row
    bitwise equal to the decode row at its position as long as decode and verify take the same kernel (the
    two kernels differ in bfloat16's last bits)."""
    choice = os.environ.get("SPECCYCLE_ATTENTION", "auto")
    if choice not in ATTENTION_KERNELS:
        raise ValueError(f"SPECCYCLE_ATTENTION={choice!r}: choose one of {', '.join(ATTENTION_KERNELS)}")
    return {"auto": paged_attention_auto, "tiles": paged_attention_tiles_triton}.get(
        choice, paged_attention_rows_triton
    )


PREFILL_ATTENTION_KERNELS = ("exact", "prefill", "rows")


def paged_attention_prefill_auto(q, k_cache, v_cache, row_request, prefix_lens, extra_slots, page_table, page_size,
                                 kv_bound=None, *, decode=paged_attention_auto):  # fmt: skip
    """A prefill's rows, each bitwise the row ``decode`` (the fast path's decode kernel) computes at its position:
    `attention_prefill.paged_attention_prefill_exact` where the decode kernel is `attention_triton`'s rows kernel
    (heads below `TILES_MIN_HEAD_DIM` under ``auto``), else the decode kernel itself (`attention_tiles`, whose
    tiles share a request's prefix blocks)."""
    rows_decode = decode is paged_attention_rows_triton or (
        decode is paged_attention_auto and q.shape[-1] < TILES_MIN_HEAD_DIM
    )
    if rows_decode:
        return paged_attention_prefill_exact(q, k_cache, v_cache, row_request, prefix_lens, extra_slots, page_table,
                                             page_size, kv_bound, fallback=paged_attention_rows_triton)  # fmt: skip
    return decode(q, k_cache, v_cache, row_request, prefix_lens, extra_slots, page_table, page_size, kv_bound)


def triton_prefill_attention():
    """The fast path's attention for a prefill's rows (`core.ports.ForwardBatch.prefill`), read once, at import:
    ``SPECCYCLE_PREFILL_ATTENTION=exact`` (the default, `paged_attention_prefill_auto`: blocks of a prompt's rows
    share their key loads and each row keeps the decode kernel's attention bits, so a prefix-cache hit or a
    recompute reads what a decode wrote as a prefill would have written it), ``prefill``
    (`attention_prefill.paged_attention_prefill_triton`: flash attention's tiles, other roundings than the decode's;
    shapes it does not take go to the decode's kernel) or ``rows`` (the decode's kernel, `triton_attention`)."""
    choice = os.environ.get("SPECCYCLE_PREFILL_ATTENTION", "exact")
    if choice not in PREFILL_ATTENTION_KERNELS:
        raise ValueError(
            f"SPECCYCLE_PREFILL_ATTENTION={choice!r}: choose one of {', '.join(PREFILL_ATTENTION_KERNELS)}"
        )
    decode = triton_attention()
    if choice == "exact":
        return functools.partial(paged_attention_prefill_auto, decode=decode)
    return decode if choice == "rows" else functools.partial(paged_attention_prefill_triton, fallback=decode)


class TorchOps:
    """The fast forward's ops in plain torch (any device; sync-free, so also graph-capturable)."""

    name = "torch"
    rms_norm = staticmethod(rms_norm_torch)
    add_rms_norm = staticmethod(add_rms_norm_torch)
    rope_write_kv = staticmethod(rope_write_kv_torch)
    silu_mul = staticmethod(silu_mul_torch)
    attention = staticmethod(paged_attention_rows_torch)
    prefill_attention = staticmethod(paged_attention_rows_torch)  # a prefill's rows (`ForwardBatch.prefill`)
    linear = staticmethod(linear_torch)
    norm_linear = staticmethod(norm_linear_torch)
    norm_gate_up_silu = staticmethod(norm_gate_up_silu_torch)
    norm_qkv_rope = staticmethod(norm_qkv_rope_torch)
    eagle_input = staticmethod(eagle_input_torch)
    needs_kv_bound = True  # the torch attention gathers keys up to a static bound
    fold_norms = False  # `FoldedNormOps`: the norms folded into the GEMMs and the kernels after them (the target's
    # layers and an EAGLE-3 head's layer, `fast.path._folded_eagle3_layer`)


class TritonOps(TorchOps):
    """The Triton kernels (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``)."""

    name = "triton"
    rms_norm = staticmethod(rms_norm_triton)
    add_rms_norm = staticmethod(add_rms_norm_triton)
    rope_write_kv = staticmethod(rope_write_kv_triton)
    silu_mul = staticmethod(silu_mul_triton)
    attention = staticmethod(triton_attention())
    prefill_attention = staticmethod(triton_prefill_attention())
    linear = staticmethod(linear_rows)  # row-invariant up to linear_triton.MAX_ROWS rows, F.linear above
    norm_linear = staticmethod(norm_linear_rows)
    norm_gate_up_silu = staticmethod(norm_gate_up_silu_rows)
    norm_qkv_rope = staticmethod(norm_qkv_rope_rows)
    eagle_input = staticmethod(eagle_input_triton)
    needs_kv_bound = False


class BatchInvariantOps(TritonOps):
    """`TritonOps` with the row-invariant GEMMs at every row count (slower than cuBLAS on large batches):
    decode and verify rows agree bitwise at any batch size, prefills included (parity runs)."""

    name = "triton-invariant"
    # a prefill row's bits are the decode row's at its position (`paged_attention_prefill_auto`, whatever the setting)
    prefill_attention = staticmethod(functools.partial(paged_attention_prefill_auto, decode=triton_attention()))
    linear = staticmethod(functools.partial(linear_rows, max_rows=None))
    norm_linear = staticmethod(functools.partial(norm_linear_rows, max_rows=None))
    norm_gate_up_silu = staticmethod(functools.partial(norm_gate_up_silu_rows, max_rows=None))
    norm_qkv_rope = staticmethod(functools.partial(norm_qkv_rope_rows, max_rows=None))


class TritonCublasOps(TritonOps):
    """The fused elementwise Triton ops with ``F.linear`` (cuBLAS) GEMMs and unfused norms: the fast path
    before `engine.kernels.linear_triton` (9 kernels a layer; benchmarks compare against it)."""

    name = "triton-cublas"
    linear = staticmethod(functools.partial(linear_rows, max_rows=0))
    norm_linear = staticmethod(functools.partial(norm_linear_rows, max_rows=0))
    norm_gate_up_silu = staticmethod(functools.partial(norm_gate_up_silu_rows, max_rows=0))
    norm_qkv_rope = staticmethod(functools.partial(norm_qkv_rope_rows, max_rows=0))


def linear_add(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x += F.linear(a, weight)`` in place, one GEMM (cuBLAS's ``beta = 1``: ``x`` is read in the epilogue and
    the sum rounded once). In place because out of place ``addmm`` first copies ``x`` to its result, a second
    kernel (measured: the decode step kept its 278.5 kernels). ``x`` must be a tensor nothing else reads
    later (the fast forward's residual stream)."""
    return x.addmm_(a, weight.t())


class FoldedNormOps(TritonCublasOps):
    """`TritonCublasOps` with the RMSNorms folded away (`fast.path.fold_norm_weights`): each norm's gain lives in
    the next GEMM's weight, its per-row factor ``rsqrt(mean(h^2) + eps)`` is applied by the kernel after the
    GEMM (RoPE + KV write, SiLU-mul), and the residual adds ride on the O and down GEMMs. 7 kernels a
    layer instead of 9. Not bitwise `TorchOps` (the scale is applied after the GEMM's rounding instead of
    before it), but every row is still a function of that row alone, and decode and verify rows run the
    same kernels at the same shapes, so greedy speculative output stays the autoregressive output."""

    name = "triton-cublas-folded"
    fold_norms = True  # an EAGLE-3 head's layer too (`fast.path._folded_eagle3_layer`)
    linear_add = staticmethod(linear_add)


def triton_available() -> bool:
    return triton is not None


CUDA_OPS: type[TorchOps] | None = None  # benchmarks: the op set `default_ops` gives CUDA (None: its choice)


def default_ops(device: torch.device | str) -> type[TorchOps]:
    """`FoldedNormOps` on CUDA when triton imports, torch otherwise.

    Folded norms: on an H100 (SmolLM2 bf16, 00efd53, `decode_profile` and `fused_bench-H100-folded-240-*`)
    the autoregressive decode step went from 278.5 kernels and 1,081 us to 218.5 and 992 us (925 -> 1,008
    tokens/s), 240 prompts x 128 tokens from 851 to 917 tokens/s end to end and fused tree cycles from 1,345 to
    1,419, every output identical to autoregressive in both. `TritonCublasOps` (the norms as kernels) is the
    same with the norms apart. The row-invariant Triton GEMMs (`TritonOps`, `BatchInvariantOps`) are not the
    default: on an H100 (bench/row_linear_bench.py, SmolLM2 bf16, 2026-11-22) they decoded at 593 tokens/s
    against cuBLAS's 769, and a 16-row cuBLAS verify already gave the 1-row decode's logits bitwise there.
    Pass ``ops=`` to use another set (``CUDA_OPS`` sets it for benchmarks).
    """
    if torch.device(device).type == "cuda" and triton is not None:
        return CUDA_OPS or FoldedNormOps
    return TorchOps
