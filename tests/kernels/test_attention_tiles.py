"""Invariant 14 for the tiled paged attention (engine/kernels/attention_tiles.py), and the bits it must keep.

The tile kernel equals the torch twin (the reference's math) on extend rows, tree rows with holes,
padding rows, several page sizes and grouped heads, split into chunks or not; a verify's rows computed
together in one tile give, bitwise, what each row gives as a decode row alone (the property that makes
greedy speculative decoding reproduce autoregressive decoding in bfloat16); and the tile size, the
program count and the other rows of a launch change no bit. Runs on CPU under ``TRITON_INTERPRET=1``
(CI) and on a GPU as is.

Which claims are bitwise where: on a GPU all of them; under the interpreter a ``tl.dot`` is numpy's matrix
product, whose summation order depends on the CPU and on how many rows the tile holds, so float32 tiles are held
to the one-row results within a few units in the last place and bfloat16 stays bitwise
(`speccycle.testing.bits`). Comparisons of launches whose products have the same shapes (launch options, the
automatic choice against the kernel it picks) are bitwise everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch
from speccycle.engine.kernels.attention_triton import paged_attention_rows_torch
from speccycle.testing.bits import assert_same_bits

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from speccycle.engine.kernels.attention_tiles import default_rows_per_tile, paged_attention_tiles_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# small chunks so that short contexts split into several (and grown) chunks under the interpreter
SPLITS = {
    "default": {},
    "split": dict(block_n=16, chunk=32, max_chunks=8),
    "grown": dict(block_n=16, chunk=16, max_chunks=3),
    "single": dict(block_n=16, chunk=16, max_chunks=1),
}


def _tree_paths(parents):
    paths = []
    for i in range(len(parents)):
        path, node = [], i
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def _batch(seed, page_size, heads, kv_heads, dim, length, parents, extend=3, padding=2):
    """Rows of two requests and padding: request 0 extends causally (its last ``extend`` positions of
    ``length + 9``), request 1 verifies the tree ``parents`` after ``length`` positions (chain or tree)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(parents)
    width = -(-(length + 9 + n) // page_size) + 1
    num_pages = 2 * width + 3
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.stack([perm[:width], perm[width : 2 * width]])

    def slot(b, p):
        return int(table[b, p // page_size]) * page_size + p % page_size

    rows = []  # (request, prefix, extra slots)
    for p in range(length + 9 - extend, length + 9):
        rows.append((0, p + 1, []))
    for path in _tree_paths(parents):
        rows.append((1, length, [slot(1, length + j) if j in path else -1 for j in range(n)]))
    rows += [(0, 0, [])] * padding
    m = n
    extra = torch.tensor([e + [-1] * (m - len(e)) for _, _, e in rows], dtype=torch.long)
    t = len(rows)
    q = torch.randn(t, heads, dim, generator=gen)
    k = torch.randn(num_pages * page_size, kv_heads, dim, generator=gen)
    v = torch.randn(num_pages * page_size, kv_heads, dim, generator=gen)
    args = (
        torch.tensor([r for r, _, _ in rows]),
        torch.tensor([p for _, p, _ in rows]),
        extra,
        table,
    )
    return q, k, v, args, slot


def _run(q, k, v, args, page_size, dtype, kernel=paged_attention_tiles_triton, **options):
    dev = [t.to(DEVICE) for t in (q.to(dtype), k.to(dtype), v.to(dtype), *args)]
    return kernel(*dev, page_size, **options).cpu()


CHAIN = [-1, 0, 1, 2, 3, 4]
TREE = [-1, 0, 0, 1, 2, 1, 3]


@pytest.mark.parametrize(
    "page_size,heads,dtype,split,parents",
    [(1, (4, 2), torch.float32, "split", TREE), (4, (6, 2), torch.float32, "grown", CHAIN),
     (16, (9, 3), torch.float32, "default", TREE), (3, (6, 2), torch.bfloat16, "split", CHAIN),
     (16, (9, 3), torch.bfloat16, "split", TREE), (4, (4, 4), torch.float32, "single", TREE)],
)  # fmt: skip
def test_tiles_equal_the_torch_twin(page_size, heads, dtype, split, parents):
    q, k, v, args, _ = _batch(7 + page_size, page_size, *heads, 16, 61, parents)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    twin = paged_attention_rows_torch(q, k, v, *args, page_size, kv_bound=args[3].shape[1] * page_size)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (None, 1, 2):
        fast = _run(q, k, v, args, page_size, dtype, rows_per_tile=rows, **SPLITS[split])
        torch.testing.assert_close(fast.float(), twin.float(), atol=tol, rtol=tol)
    assert torch.count_nonzero(fast[-2:]) == 0  # padding rows attend nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", ["default", "split", "grown", "single"])
@pytest.mark.parametrize("parents", [CHAIN, TREE], ids=["chain", "tree"])
def test_verify_tile_equals_decode_rows_bitwise(dtype, split, parents):
    """The verify rows of one request in one tile == each row as a decode row at ``L + depth`` alone.

    ``L = 45`` with 16-key blocks: the prefix ends inside a block and inside a chunk, and the rows past
    it cross into the next chunk, so both the tile's shared chunks and the rows' own chunks are used."""
    page_size, heads, kv_heads, dim, length = 4, 6, 2, 16, 45
    q, k, v, args, slot = _batch(3, page_size, heads, kv_heads, dim, length, parents, extend=0, padding=0)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    row_request, prefix, extra, table = args
    options = SPLITS[split]
    tile = _run(q, k, v, args, page_size, dtype, rows_per_tile=len(parents) // 2 + 1, **options)
    for i, path in enumerate(_tree_paths(parents)):
        # the decode view: positions L + depth hold the path's keys (what compaction would have moved there)
        k2, v2 = k.clone(), v.clone()
        for depth, node in enumerate(path):
            k2[slot(1, length + depth)] = k[slot(1, length + node)]
            v2[slot(1, length + depth)] = v[slot(1, length + node)]
        no_extra = torch.empty((1, 0), dtype=torch.long)
        decode_args = (row_request[i : i + 1], torch.tensor([length + len(path)]), no_extra, table)
        alone = _run(q[i : i + 1], k2, v2, decode_args, page_size, dtype, **options)
        assert_same_bits(tile[i], alone[0], dtype, f"row {i}", DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_size_and_programs_change_no_bit(dtype):
    q, k, v, args, _ = _batch(13, 4, 6, 2, 16, 70, TREE)
    options = SPLITS["split"]
    base = _run(q, k, v, args, 4, dtype, rows_per_tile=1, **options)
    for rows, programs in ((2, None), (3, 1), (4, 2), (None, 3), (5, None)):
        got = _run(q, k, v, args, 4, dtype, rows_per_tile=rows, programs=programs, **options)
        assert_same_bits(got, base, dtype, f"rows_per_tile={rows}, programs={programs}", DEVICE)
    # a row alone in its own launch, and the launch without the padding rows
    for r in (0, 4, 8):
        alone = _run(q[r : r + 1], k, v, [a[r : r + 1] if i < 3 else a for i, a in enumerate(args)], 4, dtype,
                     **options)  # fmt: skip
        assert_same_bits(alone[0], base[r], dtype, f"row {r} alone", DEVICE)


def test_a_prefill_takes_tiles_of_rows_and_the_same_bits(dtype=torch.bfloat16):
    """Rows without extra slots, more of them than the page table has requests (a prefill of two prompts and
    padding): the default launch puts 4 rows a tile (their prefix blocks shared), and every row keeps the bits of
    the one-row tiles and agrees with the torch twin."""
    gen = torch.Generator().manual_seed(5)
    page_size, heads, kv_heads, dim = 4, 8, 2, 16
    lengths = (37, 10)  # the first spans two 32-key chunks; the tile of rows 36-39 straddles the two prompts
    width = -(-max(lengths) // page_size)
    table = torch.randperm(2 * width + 1, generator=gen)[: 2 * width].reshape(2, width)
    request = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)] + [0, 0])
    prefix = torch.tensor([p + 1 for n in lengths for p in range(n)] + [0, 0])  # causal; two padding rows
    args = (request, prefix, torch.empty((len(request), 0), dtype=torch.long), table)
    q = torch.randn(len(request), heads, dim, generator=gen)
    k = torch.randn((2 * width + 1) * page_size, kv_heads, dim, generator=gen)
    v = torch.randn((2 * width + 1) * page_size, kv_heads, dim, generator=gen)
    assert default_rows_per_tile(0, heads // kv_heads, num_rows=len(request), table_rows=2) == 4
    options = SPLITS["split"]
    tiled = _run(q, k, v, args, page_size, dtype, **options)
    alone = _run(q, k, v, args, page_size, dtype, rows_per_tile=1, **options)
    assert_same_bits(tiled, alone, dtype, "tiles of 4 rows against one-row tiles", DEVICE)
    twin = paged_attention_rows_torch(
        q.to(dtype), k.to(dtype), v.to(dtype), *args, page_size, kv_bound=width * page_size
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(tiled.float(), twin.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_of_two_requests_in_tiles_that_do_not_straddle_them(dtype):
    """Two requests' 6-row chains (6 extra columns, tiles of 5 rows: each request's rows cut 5 + 1, never across the
    two) and two padding rows: the default launch gives every row the bits of one-row tiles."""
    gen = torch.Generator().manual_seed(11)
    page_size, heads, kv_heads, dim, n = 4, 6, 2, 16, 6
    lengths = (45, 30)
    width = -(-(max(lengths) + n) // page_size)
    table = torch.randperm(2 * width, generator=gen).reshape(2, width)

    def slot(b, p):
        return int(table[b, p // page_size]) * page_size + p % page_size

    rows = [(b, lengths[b], [slot(b, lengths[b] + j) if j <= i else -1 for j in range(n)]) for b in (0, 1)
            for i in range(n)] + [(0, 0, [-1] * n)] * 2  # fmt: skip
    args = (torch.tensor([b for b, _, _ in rows]), torch.tensor([p for _, p, _ in rows]),
            torch.tensor([e for _, _, e in rows]), table)  # fmt: skip
    q = torch.randn(len(rows), heads, dim, generator=gen)
    k = torch.randn(2 * width * page_size, kv_heads, dim, generator=gen)
    v = torch.randn(2 * width * page_size, kv_heads, dim, generator=gen)
    assert default_rows_per_tile(n, heads // kv_heads) == 5
    options = SPLITS["split"]
    grouped = _run(q, k, v, args, page_size, dtype, **options)
    one_row = _run(q, k, v, args, page_size, dtype, rows_per_tile=1, **options)
    assert_same_bits(grouped, one_row, dtype, "default tiles against one-row tiles", DEVICE)
    one_program = _run(q, k, v, args, page_size, dtype, programs=1, **options)  # a program's items in turn
    assert_same_bits(grouped, one_program, dtype, "one program", DEVICE)
    twin = paged_attention_rows_torch(q.to(dtype), k.to(dtype), v.to(dtype), *args, page_size,
                                      kv_bound=width * page_size)  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped.float(), twin.float(), atol=tol, rtol=tol)


def test_the_discard_takes_whole_lines_of_one_state():
    """`attention_tiles.discard_chunk_states`: only with the PTX hints, an aligned scratch and heads of a multiple of
    32 floats (a 16-wide head failed to compile on an H100, a 48-wide one would drop a line shared with the next
    chunk's state); ``discard_states=False`` turns it off, None takes `DISCARD_STATES`."""
    from speccycle.engine.kernels.attention_tiles import DISCARD_STATES, discard_chunk_states

    assert discard_chunk_states(None, True, 0, 128) is DISCARD_STATES and discard_chunk_states(True, True, 256, 64)
    assert not discard_chunk_states(True, False, 0, 128)  # no hints: the interpreter, ROCm, before sm_90
    assert not discard_chunk_states(False, True, 0, 128)
    assert not discard_chunk_states(True, True, 64, 128)  # a scratch off a 128-byte line
    assert not any(discard_chunk_states(True, True, 0, d) for d in (16, 48, 80))


def test_default_rows_per_tile_and_bad_arguments():
    assert default_rows_per_tile(0, 4) == 1  # decode rows: one a tile (the rows kernel takes them)
    assert default_rows_per_tile(0, 4, num_rows=8, table_rows=8) == 1  # a decode: a row a request
    assert default_rows_per_tile(0, 4, num_rows=512, table_rows=128) == 4  # a prefill in a graph's static table
    assert default_rows_per_tile(0, 3, num_rows=40, table_rows=1) == 5  # SmolLM2's: 5 rows fit
    assert default_rows_per_tile(32, 4) == 4  # a 32-row verify of Llama-3-8B: 8 tiles of 4 rows a request
    assert default_rows_per_tile(16, 3) == 5 and default_rows_per_tile(6, 3) == 5  # SmolLM2: 5 rows fit
    assert default_rows_per_tile(5, 4) == 4 and default_rows_per_tile(5, 2) == 5  # a 5-row chain: tiles of 4 and 1
    q, k, v, args, _ = _batch(1, 4, 4, 2, 16, 20, CHAIN)
    with pytest.raises(ValueError, match="rows_per_tile"):
        _run(q, k, v, args, 4, torch.float32, rows_per_tile=9)
    with pytest.raises(ValueError, match="programs"):
        _run(q, k, v, args, 4, torch.float32, programs=0)
    for bad, match in ((dict(num_warps=3), "num_warps"), (dict(combine_warps=0), "combine_warps"),
                       (dict(num_stages=0), "num_stages"), (dict(maxnreg=-1), "maxnreg")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            _run(q, k, v, args, 4, torch.float32, **bad)
    # launch choices (stages, a register cap) keep every bit
    base = _run(q, k, v, args, 4, torch.float32)
    for launch in (dict(num_stages=None, maxnreg=0), dict(num_stages=2, maxnreg=128)):
        assert torch.equal(_run(q, k, v, args, 4, torch.float32, **launch), base), launch


def test_auto_takes_tiles_for_large_heads_and_rows_below(monkeypatch):
    """`kernels.fused_ops.paged_attention_auto` (the fast path's default): tiles for heads of 128 and more (every
    forward of such a model), the rows kernel below; `SPECCYCLE_ATTENTION` names one or the other, anything else
    fails."""
    from speccycle.engine.kernels import fused_ops as kernels
    from speccycle.engine.kernels.attention_triton import paged_attention_rows_triton

    for dim, kernel in ((128, paged_attention_tiles_triton), (16, paged_attention_rows_triton)):
        q, k, v, args, _ = _batch(5, 4, 4, 2, dim, 20, CHAIN, extend=1, padding=1)
        assert torch.equal(_run(q, k, v, args, 4, torch.float32, kernel=kernels.paged_attention_auto),
                           _run(q, k, v, args, 4, torch.float32, kernel=kernel))  # fmt: skip
    for name, kernel in (("rows", paged_attention_rows_triton), ("tiles", paged_attention_tiles_triton)):
        monkeypatch.setenv("SPECCYCLE_ATTENTION", name)
        assert kernels.triton_attention() is kernel
    monkeypatch.delenv("SPECCYCLE_ATTENTION")
    assert kernels.triton_attention() is kernels.paged_attention_auto
    monkeypatch.setenv("SPECCYCLE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="SPECCYCLE_ATTENTION"):
        kernels.triton_attention()


def test_the_ptx_cache_hints_run_on_nvidia_hopper_only(monkeypatch):
    """`attention_triton._ptx_hints` (the L2 discard after the merge, written in PTX): an NVIDIA GPU of compute
    capability 9.0 or later; never on ROCm, whose torch also reports ``is_cuda``, nor on an older NVIDIA GPU."""
    from speccycle.engine.kernels import attention_triton

    hints = attention_triton._ptx_hints.__wrapped__  # the uncached check
    for hip, capability, expected in ((None, (9, 0), True), (None, (10, 0), True), (None, (8, 9), False),
                                      ("6.2", (9, 4), False)):  # fmt: skip
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert hints(0) is expected
