"""Paged attention over rows, graph-capturable: Triton kernels and their plain-torch twin.

The rule is core.ports': a row of request ``b`` attends the slots of b's positions ``[0, prefix_len)``
(through b's page table) plus the slots in its ``extra_slots`` row (-1 padded), after every row has
written its K/V. Both functions here are free of host syncs and of data-dependent shapes, so they run
inside a CUDA graph with the rows padded to a bucket: a padding row has ``prefix_len = 0`` and no
extra slot, attends nothing and returns zeros.

**One key order for every kind of row.** The kernel walks a row's keys as one virtual sequence: the
prefix positions ``0 .. prefix_len - 1``, then the row's valid extra slots in column order (a tree
row's ancestors, root first, then itself), in blocks of ``BLOCK_N`` keys that start at multiples of
``BLOCK_N``. A verify row at ``L + d`` (prefix ``L``, ``d + 1`` ancestors) and a decode row at the same
position (prefix ``L + d + 1``) therefore see the same keys in the same blocks, and the online softmax
does the same arithmetic: their outputs are bitwise equal. That is what lets greedy speculative
decoding reproduce autoregressive decoding in bfloat16 (together with GEMMs of one shape, see
`engine.fast.graphs`). A program handles the ``H / Hkv`` query heads of one KV head (Hugging Face's
``repeat_kv`` order) of one row, so a row's result never depends on the other rows.

**Split keys (flash decoding).** One program per (row, KV head) walking all keys leaves a GPU idle at
batch 1 (3 programs for SmolLM2). So the virtual sequence is cut into chunks of ``chunk_keys`` keys,
``chunk_keys = CHUNK * ceil(total / (CHUNK * MAX_CHUNKS))`` for a row of ``total`` keys: ``CHUNK`` keys
up to ``CHUNK * MAX_CHUNKS`` keys, then longer chunks (whole multiples of ``CHUNK``, hence of
``BLOCK_N``) so that no row has more than ``MAX_CHUNKS``. The chunks are a function of the key's index
and of the row's own key count only: the verify row and the decode row above (same ``total``) are cut
at the same places, whatever the number of rows, the batch, the page table's width or the launch.
Each chunk runs the online softmax from scratch over its blocks and leaves ``(max, sum, accumulator)``
in float32; the last of the row's programs (per KV head) to finish merges the row's chunks in one fixed
reduction over ``next_power_of_2(MAX_CHUNKS)`` lanes (absent chunks add exact zeros), whichever program
that is (an arrival counter per (row, KV head) in a persistent zeroed buffer, put back to 0 by the merger;
``fused_combine=False``: `_paged_attention_combine_kernel` merges instead, a second launch). A row of one chunk (at most
``CHUNK`` keys) stores its output directly, as the single pass did; the combine skips it (merging one
chunk would give the same bits: its weight is ``exp(0) = 1``). The launch: ``(rows, Hkv, P)``
programs, program ``p`` taking the row's chunks ``p, p + P, ...``; ``P`` (`default_programs_per_row`,
up to the static bound on a row's chunks from the page table's width and the extra columns) moves
work between programs and changes no bit. Programs past a row's chunks do nothing. The partial
states live in a ``[T, H, bound]`` float32 scratch allocated per call (static shape, so inside a
graph it comes from the graph's pool).

Precision: float32 models compute both products in IEEE float32; bfloat16 / float16 models use the
tensor cores (QK^T products exact, float32 accumulation, the softmax probabilities rounded to the
value dtype for P V, as flash attention does). Under ``TRITON_INTERPRET=1`` (whose ``tl.dot`` does not
handle bfloat16) the same roundings are applied and the products taken in float32.

`paged_attention_rows_torch` is the reference-style twin used where Triton is not (CPU): it gathers
every row's keys up to a static bound ``kv_bound`` (positions) and computes in float32.
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:  # a CPU install may lack triton; the torch twin still works
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on installs without triton
    triton = None


def paged_attention_rows_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_request: torch.Tensor,
    prefix_lens: torch.Tensor,
    extra_slots: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    kv_bound: int,
) -> torch.Tensor:
    """Attention of every row over its keys, in float32, with static shapes.

    Shapes: ``q [T, H, D]``, caches ``[num_slots, Hkv, D]``, ``row_request, prefix_lens [T]``,
    ``extra_slots [T, M]``, ``page_table [bs, W]`` -> ``[T, H, D]`` in ``q.dtype``. ``kv_bound`` bounds
    every ``prefix_len`` (a static number: ``W * page_size`` inside a graph). Rows that attend no key
    return zeros.
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    width = page_table.shape[1]
    positions = torch.arange(kv_bound, device=q.device)  # [S]
    page_index = (positions // page_size).clamp(max=width - 1)
    pages = page_table[row_request][:, page_index]  # [T, S]
    prefix_valid = (positions[None, :] < prefix_lens[:, None]) & (pages >= 0) & (positions < width * page_size)
    prefix_slots = pages * page_size + positions % page_size
    slots = torch.cat([prefix_slots, extra_slots], dim=1)  # [T, S + M]
    valid = torch.cat([prefix_valid, extra_slots >= 0], dim=1)
    safe = torch.where(valid, slots, 0).reshape(-1)
    keys = k_cache.index_select(0, safe).view(num_rows, -1, num_kv_heads, head_dim).float()  # [T, S+M, Hkv, D]
    values = v_cache.index_select(0, safe).view(num_rows, -1, num_kv_heads, head_dim).float()
    q32 = q.float().view(num_rows, num_kv_heads, group, head_dim)
    scores = torch.einsum("tkgd,tskd->tkgs", q32, keys) / math.sqrt(head_dim)  # [T, Hkv, G, S+M]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    out = torch.einsum("tkgs,tskd->tkgd", weights, values)
    return out.reshape(num_rows, num_heads, head_dim).to(q.dtype)


if triton is not None:

    @triton.jit
    def _row_keys(row, prefix_ptr, extra_ptr, stride_et, num_extra, page_size, table_width, BLOCK_M: tl.constexpr):
        """A row's prefix length (clamped to its page table), valid extra slots with their ranks, and key count."""
        # int32 key indices and slots (a cache of < 2**31 slots): the [BLOCK_N, BLOCK_M] slot pick below
        # costs half the registers of int64
        prefix_len = tl.minimum(tl.load(prefix_ptr + row), table_width * page_size).to(tl.int32)
        # The row's valid extra slots, numbered 0, 1, ... in column order (holes skipped).
        cols = tl.arange(0, BLOCK_M)
        extra = tl.load(extra_ptr + row * stride_et + cols, mask=cols < num_extra, other=-1).to(tl.int32)
        has_extra = extra >= 0
        rank = tl.cumsum(has_extra.to(tl.int32), axis=0) - 1
        rank = tl.where(has_extra, rank, -1)
        total = prefix_len + tl.sum(has_extra.to(tl.int32), axis=0)
        return prefix_len, extra, has_extra, rank, total

    @triton.jit
    def _row_chunks(total, CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr):
        """Keys per chunk and the row's chunk count: functions of its key count ``total`` alone.

        ``CHUNK`` keys per chunk, grown by whole multiples of ``CHUNK`` beyond ``CHUNK * MAX_CHUNKS``
        keys so that no row has more than ``MAX_CHUNKS`` chunks; a row without keys has one (empty) chunk.
        """
        chunk_keys = CHUNK * tl.cdiv(total, CHUNK * MAX_CHUNKS)
        num_chunks = tl.maximum(tl.cdiv(total, tl.maximum(chunk_keys, 1)), 1)
        return chunk_keys, num_chunks

    @triton.jit
    def _discard_l2(addresses, keep):
        """PTX ``discard.global.L2``: the 128-byte L2 lines at ``addresses`` (where ``keep``) are invalidated
        without being written back; their contents become undefined.

        A verify's tiles write ~6 MB of float32 chunk states a layer at the 8B shape (32 rows x 32 heads x ~10
        chunks x 512 bytes), which the merge reads once; left dirty in L2 they are written back to memory while
        the next GEMMs stream their weights (bench/results/neighbour_bench-H100-20261126-fc82732/). Hopper and
        later (sm_80's PTX 7.4 has it).
        """
        flag = keep.to(tl.int32)
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p discard.global.L2 [$1], 128; mov.b32 $0, 0; }",
            "=r,l,r", [addresses.to(tl.int64, bitcast=True), flag], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def _load_chunks(
        part_acc_ptr, part_max_ptr, part_sum_ptr, row, head, row_chunks, num_heads, chunk_bound,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, CACHE: tl.constexpr,
    ):  # fmt: skip
        """The ``row_chunks`` partial states of (row, query head), ``(max [BLOCK_C], sum [BLOCK_C], accumulator
        [BLOCK_C, BLOCK_D])``, absent lanes ``(-inf, 0, 0)``: the loads of `_merge_chunks`. ``CACHE``: the loads'
        cache modifier (".cg", past the SM's L1, where other programs of the same launch wrote the states)."""
        c = tl.arange(0, BLOCK_C)
        d = tl.arange(0, BLOCK_D)
        live = c < row_chunks
        part = (row.to(tl.int64) * num_heads + head) * chunk_bound + c
        m = tl.load(part_max_ptr + part, mask=live, other=float("-inf"), cache_modifier=CACHE)
        l = tl.load(part_sum_ptr + part, mask=live, other=0.0, cache_modifier=CACHE)
        a = tl.load(
            part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
            mask=live[:, None] & (d[None, :] < HEAD_DIM),
            other=0.0,
            cache_modifier=CACHE,
        )
        return m, l, a

    @triton.jit
    def _store_merged(
        out_ptr, m, l, a, row, head, stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr
    ):  # fmt: skip
        """Merge loaded partial states (`_load_chunks`) in one fixed reduction over their ``BLOCK_C`` lanes and store
        (row, head)'s output."""
        d = tl.arange(0, BLOCK_D)
        top = tl.max(m, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(m - top)  # 0 for absent chunks and chunks without a valid key
        total_sum = tl.sum(w * l, axis=0)
        o = tl.sum(w[:, None] * a, axis=0)
        o = o / tl.where(total_sum > 0, total_sum, 1.0)
        tl.store(out_ptr + row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)

    @triton.jit
    def _merge_chunks(
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, row, head, row_chunks, num_heads, chunk_bound, stride_ot,
        stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, CACHE: tl.constexpr,
        DISCARD: tl.constexpr,
    ):  # fmt: skip
        """Merge the ``row_chunks`` partial states of (row, query head) and store its output.

        All ``BLOCK_C`` chunk lanes are reduced in one fixed tree, absent chunks contributing exact zeros,
        so the result depends on the row's own chunks only (`_load_chunks`, then `_store_merged`; the rows kernel's
        fused merge and the exact prefill kernel call the two halves themselves, loading the next head's or row's
        states before they store this one's: the same arithmetic).
        ``DISCARD``: once merged, the chunks' accumulators are dropped from L2 unwritten (`_discard_l2`).
        """
        m, l, a = _load_chunks(part_acc_ptr, part_max_ptr, part_sum_ptr, row, head, row_chunks, num_heads,
                               chunk_bound, HEAD_DIM, BLOCK_D, BLOCK_C, CACHE)  # fmt: skip
        _store_merged(out_ptr, m, l, a, row, head, stride_ot, stride_oh, HEAD_DIM, BLOCK_D)
        if DISCARD:
            tl.debug_barrier()  # every thread's loads of the states are done (its store used them)
            c = tl.arange(0, BLOCK_C)
            part = (row.to(tl.int64) * num_heads + head) * chunk_bound + c
            lines = tl.arange(0, BLOCK_D // 32) * 32  # 128-byte lines of a chunk's float32 accumulator
            _discard_l2(part_acc_ptr + part[:, None] * HEAD_DIM + lines[None, :],
                        (c < row_chunks)[:, None] & (lines[None, :] < HEAD_DIM))  # fmt: skip

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        part_acc_ptr,
        part_max_ptr,
        part_sum_ptr,
        counter_ptr,
        row_request_ptr,
        prefix_ptr,
        extra_ptr,
        table_ptr,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_et,
        stride_pt,
        num_extra,
        page_size,
        table_width,
        num_heads,
        chunk_bound,
        scale,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CHUNK: tl.constexpr,
        MAX_CHUNKS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        LOW_PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        FUSED_COMBINE: tl.constexpr,
        BLOCK_C: tl.constexpr,
        PIPELINED_MERGE: tl.constexpr,
    ):
        """Programs ``(row, KV head, p)``: program ``p`` runs the online softmax over the row's chunks
        ``p, p + P, p + 2P, ...`` (``P`` programs per row and KV head, a launch choice that changes no
        bit: each chunk starts afresh and keeps its own result).

        A row of one chunk stores its output; a row of several stores each chunk's running max, sum
        and unnormalized accumulator, merged by `_paged_attention_combine_kernel` or, with
        ``FUSED_COMBINE``, by the last of the row's programs (for that KV head) to finish: each counts
        its arrival in ``counter_ptr[row, kv_head]`` (an atomic, after a barrier, so its states are
        visible first); the one that sees all others arrived merges the group's heads and puts the
        counter back to 0 for the next launch. Programs past the row's chunks do nothing.
        """
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        first_chunk = tl.program_id(2)
        request = tl.load(row_request_ptr + row)
        prefix_len, extra, has_extra, rank, total = _row_keys(
            row, prefix_ptr, extra_ptr, stride_et, num_extra, page_size, table_width, BLOCK_M
        )
        chunk_keys, row_chunks = _row_chunks(total, CHUNK, MAX_CHUNKS)
        # Masks as head-count limits (not `mask & scalar`: the interpreter turns a block mask & a scalar
        # condition into int32): a program past the row's chunks loads nothing; a row of one chunk stores
        # its output, a row of several its chunks' partial states.
        own_heads = tl.where(first_chunk < row_chunks, GROUP, 0)
        single_heads = tl.where(row_chunks == 1, GROUP, 0)
        split_heads = tl.where(row_chunks > 1, GROUP, 0)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        q_mask = (g[:, None] < own_heads) & (d[None, :] < HEAD_DIM)
        q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        offs = tl.arange(0, BLOCK_N)
        part_row = (row.to(tl.int64) * num_heads + heads) * chunk_bound  # [row, head, 0] of the scratch
        for chunk in range(first_chunk, row_chunks, tl.num_programs(2)):
            lo = chunk * chunk_keys  # a multiple of CHUNK, hence of BLOCK_N
            hi = tl.minimum(total, lo + chunk_keys)
            m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
            for start in range(lo, hi, BLOCK_N):
                n = start + offs  # virtual key index
                in_prefix = n < prefix_len
                page_col = tl.minimum(n // page_size, table_width - 1)
                page = tl.load(table_ptr + request * stride_pt + page_col, mask=in_prefix, other=-1)
                prefix_slot = tl.where(page >= 0, page * page_size + n % page_size, -1)
                if start + BLOCK_N <= prefix_len:  # a block of prefix keys only (most): no extra slot to pick
                    slot = prefix_slot
                else:
                    e = n - prefix_len  # index among the valid extra slots
                    pick = (rank[None, :] == e[:, None]) & has_extra[None, :]
                    # the extra slot of rank e (one column at most), plus one: 0 when none, so slot -1 then
                    extra_slot = tl.sum(tl.where(pick, extra[None, :] + 1, 0), axis=1) - 1
                    slot = tl.where(in_prefix, prefix_slot, extra_slot)
                # slot >= 0 implies n < total. Kept to one select on `slot`: Triton 3.6's layout pass
                # (TritonGPURemoveLayoutConversions) fails on `tl.where((n < total) & (slot >= 0), slot, 0)`.
                valid = slot >= 0
                safe = tl.maximum(slot, 0).to(tl.int64)

                k = tl.load(
                    k_ptr + safe[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                    mask=valid[:, None] & (d[None, :] < HEAD_DIM),
                    other=0.0,
                )
                v = tl.load(
                    v_ptr + safe[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                    mask=valid[:, None] & (d[None, :] < HEAD_DIM),
                    other=0.0,
                )
                if UPCAST:  # the interpreter multiplies bfloat16 bit patterns: go through float32 (products exact)
                    s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
                elif LOW_PRECISION:
                    s = tl.dot(q, tl.trans(k))  # bfloat16 / float16 tensor cores, float32 accumulation
                else:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                s = s * scale  # [BLOCK_G, BLOCK_N]
                s = tl.where(valid[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if LOW_PRECISION:  # probabilities rounded to the value dtype for the tensor cores (as flash attention)
                    p_low = p.to(v.dtype)
                    if UPCAST:
                        pv = tl.dot(p_low.to(tl.float32), v.to(tl.float32), input_precision="ieee")
                    else:
                        pv = tl.dot(p_low, v)
                else:
                    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                acc = acc * alpha[:, None] + pv
                m_i = m_new

            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=(g[:, None] < single_heads) & (d[None, :] < HEAD_DIM),
            )
            # several chunks: the chunk's partial state, at [row, head, chunk] of the [T, H, chunk_bound] scratch
            part = part_row + chunk
            split_mask = g < split_heads
            tl.store(
                part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                acc,
                mask=split_mask[:, None] & (d[None, :] < HEAD_DIM),
            )
            tl.store(part_max_ptr + part, m_i, mask=split_mask)
            tl.store(part_sum_ptr + part, l_i, mask=split_mask)
        if FUSED_COMBINE:
            if (row_chunks > 1) & (first_chunk < row_chunks):
                tl.debug_barrier()  # every thread's states stored before the arrival is counted
                counter = counter_ptr + row * tl.num_programs(1) + kv_head
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == tl.minimum(tl.num_programs(2), row_chunks) - 1:  # the last of the row's programs
                    tl.store(counter, 0)
                    if PIPELINED_MERGE:  # calls of no more rows than page-table rows (the launcher's choice)
                        # the group's heads in turn, each head's states loaded before the head before it is stored (a
                        # store may alias a later load, so the loads would otherwise wait for it): the same arithmetic.
                        # Two states held: the verifies' many programs lost residency with it (12-25% slower alone)
                        m, l, a = _load_chunks(
                            part_acc_ptr, part_max_ptr, part_sum_ptr, row, kv_head * GROUP, row_chunks, num_heads,
                            chunk_bound, HEAD_DIM, BLOCK_D, BLOCK_C, ".cg",
                        )  # fmt: skip
                        for h in tl.static_range(GROUP):
                            if h + 1 < GROUP:
                                m_next, l_next, a_next = _load_chunks(
                                    part_acc_ptr, part_max_ptr, part_sum_ptr, row, kv_head * GROUP + h + 1, row_chunks,
                                    num_heads, chunk_bound, HEAD_DIM, BLOCK_D, BLOCK_C, ".cg",
                                )  # fmt: skip
                            _store_merged(out_ptr, m, l, a, row, kv_head * GROUP + h, stride_ot, stride_oh, HEAD_DIM,
                                          BLOCK_D)  # fmt: skip
                            if h + 1 < GROUP:
                                m, l, a = m_next, l_next, a_next
                    else:  # each head loaded after the head before it is stored: fewer registers
                        for h in tl.static_range(GROUP):
                            _merge_chunks(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, row, kv_head * GROUP + h,
                                          row_chunks, num_heads, chunk_bound, stride_ot, stride_oh, HEAD_DIM, BLOCK_D,
                                          BLOCK_C, ".cg", False)  # fmt: skip

    @triton.jit
    def _paged_attention_combine_kernel(
        out_ptr,
        part_acc_ptr,
        part_max_ptr,
        part_sum_ptr,
        prefix_ptr,
        extra_ptr,
        stride_ot,
        stride_oh,
        stride_et,
        num_extra,
        page_size,
        table_width,
        num_heads,
        chunk_bound,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        CHUNK: tl.constexpr,
        MAX_CHUNKS: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_M: tl.constexpr,
        DISCARD: tl.constexpr,
    ):
        """One program per (row, query head) of a row of several chunks: merges its chunks' states.

        All ``BLOCK_C`` (a constant, ``MAX_CHUNKS`` rounded up) chunk lanes are reduced in one fixed
        tree, absent chunks contributing exact zeros, so the result depends on the row's own chunks only.
        """
        row = tl.program_id(0)
        head = tl.program_id(1)
        _, _, _, _, total = _row_keys(row, prefix_ptr, extra_ptr, stride_et, num_extra, page_size, table_width, BLOCK_M)
        _, row_chunks = _row_chunks(total, CHUNK, MAX_CHUNKS)
        if row_chunks > 1:  # a row of one chunk stored its output already
            _merge_chunks(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, row, head, row_chunks, num_heads,
                          chunk_bound, stride_ot, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_C, "", DISCARD)  # fmt: skip


# The split's constants, from the H100 sweep of bench/attention_bench.py (SmolLM2, bf16, CUDA graphs,
# bench/results/attention_bench-H100-smollm2-20261124-074538.json): chunks of 64 keys in blocks of 32
# ("b32-c64-m32") against the first choice, 128 keys in blocks of 64: 1 row at 512 / 2048 keys 8.8 / 8.8 us
# against 10.7 / 10.6; 6 rows 9.1 / 17.1 against 10.7 / 17.7; 32 rows 15.3 / 51.9 against 19.7 / 64.2; a
# 16-row verify 12.9 / 26.7 against 11.2 / 30.7; all cases summed 1,365 us against 1,527. Changing them
# changes the bits of every row that splits, never the rule that a row's chunks depend on its key count
# only (decode == verify holds for any one setting).
BLOCK_N = 32  # keys per block of the online softmax
CHUNK = 64  # keys per chunk (split) of a row, a multiple of BLOCK_N
MAX_CHUNKS = 32  # chunks per row at most: beyond CHUNK * MAX_CHUNKS keys a chunk holds a larger multiple of CHUNK

MIN_TRITON_HEAD_DIM = 16  # tl.dot's smallest K on NVIDIA GPUs
MIN_PROGRAMS_PER_ROW = 4  # the default launch: at least this many programs per (row, KV head), up to the bound
# The default launch aims at this many programs per multiprocessor over all rows. A program past its row's
# chunks exits after reading the row's key count, so surplus programs cost little, while too few make a
# row's chunks run in rounds; and a decode graph's rows are mostly padding rows (one chunk, no keys), which
# a count over all rows cannot see. Measured (same sweep, 128-key chunks): with every chunk its own program
# ("split-pmax") 1 row + 7 padding rows at 2,048 keys took 11.8 us against 18.2 with about 2 per SM, 6 rows
# at 8,192 keys 41.4 against 50.8; 32 rows at 128-512 keys in an engine-wide table lost 1.8 us.
PROGRAMS_PER_SM = 8
# ... and up to this many programs per (row, KV head), as many as keep the launch at `MAX_PROGRAMS_PER_SM` per
# multiprocessor over all rows: a long row's chunks (a 900-key row has 15) then run in two rounds, not four, and
# the launch is still small enough that the surplus programs cost less than the rounds. Measured alone (H200,
# SmolLM2 bf16, the shipped prompts' lengths plus up to 127 generated, 20 calls in a graph, µs, the old rule's count
# -> this one's; bench/results/attention_launch-H200-20261127-e262817.json): 64 requests' decode 20.6 -> 16.7, chain
# verifies of 3 / 4 / 5 rows a request 29.4 / 32.8 / 37.8 -> 25.6 / 29.5 / 34.1; 16 requests' 4-row verify 16.4 ->
# 14.5; 256 requests' decode 48.9 -> 45.5; past the cap (256 requests' 4-row verifies: 8 programs 103.6 against
# 101.4) the old rule stands.
SPREAD_PROGRAMS_PER_ROW = 8
MAX_PROGRAMS_PER_SM = 64
# Warps per program of the rows kernel and the combine kernel. Not speed only: the count sets the tensor-core
# instruction layout (Hopper's warp-group MMA needs 4 warps, 1 warp runs mma.sync), and outputs differ in the
# last bits between counts, so every call of an engine must use one count (decode and verify alike: the
# kernel reads no row count to pick it). H100, SmolLM2 (head_dim 64), bfloat16: 1 warp against 4, verify
# rows of a chain at 512 keys 10.3 against 14.0 us (16 rows) and 10.9 against 20.9 (32 rows), a decode row
# 9.9 against 9.3; the fused EAGLE cycles on 13 Spec-Bench prompts x 256 tokens 1686.7 against 1653.3
# tokens/s (tree S5 K4 N16) and 1546.5 against 1506.2 (chain S5), autoregressive 896.6 against 888.8
# (bench/results/fused_bench-H100-warps-*.json). Larger head dims (128: Llama-3-8B) keep 4, unmeasured with 1.
# ``NUM_WARPS`` (None: by head dim) overrides it for benchmarks.
NUM_WARPS: int | None = None
# Software-pipelining stages of the rows kernel's launch (None: Triton's default, 3; speed only: every launch
# gives the same bits, `attention_bench`'s ``same_bits_as_split``). One stage was faster alone (H100, SmolLM2,
# bfloat16, 20 calls in a graph with the keys warm in L2: a decode row 8.7-8.9 against 9.6-9.8 µs at 256-1,024
# keys, a 24-row verify 13.6 against 17.4 at 1,024; bench/results/attention_bench-H100-rows-launch-*.json)
# but not in the engine: old and new alternated twice on one H100 (13 prompts x 256, `fused_bench`), the
# autoregressive decode went 982.0 / 969.3 / 981.6 / 982.9 -> 959.1 / 960.6 / 972.8 / 971.4 tokens/s and the
# fused S6 K4 N24 cycles 2,641 / 2,652 -> 2,579 / 2,703 (bench/results/fused_bench-H100-20261126-71cfdab-rows-s1/).
# The tile kernel keeps its own (`attention_tiles.NUM_STAGES`), which paid end to end at the 8B shape.
# A call with more rows than page-table rows takes one stage. In the scheduler's fused cycles (a table row per
# request of the bucket) those are the verifies of two rows or more, the draft extends and a tree's draft levels
# (K rows a request), and also the autoregressive shape's step when the bucket of its rows, padded to at least
# N, outgrows the batch (1 to 4 clients with N = 5); the chain's draft levels, and the autoregressive step at 8
# clients or more, keep Triton's default. Where the table is a static buffer of the engine's `max_requests` rows
# (`ForwardGraphs`), only calls of more rows than that take one stage. Measured at 64 clients in the scheduler
# (H200, SmolLM2 bf16, EAGLE-3; CUDA event timings of its graph replays and kernel times, printed, not in result
# files): the rows kernel was 62% of an S3 cycle's GPU time; one stage for every call took a 256-row chain verify's
# attention alone from 35.0 to 25.6 µs and the S4 cycle from 3.00 to 2.59 ms, but the autoregressive step (64 rows
# of 64 requests) from 1.38 to 1.43 ms; with this rule the S3 cycle went from 2.48-2.51 to 2.17-2.18 ms and the
# autoregressive step stayed at 1.38 (two alternations on one machine). Launch only, never a bit: a verify row at
# one stage is the decode row's bits (test_attention_kernel, on a GPU).
NUM_STAGES: int | None = None  # a call of one row a request (or fewer)
MULTI_ROW_NUM_STAGES: int | None = 1  # a call with more rows than page-table rows


def default_num_stages(num_rows: int, num_requests: int) -> int | None:
    """The rows kernel's pipelining stages for a call of ``num_rows`` rows over a page table of ``num_requests``
    rows (None: Triton's default)."""
    return MULTI_ROW_NUM_STAGES if num_rows > num_requests else NUM_STAGES


def launch_options(num_stages: int | None, maxnreg: int | None) -> dict:
    """The optional Triton launch keywords of the attention kernels: pipelining stages (None: Triton's default)
    and a register cap (None or 0: none). Both move work only, never a bit of the output."""
    return {**({} if num_stages is None else {"num_stages": num_stages}), **({"maxnreg": maxnreg} if maxnreg else {})}


def default_num_warps(head_dim: int) -> int:
    """The rows kernel's warps per program for a head dim (see `NUM_WARPS`): 1 up to 64, else 4."""
    if NUM_WARPS is not None:
        return NUM_WARPS
    return 1 if head_dim <= 64 else 4


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _ptx_hints(device_index: int) -> bool:
    """Whether the cache hints written in PTX (`_discard_l2`) may run: an NVIDIA GPU of compute capability 9.0 or
    later (not ROCm, whose torch also reports ``is_cuda``)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (9, 0)


def default_programs_per_row(
    device: torch.device, rows: int, kv_heads: int, chunk_bound: int, spread: int | None = None
) -> int:
    """Programs per (row, KV head) of the default launch: about `PROGRAMS_PER_SM` per multiprocessor over
    all rows (a decode graph of 1 real row and 7 padding rows, SmolLM2's 3 KV heads: one program per chunk
    up to the bound), at least `MIN_PROGRAMS_PER_ROW`, and up to ``spread`` (default `SPREAD_PROGRAMS_PER_ROW`) as
    many as keep the launch at `MAX_PROGRAMS_PER_SM` per multiprocessor; at most
    ``chunk_bound``. Speed only: any count gives the same bits."""
    if device.type != "cuda":
        return chunk_bound  # the interpreter: one program per chunk
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    wanted = -(-PROGRAMS_PER_SM * sms // (rows * kv_heads))
    spread = SPREAD_PROGRAMS_PER_ROW if spread is None else spread
    roomy = min(spread, MAX_PROGRAMS_PER_SM * sms // (rows * kv_heads))
    return max(1, min(chunk_bound, max(MIN_PROGRAMS_PER_ROW, roomy, wanted)))


def chunk_states(num_rows: int, num_heads: int, chunk_bound: int, head_dim: int, device) -> tuple[torch.Tensor, ...]:
    """The float32 scratch of the chunks' partial states, ``(accumulator [T, H, C, D], max [T, H, C], sum [T, H, C])``,
    shared by the attention kernels that split rows into chunks. Max and sum are two allocations, not halves of one:
    the second half's address is 16-byte aligned only for some row / head / chunk counts, and Triton compiles a kernel
    per pointer alignment."""
    acc = torch.empty((num_rows, num_heads, chunk_bound, head_dim), dtype=torch.float32, device=device)
    top = torch.empty((num_rows, num_heads, chunk_bound), dtype=torch.float32, device=device)
    return acc, top, torch.empty_like(top)


# Arrival counters of the fused combine, per device: int32 zeros that every launch leaves at zero (the last
# program of a (row, KV head) puts its counter back). Allocated outside any graph capture and never freed,
# since captured graphs keep their addresses: a larger need (more rows) adds a buffer and keeps the old.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
MIN_COUNTERS = 1 << 14  # (row, KV head) pairs: 512 rows of 32 KV heads


def _arrival_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least ``needed`` counters; None when one must be made during a capture."""
    buffers = _COUNTERS.setdefault(device, [])
    if buffers and buffers[-1].numel() >= needed:
        return buffers[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None  # not allocated inside a graph's pool: this launch merges with the combine kernel
    buffers.append(torch.zeros(max(needed, MIN_COUNTERS), dtype=torch.int32, device=device))
    return buffers[-1]


def chunk_layout(total: int, chunk: int = CHUNK, max_chunks: int = MAX_CHUNKS) -> tuple[int, int]:
    """``(keys per chunk, chunks)`` of a row of ``total`` keys, as the kernels compute it (a host mirror)."""
    chunk_keys = chunk * -(-total // (chunk * max_chunks))
    return chunk_keys, max(-(-total // max(chunk_keys, 1)), 1)


def paged_attention_rows_triton(
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
    chunk: int = CHUNK,
    max_chunks: int = MAX_CHUNKS,
    block_n: int = BLOCK_N,
    programs_per_row: int | None = None,
    fused_combine: bool = True,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """The Triton kernels; same contract as `paged_attention_rows_torch` (``kv_bound`` is not needed).

    ``q`` and the caches need a contiguous last dimension; ``extra_slots`` and ``page_table`` a
    contiguous last dimension too (row strides are free, so views of wider static buffers work).

    ``chunk``, ``max_chunks``, ``block_n``: the split's constants, for tests and benchmarks only: rows
    agree bitwise only between calls with the same three. ``max_chunks=1`` is the single-pass kernel
    (one program per (row, KV head) walks all the row's keys, no combine). ``programs_per_row``: programs
    per (row, KV head), each taking every ``programs_per_row``-th chunk (default:
    `default_programs_per_row`); it changes the launch only, never a bit of the output.
    ``fused_combine``: rows of several chunks are merged by the last of their programs to finish, inside
    the one kernel (default), or by `_paged_attention_combine_kernel`, a second launch (the first design;
    benchmarks compare them). Either way a row's output is a function of its own chunks only.
    ``num_warps``: warps per program (default `default_num_warps`), for benchmarks; rows agree bitwise
    only between calls with the same count. ``num_stages`` (Triton's software pipelining; None: `default_num_stages`,
    by rows a request) and ``maxnreg`` (a cap on registers per thread; None: none) change
    the launch only.
    """
    if triton is None:
        raise RuntimeError("paged_attention_rows_triton needs triton: pip install triton, or use the torch path")
    if block_n < 1 or block_n & (block_n - 1) or chunk < block_n or chunk % block_n or max_chunks < 1:
        raise ValueError(
            f"paged_attention_rows_triton: block_n={block_n} must be a power of two, chunk={chunk} a multiple "
            f"of it and max_chunks={max_chunks} at least 1"
        )
    if programs_per_row is not None and programs_per_row < 1:
        raise ValueError(f"paged_attention_rows_triton: programs_per_row={programs_per_row} must be at least 1")
    num_rows, num_heads, head_dim = q.shape
    if q.is_cuda and head_dim < MIN_TRITON_HEAD_DIM:
        # tl.dot needs K >= 16 on a GPU (the interpreter does not check): small test models take the twin
        return paged_attention_rows_torch(
            q,
            k_cache,
            v_cache,
            row_request,
            prefix_lens,
            extra_slots,
            page_table,
            page_size,
            page_table.shape[1] * page_size if kv_bound is None else kv_bound,
        )
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    # The kernel reads a row's request and prefix length at `ptr + row`: a view with another stride (an
    # expanded [1] -> [K] at batch 1, say: stride 0) would be read past its storage.
    row_request, prefix_lens = row_request.contiguous(), prefix_lens.contiguous()
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"paged_attention_rows_triton: {name} needs a contiguous last dimension")
    num_extra = extra_slots.shape[1]
    if num_extra == 0:
        # No extra column: the kernels load no extra slot (every column is masked), so any valid int64
        # device pointer serves; the page table's, rather than a fresh [1, 1] tensor whose fill would be
        # a kernel (and a launch inside every captured layer) per call.
        extra_slots = page_table
    elif extra_slots.stride(1) != 1:
        extra_slots = extra_slots.contiguous()
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    # A static bound on a row's chunks from the shapes (the page table's positions plus the extra
    # columns), so the launch is the same at every replay; a row's own count is read in the kernel.
    table_width = page_table.shape[1]
    chunk_bound = min(max_chunks, max(1, -(-(table_width * page_size + num_extra) // chunk)))
    if chunk_bound > 1:  # partial states of rows of several chunks, [T, H, chunk_bound] (static shape)
        part_acc, part_max, part_sum = chunk_states(num_rows, num_heads, chunk_bound, head_dim, q.device)
    else:  # every row has one chunk and stores its output directly
        part_acc = part_max = part_sum = torch.empty(1, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    warps = num_warps or default_num_warps(head_dim)
    block_m = max(16, triton.next_power_of_2(max(num_extra, 1)))
    block_c = triton.next_power_of_2(max_chunks)
    counters = None
    if chunk_bound > 1 and fused_combine:
        counters = _arrival_counters(q.device, num_rows * num_kv_heads)
    fused = counters is not None
    if counters is None:
        counters = part_max  # not read
    if programs_per_row is None:
        programs = default_programs_per_row(q.device, num_rows, num_kv_heads, chunk_bound)
    else:
        programs = min(programs_per_row, chunk_bound)
    _paged_attention_kernel[(num_rows, num_kv_heads, programs)](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_max,
        part_sum,
        counters,
        row_request,
        prefix_lens,
        extra_slots,
        page_table,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        extra_slots.stride(0) if num_extra else 0,
        page_table.stride(0),
        num_extra,
        page_size,
        table_width,
        num_heads,
        chunk_bound,
        1.0 / math.sqrt(head_dim),
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        CHUNK=chunk,
        MAX_CHUNKS=max_chunks,
        BLOCK_M=block_m,
        LOW_PRECISION=q.dtype in (torch.bfloat16, torch.float16),
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        FUSED_COMBINE=fused,
        BLOCK_C=block_c,
        PIPELINED_MERGE=num_rows <= page_table.shape[0],
        num_warps=warps,
        **launch_options(
            default_num_stages(num_rows, page_table.shape[0]) if num_stages is None else num_stages, maxnreg
        ),
    )
    if chunk_bound > 1 and not fused:
        _paged_attention_combine_kernel[(num_rows, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            prefix_lens,
            extra_slots,
            out.stride(0),
            out.stride(1),
            extra_slots.stride(0) if num_extra else 0,
            num_extra,
            page_size,
            table_width,
            num_heads,
            chunk_bound,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            CHUNK=chunk,
            MAX_CHUNKS=max_chunks,
            BLOCK_C=block_c,
            BLOCK_M=block_m,
            DISCARD=False,
            num_warps=warps,
        )
    return out
