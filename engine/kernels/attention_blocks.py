"""Paged attention over query blocks of prefill rows: a request's consecutive rows load each key block once.

`attention_triton`'s rows kernel gives every (row, KV head) its own programs, so the rows of a prompt of ``n``
tokens read ~n^2 / 2 keys per KV head and layer between them, every key block once per row. Here a program holds a
**query block**: the query heads of one KV head for ``R`` consecutive rows (``R = block_lines // GROUP``), as the
lines of one ``[block_lines, D]`` query block (line ``i``: row ``i // GROUP``, head ``i % GROUP``), and multiplies
each key block it loads by all of them (``[block_lines, D] x [D, BLOCK_N]``).

**The rows kernel's bits.** Every row keeps `attention_triton`'s key order, chunks and arithmetic: its keys are its
prefix positions ``0 .. prefix_len - 1`` in blocks of ``BLOCK_N`` starting at multiples of ``BLOCK_N``, cut into
chunks of ``chunk_keys`` keys by its own key count (`attention_triton.chunk_layout`), each chunk an online softmax
from scratch, the probabilities rounded to the value dtype for the P V product in bfloat16 / float16, a row of one
chunk stored at once and a row of several merged by `attention_triton._merge_chunks` in the last of its programs to
finish (the rows kernel's fused merge, at its warps: `default_num_warps`). The rows of a block are taken in
**segments**, the block's rows of one request and one chunk length (a block straddles at most a few prompts;
``chunk_keys`` changes every ``CHUNK * MAX_CHUNKS`` keys): for the segment's chunk ``c`` the program walks the key
blocks of ``[c * chunk_keys, min((c + 1) * chunk_keys, the segment's longest row))`` once, and a line takes a block
only while the block starts inside its row's keys, its columns past them at ``-inf``; a block past a row's keys leaves
the row's state as it was (selected, not recomputed), a row without chunk ``c`` stores nothing for it. So each line
sees exactly the blocks, columns and operations of its row in the rows kernel, and a line's products depend on its own
query and the keys only. A padding row (``prefix_len = 0``) stores zeros, the rows kernel's empty chunk.

What the rows kernel and this one share is the arithmetic, and at the default 16 lines the products' shapes too
(the rows kernel's 16 lines hold one row's heads, these 5 rows'); other ``block_lines`` change ``M``. A tensor-core
product computes each line from its own operands, so a line keeps its bits whatever ``M`` as long as the instruction
and the warps' split of the key dimension stay (warps are what change a kernel's bits: ``attention_tiles.
COMBINE_WARPS``; the tile kernel gave the same bits at 16, 32 and 64 lines,
bench/results/attention_bench-H100-tile-lines-*.json). Compiled for ``sm_90`` (Triton 3.9, no GPU), both kernels at
one warp (the rows kernel's at heads of 64, `default_num_warps`) take the same ``mma.sync.m16n8k16`` in the same
one-warp layout, the P V product accumulating onto ``acc * alpha`` in both, and reduce a line's scores in the same
layout; float32 takes the same FMA layouts (a line's 32 scores over 8 threads of 4). At 64 lines and 4 warps Hopper
would take the warp-group ``wgmma`` instead. Registers (bfloat16, one warp, 3 stages): 254 and no spill at 16 lines
(bench/results/kernel_registers-blocks-l16-*.json); 255 and 284 / 288 bytes of spill stores / loads at 32, the
selection above holding a second accumulator (bench/results/kernel_registers-blocks-l32-2*.json; with
``select_state=False``, a line past its keys kept as the product's addend instead, 140 / 144 bytes:
kernel_registers-blocks-l32-zeros-*.json); the rows kernel 247 and none. On a GPU the tests require the two kernels
bitwise equal (tests/kernels/test_attention_blocks.py, SmolLM2's shape included), and so does ``attention_bench
--parts prefill``.

**Only where it pays, decided on the host.** A batch with extra-slot columns (a verify's, a draft level's) takes the
rows kernel: the host sees ``M`` in the shapes. The fast path calls this for prefill forwards only
(`core.ports.ForwardBatch.prefill`); the cycle's forwards never come here. Launch: ``(blocks, Hkv, P)``
programs, program ``p`` taking the segments' chunks ``p, p + P, ...`` (`default_programs_per_row` over blocks);
like ``block_lines``, ``P`` moves work only. Free of host syncs and data-dependent shapes: graph-capturable.

`paged_attention_blocks_triton` has `attention_triton.paged_attention_rows_triton`'s contract; its torch twin is
`attention_triton.paged_attention_rows_torch`.
"""

from __future__ import annotations

import math
import os

import torch

from .attention_triton import (
    BLOCK_N,
    CHUNK,
    MAX_CHUNKS,
    MIN_TRITON_HEAD_DIM,
    NUM_STAGES,
    _arrival_counters,
    default_num_warps,
    default_programs_per_row,
    launch_options,
    paged_attention_rows_triton,
    triton,
)

if triton is not None:
    import triton.language as tl

    from .attention_triton import _merge_chunks, _paged_attention_combine_kernel, _row_chunks

# Lines of a query block: 5 rows of SmolLM2's 3 query heads per KV head (15 of the 16 lines), one warp. The tile
# kernel's measured width (`attention_tiles.TILE_LINES`: 32 and 64 lines were slower on an H100,
# bench/results/attention_bench-H100-tile-lines-*): a short prompt's rows have one or two chunks, so a block's
# programs are few and wider blocks leave multiprocessors idle; and one warp holds 16 lines without spilling
# (module docstring). At 32 lines (5f60f9e, H200, the scheduler, one run each) prefill steps took 0.378 s against the
# rows kernel's 0.354 at 64 clients and 1.019 against 1.180 at 256 (autoregressive mode; tokens/s 22,045 / 40,376
# against 24,026 / 40,091; bench/results/scheduler_throughput-H200-20261127-5f60f9e-prefill-*.json). 16 lines
# unmeasured on a GPU: ``attention_bench --parts prefill`` times 16, 32 and 64.
BLOCK_LINES = 16


if triton is not None:

    @triton.jit
    def _paged_attention_block_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, counter_ptr, row_request_ptr,
        prefix_ptr, table_ptr, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
        stride_pt, page_size, table_width, num_heads, chunk_bound, scale, num_rows, rows_per_block,
        GROUP: tl.constexpr, BLOCK_L: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr, LOW_PRECISION: tl.constexpr,
        UPCAST: tl.constexpr, FUSED_COMBINE: tl.constexpr, BLOCK_C: tl.constexpr, SELECT_STATE: tl.constexpr,
    ):  # fmt: skip
        """Programs ``(block, KV head, p)``: program ``p`` runs chunks ``p, p + P, ...`` of each segment of the
        block's rows (module docstring); with ``FUSED_COMBINE`` the last of a row's programs merges its chunks."""
        block = tl.program_id(0)
        kv_head = tl.program_id(1)
        first_chunk = tl.program_id(2)
        programs = tl.num_programs(2)
        lines = tl.arange(0, BLOCK_L)
        local = lines // GROUP
        row0 = block * rows_per_block
        row = row0 + local
        ok = (local < rows_per_block) & (row < num_rows)
        heads = kv_head * GROUP + lines % GROUP
        d = tl.arange(0, BLOCK_D)
        d_ok = d[None, :] < HEAD_DIM
        q = tl.load(q_ptr + row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=ok[:, None] & d_ok, other=0.0)  # fmt: skip
        # every line's row: its request, key count (its prefix, clamped to the page table, as `_row_keys`) and chunks
        request = tl.load(row_request_ptr + row, mask=ok, other=0).to(tl.int32)
        total = tl.minimum(tl.load(prefix_ptr + row, mask=ok, other=0), table_width * page_size).to(tl.int32)
        chunk_keys, row_chunks = _row_chunks(total, CHUNK, MAX_CHUNKS)
        # a row without keys: the rows kernel's one empty chunk, zeros (stored by program 0, which holds chunk 0).
        # Masks as row-count limits (the interpreter turns a block mask & a scalar condition into int32).
        zero_rows = tl.where(first_chunk == 0, rows_per_block, 0)
        empty = ok & (total == 0) & (local < zero_rows)
        tl.store(out_ptr + row[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 tl.zeros([BLOCK_L, BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=empty[:, None] & d_ok)  # fmt: skip
        part_row = (row.to(tl.int64) * num_heads + heads) * chunk_bound  # [row, head, 0] of the scratch
        offs = tl.arange(0, BLOCK_N)
        big = 1 << 30
        pending = ok & (total > 0)
        todo = tl.max(pending.to(tl.int32), axis=0)
        while todo > 0:  # a segment: the pending rows of the first request and chunk length left
            seg_request = tl.min(tl.where(pending, request, big), axis=0)
            same = pending & (request == seg_request)
            seg_keys = tl.min(tl.where(same, chunk_keys, big), axis=0)
            seg = same & (chunk_keys == seg_keys)
            pending = pending & ~seg
            seg_total = tl.max(tl.where(seg, total, 0), axis=0)
            for chunk in range(first_chunk, tl.cdiv(seg_total, seg_keys), programs):
                lo = chunk * seg_keys  # a multiple of CHUNK, hence of BLOCK_N
                live = seg & (total > lo)  # the lines whose row has this chunk
                m_i = tl.full([BLOCK_L], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([BLOCK_L], dtype=tl.float32)
                acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
                for start in range(lo, tl.minimum(seg_total, lo + seg_keys), BLOCK_N):
                    n = start + offs  # key index: a position of the segment's request
                    page_col = tl.minimum(n // page_size, table_width - 1)
                    page = tl.load(table_ptr + seg_request * stride_pt + page_col, mask=n < seg_total, other=-1)
                    slot = tl.where(page >= 0, page * page_size + n % page_size, -1)
                    valid = slot >= 0
                    safe = tl.maximum(slot, 0).to(tl.int64)
                    k = tl.load(k_ptr + safe[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                                mask=valid[:, None] & d_ok, other=0.0)  # fmt: skip
                    v = tl.load(v_ptr + safe[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                                mask=valid[:, None] & d_ok, other=0.0)  # fmt: skip
                    # the rows kernel's update (`attention_triton._paged_attention_kernel`), line by line
                    if UPCAST:  # the interpreter multiplies bfloat16 bit patterns: go through float32 (products exact)
                        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
                    elif LOW_PRECISION:
                        s = tl.dot(q, tl.trans(k))  # bfloat16 / float16 tensor cores, float32 accumulation
                    else:
                        s = tl.dot(q, tl.trans(k), input_precision="ieee")
                    s = s * scale  # [BLOCK_L, BLOCK_N]
                    s = tl.where((n[None, :] < total[:, None]) & valid[None, :], s, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, axis=1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp(m_i - m_safe)
                    p = tl.exp(s - m_safe[:, None])
                    l_new = l_i * alpha + tl.sum(p, axis=1)
                    # the lines whose row's keys reach this block take it; the others keep their state
                    takes = live & (total > start)
                    if not SELECT_STATE:  # the others' accumulator as the product's addend, times 1, plus zeros
                        p = tl.where(takes[:, None], p, 0.0)
                        alpha = tl.where(takes, alpha, 1.0)
                    if LOW_PRECISION:  # probabilities rounded to the value dtype for the tensor cores
                        p_low = p.to(v.dtype)
                        if UPCAST:
                            pv = tl.dot(p_low.to(tl.float32), v.to(tl.float32), input_precision="ieee")
                        else:
                            pv = tl.dot(p_low, v)
                    else:
                        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                    acc_new = acc * alpha[:, None] + pv
                    m_i = tl.where(takes, m_new, m_i)
                    l_i = tl.where(takes, l_new, l_i)
                    acc = tl.where(takes[:, None], acc_new, acc) if SELECT_STATE else acc_new
                out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
                single = live & (row_chunks == 1)
                tl.store(out_ptr + row[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=single[:, None] & d_ok)  # fmt: skip
                # several chunks: the chunk's partial state, at [row, head, chunk] of the [T, H, chunk_bound] scratch
                part = part_row + chunk
                split = live & (row_chunks > 1)
                tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=split[:, None] & d_ok)
                tl.store(part_max_ptr + part, m_i, mask=split)
                tl.store(part_sum_ptr + part, l_i, mask=split)
            todo = tl.max(pending.to(tl.int32), axis=0)
        if FUSED_COMBINE:  # the rows kernel's merge: the last of a row's programs (per KV head) to arrive
            tl.debug_barrier()  # every thread's states stored before any arrival is counted
            for r in range(0, rows_per_block):
                the_row = row0 + r
                if the_row < num_rows:
                    r_total = tl.minimum(tl.load(prefix_ptr + the_row), table_width * page_size).to(tl.int32)
                    r_keys, r_chunks = _row_chunks(r_total, CHUNK, MAX_CHUNKS)
                    if (r_chunks > 1) & (first_chunk < r_chunks):  # this program ran chunk first_chunk of the row
                        counter = counter_ptr + the_row * tl.num_programs(1) + kv_head
                        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                        if arrived == tl.minimum(programs, r_chunks) - 1:
                            tl.store(counter, 0)
                            for h in tl.static_range(GROUP):
                                _merge_chunks(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, the_row,
                                              kv_head * GROUP + h, r_chunks, num_heads, chunk_bound, stride_ot,
                                              stride_oh, HEAD_DIM, BLOCK_D, BLOCK_C, ".cg", False)  # fmt: skip


def paged_attention_blocks_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_request: torch.Tensor,
    prefix_lens: torch.Tensor,
    extra_slots: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    kv_bound: int | None = None,
    *,
    block_lines: int = BLOCK_LINES,
    chunk: int = CHUNK,
    max_chunks: int = MAX_CHUNKS,
    block_n: int = BLOCK_N,
    programs: int | None = None,
    fused_combine: bool = True,
    num_warps: int | None = None,
    num_stages: int | None = NUM_STAGES,
    maxnreg: int | None = None,
    select_state: bool = True,
) -> torch.Tensor:
    """The query-block kernel; `attention_triton.paged_attention_rows_triton`'s contract and bits.

    Rows with extra-slot columns (``extra_slots [T, M]``, ``M > 0``) are the rows kernel's: this calls it. ``chunk``,
    ``max_chunks``, ``block_n`` and ``num_warps`` (default `default_num_warps`, the rows kernel's) set the bits: a row
    equals the rows kernel's row for the same four. ``block_lines`` (a power of two, at least 16 and the query heads
    of a KV head), ``programs`` (per block and KV head; default `default_programs_per_row` over the blocks),
    ``fused_combine`` (False: `attention_triton`'s combine kernel merges, a second launch, and a row gets that
    kernel's bits: the rows kernel's with ``fused_combine=False``), ``num_stages`` and ``maxnreg`` move work only.
    ``select_state``: a line whose row's keys end before a block keeps its accumulator by a selection (True, exact by
    construction, a second accumulator held across the product) or as the addend of the product, its probabilities
    zeroed and its rescale 1 (False, one accumulator: exact where the tensor cores add zero products exactly, which
    ``attention_bench --parts prefill`` checks as ``blocks-zeros``).
    """
    if triton is None:
        raise RuntimeError("paged_attention_blocks_triton needs triton: pip install triton, or use the torch path")
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if block_n < 1 or block_n & (block_n - 1) or chunk < block_n or chunk % block_n or max_chunks < 1:
        raise ValueError(
            f"paged_attention_blocks_triton: block_n={block_n} must be a power of two, chunk={chunk} a multiple "
            f"of it and max_chunks={max_chunks} at least 1"
        )
    if block_lines < max(16, group) or block_lines & (block_lines - 1):
        raise ValueError(f"paged_attention_blocks_triton: block_lines={block_lines} must be a power of two >= 16 "
                         f"and >= the {group} query heads of a KV head")  # fmt: skip
    if programs is not None and programs < 1:
        raise ValueError(f"paged_attention_blocks_triton: programs={programs} must be at least 1")
    rows_options = dict(chunk=chunk, max_chunks=max_chunks, block_n=block_n, fused_combine=fused_combine,
                        num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)  # fmt: skip
    if extra_slots.shape[1] > 0 or (q.is_cuda and head_dim < MIN_TRITON_HEAD_DIM):
        # extra slots: a verify's or a draft's rows, not a prefill's; heads below tl.dot's K: the torch twin
        return paged_attention_rows_triton(q, k_cache, v_cache, row_request, prefix_lens, extra_slots, page_table,
                                           page_size, kv_bound, programs_per_row=programs, **rows_options)  # fmt: skip
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_attention_blocks_triton: {name} needs a contiguous last dimension")
    row_request, prefix_lens = row_request.contiguous(), prefix_lens.contiguous()
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    table_width = page_table.shape[1]
    # the rows kernel's static bound on a row's chunks (no extra column)
    chunk_bound = min(max_chunks, max(1, -(-(table_width * page_size) // chunk)))
    if chunk_bound > 1:
        part_acc = torch.empty((num_rows, num_heads, chunk_bound, head_dim), dtype=torch.float32, device=q.device)
        part_stats = torch.empty((2, num_rows, num_heads, chunk_bound), dtype=torch.float32, device=q.device)
        part_max, part_sum = part_stats[0], part_stats[1]
    else:
        part_acc = part_max = part_sum = torch.empty(1, dtype=torch.float32, device=q.device)
    rows_per_block = block_lines // group
    blocks = -(-num_rows // rows_per_block)
    counters = None
    if chunk_bound > 1 and fused_combine:
        counters = _arrival_counters(q.device, num_rows * num_kv_heads)
    fused = counters is not None
    if counters is None:
        counters = part_max  # not read
    if programs is None:
        programs = default_programs_per_row(q.device, blocks, num_kv_heads, chunk_bound)
    programs = max(1, min(programs, chunk_bound))
    warps = num_warps or default_num_warps(head_dim)
    block_d = triton.next_power_of_2(head_dim)
    block_c = triton.next_power_of_2(max_chunks)
    _paged_attention_block_kernel[(blocks, num_kv_heads, programs)](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum, counters, row_request, prefix_lens, page_table,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), page_size, table_width, num_heads, chunk_bound,
        1.0 / math.sqrt(head_dim), num_rows, rows_per_block,
        GROUP=group, BLOCK_L=block_lines, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, CHUNK=chunk,
        MAX_CHUNKS=max_chunks, LOW_PRECISION=q.dtype in (torch.bfloat16, torch.float16),
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1", FUSED_COMBINE=fused, BLOCK_C=block_c,
        SELECT_STATE=select_state, num_warps=warps,
        **launch_options(num_stages, maxnreg),
    )  # fmt: skip
    if chunk_bound > 1 and not fused:  # the rows kernel's second-launch merge (no extra column: the table as pointer)
        _paged_attention_combine_kernel[(num_rows, num_heads)](
            out, part_acc, part_max, part_sum, prefix_lens, page_table, out.stride(0), out.stride(1), 0, 0, page_size,
            table_width, num_heads, chunk_bound, HEAD_DIM=head_dim, BLOCK_D=block_d, CHUNK=chunk,
            MAX_CHUNKS=max_chunks, BLOCK_C=block_c, BLOCK_M=16, DISCARD=False, num_warps=warps,
        )  # fmt: skip
    return out
