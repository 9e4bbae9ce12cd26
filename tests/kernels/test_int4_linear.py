"""`engine.int4_linear`: the weight-only int4 GEMM equals its torch reference (one split and two, one group a K step
and two, adding in place or not, ragged rows and columns, groups of 128 / 64 / 32), `Int4Grouped` packs what it
unpacks and stays within half a step of the weight, bad input is refused with what to do, and the default tile
follows its rule.

Under ``TRITON_INTERPRET=1`` at small shapes; on a GPU `bench/int8_linear_bench.py --forms int4` times it and checks
it against the reference at the 8B head's shapes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from speccycle.engine.int4_linear import (  # noqa: E402
    Int4Config,
    Int4Grouped,
    group_size,
    int4_config,
    int4_linear,
    int4_linear_add,
    int4_linear_add_triton,
    int4_linear_torch,
    int4_linear_triton,
    quantize_int4,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU, the compiled kernels on a GPU
SPLIT2 = Int4Config(block_m=16, block_n=32, groups=1, splits=2)
TWO_GROUPS = Int4Config(block_m=16, block_n=16, groups=2, splits=1)


def _dense(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE) * 0.05


def _exact(a: torch.Tensor, w: Int4Grouped) -> torch.Tensor:
    """Float64: ``a @ (q * scale)^T``."""
    return a.double() @ w.dequantize(torch.float64).T


def _close(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> bool:
    """Within one rounding to ``dtype`` (half an ulp, with float32's summation order on top)."""
    rel = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-8}[dtype]
    return bool(((got.double() - exact).abs() <= rel * exact.abs() + 1e-4).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [None, SPLIT2, TWO_GROUPS], ids=["default", "split2", "two-groups"])
def test_int4_linear_equals_the_reference_and_adds_in_place(dtype, config):
    gen = torch.Generator().manual_seed(0)
    w = Int4Grouped.from_weight(_dense(40, 512, 1))
    assert w.group == 128
    a = torch.randn(7, 512, generator=gen).to(DEVICE, dtype)
    x = torch.randn(7, 40, generator=gen).to(DEVICE, dtype)
    exact = _exact(a, w)
    assert _close(int4_linear_triton(a, w, config=config), exact, dtype)
    wide = int4_linear_triton(a, w, torch.float32, config=config)
    assert wide.dtype == torch.float32 and torch.equal(wide, int4_linear_triton(a, w, config=config).float())
    y = x.clone()
    assert int4_linear_add_triton(y, a, w, config=config) is y
    assert _close(y, x.double() + exact, dtype)
    ref = x.clone()
    int4_linear_torch(a, w, x=ref)
    assert _close(y, ref.double(), dtype)
    assert _close(int4_linear_torch(a, w), exact, dtype)


@pytest.mark.parametrize("k,group", [(192, 64), (96, 32), (1728, 64)])
@pytest.mark.parametrize("rows", [1, 17])
def test_int4_linear_takes_every_group_size_and_ragged_tiles(k, group, rows):
    """Groups of 64 and 32 (SmolLM2's 576- and 1,728-wide inputs take 64), 17 rows over two 16-row blocks, 33 columns
    over two 32-column blocks."""
    w = Int4Grouped.from_weight(_dense(33, k, 2))
    assert w.group == group == group_size(k)
    a = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert _close(int4_linear(a, w), _exact(a, w), torch.float32)
    x = torch.randn(rows, 33, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    y = x.clone()
    int4_linear_add(y, a, w)
    assert _close(y, x.double() + _exact(a, w), torch.float32)


def test_int4_packing_holds_the_integers_and_half_a_step():
    """Byte ``j`` of a group holds its columns ``j`` (low nibble) and ``j + group / 2`` (high); the integers are
    -7..7, the largest of each group's magnitudes is 7, and every weight is within half a step (plus the bfloat16
    scale's rounding) of its dequantized value. A dequantized weight packs back to the same bytes, and an all-zero
    group gets scale 1."""
    dense = _dense(6, 256, 5)
    dense[2, :128] = 0
    w = Int4Grouped.from_weight(dense)
    q = w.integers()
    assert q.dtype == torch.int8 and int(q.abs().max()) == 7 and int(q.min()) >= -7
    groups = q.reshape(6, 2, 128).abs().amax(dim=2)
    assert bool((groups[torch.arange(6) != 2] == 7).all()) and int(groups[2, 0]) == 0 and float(w.scale[0, 2]) == 1.0
    step = w.scale.float().t().repeat_interleave(128, dim=1)
    assert bool(((w.dequantize() - dense.float()).abs() <= 0.5 * step * (1 + 2**-7) + 1e-12).all())
    lo, hi = (w.packed[:, :64] & 15).to(torch.int8) - 8, (w.packed[:, :64] >> 4).to(torch.int8) - 8
    assert torch.equal(lo, q[:, :64]) and torch.equal(hi, q[:, 64:128])
    again = Int4Grouped.from_weight(w.dequantize())
    assert torch.equal(again.packed, w.packed) and torch.equal(again.scale, w.scale)
    packed, scale = quantize_int4(dense, 64)
    assert packed.shape == (6, 128) and scale.shape == (4, 6) and scale.dtype == torch.bfloat16
    assert w.nbytes == 6 * 128 + 2 * 6 * 2


def test_int4_refusals_say_what_to_do():
    w = Int4Grouped.from_weight(_dense(8, 128, 6))
    with pytest.raises(ValueError, match="K divisible by 32; got K=48"):
        Int4Grouped.from_weight(torch.randn(4, 48))
    with pytest.raises(ValueError, match="2-D float weight"):
        Int4Grouped.from_weight(torch.zeros(4, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="groups of 128 do not divide K=192"):
        Int4Grouped.from_weight(torch.randn(4, 192), group=128)
    with pytest.raises(ValueError, match="group must be one of"):
        Int4Grouped(w.packed, w.scale, 16)
    with pytest.raises(ValueError, match="scale must be bfloat16"):
        Int4Grouped(w.packed, w.scale.float(), 128)
    with pytest.raises(ValueError, match=r"a must be \[T, 128\]"):
        int4_linear_triton(torch.randn(2, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="activations must be one of"):
        int4_linear_triton(torch.zeros(2, 128, dtype=torch.int32, device=DEVICE), w)
    with pytest.raises(ValueError, match="not 2 splits of whole 256-column steps"):
        int4_linear_triton(torch.randn(2, 128, device=DEVICE), w, config=Int4Config(groups=2, splits=2))
    with pytest.raises(ValueError, match="out_dtype"):
        int4_linear_triton(torch.randn(2, 128, device=DEVICE), w, torch.float16)
    with pytest.raises(TypeError, match="Int4Grouped"):
        int4_linear_triton(torch.randn(2, 128, device=DEVICE), torch.randn(8, 128, device=DEVICE))


def test_int4_default_tile_rule():
    """32 columns a program; 16 / 32 / 64 rows a block; K steps of two 128-column groups (four of 64); the narrow
    8B weights from 8,192 columns in two splits, the wide ones (and 64-row blocks) in one."""
    c = int4_config(4, 6144, 8192, 128)
    assert (c.block_m, c.block_n, c.groups, c.splits) == (16, 32, 2, 2)
    assert int4_config(4, 28672, 4096, 128).splits == 1 and int4_config(4, 4096, 4096, 128).splits == 1
    assert int4_config(32, 4096, 14336, 128).block_m == 32 and int4_config(64, 4096, 14336, 128).splits == 1
    assert int4_config(1, 576, 1728, 64).groups == 1  # 27 groups of 64: odd
    assert int4_config(1, 576, 1536, 128).groups == 2
