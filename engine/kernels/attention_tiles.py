"""Paged attention over tiles of rows: a verify's rows load their request's prefix once, not once a row.

`attention_triton`'s kernel gives each (row, KV head) its own programs, so the ``N`` verify rows of a
request each read the request's whole prefix: at the Llama-3-8B shape a 32-row verify spent 3.9 ms of
a 13.9 ms tree cycle in attention against 1.0 ms of a decode step (bench/results/scale_profile-*).
Here a program holds a **tile**: the query heads of one KV head for ``R`` consecutive rows, as the
lines of one ``[TILE_LINES, D]`` query block (line ``i``: row ``i // GROUP``, head ``i % GROUP``).

**The same bits as the rows kernel.** Every row keeps `attention_triton`'s key order and chunking: its
keys are the virtual sequence prefix then extra slots, cut into chunks by its own key count, each chunk
an online softmax over ``BLOCK_N``-key blocks from scratch, the chunks merged by `attention_triton`'s
merge. What a tile changes is who computes a (row, chunk):

* a **shared** chunk, one that lies inside the prefix of every row of the tile (all rows of one request,
  with the same chunk length): one program loads each of its key blocks once and updates every line;
* any other chunk of a row (its last ones, past the shortest prefix; a padding row's empty one; every
  chunk of a tile whose rows do not share a request) is **its row's**: a program loads that row's keys
  (prefix positions, then its extra slots by rank) and updates that row's lines only.

Both paths run the same ``[TILE_LINES, D] x [D, BLOCK_N]`` products and row-wise reductions in one
compiled kernel, and a line's values depend on its own query and keys only; so a verify row computed in
a tile gives the bits of the decode row at its position computed as a tile of one row. Decode rows must
therefore take this kernel too (``SPECCYCLE_ATTENTION=tiles``: every forward of the fast path), not
`attention_triton`'s: on the H100 a tiled bfloat16 verify row differed in its last bits from that
kernel's decode row at real shapes (5 or more chunks; float32 agreed), although the two run the same
math on same-shaped blocks (bench/results/attention_bench-H100-rows-or-tiles-bitwise-*.json), while the
tile kernel against itself passed every check, bfloat16 and float32, SmolLM2 and Llama-3-8B shapes, 100
to 6,000 keys (`attention_bench-H100-tiles16-bitwise-*.json`). Tested on the interpreter too
(tests/kernels/test_attention_tiles.py).

**Work items.** Per (tile, KV head) the items are the shared chunks, then ``R * tail`` row items, ``t``-major
(item ``n_shared + t * R + r``: row ``r``'s chunks ``n_shared + t, n_shared + t + tail, ...``; ``tail`` is a
bound, so the last ones often find no chunk); ``P`` programs take every ``P``-th item. A row of one chunk stores
its output; a row of several stores each chunk's ``(max, sum, accumulator)`` and `attention_triton`'s combine kernel
merges them (a second launch). A tile's rows are consecutive rows of one group: a request's ``N`` verify rows under
the default launch (``group_rows`` ``N``, ``ceil(N / R)`` tiles a group, so no tile straddles two requests), else a
tile's own ``R`` rows. ``rows_per_tile`` (``R``), the groups and ``P`` are launch choices: they move work, never bits.

`paged_attention_tiles_triton` has `attention_triton.paged_attention_rows_triton`'s contract; its
torch twin is `attention_triton.paged_attention_rows_torch`.
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
    PROGRAMS_PER_SM,
    _multiprocessors,
    _ptx_hints,
    chunk_states,
    launch_options,
    paged_attention_rows_torch,
    triton,
)

if triton is not None:
    import triton.language as tl

    from .attention_triton import _paged_attention_combine_kernel, _row_chunks, _row_keys

# Lines of a tile's query block: the rows kernel's query block (`attention_triton`: 16 lines, the heads of
# one KV head of one row), so that a line's products and reductions have that kernel's shapes and layout:
# 4 rows of Llama-3-8B's 4 heads per KV head, 5 of SmolLM2's 3. (A first design took 64 lines for every
# launch, decode included: decode attention at the 8B shape went from 15.4 to 27.6 µs, bench/results/
# attention_bench-H100-tiles64-*.json.)
TILE_LINES = 16
# Registers a thread may hold in the default launch of tiles of several rows (speed only: the same bits).
# Uncapped the kernel took ~231 (at 155a47a), so 2 programs of 4 warps fit a multiprocessor; at 128 4 fit, and a
# program's chunks are latency-bound (2 key blocks each), so residency pays more than the spills cost. Since the
# int32 preamble (fff0a2d) it takes 165 uncapped and spills 56 bytes at 128 instead of 296 (bench/kernel_registers):
# 32 tree-verify rows 26.0 -> 17.8 µs at 512 keys on an H100 (bench/results/attention_bench-H100-int32-*).
# One-row tiles stay uncapped: on an H100 the cap cost the plain (1-row) decode 0.7% end to end at the 8B
# shape (156.4 / 156.2 -> 155.3 / 155.3 tokens/s, bench/results/gpu_bench-H100-scale-155a47a-{old,capall}-*),
# and with the int32 preamble a lone decode row is still faster uncapped (7.7 against 8.3 µs at 512 keys). Measured
# again on an H100 (27204c9; the GPU's Triton 3.6 compiles a verify tile to 231-244 registers uncapped, where
# this machine's 3.9 gives 165): a lone row equal (8.1 µs capped or not), 6 decode rows 45.9 -> 33.4 µs at 2,048
# keys with the cap, yet the plain decode 159.6 / 159.5 -> 159.2 / 159.1 tokens/s end to end (gpu_bench-H100-scale-
# 27204c9-onerowcap-*); and for a verify's tiles 96 or 168 registers, or more or fewer programs, were slower
# (attention_bench-H100-7f815ee-launch-*). So these stay.
MAXNREG = 128
# Programs of this kernel resident on one multiprocessor at `MAXNREG`: the default launch of a verify's tiles
# aims at one wave of them (`default_tile_programs`).
RESIDENT_TILE_PROGRAMS = 4
# Software-pipelining stages of the launch (speed only). A chunk is 2 blocks of keys, too few for
# prefetching to pay, while the stages' shared memory and registers cost residency.
NUM_STAGES = 1
# Warps of each program of the merge kernel (one program per row and query head, merging up to `MAX_CHUNKS`
# chunk states of a head's width). Part of the bits (the reductions' layout), decode and verify alike.
COMBINE_WARPS = 1
# The merge drops the chunk states from L2 once read (`attention_triton._discard_l2`), so they are not written
# back to memory under the next GEMMs. Speed only (the states are dead: the bitwise suite passes with it,
# bench/results/attention_bench-H100-46a9139-discard-bitwise-*); NVIDIA sm_90+ only, never under the interpreter.
# A 32-row verify's tiles write ~6 MB of them a layer at the 8B shape. On an H100 (a benchmark since removed: 16 layers
# of attention, O and gate-up from one graph) the O GEMM after the verify's attention took 16.7 µs with them left
# dirty and 15.9 with them dropped (14.6-14.9 with no attention before it), the gate-up 89.1 -> 87.8 (86.6); a layer
# 1.6-2.3 µs less (neighbour_bench-H100-20261126-fc82732/); the 32-node tree's cycle 8,692 -> 8,660 µs
# (scale_profile-H100-20261126-eefbb4f/discard-*). A decode row's states are few: no change there.
DISCARD_STATES = True


if triton is not None:

    @triton.jit
    def _block_update(q, k, v, cols_valid, lines, m_i, l_i, acc, scale, LOW_PRECISION: tl.constexpr,
                      UPCAST: tl.constexpr):  # fmt: skip
        """One key block of the online softmax for the lines in ``lines`` (the others keep their state)."""
        if UPCAST:  # the interpreter multiplies bfloat16 bit patterns: go through float32 (products exact)
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif LOW_PRECISION:
            s = tl.dot(q, tl.trans(k))  # bfloat16 / float16 tensor cores, float32 accumulation
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = s * scale
        s = tl.where(lines[:, None] & cols_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_new = l_i * alpha + tl.sum(p, axis=1)
        if LOW_PRECISION:  # probabilities rounded to the value dtype for the tensor cores (as flash attention)
            p_low = p.to(v.dtype)
            if UPCAST:
                pv = tl.dot(p_low.to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p_low, v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc_new = acc * alpha[:, None] + pv
        return (tl.where(lines, m_new, m_i), tl.where(lines, l_new, l_i), tl.where(lines[:, None], acc_new, acc))

    @triton.jit
    def _finish_chunk(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, lines, row, head, chunk, row_chunks, m_i,
                      l_i, acc, d, num_heads, chunk_bound, stride_ot, stride_oh, HEAD_DIM: tl.constexpr):  # fmt: skip
        """Store chunk ``chunk`` of the lines in ``lines``: the output of a row of one chunk, else the chunk's
        partial state at ``[row, head, chunk]`` (`attention_triton`'s combine kernel merges them)."""
        d_ok = d[None, :] < HEAD_DIM
        single = lines & (row_chunks == 1)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=single[:, None] & d_ok)  # fmt: skip
        split = lines & (row_chunks > 1)
        part = (row * num_heads + head) * chunk_bound + chunk  # [row, head, chunk] of the [T, H, bound] scratch
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=split[:, None] & d_ok)
        tl.store(part_max_ptr + part, m_i, mask=split)
        tl.store(part_sum_ptr + part, l_i, mask=split)

    @triton.jit
    def _paged_attention_tile_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        row_request_ptr, prefix_ptr, extra_ptr, table_ptr,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_et, stride_pt,
        num_extra, page_size, table_width, num_heads, chunk_bound, scale, num_rows, rows_per_tile, tail, group_rows,
        tiles_per_group,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr,
        LOW_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        """Programs ``(tile, KV head, p)``; program ``p`` takes items ``p, p + P, ...`` (module docstring)."""
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        lines = tl.arange(0, BLOCK_Q)
        local = lines // GROUP
        # the tile's rows: its group's (``group_rows`` consecutive rows, a request's verify rows), from its place in it
        in_group = (tile % tiles_per_group) * rows_per_tile
        row0 = (tile // tiles_per_group) * group_rows + in_group  # the tile's first row
        row = (row0 + local).to(tl.int64)
        ok = (local < rows_per_tile) & (in_group + local < group_rows) & (row < num_rows)
        head = kv_head * GROUP + lines % GROUP
        d = tl.arange(0, BLOCK_D)
        d_ok = d[None, :] < HEAD_DIM
        q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=ok[:, None] & d_ok, other=0.0)  # fmt: skip
        # every line's key count and chunks (functions of its row's prefix and valid extra slots)
        # int32 requests, key counts and chunk indices (a cache of < 2**31 slots, as `_row_keys`): in int64 they
        # held ~45 more registers a thread through the whole kernel (sm_90, a 32-node verify's tiles: 210 -> 165
        # uncapped, 296 -> 56 bytes of spill stores at the 128 cap; bench/kernel_registers.py), registers being what
        # limits this kernel's residency
        request = tl.load(row_request_ptr + row, mask=ok, other=-1).to(tl.int32)
        prefix_len = tl.minimum(tl.load(prefix_ptr + row, mask=ok, other=0), table_width * page_size).to(tl.int32)
        cols = tl.arange(0, BLOCK_M)
        extra = tl.load(extra_ptr + row[:, None] * stride_et + cols[None, :],
                        mask=ok[:, None] & (cols[None, :] < num_extra), other=-1)  # fmt: skip
        total = prefix_len + tl.sum((extra >= 0).to(tl.int32), axis=1)
        chunk_keys, row_chunks = _row_chunks(total, CHUNK, MAX_CHUNKS)
        # shared chunks: inside the prefix of every row with keys, all of one request and one chunk length
        active = ok & (total > 0)
        big = 1 << 30
        same_request = tl.min(tl.where(active, request, big), axis=0) == tl.max(tl.where(active, request, -1), axis=0)
        chunk_lo = tl.min(tl.where(active, chunk_keys, big), axis=0)
        same_chunks = chunk_lo == tl.max(tl.where(active, chunk_keys, -1), axis=0)
        min_prefix = tl.min(tl.where(active, prefix_len, big), axis=0)
        n_shared = tl.where(same_request & same_chunks, min_prefix // tl.maximum(chunk_lo, 1), 0)
        shared_request = tl.min(tl.where(active, request, big), axis=0)
        offs = tl.arange(0, BLOCK_N)
        programs = tl.num_programs(2)
        for item in range(tl.program_id(2), n_shared + rows_per_tile * tail, programs):
            m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
            acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
            if item < n_shared:  # a shared chunk: each key block loaded once for the whole tile
                lo = item * chunk_lo
                for start in range(lo, lo + chunk_lo, BLOCK_N):
                    n = start + offs  # inside every active row's prefix, hence inside its page table
                    page = tl.load(table_ptr + shared_request * stride_pt + n // page_size)
                    valid = page >= 0
                    safe = tl.where(valid, page * page_size + n % page_size, 0).to(tl.int64)
                    k = tl.load(k_ptr + safe[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                                mask=valid[:, None] & d_ok, other=0.0)  # fmt: skip
                    v = tl.load(v_ptr + safe[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                                mask=valid[:, None] & d_ok, other=0.0)  # fmt: skip
                    m_i, l_i, acc = _block_update(q, k, v, valid, active, m_i, l_i, acc, scale, LOW_PRECISION,
                                                  UPCAST)  # fmt: skip
                _finish_chunk(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, active, row, head, item, row_chunks,
                              m_i, l_i, acc, d, num_heads, chunk_bound, stride_ot, stride_oh, HEAD_DIM)  # fmt: skip
            else:  # a row's own chunks: its keys (prefix positions, then its extra slots by rank)
                # t-major: the rows' first items (each row's next chunk past the shared ones, present in every
                # row with keys) before their second ones (present only where a row's keys reach that far), so
                # the items that find no chunk come last and P programs share the real ones evenly
                r = (item - n_shared) % rows_per_tile
                t = (item - n_shared) // rows_per_tile
                the_row = (row0 + r).to(tl.int64)
                if (the_row < num_rows) & (in_group + r < group_rows):
                    own = ok & (local == r)
                    r_prefix, r_extra, r_has, r_rank, r_total = _row_keys(
                        the_row, prefix_ptr, extra_ptr, stride_et, num_extra, page_size, table_width, BLOCK_M
                    )
                    r_keys, r_chunks = _row_chunks(r_total, CHUNK, MAX_CHUNKS)
                    r_request = tl.load(row_request_ptr + the_row)
                    first = tl.where(r_total > 0, n_shared, 0) + t  # a padding row: its one empty chunk
                    for chunk in range(first, r_chunks, tail):
                        m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
                        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
                        acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
                        lo = chunk * r_keys
                        for start in range(lo, tl.minimum(r_total, lo + r_keys), BLOCK_N):
                            n = start + offs
                            in_prefix = n < r_prefix
                            column = tl.minimum(n // page_size, table_width - 1)
                            page = tl.load(table_ptr + r_request * stride_pt + column, mask=in_prefix, other=-1)
                            prefix_slot = tl.where(page >= 0, page * page_size + n % page_size, -1)
                            if start + BLOCK_N <= r_prefix:  # prefix keys only: no extra slot to pick
                                slot = prefix_slot
                            else:
                                e = n - r_prefix  # index among the row's valid extra slots
                                pick = (r_rank[None, :] == e[:, None]) & r_has[None, :]
                                extra_slot = tl.sum(tl.where(pick, r_extra[None, :] + 1, 0), axis=1) - 1
                                slot = tl.where(in_prefix, prefix_slot, extra_slot)
                            valid = slot >= 0
                            safe = tl.maximum(slot, 0).to(tl.int64)
                            k = tl.load(k_ptr + safe[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                                        mask=valid[:, None] & d_ok, other=0.0)  # fmt: skip
                            v = tl.load(v_ptr + safe[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                                        mask=valid[:, None] & d_ok, other=0.0)  # fmt: skip
                            m_i, l_i, acc = _block_update(q, k, v, valid, own, m_i, l_i, acc, scale, LOW_PRECISION,
                                                          UPCAST)  # fmt: skip
                        _finish_chunk(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, own, row, head, chunk,
                                      row_chunks, m_i, l_i, acc, d, num_heads, chunk_bound, stride_ot, stride_oh,
                                      HEAD_DIM)  # fmt: skip


def discard_chunk_states(requested: bool | None, hints: bool, scratch_address: int, head_dim: int) -> bool:
    """Whether the merge drops the chunk states from L2 once read (``requested``; None: `DISCARD_STATES`): only where
    the PTX hints run (``hints``: `attention_triton._ptx_hints`, outside the interpreter) and on whole 128-byte lines
    of one (row, head, chunk) state: an aligned scratch and states of a multiple of 32 floats (a head of 16 or 48
    would put a line across two states, or none: `_merge_chunks` takes ``BLOCK_D // 32`` lines)."""
    wanted = DISCARD_STATES if requested is None else requested
    return bool(wanted and hints and scratch_address % 128 == 0 and head_dim % 32 == 0)


def default_tile_programs(device: torch.device, tiles: int, kv_heads: int, rows_per_tile: int, items: int) -> int:
    """Programs per (tile, KV head) of the default launch; speed only (any count gives the same bits).

    Tiles of one row (decode rows, mostly padding in a decode graph's bucket): about `PROGRAMS_PER_SM` per
    multiprocessor, as the rows kernel, so a lone real row still gets a program per chunk. Tiles of several
    rows (a verify's, all real): `RESIDENT_TILE_PROGRAMS` per multiprocessor, one wave, since a program's
    chunks are latency-bound and more programs than fit run in rounds. The interpreter: every item its own
    program.

    Measured on an H200 at the 8B shape (`attention_bench`, µs per call at 512 / 1,024 / 2,048 keys; every
    launch gave the tile kernel's bits, `same_bits_as_tiles`):

    | launch (stages, registers, verify programs) | 32 tree-verify rows | 1 decode row + 7 padding | 6 decode rows |
    | --- | --- | --- | --- |
    | before: 3, uncapped, 17 | 39.5 / 53.6 / 72.0 | 14.7 / 19.3 / 25.1 | 20.4 / 30.4 / 54.4 |
    | 1, uncapped, 4 (2 resident) | 29.7 / 40.6 / 59.4 | 12.5 / 16.5 / 21.1 | 17.7 / 26.4 / 52.7 |
    | 1, 128, 8 (4 resident) | 27.8 / 36.9 / 50.1 | 12.5 / 15.3 / 21.6 | 14.1 / 24.3 / 39.4 |

    (bench/results/attention_bench-H200-tile-launch-*.json, the second run; decode rows take the one-row
    count in every launch.) The default is the last row for a verify's tiles and the second for one-row
    tiles (`MAXNREG`).
    """
    if device.type != "cuda":
        return items
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    if rows_per_tile > 1:
        return max(1, RESIDENT_TILE_PROGRAMS * sms // (tiles * kv_heads))
    return -(-PROGRAMS_PER_SM * sms // (tiles * kv_heads))


def default_rows_per_tile(num_extra: int, group: int, tile_lines: int = TILE_LINES, num_rows: int = 0,
                          table_rows: int = 0) -> int:  # fmt: skip
    """Rows a tile takes when the caller does not say: rows with extra slots are a verify's (``N`` rows of
    a request, ``N`` extra columns): as many as fit, up to ``N``, the launch cutting each request's ``N`` rows into
    tiles that never straddle two requests (a 5-row chain's request: a tile of 4 rows and one of 1; until c57bf7d
    the largest divisor of ``N`` that fits, which gave a 5-row chain one-row tiles, each reading the whole prefix);
    rows without extra slots one a tile (decode rows, one per request), unless there are more rows than
    the page table has requests (``num_rows > table_rows``): a prefill's or an extend's, consecutive positions of
    a request, whose tiles share their prefix blocks (as many rows as fit).

    (The rows' count against the table's is what a launch can see without reading the device: a graph's static
    table has `FastOptions.max_requests` rows, an eager call's one a request, and a decode has a row a request.
    Tiles change no bit, so a batch that mixes prefill and decode rows only runs at another speed.)"""
    fit = max(1, tile_lines // group)
    if num_extra <= 0:
        return fit if num_rows > table_rows > 0 else 1
    return min(fit, num_extra)


def paged_attention_tiles_triton(
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
    rows_per_tile: int | None = None,
    programs: int | None = None,
    tile_lines: int = TILE_LINES,
    chunk: int = CHUNK,
    max_chunks: int = MAX_CHUNKS,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    num_stages: int | None = NUM_STAGES,
    maxnreg: int | None = None,
    combine_warps: int = COMBINE_WARPS,
    discard_states: bool | None = None,
) -> torch.Tensor:
    """The tile kernel; same contract as `attention_triton.paged_attention_rows_triton`.

    ``rows_per_tile`` (default `default_rows_per_tile`), ``programs`` (per tile and KV head; default
    `default_tile_programs`), ``num_stages`` (Triton's software pipelining; None: Triton's default) and
    ``maxnreg`` (a cap on registers per thread, for more programs resident per multiprocessor; None: `MAXNREG`
    for tiles of several rows, none for one-row tiles; 0: none) and ``discard_states`` (the merge drops the chunk
    states from L2 once read; None: `DISCARD_STATES`; only ever on NVIDIA sm_90+ outside the interpreter) move work
    only.
    ``tile_lines``, ``chunk``, ``max_chunks``, ``block_n``, ``num_warps`` (the tensor-core instruction
    layout) and ``combine_warps`` (the warps of the merge of a row's chunks: the layout of its reductions) set
    the bits: rows agree bitwise only between calls with the same six (and with the rows kernel at its
    defaults only for the defaults here).
    """
    if triton is None:
        raise RuntimeError("paged_attention_tiles_triton needs triton: pip install triton, or use the torch path")
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if block_n < 1 or block_n & (block_n - 1) or chunk < block_n or chunk % block_n or max_chunks < 1:
        raise ValueError(
            f"paged_attention_tiles_triton: block_n={block_n} must be a power of two, chunk={chunk} a multiple "
            f"of it and max_chunks={max_chunks} at least 1"
        )
    if tile_lines < max(16, group) or tile_lines & (tile_lines - 1):
        raise ValueError(f"paged_attention_tiles_triton: tile_lines={tile_lines} must be a power of two >= 16 "
                         f"and >= the {group} query heads of a KV head")  # fmt: skip
    num_extra = extra_slots.shape[1]
    fit = tile_lines // group
    if rows_per_tile is None:
        rows = default_rows_per_tile(num_extra, group, tile_lines, num_rows, page_table.shape[0])
    else:
        rows = rows_per_tile
    if not 1 <= rows <= fit:
        raise ValueError(f"paged_attention_tiles_triton: rows_per_tile={rows} must lie in [1, {fit}] "
                         f"({tile_lines} lines of {group} heads)")  # fmt: skip
    if programs is not None and programs < 1:
        raise ValueError(f"paged_attention_tiles_triton: programs={programs} must be at least 1")
    for name, warps in (("num_warps", num_warps), ("combine_warps", combine_warps)):
        if warps < 1 or warps & (warps - 1):
            raise ValueError(f"paged_attention_tiles_triton: {name}={warps} must be a power of two")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"paged_attention_tiles_triton: num_stages={num_stages} must be at least 1")
    if maxnreg is not None and maxnreg < 0:
        raise ValueError(f"paged_attention_tiles_triton: maxnreg={maxnreg} must be None (the default), 0 (none) "
                         "or a register count")  # fmt: skip
    if q.is_cuda and head_dim < MIN_TRITON_HEAD_DIM:
        bound = page_table.shape[1] * page_size if kv_bound is None else kv_bound
        return paged_attention_rows_torch(q, k_cache, v_cache, row_request, prefix_lens, extra_slots, page_table,
                                          page_size, bound)  # fmt: skip
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_attention_tiles_triton: {name} needs a contiguous last dimension")
    row_request, prefix_lens = row_request.contiguous(), prefix_lens.contiguous()
    if num_extra == 0:
        extra_slots = page_table  # no column is read (see paged_attention_rows_triton)
    elif extra_slots.stride(1) != 1:
        extra_slots = extra_slots.contiguous()
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    table_width = page_table.shape[1]
    chunk_bound = min(max_chunks, max(1, -(-(table_width * page_size + num_extra) // chunk)))
    if chunk_bound > 1:
        part_acc, part_max, part_sum = chunk_states(num_rows, num_heads, chunk_bound, head_dim, q.device)
    else:
        part_acc = part_max = part_sum = torch.empty(1, dtype=torch.float32, device=q.device)
    # groups of rows that tiles never straddle: a verify's rows of one request (``num_extra`` of them) when the
    # default launch chose the tile, so a tile of 4 rows and one of 1 cover a 5-row chain's request; else tiles follow
    # each other (one group)
    group_rows = num_extra if rows_per_tile is None and num_extra > rows else rows
    tiles_per_group = -(-group_rows // rows)
    tiles = -(-num_rows // group_rows) * tiles_per_group
    # a row's chunks past the shared ones: its own rows' spread (R - 1 positions) and extra slots, one more
    tail = min(chunk_bound, 1 + -(-(rows - 1 + num_extra) // chunk))
    items = chunk_bound + rows * tail
    if programs is None:
        programs = default_tile_programs(q.device, tiles, num_kv_heads, rows, items)
    programs = max(1, min(programs, items))
    if maxnreg is None:  # a verify's tiles: residency pays; a lone decode row's few programs only lose to spills
        maxnreg = MAXNREG if rows > 1 else 0
    block_m = max(16, triton.next_power_of_2(max(num_extra, 1)))
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    hints = q.is_cuda and not interpret and _ptx_hints(q.device.index if q.device.index is not None else 0)
    discard = discard_chunk_states(discard_states, hints, part_acc.data_ptr(), head_dim)
    stride_et = extra_slots.stride(0) if num_extra else 0
    _paged_attention_tile_kernel[(tiles, num_kv_heads, programs)](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum, row_request, prefix_lens, extra_slots,
        page_table, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), out.stride(0), out.stride(1), stride_et, page_table.stride(0), num_extra, page_size,
        table_width, num_heads, chunk_bound, 1.0 / math.sqrt(head_dim), num_rows, rows, tail, group_rows,
        tiles_per_group,
        GROUP=group, BLOCK_Q=tile_lines, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n, CHUNK=chunk, MAX_CHUNKS=max_chunks, BLOCK_M=block_m,
        LOW_PRECISION=q.dtype in (torch.bfloat16, torch.float16), UPCAST=interpret,
        num_warps=num_warps, **launch_options(num_stages, maxnreg),
    )  # fmt: skip
    if chunk_bound > 1:  # rows of several chunks: `attention_triton`'s merge, one program per (row, head)
        _paged_attention_combine_kernel[(num_rows, num_heads)](
            out, part_acc, part_max, part_sum, prefix_lens, extra_slots, out.stride(0), out.stride(1), stride_et,
            num_extra, page_size, table_width, num_heads, chunk_bound, HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), CHUNK=chunk, MAX_CHUNKS=max_chunks,
            BLOCK_C=triton.next_power_of_2(max_chunks), BLOCK_M=block_m, DISCARD=discard, num_warps=combine_warps,
        )  # fmt: skip
    return out
