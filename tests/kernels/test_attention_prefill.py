"""The prefill attention kernel equals its torch twin (`paged_attention_rows_torch`) on a prefill's rows.

Cases: several prompts in one batch (blocks that hold the end of one prompt and the start of the next, a prompt
longer than a block of rows and of keys), a cached prefix (rows from position ``c`` on, attending the cached
pages), scattered pages of several sizes, grouped-query heads, padding rows (``prefix_len == 0``: zeros), rows
in any order; a batch with extra slots goes to the rows kernel, bitwise. float32 on the interpreter (CI), and
bfloat16 too on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from speccycle.engine.kernels.attention_triton import paged_attention_rows_torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from speccycle.engine.kernels.attention_prefill import paged_attention_prefill_triton  # noqa: E402
from speccycle.engine.kernels.attention_triton import paged_attention_rows_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _prefill(seed, lens, cached, page_size, num_heads, num_kv_heads, head_dim, dtype, pad=0, order=None):
    """Requests of ``lens`` tokens whose first ``cached`` are in the pool already: their remaining rows, causal
    (``prefix_len = position + 1``), then ``pad`` padding rows. Returns the arguments of the kernels."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // page_size)
    num_pages = len(lens) * width + 2
    perm = torch.randperm(num_pages, generator=gen)
    table = perm[: len(lens) * width].view(len(lens), width).clone()
    row_request, positions = [], []
    for b, (n, c) in enumerate(zip(lens, cached)):
        row_request += [b] * (n - c)
        positions += list(range(c, n))
    row_request = torch.tensor(row_request + [0] * pad, dtype=torch.long)
    prefix_lens = torch.tensor([p + 1 for p in positions] + [0] * pad, dtype=torch.long)
    if order is not None:
        perm_rows = torch.randperm(len(row_request), generator=gen)
        row_request, prefix_lens = row_request[perm_rows], prefix_lens[perm_rows]
    t = len(row_request)
    slots = num_pages * page_size
    q = torch.randn(t, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    extra = torch.empty(t, 0, dtype=torch.long)
    args = (q, k, v, row_request, prefix_lens, extra, table, page_size)
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args), width * page_size


CASES = [
    # lens, cached, page_size, heads, kv heads, head dim
    ((5, 70, 23), (0, 0, 0), 16, 4, 2, 16),
    ((130,), (0,), 16, 3, 1, 32),
    ((44, 44, 47, 66), (0, 16, 0, 32), 4, 4, 4, 16),
    ((1, 2, 3, 200), (0, 1, 0, 64), 8, 6, 2, 16),
]


@pytest.mark.parametrize("lens, cached, page_size, heads, kv_heads, head_dim", CASES)
def test_prefill_kernel_equals_torch_twin(lens, cached, page_size, heads, kv_heads, head_dim):
    args, bound = _prefill(0, lens, cached, page_size, heads, kv_heads, head_dim, torch.float32, pad=5)
    got = paged_attention_prefill_triton(*args)
    want = paged_attention_rows_torch(*args, bound)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert not got[-5:].any(), "padding rows (prefix_len 0) return zeros"


def test_prefill_kernel_any_row_order():
    """Rows out of order (several requests in every block): still each row's own attention."""
    args, bound = _prefill(1, (37, 90, 12), (0, 8, 0), 16, 4, 2, 16, torch.float32, pad=3, order="shuffle")
    torch.testing.assert_close(
        paged_attention_prefill_triton(*args), paged_attention_rows_torch(*args, bound), atol=2e-5, rtol=2e-5
    )


def test_rows_with_extra_slots_take_the_rows_kernel():
    """A batch with extra slots is not a prefill's: the call is the rows kernel's, bit for bit."""
    (q, k, v, row_request, prefix_lens, _, table, page_size), _ = _prefill(
        2, (20, 9), (0, 0), 16, 4, 2, 16, torch.float32
    )
    extra = torch.full((q.shape[0], 2), -1, dtype=torch.long, device=q.device)
    extra[0, 0] = int(table[0, 0]) * page_size  # one row also attends the first slot of its first page
    args = (q, k, v, row_request, prefix_lens, extra, table, page_size)
    assert torch.equal(paged_attention_prefill_triton(*args), paged_attention_rows_triton(*args))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 products on a GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_bfloat16(head_dim):
    args, bound = _prefill(3, (767, 44, 233, 85), (0, 0, 32, 0), 16, 9, 3, head_dim, torch.bfloat16, pad=7)
    got = paged_attention_prefill_triton(*args).float()
    want = paged_attention_rows_torch(*args, bound).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
