"""Paged attention for a prefill's rows: blocks of consecutive rows share every key block they load, on tensor cores.

`attention_triton`'s rows kernel gives each (row, KV head) its own programs, which is what a decode or a verify
needs (a row's bits never depend on the rows beside it), but a prompt of ``n`` rows then loads its keys ``n``
times: on an H200 a prefill of the 13 shipped prompts (2,367 rows, SmolLM2-135M bf16) spent 8.5 of its 13.0 ms
of GPU time in that kernel. Both kernels here hold ``BLOCK_M`` consecutive rows of one query head a program and
load each key block once for all of them. A row attends the positions ``[0, prefix_len)`` of its request, exactly
as the rows kernel's contract says; rows with ``prefix_len == 0`` (padding rows of a captured batch) return zeros.
Rows of one request need not fill a block alone: a block that holds the end of one prompt and the start of the
next walks each request's keys in turn, masking the other rows. Any row order is correct; consecutive rows of
one request are what makes them fast. Their torch twin is `attention_triton.paged_attention_rows_torch`.

**Which forwards take them.** Only those a `ForwardBatch` marks ``prefill`` (the prefill transition's target
forward and the draft extend over its prompts; the autoregressive baselines' prefills): their rows are whole
prompts, each request's rows consecutive, and no extra slots (a call with extra slots goes to ``fallback``).

**Exact** (`paged_attention_prefill_exact`, the fast path's default). Each row's output is the rows kernel's bits
for that row: a program holds 16 rows (the rows kernel's tensor-core tile height) of one query head and one of
their chunks (program ``(block, head, p)`` takes the block's chunks ``p, p + P, ...``, ``P`` chosen as the rows
kernel chooses its programs per row: a launch choice that changes no bit), each row's chunks cut by
its own key count as `attention_triton._row_chunks` cuts them; per 32-key block it runs the rows kernel's
``[16, D] x [D, 32]`` products in the rows kernel's warp count, its masked online softmax from scratch each chunk,
its probabilities rounded to the value dtype for ``P V``. A row's blocks outside its chunk, and the other rows'
blocks, leave its state bitwise as it is (``alpha = 1``, zero terms). A row of one chunk stores its output; a row
of several stores each chunk's ``(max, sum, accumulator)``, and the last of the block's programs to finish (an
arrival counter per (block, head), `attention_triton._arrival_counters`) merges each row with the rows kernel's
own merge (`_load_chunks`, then `_store_merged`: each row's states loaded before the row before it is stored),
in-kernel as the rows kernel's fused combine does: the rows kernel's separate combine kernel gives other bfloat16
bits. So a prefill row's attention is the decode row's, and a retraction's
recompute or a prefix-cache hit reads and writes the attention bits a decode would (the prefill's GEMMs still run at
its own row counts: `fast_engine.md`). Tested bitwise against the rows kernel on the GPU (heads of 64, groups of
1 and 3). A group of more than 16 query heads a KV head (the rows kernel's tile grows past 16) takes the rows kernel.

**Non-finite values.** A block's ``P V`` product is shared by its 16 rows, so another request's infinite value
would reach a row through ``0 * inf`` (its probability there is 0). Both kernels therefore update a row's state
only from a key block where the row owns a key (where it owns none, the update would leave the state as it is for
finite values, so no bit moves: the GPU's bitwise test is unchanged): an overflowing prompt fails its own request
only, as with the rows kernel. Its own earlier rows may turn non-finite where the rows kernel's would not (they
share key blocks with the value), which changes nothing the request reports: its last row attends the value.

**Flash** (`paged_attention_prefill_triton`, ``SPECCYCLE_PREFILL_ATTENTION=prefill``). For each request among its
rows a program walks the request's keys ``[0, n)`` (``n`` the longest prefix of its rows in the block) in
``BLOCK_N``-key blocks with four warps: flash attention's online softmax, other roundings than the rows kernel's
(other tile shapes and summation order), so a row is not the decode row's bits. Faster at the first token.
"""

from __future__ import annotations

import math
import os

import torch

from . import attention_triton as rows_kernel
from .attention_triton import paged_attention_rows_torch, paged_attention_rows_triton, triton

if triton is not None:
    import triton.language as tl

    from .attention_triton import _load_chunks, _row_chunks, _store_merged


# The flash kernel's rows per program and keys per block. Launch constants only: a row's output does not depend on
# BLOCK_M (its key blocks are the same whichever rows share its program, and the other rows' keys leave its sums
# exactly as they are), and BLOCK_N sets where its keys are cut into blocks. A program walks its keys serially,
# so a long prompt's blocks are latency-bound: more, smaller row blocks keep more multiprocessors busy.
# ``SPECCYCLE_PREFILL_BLOCK_M`` (16, 32 or 64) sets the rows a program holds, for benchmarks; read at import.
def _block_m() -> int:
    value = os.environ.get("SPECCYCLE_PREFILL_BLOCK_M", "16")
    if value not in ("16", "32", "64"):
        raise ValueError(f"SPECCYCLE_PREFILL_BLOCK_M={value!r}: choose 16, 32 or 64 (rows a program of the kernel)")
    return int(value)


BLOCK_M = _block_m()
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
MIN_HEAD_DIM = 16  # tl.dot's smallest K on NVIDIA GPUs
EXACT_BLOCK_M = 16  # rows a program of the exact kernel (the rows kernel's tensor-core tile: 16 heads' lanes)


# Row counts and page-table widths vary from call to call (eager prefills take their batch's own table, captured ones
# a bucket's rows): not specialized, so one compiled kernel serves them all. Each new specialization compiled in the
# middle of serving: an H200 soak (64 clients) stalled 3.4 s on one exact-kernel compile inside its timed run.
_VARYING = ["num_rows", "stride_table", "table_width", "chunk_bound"]

if triton is not None:

    @triton.jit(do_not_specialize=_VARYING[:2])
    def _prefill_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, row_request_ptr, prefix_lens_ptr, table_ptr,
        num_rows, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        stride_table, page_size, scale_log2,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        block = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        in_range = rows < num_rows
        request = tl.load(row_request_ptr + rows, mask=in_range, other=0)
        prefix = tl.load(prefix_lens_ptr + rows, mask=in_range, other=0)
        live = in_range & (prefix > 0)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=in_range[:, None],
                    other=0.0)  # fmt: skip
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        first = tl.min(tl.where(live, request, 2**62), axis=0)
        last = tl.max(tl.where(live, request, -1), axis=0)
        for r in range(first, last + 1):
            mine = live & (request == r)
            n = tl.max(tl.where(mine, prefix, 0), axis=0)  # 0 when no row of the block is r's: no key block
            for start in range(0, n, BLOCK_N):
                keys = start + tl.arange(0, BLOCK_N)
                inside = keys < n
                page = tl.load(table_ptr + r * stride_table + keys // page_size, mask=inside, other=0)
                slots = page * page_size + keys % page_size
                k = tl.load(k_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                            mask=inside[:, None], other=0.0)  # fmt: skip
                if UPCAST:  # the interpreter multiplies bfloat16 bit patterns: go through float32 (products exact)
                    s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
                elif IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                seen = mine[:, None] & (keys[None, :] < prefix[:, None])
                has = mine & (prefix > start)  # the row sees a key of this block
                s = tl.where(seen, s * scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to scale
                p = tl.math.exp2(s - m_safe[:, None])
                alpha = tl.math.exp2(m_i - m_safe)
                l_i = tl.where(has, l_i * alpha + tl.sum(p, axis=1), l_i)
                v = tl.load(v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                            mask=inside[:, None], other=0.0)  # fmt: skip
                if UPCAST:  # probabilities rounded to the value dtype, as the GPU's products take them
                    pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
                elif IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = tl.where(has[:, None], acc * alpha[:, None] + pv, acc)  # another request's inf stays out
                m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=in_range[:, None])  # fmt: skip


if triton is not None:

    @triton.jit(do_not_specialize=_VARYING)
    def _prefill_attention_exact_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, counter_ptr, row_request_ptr,
        prefix_lens_ptr, table_ptr, num_rows, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh, stride_table, page_size, table_width, num_heads, chunk_bound, scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr,
        LOW_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        """Programs ``(block of BLOCK_M rows, query head, p)``: program ``p`` runs chunks ``p, p + P, ...`` of the
        block's rows (module docstring, "Exact"). A row of one chunk stores its output; a row of several stores
        each chunk's ``(max, sum, accumulator)``, and the block's last program to finish merges them."""
        block = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        in_range = rows < num_rows
        request = tl.load(row_request_ptr + rows, mask=in_range, other=0)
        # the rows kernel's key count: the prefix clamped to the page table (no extra slots)
        total = tl.minimum(tl.load(prefix_lens_ptr + rows, mask=in_range, other=0), table_width * page_size)
        total = total.to(tl.int32)
        chunk_keys, row_chunks = _row_chunks(total, CHUNK, MAX_CHUNKS)
        live = in_range & (total > 0)
        block_chunks = tl.max(tl.where(in_range, row_chunks, 0), axis=0)
        first = tl.min(tl.where(live, request, 2**62), axis=0)
        last = tl.max(tl.where(live, request, -1), axis=0)
        d = tl.arange(0, BLOCK_D)
        dims = d[None, :] < HEAD_DIM
        # a program past the block's chunks loads nothing (a limit, not `mask & scalar`: the interpreter's int32)
        working = rows < tl.where(tl.program_id(2) < block_chunks, num_rows, 0)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=working[:, None] & dims,
                    other=0.0)  # fmt: skip
        offs = tl.arange(0, BLOCK_N)
        part_row = (rows.to(tl.int64) * num_heads + head) * chunk_bound  # [row, head, 0] of the scratch
        for chunk in range(tl.program_id(2), block_chunks, tl.num_programs(2)):
            # each row's chunk: keys [lo, hi) (lo a multiple of CHUNK, hence of BLOCK_N), from scratch
            lo = chunk * chunk_keys
            hi = tl.minimum(total, lo + chunk_keys)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for r in range(first, last + 1):
                mine = live & (request == r) & (chunk < row_chunks)
                start_at = tl.min(tl.where(mine, lo, 2**30), axis=0)
                end_at = tl.max(tl.where(mine, hi, 0), axis=0)  # no row of r in this chunk: no key block
                for start in range(start_at, end_at, BLOCK_N):
                    key = start + offs
                    inside = key < end_at
                    page_col = tl.minimum(key // page_size, table_width - 1)
                    page = tl.load(table_ptr + r * stride_table + page_col, mask=inside, other=-1)
                    slot = tl.where(page >= 0, page * page_size + key % page_size, -1)
                    valid = slot >= 0
                    safe = tl.maximum(slot, 0).to(tl.int64)
                    k = tl.load(k_ptr + safe[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                                mask=valid[:, None] & dims, other=0.0)  # fmt: skip
                    v = tl.load(v_ptr + safe[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                                mask=valid[:, None] & dims, other=0.0)  # fmt: skip
                    if UPCAST:  # the interpreter multiplies bfloat16 bit patterns: through float32 (products exact)
                        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
                    elif LOW_PRECISION:
                        s = tl.dot(q, tl.trans(k))
                    else:
                        s = tl.dot(q, tl.trans(k), input_precision="ieee")
                    s = s * scale
                    own = mine[:, None] & valid[None, :] & (key[None, :] >= lo[:, None]) & (key[None, :] < hi[:, None])
                    has = mine & (lo < start + BLOCK_N) & (hi > start)  # the row owns a key of this block
                    s = tl.where(own, s, float("-inf"))  # a block outside a row's chunk leaves its state as it is
                    m_new = tl.maximum(m_i, tl.max(s, axis=1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp(m_i - m_safe)
                    p = tl.exp(s - m_safe[:, None])
                    l_i = tl.where(has, l_i * alpha + tl.sum(p, axis=1), l_i)
                    if LOW_PRECISION:
                        p_low = p.to(v.dtype)
                        if UPCAST:
                            pv = tl.dot(p_low.to(tl.float32), v.to(tl.float32), input_precision="ieee")
                        else:
                            pv = tl.dot(p_low, v)
                    else:
                        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                    # a row without a key here keeps its state: another request's non-finite V (0 * inf in the
                    # shared product) stays out of it; for finite values both sides are the same bits
                    acc = tl.where(has[:, None], acc * alpha[:, None] + pv, acc)
                    m_i = m_new
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            single = in_range & (row_chunks == 1) & (chunk == 0)
            tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=single[:, None] & dims)  # fmt: skip
            split = in_range & (row_chunks > 1) & (chunk < row_chunks)
            part = part_row + chunk
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=split[:, None] & dims)
            tl.store(part_max_ptr + part, m_i, mask=split)
            tl.store(part_sum_ptr + part, l_i, mask=split)
        # the last of the block's programs (for this head) merges its rows, as the rows kernel does
        if (block_chunks > 1) & (tl.program_id(2) < block_chunks):
            tl.debug_barrier()  # every thread's states stored before the arrival is counted
            counter = counter_ptr + block * num_heads + head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.minimum(tl.num_programs(2), block_chunks) - 1:
                tl.store(counter, 0)
                # the block's rows in turn, each row's chunk count from the block's vector (no reload of its prefix)
                # and its states loaded before the row before it is stored (a store may alias a later load, so the
                # loads would otherwise wait for it); a row of one chunk stored its output and loads nothing here
                lanes = tl.arange(0, BLOCK_M)
                merged = tl.where(in_range & (row_chunks > 1), row_chunks, 0)
                m, l, a = _load_chunks(part_acc_ptr, part_max_ptr, part_sum_ptr, block * BLOCK_M, head,
                                       tl.sum(tl.where(lanes == 0, merged, 0), axis=0), num_heads, chunk_bound,
                                       HEAD_DIM, BLOCK_D, BLOCK_C, ".cg")  # fmt: skip
                for i in tl.static_range(BLOCK_M):
                    row = block * BLOCK_M + i
                    chunks = tl.sum(tl.where(lanes == i, merged, 0), axis=0)
                    if i + 1 < BLOCK_M:
                        m_next, l_next, a_next = _load_chunks(
                            part_acc_ptr, part_max_ptr, part_sum_ptr, row + 1, head,
                            tl.sum(tl.where(lanes == i + 1, merged, 0), axis=0), num_heads, chunk_bound, HEAD_DIM,
                            BLOCK_D, BLOCK_C, ".cg",
                        )  # fmt: skip
                    if chunks > 1:
                        _store_merged(out_ptr, m, l, a, row, head, stride_ot, stride_oh, HEAD_DIM, BLOCK_D)
                    if i + 1 < BLOCK_M:
                        m, l, a = m_next, l_next, a_next


def _check_layout(kernel: str, q, k_cache, v_cache, page_table) -> int:
    """The KV head count, once the query heads split evenly over it and every tensor the kernels index has a
    contiguous last dimension (else a one-line ValueError naming ``kernel``)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{kernel}: {num_heads} query heads over {num_kv_heads} KV heads")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("page_table", page_table)):
        if t.stride(-1) != 1:
            raise ValueError(f"{kernel}: {name} needs a contiguous last dimension")
    return num_kv_heads


def paged_attention_prefill_exact(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_request: torch.Tensor,
    prefix_lens: torch.Tensor,
    extra_slots: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    kv_bound: int | None = None,
    fallback=paged_attention_rows_triton,
    *,
    programs_per_block: int | None = None,
) -> torch.Tensor:
    """`paged_attention_prefill_triton`'s contract, each row bitwise the rows kernel's (module docstring, "Exact").

    ``programs_per_block``: programs per (block of rows, query head), each taking every ``programs_per_block``-th
    chunk of the block's rows (default: `attention_triton.default_programs_per_row` over the blocks, as the rows
    kernel picks its own); a launch choice that changes no bit (each chunk starts afresh and keeps its state)."""
    if not fits_prefill_kernel(q, extra_slots):
        return fallback(q, k_cache, v_cache, row_request, prefix_lens, extra_slots, page_table, page_size, kv_bound)
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = _check_layout("paged_attention_prefill_exact", q, k_cache, v_cache, page_table)
    if num_heads // num_kv_heads > EXACT_BLOCK_M:  # the rows kernel's tile is taller than 16 rows: its own bits
        return fallback(q, k_cache, v_cache, row_request, prefix_lens, extra_slots, page_table, page_size, kv_bound)
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    row_request, prefix_lens = row_request.contiguous(), prefix_lens.contiguous()
    table_width = page_table.shape[1]
    chunk_bound = min(rows_kernel.MAX_CHUNKS, max(1, -(-(table_width * page_size) // rows_kernel.CHUNK)))
    if programs_per_block is not None and programs_per_block < 1:
        raise ValueError(f"paged_attention_prefill_exact: programs_per_block={programs_per_block} must be at least 1")
    blocks = triton.cdiv(num_rows, EXACT_BLOCK_M)
    # The page table of a captured forward spans the pool, so ``chunk_bound`` is MAX_CHUNKS there while a prompt's
    # blocks hold a few chunks: a program per chunk of the bound would mostly find nothing to do. No spread past
    # `MIN_PROGRAMS_PER_ROW`: the 13 shipped prompts' rows (2,367) took 107.6 µs at 4 programs a block, 112.7 at 6 (what
    # the spread would give) and 119.2 at 8 (H200, bench/results/attention_launch-H200-20261127-e262817.json).
    if programs_per_block is None:
        programs = rows_kernel.default_programs_per_row(q.device, blocks, num_heads, chunk_bound, spread=0)
    else:
        programs = min(programs_per_block, chunk_bound)
    grid = (blocks, num_heads, programs)
    if chunk_bound > 1:
        counters = rows_kernel._arrival_counters(q.device, grid[0] * num_heads)
        if counters is None:  # none may be allocated inside this capture: the rows kernel, the decode row's bits
            return paged_attention_rows_triton(q, k_cache, v_cache, row_request, prefix_lens, extra_slots,
                                               page_table, page_size, kv_bound)  # fmt: skip
        part_acc, part_max, part_sum = rows_kernel.chunk_states(num_rows, num_heads, chunk_bound, head_dim, q.device)
    else:  # every row has one chunk and stores its output: nothing merged, no counter read (the types of the real
        # ones, so the kernel compiled for them serves: a table this narrow comes from an eager call in mid-serving)
        part_acc = part_max = part_sum = torch.empty(1, dtype=torch.float32, device=q.device)
        counters = torch.zeros(1, dtype=torch.int32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    warps = rows_kernel.default_num_warps(head_dim)
    block_c = triton.next_power_of_2(rows_kernel.MAX_CHUNKS)
    _prefill_attention_exact_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum, counters, row_request,
        prefix_lens, page_table, num_rows, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), page_table.stride(0), page_size,
        table_width, num_heads, chunk_bound, 1.0 / math.sqrt(head_dim),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=EXACT_BLOCK_M,
        BLOCK_N=rows_kernel.BLOCK_N, CHUNK=rows_kernel.CHUNK, MAX_CHUNKS=rows_kernel.MAX_CHUNKS, BLOCK_C=block_c,
        LOW_PRECISION=q.dtype in (torch.bfloat16, torch.float16),
        UPCAST=q.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=warps,
    )  # fmt: skip
    return out


def fits_prefill_kernel(q: torch.Tensor, extra_slots: torch.Tensor) -> bool:
    """Whether the prefill kernels (flash and exact) run their own kernel: no extra slots, a power-of-two head size
    of at least `MIN_HEAD_DIM`, a float dtype (else they hand the call to their fallback, the decode's kernel)."""
    head_dim = q.shape[-1]
    return (
        triton is not None
        and extra_slots.shape[1] == 0
        and head_dim >= MIN_HEAD_DIM
        and head_dim & (head_dim - 1) == 0
        and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    )


def paged_attention_prefill_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_request: torch.Tensor,
    prefix_lens: torch.Tensor,
    extra_slots: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    kv_bound: int | None = None,
    fallback=paged_attention_rows_triton,
) -> torch.Tensor:
    """`attention_triton.paged_attention_rows_torch`'s contract for a prefill's rows (module docstring).

    Shapes: ``q [T, H, D]``, caches ``[num_slots, Hkv, D]``, ``row_request, prefix_lens [T]``, ``extra_slots
    [T, 0]``, ``page_table [bs, W]`` -> ``[T, H, D]`` in ``q.dtype``. Rows with extra slots, or shapes the kernel
    does not take (`fits_prefill_kernel`), go to ``fallback`` (the rows kernel by default). Sync-free: it can be
    captured in a CUDA graph.
    """
    if not fits_prefill_kernel(q, extra_slots):
        return fallback(q, k_cache, v_cache, row_request, prefix_lens, extra_slots, page_table, page_size, kv_bound)
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = _check_layout("paged_attention_prefill_triton", q, k_cache, v_cache, page_table)
    out = torch.empty_like(q)
    if num_rows == 0:
        return out
    row_request, prefix_lens = row_request.contiguous(), prefix_lens.contiguous()
    scale_log2 = (head_dim**-0.5) * 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))
    grid = (triton.cdiv(num_rows, BLOCK_M), num_heads)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, row_request, prefix_lens, page_table,
        num_rows, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), out.stride(0), out.stride(1), page_table.stride(0), page_size, scale_log2,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32, UPCAST=q.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out


__all__ = [
    "fits_prefill_kernel",
    "paged_attention_prefill_exact",
    "paged_attention_prefill_triton",
    "paged_attention_rows_torch",
]
