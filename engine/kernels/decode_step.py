"""The bookkeeping of a captured autoregressive decode step (`graphs.GreedyDecodeGraphs`), fused.

Around its forward, a decode step turns the step's positions into the forward's row inputs and, after
the forward, the logits into the next step's inputs. In plain torch that is about twenty small kernels
per step (an ``arange``, comparisons, ``where``, a floor division, a remainder, a clamp, a page-table
gather, copies, an ``index_copy`` and torch's argmax, which reduced 8 rows of a 49,152-word vocabulary in
13 us on an H100 as one block per row). Inside a CUDA graph each kernel costs its launch gap as well. Here
they are two Triton kernels around the vocabulary argmax of `backends.cuda.argmax` (the same answer as
``torch.argmax``, ties and NaNs included, spread over the whole GPU):

* `decode_rows`: ``(row_request, out_slots, prefix_lens)`` of the step's rows from their positions, the
  number of valid rows and the page table (a padding row: request 0, slot -1, prefix 0);
* `decode_advance`: the next token into the next step's ids and into the history at column ``step``,
  the positions of the valid rows advanced by one, ``step + 1``.

Each has a plain-torch twin (`decode_rows_torch`, `decode_advance_torch`): the CPU path, and what the
kernels are tested equal to (exactly: integers only). All are free of host syncs and of data-dependent
shapes, so they run inside a captured graph.
"""

from __future__ import annotations

import torch

try:  # a CPU install may lack triton; the torch twins still work
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on installs without triton
    triton = None


def decode_rows_torch(
    positions: torch.Tensor, num_valid: torch.Tensor, table: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row_request, out_slots, prefix_lens)`` ``[T]`` int64 of decode rows ``r`` at ``positions[r]``.

    Row ``r < num_valid`` is request ``r`` (its pages: ``table[r]``), writes its KV at its position's slot
    and attends its ``position + 1`` keys; the others are padding rows (request 0, slot -1, prefix 0).
    Shapes: ``positions [T]``, ``num_valid [1]``, ``table [>= T, W]``.
    """
    rows = positions.shape[0]
    width = table.shape[1]
    index = torch.arange(rows, device=positions.device)
    valid = index < num_valid
    request = torch.where(valid, index, 0)
    page = table[request, (positions // page_size).clamp(max=width - 1)]
    slot = page * page_size + positions % page_size
    return request, torch.where(valid, slot, -1), torch.where(valid, positions + 1, 0)


def decode_advance_torch(
    next_ids: torch.Tensor,
    positions: torch.Tensor,
    step: torch.Tensor,
    num_valid: torch.Tensor,
    ids_out: torch.Tensor,
    positions_out: torch.Tensor,
    step_out: torch.Tensor,
    history: torch.Tensor,
) -> None:
    """``ids_out = next_ids``, ``positions_out = positions + (r < num_valid)``, ``step_out = step + 1``,
    ``history[r, step] = next_ids[r]``. Shapes: ``next_ids, positions, ids_out, positions_out [T]``,
    ``step, step_out, num_valid [1]``, ``history [T, max_steps]`` (a view of the rows)."""
    rows = positions.shape[0]
    valid = torch.arange(rows, device=positions.device) < num_valid
    ids_out.copy_(next_ids)
    positions_out.copy_(positions + valid.long())
    step_out.copy_(step + 1)
    history.index_copy_(1, step, next_ids[:, None])


if triton is not None:

    @triton.jit
    def _decode_rows_kernel(
        pos_ptr, num_valid_ptr, table_ptr, request_ptr, slot_ptr, prefix_ptr, rows, stride_t, width, page_size,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        r = tl.arange(0, BLOCK)
        inside = r < rows
        valid = r < tl.load(num_valid_ptr)
        pos = tl.load(pos_ptr + r, mask=inside, other=0)
        request = tl.where(valid, r, 0)
        page = tl.load(table_ptr + request.to(tl.int64) * stride_t + tl.minimum(pos // page_size, width - 1),
                       mask=inside, other=-1)  # fmt: skip
        slot = page * page_size + pos % page_size
        tl.store(request_ptr + r, request.to(tl.int64), mask=inside)
        tl.store(slot_ptr + r, tl.where(valid, slot, -1), mask=inside)
        tl.store(prefix_ptr + r, tl.where(valid, pos + 1, 0), mask=inside)

    @triton.jit
    def _decode_advance_kernel(
        next_ptr, pos_ptr, step_ptr, num_valid_ptr, ids_out_ptr, pos_out_ptr, step_out_ptr, history_ptr, rows,
        stride_h, BLOCK: tl.constexpr,
    ):  # fmt: skip
        r = tl.arange(0, BLOCK)
        inside = r < rows
        step = tl.load(step_ptr)
        nxt = tl.load(next_ptr + r, mask=inside, other=0)
        pos = tl.load(pos_ptr + r, mask=inside, other=0)
        valid = r < tl.load(num_valid_ptr)
        tl.store(ids_out_ptr + r, nxt, mask=inside)
        tl.store(pos_out_ptr + r, pos + valid.to(pos.dtype), mask=inside)
        tl.store(history_ptr + r.to(tl.int64) * stride_h + step, nxt, mask=inside)
        tl.store(step_out_ptr, step + 1)


def decode_rows_triton(
    positions: torch.Tensor, num_valid: torch.Tensor, table: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`decode_rows_torch` in one kernel (int64 ``positions`` and ``table``, ``table`` rows contiguous)."""
    rows = positions.shape[0]
    out = torch.empty((3, rows), dtype=torch.long, device=positions.device)
    if rows:
        _decode_rows_kernel[(1,)](
            positions, num_valid, table, out[0], out[1], out[2], rows, table.stride(0), table.shape[1], page_size,
            BLOCK=triton.next_power_of_2(rows),
        )  # fmt: skip
    return out[0], out[1], out[2]


def decode_advance_triton(
    next_ids: torch.Tensor,
    positions: torch.Tensor,
    step: torch.Tensor,
    num_valid: torch.Tensor,
    ids_out: torch.Tensor,
    positions_out: torch.Tensor,
    step_out: torch.Tensor,
    history: torch.Tensor,
) -> None:
    """`decode_advance_torch` in one kernel (int64 tensors; ``history`` with contiguous rows)."""
    rows = positions.shape[0]
    _decode_advance_kernel[(1,)](
        next_ids, positions, step, num_valid, ids_out, positions_out, step_out, history, rows, history.stride(0),
        BLOCK=triton.next_power_of_2(max(rows, 1)),
    )  # fmt: skip


def vocab_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` through `backends.cuda.argmax` (Triton), the same indices as torch's."""
    from ...backends.cuda.argmax import vocab_argmax as triton_argmax

    return triton_argmax(logits)


def fused_available() -> bool:
    return triton is not None
