"""The row-invariant GEMMs of `engine.kernels.linear_triton`: equal to their references, and a row's bits never
depend on the row count or the other rows (what makes a verify row compute a decode step's logits).

Runs on CPU under ``TRITON_INTERPRET=1`` (CI) and on a GPU as is. The interpreter checks the kernels'
tiling, masks, fused prologues and epilogues, and their fixed reduction order; its ``tl.dot`` stand-in
is a product-and-sum (numpy's matmul is not row-invariant), so the tensor-core MMA's invariance is
checked on a GPU (this file there, and ``bench/row_linear_bench.py``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from speccycle.core.ports import ForwardBatch
from speccycle.engine.fast.path import FastOptions, FastTarget
from speccycle.engine.greedy import extend_batch
from speccycle.engine.kernels import fused_ops as kernels
from speccycle.engine.kernels import linear_triton as lt
from speccycle.engine.kernels.fused_ops import BatchInvariantOps, TorchOps, TritonCublasOps, TritonOps
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import random_llama_weights, rope_cos_sin
from speccycle.engine.models.target import LlamaTarget
from speccycle.engine.weights.weights_gguf import LlamaConfig

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
K, N = 48, 40  # neither a multiple of the tile: masked columns and a masked K tail


def _tol(dtype):  # against float32 math on the same inputs: the output's rounding plus reduction order
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}.get(
        dtype, dict(atol=3e-2, rtol=2e-2)
    )


def _data(dtype, rows=37, k=K, n=N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    r = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    w = (0.2 * torch.randn(n, k, generator=gen)).to(dtype).to(DEVICE)
    return x, r, norm_w, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_linear_equals_reference(dtype):
    x, _, _, w = _data(dtype)
    got = lt.row_linear(x, w)
    assert got.dtype == dtype and got.shape == (37, N)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), **_tol(dtype))
    wide = lt.row_linear(x, w, torch.float32)  # stored as float32, rounded to the dtype first
    assert wide.dtype == torch.float32 and torch.equal(wide, got.float())
    assert lt.row_linear(x[:0], w).shape == (0, N)
    strided = torch.zeros(37, 3 * K, dtype=dtype, device=DEVICE)
    strided[:, K : 2 * K] = x
    assert torch.equal(lt.row_linear(strided[:, K : 2 * K], w), got)  # a row stride other than K


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_linear_rows_do_not_depend_on_the_batch(dtype):
    x, _, _, w = _data(dtype, rows=40)
    full = lt.row_linear(x, w)
    for t in (1, 2, 3, 7, 15, 16, 17, 31, 33):
        assert torch.equal(lt.row_linear(x[:t], w), full[:t]), t
    for r in (0, 5, 15, 16, 23, 39):  # each row alone, wherever it sat in the tile of the full call
        assert torch.equal(lt.row_linear(x[r : r + 1], w), full[r : r + 1]), r
    other = torch.randn(40, K, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
    other[[3, 20]] = x[[3, 20]]  # the same rows among different neighbours
    mixed = lt.row_linear(other, w)
    assert torch.equal(mixed[[3, 20]], full[[3, 20]])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_linear_equals_reference_and_is_row_invariant(dtype):
    x, r, norm_w, w = _data(dtype)
    for residual in (None, r):
        features = torch.zeros(37, 3 * K, dtype=dtype, device=DEVICE)  # h also goes to a strided column block
        h, y = lt.norm_linear_triton(x, residual, norm_w, 1e-5, w, features[:, K : 2 * K], torch.float32)
        h_ref, y_ref = kernels.norm_linear_torch(x, residual, norm_w, 1e-5, w, None, torch.float32)
        assert torch.equal(h, h_ref) and torch.equal(features[:, K : 2 * K], h_ref)  # the dtype add is torch's
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, y_ref, **_tol(dtype))
        for t in (1, 16, 17):
            part = None if residual is None else residual[:t]
            h_t, y_t = lt.norm_linear_triton(x[:t], part, norm_w, 1e-5, w, None, torch.float32)
            assert torch.equal(y_t, y[:t]) and torch.equal(h_t, h[:t])
        h_one, y_one = lt.norm_linear_triton(x[30:31], None if residual is None else r[30:31], norm_w, 1e-5, w)
        assert torch.equal(y_one.float(), y[30:31])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_gate_up_silu_equals_reference_and_is_row_invariant(dtype):
    x, r, norm_w, w = _data(dtype, n=2 * 24)  # gate and up: 24 columns each (a masked column block)
    for residual in (None, r):
        h, act = lt.norm_gate_up_silu_triton(x, residual, norm_w, 1e-5, w)
        h_ref, act_ref = kernels.norm_gate_up_silu_torch(x, residual, norm_w, 1e-5, w)
        assert act.shape == (37, 24) and act.dtype == dtype
        assert torch.equal(h, h_ref)
        torch.testing.assert_close(act.float(), act_ref.float(), **_tol(dtype))
        for t in (1, 5, 16, 17):
            _, act_t = lt.norm_gate_up_silu_triton(x[:t], None if residual is None else r[:t], norm_w, 1e-5, w)
            assert torch.equal(act_t, act[:t]), t


def _rope_case(dtype, rows=21, heads=3, kv_heads=1, head_dim=16, num_slots=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = 48
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    r = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    w = (0.2 * torch.randn((heads + 2 * kv_heads) * head_dim, k, generator=gen)).to(dtype).to(DEVICE)
    cos, sin = rope_cos_sin(torch.arange(64), head_dim, 10000.0, dtype)
    positions = torch.randint(0, 64, (rows,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_slots, generator=gen)[:rows].to(DEVICE)
    slots[[2, 7]] = -1  # padding rows: no KV write
    return x, r, norm_w, w, positions, cos.to(DEVICE), sin.to(DEVICE), slots, (heads, kv_heads, head_dim, num_slots)


def _caches(dims, dtype):
    heads, kv_heads, head_dim, num_slots = dims
    return [torch.full((num_slots, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE) for _ in range(2)]


@pytest.mark.parametrize(
    "dtype,head_dim", [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 64)], ids=str
)  # D 64: two programs per head (16 of its 32 rotated pairs each)
def test_norm_qkv_rope_equals_reference_and_is_row_invariant(dtype, head_dim):
    x, r, norm_w, w, positions, cos, sin, slots, dims = _rope_case(dtype, head_dim=head_dim)
    heads, kv_heads = dims[:2]
    for residual, nw in ((r, norm_w), (None, norm_w), (None, None)):
        features = torch.zeros(21, 2 * 48, dtype=dtype, device=DEVICE) if nw is not None else None
        sum_out = None if features is None else features[:, 48:]
        k_cache, v_cache = _caches(dims, dtype)
        h, q = lt.norm_qkv_rope_triton(x, residual, nw, 1e-5, w, sum_out, positions, cos, sin, slots, k_cache,
                                       v_cache, heads, kv_heads)  # fmt: skip
        k_ref, v_ref = _caches(dims, dtype)
        h_ref, q_ref = kernels.norm_qkv_rope_torch(x, residual, nw, 1e-5, w, None, positions, cos, sin, slots, k_ref,
                                              v_ref, heads, kv_heads)  # fmt: skip
        assert torch.equal(h, h_ref)
        if sum_out is not None:
            assert torch.equal(sum_out, h_ref)
        tol = _tol(dtype)
        torch.testing.assert_close(q.float(), q_ref.float(), **tol)
        torch.testing.assert_close(k_cache.float(), k_ref.float(), **tol)
        torch.testing.assert_close(v_cache.float(), v_ref.float(), **tol)
        untouched = torch.ones(dims[3], dtype=torch.bool)
        untouched[slots[slots >= 0].cpu()] = False
        assert bool((k_cache[untouched.to(DEVICE)] == 7).all() and (v_cache[untouched.to(DEVICE)] == 7).all())
        for t in (1, 16, 17):  # the first t rows alone: the same Q and cache bits
            k_t, v_t = _caches(dims, dtype)
            _, q_t = lt.norm_qkv_rope_triton(x[:t], None if residual is None else residual[:t], nw, 1e-5, w, None,
                                             positions[:t], cos, sin, slots[:t], k_t, v_t, heads, kv_heads)  # fmt: skip
            assert torch.equal(q_t, q[:t])
            written = slots[:t][slots[:t] >= 0]
            assert torch.equal(k_t[written], k_cache[written]) and torch.equal(v_t[written], v_cache[written])


def test_op_sets_route_by_row_count():
    x, r, norm_w, w = _data(torch.float32, rows=lt.MAX_ROWS + 1, k=16, n=16)
    # above the bound TritonOps takes F.linear (cuBLAS / MKL) and the unfused norm; BatchInvariantOps does not
    assert torch.equal(TritonOps.linear(x, w), F.linear(x, w))
    assert torch.equal(BatchInvariantOps.linear(x, w), lt.row_linear(x, w))
    assert torch.equal(BatchInvariantOps.linear(x[:3], w), TritonOps.linear(x[:3], w))
    h, y = TritonOps.norm_linear(x, r, norm_w, 1e-5, w)
    h_ref, y_ref = TorchOps.norm_linear(x, r, norm_w, 1e-5, w)
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    _, act = BatchInvariantOps.norm_gate_up_silu(x, r, norm_w, 1e-5, w)
    assert torch.equal(act, lt.norm_gate_up_silu_triton(x, r, norm_w, 1e-5, w)[1])
    assert torch.equal(TritonCublasOps.linear(x[:1], w), F.linear(x[:1], w))  # cuBLAS at any row count


def test_errors_say_what_to_do():
    x, _, norm_w, w = _data(torch.float32, rows=2)
    with pytest.raises(ValueError, match="weight"):
        lt.row_linear(x, w[:, :10])
    with pytest.raises(ValueError, match="dtype"):
        lt.row_linear(x.double(), w.double())
    with pytest.raises(ValueError, match="even"):
        lt.norm_gate_up_silu_triton(x, None, norm_w, 1e-5, w[:39])
    with pytest.raises(ValueError, match="norm weight"):
        lt.norm_linear_triton(x, None, norm_w[:5], 1e-5, w)


# ---- a tiny model: a verify batch's rows are bitwise its decode steps ---------------------------------
SMALL = LlamaConfig(
    architecture="llama",
    vocab_size=80,
    hidden_size=48,
    intermediate_size=40,
    num_layers=2,
    num_heads=3,
    num_kv_heads=1,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=128,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def _target(dtype, ops):
    weights = {k: v.to(dtype) for k, v in random_llama_weights(SMALL, seed=4, scale=0.3).items()}
    pool = PagedKVPool(num_pages=32, page_size=4, device=DEVICE)
    target = LlamaTarget.from_weights(SMALL, weights, pool, dtype=dtype)
    options = FastOptions(DEVICE, graphs=False, ops=ops, max_rows=32, min_target_rows=1)
    return FastTarget(target, pool, options), pool


def _chain_verify_batch(pool, request_ids, lengths, tokens) -> ForwardBatch:
    """A chain verify per request: row ``d`` at ``L + d``, prefix ``L``, its ancestors (itself last) as extras."""
    n = len(tokens[0])
    rows, extra = [], []
    for b, (rid, length) in enumerate(zip(request_ids, lengths)):
        pool.allocate(rid, length + n)
        slots = pool.slots_for([rid], torch.arange(length, length + n, device=pool.device)[None])[0]
        for d in range(n):
            rows.append((tokens[b][d], length + d, b, int(slots[d]), length))
            extra.append([int(s) for s in slots[: d + 1]] + [-1] * (n - d - 1))
    col = list(zip(*rows))
    long = dict(dtype=torch.long, device=pool.device)
    return ForwardBatch(
        input_ids=torch.tensor(col[0], **long),
        positions=torch.tensor(col[1], **long),
        row_request=torch.tensor(col[2], **long),
        out_slots=torch.tensor(col[3], **long),
        prefix_lens=torch.tensor(col[4], **long),
        extra_slots=torch.tensor(extra, **long),
        page_table=pool.page_table(list(request_ids)),
        page_size=pool.page_size,
        request_ids=tuple(request_ids),
    )


def test_verify_logits_are_bitwise_the_decode_logits(ops=TritonOps):
    """bfloat16, two requests: one verify forward of 2 x 5 rows against 5 decode forwards of 2 rows (and of
    1 row for the first request): the logits and hidden states of each token are bitwise equal."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, SMALL.vocab_size, (n,), generator=gen).tolist() for n in (9, 6)]
    chain = [torch.randint(3, SMALL.vocab_size, (5,), generator=gen).tolist() for _ in prompts]
    lengths = [len(p) for p in prompts]

    verify_target, pool = _target(dtype, ops)
    verify_target.forward(extend_batch(pool, [0, 1], prompts, [0, 0]))
    verify = verify_target.forward(_chain_verify_batch(pool, [0, 1], lengths, chain))

    decode_target, pool = _target(dtype, ops)
    decode_target.forward(extend_batch(pool, [0, 1], prompts, [0, 0]))  # the same prefill: the same KV bits
    for d in range(5):
        step = decode_target.forward(extend_batch(pool, [0, 1], [[c[d]] for c in chain], [n + d for n in lengths]))
        for b in range(2):
            assert torch.equal(step.logits[b], verify.logits[5 * b + d]), (b, d)
            assert torch.equal(step.hidden[b], verify.hidden[5 * b + d]), (b, d)

    single_target, pool = _target(dtype, ops)  # request 0 alone: a 1-row decode
    single_target.forward(extend_batch(pool, [0], prompts[:1], [0]))
    for d in range(2):
        step = single_target.forward(extend_batch(pool, [0], [[chain[0][d]]], [lengths[0] + d]))
        assert torch.equal(step.logits[0], verify.logits[d]), d

    reference_target, pool = _target(dtype, TorchOps)  # and the fused forward tracks the plain one
    reference_target.forward(extend_batch(pool, [0, 1], prompts, [0, 0]))
    reference = reference_target.forward(_chain_verify_batch(pool, [0, 1], lengths, chain))
    torch.testing.assert_close(verify.logits, reference.logits, atol=0.1, rtol=0.05)
