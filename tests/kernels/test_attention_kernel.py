"""Invariant 14 for the paged row attention: the Triton kernel equals the torch twin and the reference.

The reference is engine/kernels/attention.py (plan + SDPA, the engine's plain path); the torch twin is the
static-shape version the fast path uses without Triton. Cases: causal extends, tree rows with extra
slots (holes included), padding rows, several page sizes, grouped-query heads, rows split into
several chunks (small ``chunk`` / ``block_n`` so that short contexts split, chunks grown past
``max_chunks``) and the single-pass kernel. Also, bitwise: a verify row and a decode row of the same
position give equal outputs (one key order for both), split or not; a row's output does not change
when other rows, page-table columns or extra-slot columns are added.

Runs on CPU under ``TRITON_INTERPRET=1`` (CI) and on a GPU as is.
"""

from __future__ import annotations

import os

import pytest
import torch
from speccycle.core.ports import ForwardBatch
from speccycle.engine.kernels.attention import paged_attention, plan_attention
from speccycle.engine.kernels.attention_triton import paged_attention_rows_torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from speccycle.engine.kernels.attention_triton import (  # noqa: E402
    _COUNTERS,
    CHUNK,
    MAX_CHUNKS,
    chunk_layout,
    default_num_stages,
    paged_attention_rows_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seed: int, page_size: int, num_heads: int, num_kv_heads: int, head_dim: int = 16, lens=(11, 7)):
    """Two requests with scattered pages: request 0 extends causally (its last 3 positions of ``lens[0]``),
    request 1 verifies a 5-node tree after ``lens[1]`` positions."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-(max(lens) + 8) // page_size)
    num_pages = 2 * width + 3
    slots = num_pages * page_size
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((2, width), -1, dtype=torch.long)
    table[0] = perm[:width]
    table[1] = perm[width : 2 * width]

    def slot(b, p):
        return int(table[b, p // page_size]) * page_size + p % page_size

    rows = {"row_request": [], "positions": [], "prefix_lens": [], "out_slots": [], "extra": []}
    # request 0: 3 causal rows at positions lens[0] - 3 .. lens[0] - 1 (an extend)
    for p in range(lens[0] - 3, lens[0]):
        rows["row_request"].append(0)
        rows["positions"].append(p)
        rows["prefix_lens"].append(p + 1)
        rows["out_slots"].append(slot(0, p))
        rows["extra"].append([])
    # request 1: a tree over verify rows at L = 7: parents of rows 0..4
    parents = [-1, 0, 0, 1, 2]
    length = lens[1]
    for i, _ in enumerate(parents):
        path, node = [], i
        while node >= 0:
            path.append(node)
            node = parents[node]
        path.reverse()
        rows["row_request"].append(1)
        rows["positions"].append(length + len(path) - 1)
        rows["prefix_lens"].append(length)
        rows["out_slots"].append(slot(1, length + i))
        mask = [slot(1, length + j) if j in path else -1 for j in range(len(parents))]
        rows["extra"].append(mask)
    m = max(len(e) for e in rows["extra"])
    extra = torch.tensor([e + [-1] * (m - len(e)) for e in rows["extra"]], dtype=torch.long)
    t = len(rows["positions"])
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.long),
        positions=torch.tensor(rows["positions"]),
        row_request=torch.tensor(rows["row_request"]),
        out_slots=torch.tensor(rows["out_slots"]),
        prefix_lens=torch.tensor(rows["prefix_lens"]),
        extra_slots=extra,
        page_table=table,
        page_size=page_size,
        request_ids=(0, 1),
    )
    q = torch.randn(t, num_heads, head_dim, generator=gen)
    k_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(slots, num_kv_heads, head_dim, generator=gen)
    return batch, q, k_cache, v_cache


def _rows_args(batch: ForwardBatch, device):
    return [t.to(device) for t in (batch.row_request, batch.prefix_lens, batch.extra_slots, batch.page_table)]


@pytest.mark.parametrize(
    "page_size,heads,dtype",
    [(1, (4, 2), torch.float32), (3, (6, 2), torch.float32), (4, (4, 4), torch.float32), (16, (9, 3), torch.float32),
     (3, (6, 2), torch.bfloat16), (16, (9, 3), torch.bfloat16)],
)  # fmt: skip
def test_kernel_equals_reference_and_torch_twin(page_size, heads, dtype):
    batch, q, k_cache, v_cache = _case(7 + page_size, page_size, *heads)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    reference = paged_attention(plan_attention(batch), q, k_cache, v_cache).float()
    twin = paged_attention_rows_torch(q, k_cache, v_cache, *_rows_args(batch, "cpu"), page_size, kv_bound=32)
    fast = paged_attention_rows_triton(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                       *_rows_args(batch, DEVICE), page_size).cpu()  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: outputs and P rounded to the dtype
    torch.testing.assert_close(twin.float(), reference, atol=tol, rtol=tol)
    torch.testing.assert_close(fast.float(), reference, atol=tol, rtol=tol)


def test_padding_rows_attend_nothing_and_return_zeros():
    batch, q, k_cache, v_cache = _case(3, 4, 4, 2)
    pad = 3
    row_request = torch.cat([batch.row_request, torch.zeros(pad, dtype=torch.long)])
    prefix = torch.cat([batch.prefix_lens, torch.zeros(pad, dtype=torch.long)])
    extra = torch.cat([batch.extra_slots, torch.full((pad, batch.extra_slots.shape[1]), -1)])
    q_pad = torch.cat([q, torch.randn(pad, *q.shape[1:])])
    args = (row_request, prefix, extra, batch.page_table)
    fast = paged_attention_rows_triton(q_pad.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                       *[a.to(DEVICE) for a in args], 4).cpu()  # fmt: skip
    twin = paged_attention_rows_torch(q_pad, k_cache, v_cache, *args, 4, kv_bound=32)
    assert torch.count_nonzero(fast[-pad:]) == 0 and torch.count_nonzero(twin[-pad:]) == 0
    reference = paged_attention(plan_attention(batch), q, k_cache, v_cache)
    torch.testing.assert_close(fast[:-pad], reference, atol=1e-5, rtol=1e-5)


# Split settings small enough for the interpreter's short contexts: several chunks, and chunks grown
# past max_chunks (a row of 75 keys, chunk 16, max_chunks 3: chunks of 32 keys).
SPLITS = {
    "split": dict(block_n=16, chunk=32, max_chunks=8),
    "one-block-chunks": dict(block_n=16, chunk=16, max_chunks=8),
    "grown": dict(block_n=16, chunk=16, max_chunks=3),
    "single-pass": dict(block_n=16, chunk=16, max_chunks=1),
    "looped": dict(block_n=16, chunk=16, max_chunks=8, programs_per_row=2),  # programs take several chunks
}


@pytest.mark.parametrize(
    "page_size,heads,dtype,split",
    [(1, (4, 2), torch.float32, "one-block-chunks"), (4, (6, 2), torch.float32, "split"),
     (3, (6, 2), torch.float32, "grown"), (16, (9, 3), torch.bfloat16, "split"),
     (4, (6, 2), torch.bfloat16, "grown"), (4, (4, 2), torch.float32, "single-pass"),
     (3, (6, 2), torch.bfloat16, "looped")],
)  # fmt: skip
def test_split_kernel_equals_torch_twin_and_reference(page_size, heads, dtype, split):
    """Rows of several chunks (and of grown chunks) merge to the twin's softmax; the single pass too."""
    batch, q, k_cache, v_cache = _case(11 + page_size, page_size, *heads, lens=(75, 40))
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    options = SPLITS[split]
    totals = (batch.prefix_lens + (batch.extra_slots >= 0).sum(dim=1)).tolist()
    layouts = [chunk_layout(t, options["chunk"], options["max_chunks"]) for t in totals]
    if options["max_chunks"] > 1:  # the case does exercise the split (and, "grown", the grown chunks)
        assert max(n for _, n in layouts) > 1
        assert (max(k for k, _ in layouts) > options["chunk"]) == (split == "grown")
    kv_bound = batch.page_table.shape[1] * page_size
    twin = paged_attention_rows_torch(q, k_cache, v_cache, *_rows_args(batch, "cpu"), page_size, kv_bound=kv_bound)
    reference = paged_attention(plan_attention(batch), q, k_cache, v_cache).float()
    fast = paged_attention_rows_triton(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                       *_rows_args(batch, DEVICE), page_size, **options).cpu()  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(twin.float(), reference, atol=tol, rtol=tol)
    torch.testing.assert_close(fast.float(), twin.float(), atol=tol, rtol=tol)
    # the merge by a second kernel (the first design) gives the fused merge's output
    two_kernels = paged_attention_rows_triton(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                              *_rows_args(batch, DEVICE), page_size, fused_combine=False,
                                              **options).cpu()  # fmt: skip
    torch.testing.assert_close(two_kernels.float(), fast.float(), atol=tol, rtol=tol)
    # every launch leaves its arrival counters at zero (the next launch, or a graph replay, counts from 0)
    for buffer in _COUNTERS.get(torch.device(DEVICE), []):
        assert torch.count_nonzero(buffer) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_output_does_not_depend_on_other_rows_or_static_widths(dtype):
    """Bitwise: each row alone == the row in the batch == the row among padding rows, in another order,
    with wider page tables and extra-slot buffers (a higher bound on the chunks), with fewer programs
    per row than chunks (programs loop over chunks)."""
    page_size, options = 4, SPLITS["split"]
    batch, q, k_cache, v_cache = _case(23, page_size, 6, 2, lens=(75, 40))
    q, k_cache, v_cache = q.to(dtype).to(DEVICE), k_cache.to(dtype).to(DEVICE), v_cache.to(dtype).to(DEVICE)
    row_request, prefix, extra, table = _rows_args(batch, DEVICE)

    def attend(rows, table, extra, programs=None):
        return paged_attention_rows_triton(
            q[rows], k_cache, v_cache, row_request[rows], prefix[rows], extra[rows], table, page_size, **options,
            programs_per_row=programs,
        ).cpu()  # fmt: skip

    everything = torch.arange(q.shape[0], device=DEVICE)
    full = attend(everything, table, extra)
    assert (chunk_layout(int(prefix.max()) + 1, options["chunk"], options["max_chunks"])[1]) > 1
    for r, programs in ((0, None), (2, 1), (3, 2), (q.shape[0] - 1, None)):  # extend and tree rows, each alone
        assert torch.equal(attend(everything[r : r + 1], table, extra, programs)[0], full[r])
    # wider static shapes (40 more page columns, 20 more extra columns, all -1: 8 chunks in the grid
    # instead of 3) and 2 padding rows
    wide_table = torch.cat([table, torch.full((table.shape[0], 40), -1, device=DEVICE)], dim=1)
    wide_extra = torch.cat([extra, torch.full((extra.shape[0], 20), -1, device=DEVICE)], dim=1)
    pad = q.shape[0]
    q_pad = torch.cat([q, torch.randn(2, *q.shape[1:]).to(q)])
    req_pad = torch.cat([row_request, torch.zeros(2, dtype=torch.long, device=DEVICE)])
    prefix_pad = torch.cat([prefix, torch.zeros(2, dtype=torch.long, device=DEVICE)])
    extra_pad = torch.cat([wide_extra, torch.full((2, wide_extra.shape[1]), -1, device=DEVICE)])
    order = torch.tensor([pad, *reversed(range(pad)), pad + 1], device=DEVICE)
    shuffled = paged_attention_rows_triton(
        q_pad[order], k_cache, v_cache, req_pad[order], prefix_pad[order], extra_pad[order], wide_table, page_size,
        **options, programs_per_row=2,
    ).cpu()  # fmt: skip
    assert torch.equal(shuffled[1:-1], full.flip(0))
    assert torch.count_nonzero(shuffled[0]) == 0 and torch.count_nonzero(shuffled[-1]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "length,split",
    [(50, "default"), (300, "default"), (70, "split"), (70, "one-block-chunks"), (70, "grown"), (70, "single-pass")],
)  # fmt: skip
def test_verify_row_and_decode_row_are_bitwise_equal(dtype, length, split):
    """A tree row at L + d (prefix L, ancestors as extra slots, holes between) == a decode row at L + d.

    Split or not: the chunks cut the same virtual key sequence at the same places (the key count is the
    same), although the verify call's grid has more chunks (its extra columns widen the static bound).
    """
    options = {} if split == "default" else SPLITS[split]
    chunk, max_chunks = options.get("chunk", CHUNK), options.get("max_chunks", MAX_CHUNKS)
    num_chunks = chunk_layout(length + 3, chunk, max_chunks)[1]  # the row's L + 3 keys
    assert num_chunks == 1 if (split, length) == ("default", 50) or max_chunks == 1 else num_chunks > 1
    gen = torch.Generator().manual_seed(5)
    page_size, heads, kv_heads, dim = 4, 4, 2, 16  # the prefix crosses block (and chunk) boundaries
    num_pages = (length + 8) // page_size + 2
    table = torch.randperm(num_pages + 10, generator=gen)[:num_pages][None]  # one request
    slots = (num_pages + 10) * page_size
    k_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(1, heads, dim, generator=gen).to(dtype)

    def slot(p):
        return int(table[0, p // page_size]) * page_size + p % page_size

    # Tree path root(0) -> row 2 -> row 5, the node at depth 2 sits at position L + 2; its verify slots
    # are L + row. Rewire the decode view: positions L, L+1, L+2 hold the path's keys.
    path_rows = [0, 2, 5]
    # 64 extra columns (a 64-node tree's buffer): the verify call's grid has more chunks than the decode's
    extra = torch.tensor([[slot(length + r) if r in path_rows else -1 for r in range(64)]])
    # The decode row sees positions [0, L + 3): a copy of the cache where position L + depth holds the
    # key of the path's node at that depth (what compaction would have moved there).
    decode_table = table.clone()
    k2, v2 = k_cache.clone(), v_cache.clone()
    for depth, r in enumerate(path_rows):
        k2[slot(length + depth)] = k_cache[slot(length + r)]
        v2[slot(length + depth)] = v_cache[slot(length + r)]
    one = torch.zeros(1, dtype=torch.long)
    verify = paged_attention_rows_triton(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), one.to(DEVICE),
        torch.tensor([length]).to(DEVICE), extra.to(DEVICE), table.to(DEVICE), page_size, **options,
    ).cpu()  # fmt: skip
    decode = paged_attention_rows_triton(
        q.to(DEVICE), k2.to(DEVICE), v2.to(DEVICE), one.to(DEVICE),
        torch.tensor([length + 3]).to(DEVICE), torch.empty((1, 0), dtype=torch.long).to(DEVICE),
        decode_table.to(DEVICE), page_size, **options,
    ).cpu()  # fmt: skip
    assert torch.equal(verify, decode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [40, 300])
@pytest.mark.parametrize("stages", [None, 1, 2, 4] if torch.cuda.is_available() else [None])  # the interpreter: none
def test_a_chains_verify_rows_are_the_decode_rows_bits(dtype, length, stages):
    """A chain's 5 verify rows of each of 2 requests equal the decode rows at their positions, bitwise, whatever
    the verify's pipelining stages (None: the default launch, one stage for more rows than page-table rows) against
    the decode's default (Triton's). The interpreter ignores stages; a GPU compiles each count. The decode merges a
    row's chunks with the pipelined merge, the verify head after head (`PIPELINED_MERGE`): the same bits too."""
    gen = torch.Generator().manual_seed(7)
    page_size, heads, kv_heads, dim, n, bs = 16, 6, 2, 64, 5, 2
    width = (length + n) // page_size + 1
    perm = torch.randperm(bs * width + 4, generator=gen)
    table = perm[: bs * width].view(bs, width)
    k_cache = torch.randn((bs * width + 4) * page_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype)
    q = torch.randn(bs * n, heads, dim, generator=gen).to(dtype)
    lens = torch.tensor([length, length - 13])
    positions = lens[:, None] + torch.arange(n)[None]  # row d of request b at L_b + d
    slots = table.gather(1, positions // page_size) * page_size + positions % page_size
    extra = torch.where(torch.ones(n, n, dtype=torch.bool).tril()[None], slots[:, None, :], -1).reshape(bs * n, n)
    rows = torch.arange(bs).repeat_interleave(n)
    assert default_num_stages(bs * n, bs) != default_num_stages(bs, bs)  # the two launches differ
    dev = [t.to(DEVICE) for t in (q, k_cache, v_cache, table)]
    verify = paged_attention_rows_triton(dev[0], dev[1], dev[2], rows.to(DEVICE), lens.repeat_interleave(n).to(DEVICE),
                                         extra.to(DEVICE), dev[3], page_size, num_stages=stages).cpu()  # fmt: skip
    no_extra = torch.empty((bs, 0), dtype=torch.long, device=DEVICE)
    for d in range(n):  # the decode step at depth d: one row a request, its position's keys in the page table
        decode = paged_attention_rows_triton(dev[0].view(bs, n, heads, dim)[:, d], dev[1], dev[2],
                                             torch.arange(bs, device=DEVICE), (lens + d + 1).to(DEVICE), no_extra,
                                             dev[3], page_size).cpu()  # fmt: skip
        assert torch.equal(verify.view(bs, n, heads, dim)[:, d], decode)


def test_rows_without_extra_columns_allocate_nothing_and_equal_a_column_of_holes():
    """Decode rows (``extra_slots [T, 0]``, every captured decode layer) give the bits of the same rows
    with one all -1 extra column, and the call creates no tensor of its own for the missing columns
    (a ``new_full`` there was a fill kernel per layer and step inside the decode graph)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    batch, q, k_cache, v_cache = _case(5, 4, 6, 2, lens=(40, 30))
    causal = batch.extra_slots.eq(-1).all(dim=1)  # request 0's extend rows: no extra slot
    row_request, prefix, extra, table = _rows_args(batch, DEVICE)
    rows = causal.nonzero().flatten().to(DEVICE)
    q_rows, req_rows, prefix_rows = q.to(DEVICE)[rows], row_request[rows], prefix[rows]
    options = dict(block_n=16, chunk=16, max_chunks=8)

    class Ops(TorchDispatchMode):
        names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    empty = extra[rows][:, :0]
    with Ops() as ops:
        none = paged_attention_rows_triton(q_rows, k_cache.to(DEVICE), v_cache.to(DEVICE), req_rows, prefix_rows,
                                           empty, table, 4, **options)  # fmt: skip
    assert not [name for name in ops.names if "fill" in name or "full" in name], ops.names
    holes = torch.full((rows.numel(), 1), -1, dtype=torch.long, device=DEVICE)
    with_holes = paged_attention_rows_triton(q_rows, k_cache.to(DEVICE), v_cache.to(DEVICE), req_rows, prefix_rows,
                                             holes, table, 4, **options)  # fmt: skip
    assert torch.equal(none, with_holes)


def test_default_launch_gives_a_decode_graph_one_program_per_chunk(monkeypatch):
    """`default_programs_per_row` on an H100 (132 SMs), SmolLM2's 3 KV heads: a decode graph of 8 rows
    (1 real, 7 padding) gets every chunk its own program; 32 rows get ~8 programs per SM over all rows; 64 to 256
    rows the spread's 8 a row (at most 64 per SM); 512 rows what 64 per SM allows; 1024 rows the minimum."""
    from speccycle.engine.kernels import attention_triton as attention

    monkeypatch.setattr(attention, "_multiprocessors", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert attention.default_programs_per_row(cuda, 8, 3, 32) == 32
    assert attention.default_programs_per_row(cuda, 32, 3, 32) == 11  # ceil(8 * 132 / 96)
    assert attention.default_programs_per_row(cuda, 64, 3, 32) == attention.SPREAD_PROGRAMS_PER_ROW == 8
    assert attention.default_programs_per_row(cuda, 256, 3, 32) == 8  # 6,144 programs: 46.5 per SM
    assert attention.default_programs_per_row(cuda, 512, 3, 32) == 5  # floor(64 * 132 / 1536)
    assert attention.default_programs_per_row(cuda, 1024, 3, 32) == attention.MIN_PROGRAMS_PER_ROW
    assert attention.default_programs_per_row(cuda, 64, 3, 32, spread=0) == 6  # the exact prefill's: no spread
    assert attention.default_programs_per_row(cuda, 8, 3, 2) == 2  # never past the bound


def test_strided_row_indices_are_read_as_their_values():
    """A tree's draft level at batch 1 hands the kernel ``row_request`` and ``prefix_lens`` as an expanded
    ``[1] -> [K]`` view (stride 0): the kernel reads ``ptr + row``, so the launcher must make them contiguous
    (on an H100 the stride-0 view was read past its storage: an illegal address inside the draft's graph)."""
    batch, q, k_cache, v_cache = _case(5, 4, 4, 2)
    rows = 4
    row_request = torch.zeros(1, dtype=torch.long).expand(rows)
    prefix_lens = torch.full((1,), 9, dtype=torch.long).expand(rows)
    assert row_request.stride(0) == 0
    q = q[:rows]
    extra = batch.extra_slots[:rows]
    args = [t.to(DEVICE) for t in (q, k_cache, v_cache)]
    got = paged_attention_rows_triton(*args, row_request.to(DEVICE), prefix_lens.to(DEVICE), extra.to(DEVICE),
                                      batch.page_table.to(DEVICE), 4)  # fmt: skip
    want = paged_attention_rows_triton(*args, row_request.contiguous().to(DEVICE), prefix_lens.contiguous().to(DEVICE),
                                       extra.to(DEVICE), batch.page_table.to(DEVICE), 4)  # fmt: skip
    assert torch.equal(got.cpu(), want.cpu())
