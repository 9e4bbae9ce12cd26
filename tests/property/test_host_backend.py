"""The host control plane's ops (`engine.fast.host_control.HostBackend`) equal the torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from speccycle.backends.torch import TorchBackend
from speccycle.engine.fast.host_control import HostBackend

reference, host = TorchBackend(), HostBackend()


@st.composite
def verify_inputs(draw):
    """Random trees (parents precede children) with tokens and predictions from a tiny vocabulary."""
    bs, n = draw(st.integers(1, 4)), draw(st.integers(1, 16))
    parents = [[-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)] for _ in range(bs)]
    tokens = [[draw(st.integers(0, 2)) for _ in range(n)] for _ in range(bs)]
    predict = [[draw(st.integers(0, 2)) for _ in range(n)] for _ in range(bs)]
    width = draw(st.integers(1, n + 2))
    return torch.tensor(tokens), torch.tensor(parents), torch.tensor(predict), width


@given(verify_inputs())
def test_host_verify_greedy_equals_reference(inputs):
    got, want = host.verify_greedy(*inputs), reference.verify_greedy(*inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_host_verify_greedy_takes_the_reference_past_its_limit():
    bs, n = 40, 16  # 640 rows > WALK_LIMIT
    parents = torch.arange(-1, n - 1).expand(bs, n).contiguous()
    tokens = torch.randint(0, 2, (bs, n), generator=torch.Generator().manual_seed(0))
    predict = tokens.roll(-1, 1)
    got, want = host.verify_greedy(tokens, parents, predict, 5), reference.verify_greedy(tokens, parents, predict, 5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(got[1].max()) == 5


@given(st.integers(1, 4), st.sampled_from([1, 4, 16]), st.integers(1, 12), st.integers(0, 10_000))
def test_host_slots_for_positions_equal_reference(bs, page_size, width, seed):
    gen = torch.Generator().manual_seed(seed)
    pages = 1 + width // page_size
    table = torch.randperm(64, generator=gen)[: bs * pages].reshape(bs, pages)
    positions = torch.randint(0, pages * page_size, (bs, width), generator=gen)
    assert torch.equal(host.slots_for_positions(table, positions, page_size),
                       reference.slots_for_positions(table, positions, page_size))  # fmt: skip


def test_host_slots_for_positions_refuse_unreserved_positions():
    table = torch.tensor([[3, -1]])
    with pytest.raises(IndexError, match="reserve before assigning slots"):
        host.slots_for_positions(table, torch.tensor([[0, 5]]), 4)


@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 10_000))
def test_packed_rows_come_back_exactly(rows, k, seed):
    """`graphs.pack_rows` (how a draft graph hands back its top-K and candidates in one copy) is exact for
    token ids (up to 2^53, -1 padding), float32 scores (extremes, subnormals, inf) and bools."""
    from speccycle.engine.fast.graphs import pack_rows, row_layout, unpack_rows

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, 2**53, (rows, k), generator=gen)
    scores = torch.randn(rows, k, generator=gen) * torch.tensor([1e-40, 1.0, 3e38, float("inf")]).repeat(k)[:k]
    nested = torch.randint(0, 50_000, (rows, 2, k), generator=gen)
    flags = torch.rand(rows, generator=gen) > 0.5
    tensors = (ids, scores, nested, flags)
    back = unpack_rows(pack_rows(tensors), row_layout(tensors))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(tensors, back))


def test_row_references_refuse_a_replaced_output():
    """Host records name device hidden states by (generation, row); a reference to a replaced output is refused."""
    from speccycle.engine.fast.host_control import DeviceRows

    kept = DeviceRows("target's features")
    first = kept.keep(torch.arange(12.0).view(4, 3))
    rows = kept.rows(first[[3, 1]])
    assert torch.equal(rows.gather(torch.float32), torch.tensor([[9.0, 10.0, 11.0], [3.0, 4.0, 5.0]]))
    kept.keep(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="earlier target's features"):
        kept.rows(first[:1])
    with pytest.raises(ValueError, match="row references"):
        kept.rows(torch.zeros(2, 3))
