"""Invariant 14 for the fast forward's fused ops: each Triton kernel equals its torch reference.

The references equal engine/models/llama.py's ops (RMSNorm, RoPE, SiLU-mul), checked here too. Strided
views (a column block of a features buffer), padding rows (slot -1: no KV write) and bfloat16.
Runs on CPU under ``TRITON_INTERPRET=1`` (CI) and on a GPU as is.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from speccycle.engine.kernels import fused_ops as kernels
from speccycle.engine.models.llama import RMSNorm, apply_rope, rope_cos_sin

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _exact(dtype):
    """Bitwise in bfloat16, on a GPU and under the interpreter alike: the kernels round float32 -> bfloat16
    to nearest even in integer arithmetic (the interpreter's cast truncates; on a GPU a plain cast lets
    LLVM fuse a product into an ``fma.rn.bf16`` and skip its rounding). Float32: within an ulp or so."""
    if dtype == torch.float32:
        return {"atol": 1e-6, "rtol": 1e-6}
    return {"atol": 0.0, "rtol": 0.0}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_rms_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 40, generator=gen).to(dtype)
    r = torch.randn(5, 40, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(40, generator=gen)).to(dtype)
    reference = RMSNorm(w, 1e-5)(x)
    torch.testing.assert_close(kernels.rms_norm_torch(x, w, 1e-5), reference, atol=0, rtol=0)
    fast = kernels.rms_norm_triton(x.to(DEVICE), w.to(DEVICE), 1e-5).cpu()
    torch.testing.assert_close(fast, reference, **_tol(dtype))

    features = torch.zeros(5, 3 * 40, dtype=dtype)  # the sum goes to a strided column block
    h_ref, y_ref = kernels.add_rms_norm_torch(x, r, w, 1e-5, features[:, 40:80])
    torch.testing.assert_close(h_ref, x + r, atol=0, rtol=0)
    torch.testing.assert_close(y_ref, RMSNorm(w, 1e-5)(x + r), atol=0, rtol=0)
    features_fast = torch.zeros(5, 3 * 40, dtype=dtype, device=DEVICE)
    h, y = kernels.add_rms_norm_triton(x.to(DEVICE), r.to(DEVICE), w.to(DEVICE), 1e-5, features_fast[:, 40:80])
    torch.testing.assert_close(features_fast.cpu(), features, **_exact(dtype))  # the dtype add
    torch.testing.assert_close(h.cpu(), h_ref, **_exact(dtype))
    torch.testing.assert_close(y.cpu(), y_ref, **_tol(dtype))


# heads and KV heads: 2 heads a program; SmolLM2's 9 / 3 (3 a program, a masked fourth lane); 1 a program
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3), (3, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv(dtype, heads, kv_heads):
    gen = torch.Generator().manual_seed(1)
    dim, rows, slots = 16, 6, 20
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 9, 9, 31, 2])
    out_slots = torch.tensor([4, 7, -1, 11, 0, -1])  # -1: padding rows write nothing
    cos, sin = rope_cos_sin(torch.arange(40), dim, 10000.0, dtype)
    caches = {}
    for name, fn, device in (
        ("torch", kernels.rope_write_kv_torch, "cpu"),
        ("triton", kernels.rope_write_kv_triton, DEVICE),
    ):
        k_cache = torch.full((slots, kv_heads, dim), 7.0, dtype=dtype, device=device)
        v_cache = torch.full((slots, kv_heads, dim), 7.0, dtype=dtype, device=device)
        q = fn(qkv.to(device), positions.to(device), cos.to(device), sin.to(device), out_slots.to(device),
               k_cache, v_cache, heads, kv_heads)  # fmt: skip
        caches[name] = (q.cpu(), k_cache.cpu(), v_cache.cpu())
    q_size, kv_size = heads * dim, kv_heads * dim
    q_ref, k_ref, v_ref = qkv.split([q_size, kv_size, kv_size], dim=-1)
    c, s = cos[positions], sin[positions]
    q_ref = apply_rope(q_ref.reshape(rows, heads, dim), c, s)
    k_ref = apply_rope(k_ref.reshape(rows, kv_heads, dim), c, s)
    v_ref = v_ref.reshape(rows, kv_heads, dim)
    for name, (q, k_cache, v_cache) in caches.items():
        tol = _exact(dtype) if name == "triton" else {"atol": 0.0, "rtol": 0.0}  # the same roundings
        torch.testing.assert_close(q, q_ref, **tol, msg=name)
        written = out_slots >= 0
        torch.testing.assert_close(k_cache[out_slots[written]], k_ref[written], **tol, msg=name)
        torch.testing.assert_close(v_cache[out_slots[written]], v_ref[written], atol=0, rtol=0, msg=name)
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[out_slots[written]] = False
        assert bool((k_cache[untouched] == 7).all() and (v_cache[untouched] == 7).all()), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(3, 2 * 48, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    reference = F.silu(gate) * up
    torch.testing.assert_close(kernels.silu_mul_torch(gate_up), reference, atol=0, rtol=0)
    fast = kernels.silu_mul_triton(gate_up.to(DEVICE)).cpu()
    torch.testing.assert_close(fast, reference, **_tol(dtype))


def test_rope_write_kv_reads_strided_positions_and_slots_as_their_values():
    """Index tensors that are views of other strides (expanded, sliced) are read as their values."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, rows, slots = 4, 2, 16, 4, 20
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor([5]).expand(rows)  # stride 0
    out_slots = torch.tensor([[3, 0], [8, 0], [12, 0], [17, 0]])[:, 0]  # stride 2
    cos, sin = rope_cos_sin(torch.arange(40), dim, 10000.0, torch.float32)
    results = []
    for pos, slot in ((positions, out_slots), (positions.contiguous(), out_slots.contiguous())):
        k_cache = torch.zeros((slots, kv_heads, dim), device=DEVICE)
        v_cache = torch.zeros((slots, kv_heads, dim), device=DEVICE)
        q = kernels.rope_write_kv_triton(qkv.to(DEVICE), pos.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE),
                                         slot.to(DEVICE), k_cache, v_cache, heads, kv_heads)  # fmt: skip
        results.append((q.cpu(), k_cache.cpu(), v_cache.cpu()))
    for got, want in zip(results[0], results[1]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_folded_norm_prologues_equal_their_twins(dtype):
    """`FoldedNormOps`: the RoPE + KV-write and SiLU-mul kernels scale each row by its residual row's RMS
    factor first. The twins equal the folded algebra (norm gain in the weight, factor after the GEMM), and
    the kernels equal the twins; in float32 the folded GEMM equals the norm-then-GEMM one closely."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, hidden, rows = 4, 2, 8, 40, 5
    h = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)  # the residual stream, not unit scale
    gain = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    w = (0.2 * torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=gen)).to(dtype)
    folded = (w.float() * gain.float()[None, :]).to(dtype)
    qkv = F.linear(h, folded)
    scale = kernels.rms_scale_torch(h, 1e-5)
    torch.testing.assert_close(kernels.scale_rows_torch(qkv, h, 1e-5), (qkv.float() * scale).to(dtype), atol=0, rtol=0)
    if dtype == torch.float32:  # the algebra: F.linear(rms_norm(h), w) == F.linear(h, w * g) * rms_scale(h)
        torch.testing.assert_close(
            kernels.scale_rows_torch(qkv, h, 1e-5), F.linear(RMSNorm(gain, 1e-5)(h), w), atol=1e-5, rtol=1e-5
        )
    cos, sin = rope_cos_sin(torch.arange(64), dim, 10000.0, dtype)
    positions = torch.tensor([3, 0, 17, 17, 40])
    slots = torch.tensor([4, -1, 9, 2, 11])
    outs = {}
    for name, fn, device in (
        ("torch", kernels.rope_write_kv_torch, "cpu"),
        ("triton", kernels.rope_write_kv_triton, DEVICE),
    ):
        k_cache = torch.zeros(16, kv_heads, dim, dtype=dtype, device=device)
        v_cache = torch.zeros(16, kv_heads, dim, dtype=dtype, device=device)
        q = fn(qkv.to(device), positions.to(device), cos.to(device), sin.to(device), slots.to(device),
               k_cache, v_cache, heads, kv_heads, h.to(device), 1e-5)  # fmt: skip
        outs[name] = (q.cpu(), k_cache.cpu(), v_cache.cpu())
    plain = torch.zeros(16, kv_heads, dim, dtype=dtype), torch.zeros(16, kv_heads, dim, dtype=dtype)
    q_plain = kernels.rope_write_kv_torch(kernels.scale_rows_torch(qkv, h, 1e-5), positions, cos, sin, slots,
                                          *plain, heads, kv_heads)  # fmt: skip
    for got, want in zip(outs["torch"], (q_plain, *plain)):  # the twin: scale, then the plain RoPE
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    for got, want in zip(outs["triton"], outs["torch"]):  # the factor's sum may round in another order
        torch.testing.assert_close(got, want, **_tol(dtype))

    gate_up = F.linear(h, (0.2 * torch.randn(2 * 24, hidden, generator=gen)).to(dtype))
    want = kernels.silu_mul_torch(kernels.scale_rows_torch(gate_up, h, 1e-5))
    torch.testing.assert_close(kernels.silu_mul_torch(gate_up, h, 1e-5), want, atol=0, rtol=0)
    fast = kernels.silu_mul_triton(gate_up.to(DEVICE), h.to(DEVICE), 1e-5).cpu()
    torch.testing.assert_close(fast, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_copies_the_norm_source_into_a_strided_feature_view(dtype):
    """``copy_src_to``: the folded RoPE kernel writes the residual rows it reads (EAGLE-3's features) into a
    column block of a wider buffer, exactly, and leaves the rest of that buffer as it was; Q, K and V are
    what they are without the copy."""
    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, dim, hidden, rows = 4, 2, 16, 40, 5
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    h = torch.randn(rows, hidden, generator=gen).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(64), dim, 10000.0, dtype)
    positions, slots = torch.tensor([3, 0, 17, 17, 40]), torch.tensor([4, -1, 9, 2, 11])
    for fn, device in ((kernels.rope_write_kv_torch, "cpu"), (kernels.rope_write_kv_triton, DEVICE)):
        args = [t.to(device) for t in (qkv, positions, cos, sin, slots)]
        results = []
        for copy in (False, True):
            features = torch.full((rows, 3 * hidden), 7.0, dtype=dtype, device=device)
            caches = [torch.zeros(16, kv_heads, dim, dtype=dtype, device=device) for _ in range(2)]
            view = features[:, hidden : 2 * hidden] if copy else None
            q = fn(*args, *caches, heads, kv_heads, h.to(device), 1e-5, view)
            results.append([t.cpu() for t in (q, *caches)])
            if copy:
                assert torch.equal(features[:, hidden : 2 * hidden].cpu(), h)
                assert bool((features[:, :hidden] == 7).all()) and bool((features[:, 2 * hidden :] == 7).all())
        for got, want in zip(*results):
            assert torch.equal(got, want)
        with pytest.raises(ValueError, match="copy_src_to receives norm_src"):
            fn(*args, *caches, heads, kv_heads, None, 0.0, features[:, :hidden])


def test_linear_add_is_one_gemm_with_the_residual():
    gen = torch.Generator().manual_seed(6)
    x, a, w = torch.randn(4, 12, generator=gen), torch.randn(4, 20, generator=gen), torch.randn(12, 20, generator=gen)
    want = x + F.linear(a, w)
    got = kernels.linear_add(x, a, w)
    assert got is x  # in place: no copy kernel
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_eagle_input_equals_its_twin_and_the_unfused_ops(dtype):
    """An EAGLE-3 head's layer input in one kernel: the token's embedding and the hidden row, each RMS-normed
    with its own gain, side by side, and a fresh copy of the hidden row (the residual the O and down GEMMs add
    into in place). The twin is the unfused ops; the kernel reads a strided hidden view and padding tokens."""
    gen = torch.Generator().manual_seed(7)
    vocab, hidden, rows = 50, 40, 6
    embed = torch.randn(vocab, hidden, generator=gen).to(dtype)
    wide = (3 * torch.randn(rows, 2 * hidden, generator=gen)).to(dtype)
    h = wide[:, hidden:]  # a strided view, as a gathered parent's state may be
    ids = torch.tensor([0, 49, 7, 7, 3, 0])
    g_e = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    g_h = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    want = torch.cat([RMSNorm(g_e, 1e-5)(F.embedding(ids, embed)), RMSNorm(g_h, 1e-5)(h)], -1)
    normed, residual = kernels.eagle_input_torch(ids, embed, h, g_e, g_h, 1e-5)
    torch.testing.assert_close(normed, want, atol=0, rtol=0)
    assert torch.equal(residual, h) and residual.data_ptr() != h.data_ptr()
    fast, fast_residual = kernels.eagle_input_triton(
        ids.to(DEVICE), embed.to(DEVICE), h.to(DEVICE), g_e.to(DEVICE), g_h.to(DEVICE), 1e-5
    )
    torch.testing.assert_close(fast.cpu(), want, **_tol(dtype))
    assert torch.equal(fast_residual.cpu(), h)  # a copy, bit for bit
    empty, empty_residual = kernels.eagle_input_triton(
        ids[:0].to(DEVICE), embed.to(DEVICE), h[:0].to(DEVICE), g_e.to(DEVICE), g_h.to(DEVICE), 1e-5
    )
    assert empty.shape == (0, 2 * hidden) and empty_residual.shape == (0, hidden)
