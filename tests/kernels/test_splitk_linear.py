"""`engine.splitk_linear`: the split-K GEMM for few rows equals its torch reference within the dtype's rounding,
its rows are bitwise independent of the row count, and a K that its tile cannot split is refused.

Under ``TRITON_INTERPRET=1`` (its products and sums as `linear_triton`'s, not numpy's matmul). On an H100 it lost
to cuBLAS at the 8B shape's O and down projections (bench/results/blas_rows_bench-H100-cold-*), so no op set uses
it; `bench/blas_rows_bench.py --parts splitk` measures it again.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from speccycle.engine.splitk_linear import SplitKConfig, splitk_config, splitk_linear, splitk_linear_add  # noqa: E402

CONFIG = SplitKConfig(block_m=16, block_n=32, block_k=32, splits=4)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU, the compiled kernels on a GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_splitk_equals_the_reference_and_adds_in_place(dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=gen).to(DEVICE, dtype)
    a = torch.randn(7, 256, generator=gen).to(DEVICE, dtype)
    x = torch.randn(7, 96, generator=gen).to(DEVICE, dtype)
    exact = a.double() @ w.double().T
    tol = 1e-4 if dtype == torch.float32 else 0.15  # bfloat16: half an ulp at |y| < 64 is 0.125
    assert (splitk_linear(a, w, config=CONFIG).double() - exact).abs().max() < tol
    y = x.clone()
    assert splitk_linear_add(y, a, w, config=CONFIG) is y
    assert (y.double() - (x.double() + exact)).abs().max() < tol


def test_splitk_rows_do_not_depend_on_the_row_count():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=gen).to(DEVICE, torch.bfloat16)
    a = torch.randn(20, 128, generator=gen).to(DEVICE, torch.bfloat16)
    full = splitk_linear(a, w, config=CONFIG)
    for rows in (1, 5, 17):
        assert torch.equal(splitk_linear(a[:rows], w, config=CONFIG), full[:rows])
    assert torch.equal(splitk_linear(a[9:10], w, config=CONFIG)[0], full[9])


def test_splitk_refuses_what_it_cannot_split_and_picks_whole_steps():
    w, a = torch.zeros(32, 96, device=DEVICE), torch.zeros(2, 96, device=DEVICE)
    with pytest.raises(ValueError, match="splits"):
        splitk_linear(a, w, config=SplitKConfig(block_k=64, splits=2))
    with pytest.raises(ValueError, match="x must be"):
        splitk_linear_add(torch.zeros(2, 31, device=DEVICE), a, w, config=SplitKConfig(block_k=32, splits=3))
    config = splitk_config(4096, 14336, torch.bfloat16)
    assert 14336 % (config.splits * config.block_k) == 0
