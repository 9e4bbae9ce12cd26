"""`engine.kernels.int8_linear`: the weight-only int8 GEMM equals its torch reference (one split and two, adding in
place or not, ragged rows, columns and K), `Int8Rowwise` recovers the integers a head was stored as, bad input is
refused with what to do, and the default tile follows the H100 sweep's rule.

Under ``TRITON_INTERPRET=1`` at small shapes; on an H100 `bench/int8_linear_bench.py` times it and checks it against
the reference at the 8B head's shapes (bench/results/int8_linear_bench-H100-{20261126-1381642,274181b,4585721}-*).
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from speccycle.engine.drafters.eagle_pack import dequantize_rowwise, quantize_rowwise  # noqa: E402
from speccycle.engine.kernels.int8_linear import (  # noqa: E402
    Int8Config,
    Int8Rowwise,
    int8_config,
    int8_linear,
    int8_linear_add,
    int8_linear_add_triton,
    int8_linear_torch,
    int8_linear_triton,
)

SPLIT2 = Int8Config(block_m=16, block_n=32, block_k=64, splits=2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU, the compiled kernels on a GPU


def _weight(n, k, seed):
    return Int8Rowwise.from_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE))


def _close(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> bool:
    """Within one rounding to ``dtype`` (half an ulp, with float32's summation order on top)."""
    rel = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-8}[dtype]
    return bool(((got.double() - exact).abs() <= rel * exact.abs() + 1e-3).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [None, SPLIT2], ids=["default", "split2"])
def test_int8_linear_equals_the_reference_and_adds_in_place(dtype, config):
    gen = torch.Generator().manual_seed(0)
    w = _weight(96, 256, 1)
    a = torch.randn(7, 256, generator=gen).to(DEVICE, dtype)
    x = torch.randn(7, 96, generator=gen).to(DEVICE, dtype)
    exact = (a.double() @ w.q.double().T) * w.scale.double()
    assert _close(int8_linear_triton(a, w, config=config), exact, dtype)
    wide = int8_linear_triton(a, w, torch.float32, config=config)
    assert wide.dtype == torch.float32 and torch.equal(wide, int8_linear_triton(a, w, config=config).float())
    y = x.clone()
    assert int8_linear_add_triton(y, a, w, config=config) is y
    assert _close(y, x.double() + exact, dtype)
    ref = x.clone()
    int8_linear_torch(a, w, x=ref)
    assert _close(y, ref.double(), dtype)


@pytest.mark.parametrize("rows,n,k", [(1, 40, 200), (17, 33, 100), (3, 70, 96)])
def test_ragged_rows_columns_and_k(rows, n, k):
    """Row blocks of 16 and 32, a column block past ``N``, a K that is no whole number of steps (masked)."""
    gen = torch.Generator().manual_seed(rows)
    w = _weight(n, k, rows)
    a = torch.randn(rows, k, generator=gen).to(DEVICE, torch.bfloat16)
    exact = (a.double() @ w.q.double().T) * w.scale.double()
    assert _close(int8_linear_triton(a, w), exact, torch.bfloat16)
    assert int8_linear_triton(a[:0], w).shape == (0, n)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's dispatch on CPU tensors")
def test_the_dispatch_takes_the_kernel_under_the_interpreter_and_torch_without(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    w = _weight(48, 64, 2)
    a = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 48, generator=gen).to(torch.bfloat16)
    kernel, kernel_sum = int8_linear(a, w), int8_linear_add(x.clone(), a, w)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU tensor without the interpreter: the reference
    torch.testing.assert_close(int8_linear(a, w), kernel, atol=1e-3, rtol=2**-8)
    torch.testing.assert_close(int8_linear_add(x.clone(), a, w), kernel_sum, atol=1e-3, rtol=2**-8)
    assert torch.equal(int8_linear(a, w), int8_linear_torch(a, w))


def test_from_weight_recovers_the_stored_integers_through_bfloat16():
    """A head stored int8-rowwise is loaded dequantized (float32) and cast to bfloat16; quantizing that again gives
    back the stored integers but where bfloat16's rounding (2^-9 of the value and of the row's largest) crosses half
    a step: at most one step, on a few values in ten thousand (45 of 102,400 here)."""
    w = torch.randn(256, 400, generator=torch.Generator().manual_seed(3)) * 0.02
    q, scale = quantize_rowwise(w)
    again = Int8Rowwise.from_weight(dequantize_rowwise(q, scale).to(torch.bfloat16))
    moved = (again.q.int() - q.int()).abs()
    assert moved.max() <= 1 and moved.float().mean() < 1e-3
    torch.testing.assert_close(again.scale, scale, atol=0, rtol=2**-8)
    assert again.nbytes == 256 * 400 + 4 * 256
    exact = Int8Rowwise(q, scale)
    assert torch.equal(exact.dequantize(), dequantize_rowwise(q, scale))


def test_bad_weights_and_activations_are_refused():
    q = torch.zeros(8, 16, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="2-D int8"):
        Int8Rowwise(q.float(), torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match="2-D int8"):
        Int8Rowwise(q.t(), torch.ones(16, device=DEVICE))  # not contiguous along K
    with pytest.raises(ValueError, match=r"float32 \[8\]"):
        Int8Rowwise(q, torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match=r"float32 \[8\]"):
        Int8Rowwise(q, torch.ones(8, dtype=torch.float64, device=DEVICE))
    w = Int8Rowwise(q, torch.ones(8, device=DEVICE))
    zeros = functools.partial(torch.zeros, device=DEVICE)
    with pytest.raises(TypeError, match="must be an Int8Rowwise"):
        int8_linear_triton(zeros(2, 16), q)
    with pytest.raises(ValueError, match=r"\[T, 16\]"):
        int8_linear_triton(zeros(2, 12), w)
    with pytest.raises(ValueError, match="activations must be one of"):
        int8_linear_triton(zeros(2, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="splits of whole"):
        int8_linear_triton(zeros(2, 16), w, config=Int8Config(block_k=16, splits=3))
    with pytest.raises(ValueError, match="out_dtype must be the activations' dtype or float32"):
        int8_linear_triton(zeros(2, 16, dtype=torch.bfloat16), w, torch.float16)
    with pytest.raises(ValueError, match=r"x must be a \[2, 8\]"):
        int8_linear_add_triton(zeros(2, 9), zeros(2, 16), w)


def test_the_default_tile_follows_the_sweep():
    """bench/results/int8_linear_bench-H100-4585721-sweep-*: wide weights 32 x 128, 3 stages, one split; narrow
    ones 32 x 256, 5 stages, K split in 2 from 8,192 columns; 16 / 32 / 64 rows a block."""
    gate_up, lm_head = int8_config(4, 28672, 4096), int8_config(1, 32000, 4096)
    for c in (gate_up, lm_head):
        assert (c.block_m, c.block_n, c.block_k, c.num_stages, c.splits) == (16, 32, 128, 3, 1)
    assert (int8_config(4, 4096, 4096).block_k, int8_config(4, 4096, 4096).splits) == (256, 1)  # O
    for k in (8192, 12288, 14336):  # QKV, fc, down
        c = int8_config(1, 6144 if k == 8192 else 4096, k)
        assert (c.block_k, c.num_stages, c.splits) == (256, 5, 2)
    assert [int8_config(r, 4096, 4096).block_m for r in (1, 16, 17, 32, 33, 512)] == [16, 16, 32, 32, 64, 64]
    small = int8_config(3, 10, 20)  # a tiny weight: blocks no larger than it needs (16 at least)
    assert (small.block_n, small.block_k, small.splits) == (16, 32, 1)
