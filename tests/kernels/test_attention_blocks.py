"""The query-block kernel of prefill rows (engine/kernels/attention_blocks.py) gives the rows kernel's bits.

Random prefill layouts: several prompts of random lengths (1 included), prompts after a cached prefix (rows from
position ``c > 0``), rows past ``CHUNK * MAX_CHUNKS`` keys (longer chunks, so a block's rows change chunk length),
blocks that straddle two prompts, padding rows (``prefix_len = 0``) among and after them; bfloat16 and float32,
query groups of 1 and 3. Each is held to `attention_triton.paged_attention_rows_triton` (`assert_same_bits`: bit for
bit on a GPU, and for bfloat16 under the interpreter, whose float32 products of other shapes differ in the last
places) and to the torch twin within the kernel tests' tolerances. The launch choices (lines a block, programs, the
merge's place: the rows kernel's own merge in either place) change no bit; rows with extra slots are the rows
kernel's. On a GPU also SmolLM2's shape at the
default constants, the benchmark's 13 prompts and a prompt of grown chunks, eager and replayed in a graph.

Runs on CPU under ``TRITON_INTERPRET=1`` (CI) and on a GPU as is.
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

from speccycle.engine.kernels.attention_blocks import BLOCK_LINES, paged_attention_blocks_triton  # noqa: E402
from speccycle.engine.kernels.attention_triton import (  # noqa: E402
    _COUNTERS,
    CHUNK,
    MAX_CHUNKS,
    chunk_layout,
    paged_attention_rows_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the rows kernel's launch under the interpreter: one program per (row, KV head), fewer to interpret (no bit changes)
ONE = None if DEVICE == "cuda" else 1
# small constants so that the interpreter's short prompts split into several chunks and grow them
SPLITS = {
    "default": {},
    "split": dict(block_n=16, chunk=32, max_chunks=8),
    "grown": dict(block_n=16, chunk=16, max_chunks=3),  # rows past 48 keys take chunks of 32
}


def prefill_case(seed, page_size, heads, kv_heads, dim, prompts, dtype, padding=2, hole_after=None):
    """The rows of a prefill: prompt ``b`` of ``prompts[b] = (cached, rows)`` feeds ``rows`` rows at positions
    ``cached ..`` (``prefix_len = position + 1``) through its own scattered pages; ``padding`` rows (request 0,
    prefix 0) at the end and, after row ``hole_after``, one more among them. Returns the tensors of a call."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-(c + n) // page_size) for c, n in prompts) + 1
    num_pages = len(prompts) * width + 3
    table = torch.randperm(num_pages, generator=gen)[: len(prompts) * width].view(len(prompts), width).clone()
    request, prefix = [], []
    for b, (cached, rows) in enumerate(prompts):
        request += [b] * rows
        prefix += [cached + i + 1 for i in range(rows)]
    if hole_after is not None:
        request.insert(hole_after + 1, 0)
        prefix.insert(hole_after + 1, 0)
    request += [0] * padding
    prefix += [0] * padding
    t = len(request)
    q = torch.randn(t, heads, dim, generator=gen).to(dtype)
    k = torch.randn(num_pages * page_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_pages * page_size, kv_heads, dim, generator=gen).to(dtype)
    rows = (torch.tensor(request), torch.tensor(prefix), torch.empty((t, 0), dtype=torch.long), table)
    return tuple(x.to(DEVICE) for x in (q, k, v, *rows)), width * page_size


def random_prompts(seed, count=4, longest=24, cached=(41, 47)):
    """``count`` prompts of random lengths in ``[1, longest]``, one of them 1 row, one after a cached prefix of a
    random length in ``cached`` (its rows cross chunk boundaries without many rows)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=gen).tolist()
    lengths[0], lengths[1] = 1, longest
    prefixes = [0] * count
    prefixes[1] = int(torch.randint(*cached, (1,), generator=gen))
    return list(zip(prefixes, lengths))


def counters_are_zero():
    return all(torch.count_nonzero(buffer) == 0 for buffer in _COUNTERS.get(torch.device(DEVICE), []))


@pytest.mark.parametrize(
    "dtype,heads,page_size,split",
    [(torch.bfloat16, (3, 1), 4, "grown"), (torch.float32, (3, 1), 3, "grown"), (torch.bfloat16, (2, 2), 16, "split"),
     (torch.float32, (2, 2), 1, "default"), (torch.bfloat16, (6, 2), 16, "default")],
)  # fmt: skip
def test_blocks_give_the_rows_kernel_bits_on_random_prefills(dtype, heads, page_size, split):
    options = SPLITS[split]
    prompts = random_prompts(heads[0] + page_size)
    args, bound = prefill_case(page_size, page_size, *heads, 16, prompts, dtype, hole_after=prompts[0][1] + 3)
    chunk, max_chunks = options.get("chunk", CHUNK), options.get("max_chunks", MAX_CHUNKS)
    layouts = {chunk_layout(c + n, chunk, max_chunks) for c, n in prompts}
    assert max(n for _, n in layouts) > 1  # rows of several chunks
    if split == "grown":  # and of grown ones, a block's rows of two chunk lengths among them
        keys = [chunk_layout(int(n), chunk, max_chunks)[0] for n in args[4].tolist()]
        per_block = BLOCK_LINES // (heads[0] // heads[1])
        assert any(len({k for k in keys[i : i + per_block] if k}) > 1 for i in range(0, len(keys), per_block))
    rows = paged_attention_rows_triton(*args, page_size, **options, programs_per_row=ONE)
    blocks = paged_attention_blocks_triton(*args, page_size, **options)
    assert_same_bits(blocks, rows, dtype, f"blocks against rows ({split})", DEVICE)
    assert counters_are_zero()
    twin = paged_attention_rows_torch(*args, page_size, kv_bound=bound)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(blocks.float(), twin.float(), atol=tol, rtol=tol)
    padding = args[4] == 0
    assert torch.count_nonzero(blocks[padding]) == 0


def test_lines_and_programs_change_no_bit_and_the_second_kernels_merge_is_the_rows_kernels(dtype=torch.bfloat16):
    """Launch choices keep the bits; the merge by `attention_triton`'s combine kernel (``fused_combine=False``) gives
    the rows kernel's rows merged by that kernel (the two merges reduce in other layouts on a GPU: each is held to its
    own)."""
    options = SPLITS["grown"]
    args, _ = prefill_case(3, 4, 6, 2, 16, [(0, 14), (40, 12), (0, 1)], dtype)
    base = paged_attention_blocks_triton(*args, 4, **options)
    for launch in (dict(block_lines=32), dict(block_lines=64), dict(programs=1), dict(programs=2),
                   dict(select_state=False)):  # fmt: skip
        got = paged_attention_blocks_triton(*args, 4, **options, **launch)
        assert_same_bits(got, base, dtype, launch, DEVICE)
    two_kernels = paged_attention_blocks_triton(*args, 4, **options, fused_combine=False)
    rows_two_kernels = paged_attention_rows_triton(*args, 4, **options, fused_combine=False, programs_per_row=ONE)
    assert_same_bits(two_kernels, rows_two_kernels, dtype, "the merge by the combine kernel", DEVICE)
    assert counters_are_zero()


def test_rows_with_extra_slots_take_the_rows_kernel_and_bad_arguments_are_refused():
    args, _ = prefill_case(4, 4, 4, 2, 16, [(0, 9), (3, 4)], torch.float32, padding=0)
    q, k, v, request, prefix, _, table = args
    extra = torch.full((q.shape[0], 3), -1, dtype=torch.long, device=DEVICE)
    extra[:, 0] = table[request, 0] * 4  # every row also attends its request's position 0 again
    call = (q, k, v, request, prefix, extra, table, 4)
    assert torch.equal(
        paged_attention_blocks_triton(*call, programs=ONE), paged_attention_rows_triton(*call, programs_per_row=ONE)
    )
    with pytest.raises(ValueError, match="block_lines=24"):
        paged_attention_blocks_triton(*args, 4, block_lines=24)
    with pytest.raises(ValueError, match="programs=0"):
        paged_attention_blocks_triton(*args, 4, programs=0)


# SmolLM2-135M's attention (9 query heads on 3 KV heads of 64) at the serving benchmark's prompt lengths
PROMPTS = (44, 44, 47, 66, 73, 78, 81, 85, 85, 93, 233, 671, 767)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SmolLM2's shape at the default constants: GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_smollm2_prefills_on_the_gpu_are_bitwise_the_rows_kernel(dtype):
    grown = CHUNK * MAX_CHUNKS + 50  # a prompt of longer chunks
    prompts = [(0, n) for n in PROMPTS] + [(0, grown), (300, 90)]  # and one after a cached prefix of 300
    args, _ = prefill_case(11, 16, 9, 3, 64, prompts, dtype, padding=7, hole_after=200)
    rows = paged_attention_rows_triton(*args, 16)
    blocks = paged_attention_blocks_triton(*args, 16)
    assert torch.equal(blocks, rows)
    for launch in (dict(block_lines=32), dict(block_lines=64), dict(programs=1)):
        assert torch.equal(paged_attention_blocks_triton(*args, 16, **launch), rows), launch
    two_kernels = paged_attention_rows_triton(*args, 16, fused_combine=False)
    assert torch.equal(paged_attention_blocks_triton(*args, 16, fused_combine=False), two_kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = paged_attention_blocks_triton(*args, 16)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, rows)
    assert counters_are_zero()
