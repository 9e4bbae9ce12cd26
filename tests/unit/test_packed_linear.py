"""`engine.models.llama.PackedLinear`: the CPU float32 linear of the reference engine (docs/engine.md).

Rows do not depend on how many run together (a verify row is bitwise the decode row), the result is
``F.linear``'s up to rounding, and the packed copy follows the weight when it changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from speccycle.engine.models import llama
from speccycle.engine.models.llama import PackedLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


@pytest.mark.parametrize("shape", [(96, 64), (64, 160), (1000, 64)])
def test_rows_equal_the_one_row_call_bitwise_and_f_linear_closely(shape):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen) * 0.1
    linear = PackedLinear()
    x = torch.randn(16, shape[1], generator=gen)
    for n in (2, 3, 5, 8, 16):
        rows = linear(x[:n], weight)
        alone = torch.cat([linear(x[r : r + 1], weight) for r in range(n)])
        assert torch.equal(rows, alone), n
        torch.testing.assert_close(rows, F.linear(x[:n], weight), atol=1e-5, rtol=1e-5)


def test_the_packed_copy_follows_the_weight():
    gen = torch.Generator().manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(32, 16, generator=gen), requires_grad=False)
    linear, x = PackedLinear(), torch.randn(3, 16, generator=gen)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight))
    with torch.no_grad():
        weight.mul_(2.0)  # in place: the version counter moves
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight))
    weight.data = torch.randn(32, 16, generator=gen)  # new storage, same Parameter
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight))
    other = torch.randn(32, 16, generator=gen)  # another weight through the same instance
    torch.testing.assert_close(linear(x, other), F.linear(x, other))


def test_other_dtypes_empty_inputs_and_autograd_take_f_linear():
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(8, 4, generator=gen), torch.randn(2, 4, generator=gen)
    linear = PackedLinear()
    assert torch.equal(linear(x.double(), weight.double()), F.linear(x.double(), weight.double()))
    assert linear(x[:0], weight).shape == (0, 8)
    trained = weight.clone().requires_grad_(True)
    linear(x, trained).sum().backward()  # F.linear: the gradient flows
    torch.testing.assert_close(trained.grad, x.sum(0).expand(8, 4))


def test_more_rows_than_packed_max_rows_take_f_linear():
    from speccycle.engine.models.llama import PACKED_MAX_ROWS

    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(8, 4, generator=gen), torch.randn(PACKED_MAX_ROWS + 1, 4, generator=gen)
    linear = PackedLinear()
    assert torch.equal(linear(x, weight), F.linear(x, weight))
    assert not linear._packed  # nothing was packed: a prefill this long runs MKL's GEMM
    linear(x[:PACKED_MAX_ROWS], weight)
    assert len(linear._packed) == 1


def test_skinny_rows_run_the_gemm_measured_faster_and_keep_the_values(monkeypatch):
    """``skinny=True``: 2 to 4 rows take the skinny GEMM only where `skinny_pays` measured it faster for the
    weight's shape and row count (once, remembered); otherwise the packed call, bitwise the 1-row call's."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 64, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    linear = PackedLinear(skinny=True)
    key = (96, 64, 3, torch.get_num_threads())
    monkeypatch.setattr(llama, "_SKINNY_PAYS", {})
    out = linear(x, weight)
    assert key in llama._SKINNY_PAYS  # measured on first use
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-5, rtol=1e-5)
    calls = []
    monkeypatch.setattr(llama, "_skinny_linear", lambda *a: calls.append(a) or F.linear(*a))
    llama._SKINNY_PAYS[key] = False  # packed: every row bitwise the packed 1-row call
    llama._SKINNY_PAYS[(96, 64, 1, torch.get_num_threads())] = False
    rows = linear(x, weight)
    assert not calls
    for r in range(3):
        assert torch.equal(rows[r], linear(x[r : r + 1], weight)[0])
    llama._SKINNY_PAYS[key] = True
    linear(x, weight)
    assert len(calls) == 1
    one = x[:1]
    llama._SKINNY_PAYS[(96, 64, 1, torch.get_num_threads())] = True  # 1 row: MKL's GEMV, F.linear's bits
    assert torch.equal(linear(one, weight), F.linear(one, weight))
    llama._SKINNY_PAYS.clear()
    PackedLinear(skinny=False)(x, weight)
    assert not llama._SKINNY_PAYS  # only skinny=True measures
