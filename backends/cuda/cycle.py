"""The fused cycle's bookkeeping as three Triton kernels, each beside its plain-torch twin.

`engine.fast.fused_cycle` runs a greedy EAGLE cycle as one CUDA graph. Between its forwards sat some 150
small torch kernels per cycle (slot lookups, the tree's depths and mask, the verify rows' inputs, the
greedy walk, the stop cut, the output log, the next state, the draft extend's inputs): each ~1-2 us of
GPU time plus a gap, together more than the forwards they connect (the profile before them, 2026-11-25: 585 kernels a
tree cycle against a decode step's 278). Here each stretch between two forwards is one kernel:

* `cycle_slots`: the slots of ``L[b] + offsets[c]`` (the verify rows and the draft scratch) through the
  page table, ``-1`` for a finished request (it writes no KV).
* `verify_rows`: the verify forward's row inputs in static buffers: tokens, positions ``L + depth``,
  output slots, prefix lengths ``L``, and the extra slots (a row's ancestors' and its own verify slots,
  ``-1`` elsewhere: the tree mask as slots). A chain's depth is the row and its mask the lower triangle.
* `accept_commit`: the greedy walk (the first child whose draft token equals the target's prediction
  at its parent, `TorchBackend.verify_greedy`), the commit (cut at the first stop token and at
  ``max_new_tokens``; a finished request commits nothing), the output log and the accept-length
  histogram, the next cycle state, the draft extend's row inputs, and a tree's KV moves
  (`backends.cuda.kv.plan_kv_move_padded`).

The twins are the code the fused cycle ran before (`statemachine` semantics); tests/kernels/
test_fused_cycle_kernels.py holds every kernel equal to its twin on random batches (exactly: all integers).
The kernels run on CUDA tensors and, under ``TRITON_INTERPRET=1``, on CPU tensors (CI); elsewhere the
fused cycle takes the twins (`use_kernels`).
"""

from __future__ import annotations

import torch

try:  # a CPU install may lack triton: the twins still run
    import triton
    import triton.language as tl

    from .launch import next_power_of_2, runs_triton
except ImportError:  # pragma: no cover - exercised on installs without triton
    triton = None


# what `accept_commit` writes per (request, depth): the draft extend's row inputs and a tree's KV moves
EXTEND_FIELDS = ("input_ids", "positions", "out_slots", "prefix_lens", "feature_rows", "src", "dst")


def use_kernels(tensor: torch.Tensor) -> bool:
    """Whether the kernels run for tensors on ``tensor``'s device (CUDA, or the CPU under the interpreter)."""
    return triton is not None and runs_triton(tensor)


# ---- cycle_slots ------------------------------------------------------------------------------------


def cycle_slots_torch(
    table: torch.Tensor, L: torch.Tensor, done: torch.Tensor, offsets: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Slot of position ``L[b] + offsets[c]``; ``-1`` for a finished request.

    Shapes: ``table [B, W]``, ``L [B]``, ``done [B]`` bool, ``offsets [C]`` -> ``[B, C]`` int64.
    """
    positions = L[:, None] + offsets[None, :]
    page = table.gather(1, (positions // page_size).clamp(max=table.shape[1] - 1))
    return torch.where(done[:, None], -1, page * page_size + positions % page_size)


if triton is not None:

    @triton.jit
    def _cycle_slots_kernel(table_ptr, table_stride, table_width, L_ptr, done_ptr, offsets_ptr, out_ptr, C,
                            page_size, BLOCK_C: tl.constexpr):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        inside = c < C
        position = tl.load(L_ptr + b) + tl.load(offsets_ptr + c, mask=inside, other=0)
        column = tl.minimum(position // page_size, table_width - 1)
        page = tl.load(table_ptr + b * table_stride + column, mask=inside, other=-1)
        slot = tl.where(tl.load(done_ptr + b), -1, page * page_size + position % page_size)
        tl.store(out_ptr + b * C + c, slot, mask=inside)


def cycle_slots(
    table: torch.Tensor, L: torch.Tensor, done: torch.Tensor, offsets: torch.Tensor, page_size: int
) -> torch.Tensor:
    """`cycle_slots_torch` as one kernel where kernels run (`use_kernels`). Same shapes."""
    if not use_kernels(L):
        return cycle_slots_torch(table, L, done, offsets, page_size)
    batch, count = L.shape[0], offsets.shape[0]
    out = torch.empty((batch, count), dtype=torch.long, device=L.device)
    if batch and count:
        _cycle_slots_kernel[(batch,)](table, table.stride(0), table.shape[1], L, done, offsets, out, count,
                                      page_size, BLOCK_C=next_power_of_2(count))  # fmt: skip
    return out


# ---- verify_rows ------------------------------------------------------------------------------------


def tree_depths_torch(parents: torch.Tensor, rounds: int) -> torch.Tensor:
    """Depth of every node of trees at most ``rounds`` deep. Shapes: ``parents [B, N]`` -> ``[B, N]``."""
    depths = torch.zeros_like(parents)
    for _ in range(rounds):
        depths = torch.where(parents >= 0, depths.gather(1, parents.clamp(min=0)) + 1, 0)
    return depths


def verify_rows_torch(tokens, parents, L, verify_slots, rounds: int, rows: dict, backend, widths=None) -> None:
    """Write the verify forward's first ``B * N`` rows into the static buffers ``rows``.

    ``rows``: ``input_ids, positions, out_slots, prefix_lens [T]`` and ``extra_slots [T, N]`` (``T >= B * N``;
    the padding rows past ``B * N`` are left as they are). ``parents`` None: a chain (row ``i``'s parent is
    ``i - 1``). ``rounds``: a bound on the trees' depth (``S``). Shapes: ``tokens, parents, verify_slots
    [B, N]``, ``L [B]``. ``backend`` gives the tree mask (`TorchBackend.tree_mask`). ``widths [B]`` (a chain's,
    `DraftTree.widths`; None: ``N`` each): a request's rows from its width on attend nothing and write no KV (prefix
    0, no extra slot, out slot -1): the walk never accepts them, and the attention kernel skips a row without keys.
    """
    B, N = tokens.shape
    n = B * N
    offs = torch.arange(N, device=tokens.device)
    if parents is None:
        depths = offs.expand(B, N)
        mask = torch.ones((N, N), dtype=torch.bool, device=tokens.device).tril()[None]
    else:
        depths = tree_depths_torch(parents, rounds)
        mask = backend.tree_mask(parents)
    prefix = L[:, None].expand(B, N)
    extra = torch.where(mask, verify_slots[:, None, :], -1)  # [B, N, N]
    if widths is not None:
        live = offs[None, :] < widths[:, None]  # [B, N]
        verify_slots = torch.where(live, verify_slots, -1)
        prefix = torch.where(live, prefix, 0)
        extra = torch.where(live[:, :, None], extra, -1)
    rows["input_ids"][:n].copy_(tokens.reshape(-1))
    rows["positions"][:n].copy_((L[:, None] + depths).reshape(-1))
    rows["out_slots"][:n].copy_(verify_slots.reshape(-1))
    rows["prefix_lens"][:n].copy_(prefix.reshape(-1))
    rows["extra_slots"][:n].copy_(extra.reshape(n, N))


if triton is not None:

    @triton.jit
    def _verify_rows_kernel(tokens_ptr, parents_ptr, L_ptr, slots_ptr, ids_ptr, positions_ptr, out_slots_ptr,
                            prefix_ptr, extra_ptr, extra_stride, N, widths_ptr, ROUNDS: tl.constexpr,
                            TREE: tl.constexpr, BLOCK_N: tl.constexpr, WIDTHS: tl.constexpr):  # fmt: skip
        """One program per request: its ``N`` rows (row ``i`` sees column ``j``: ``j`` an ancestor or ``i``); with
        ``WIDTHS``, rows from the request's width on attend nothing and write no KV."""
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK_N)
        inside = i < N
        L = tl.load(L_ptr + b)
        token = tl.load(tokens_ptr + b * N + i, mask=inside, other=0)
        slot = tl.load(slots_ptr + b * N + i, mask=inside, other=-1)
        live = inside
        if WIDTHS:
            live = i < tl.load(widths_ptr + b)
            slot = tl.where(live, slot, -1)
        cols = i[None, :]
        if TREE:
            # walk up ROUNDS parents from every row at once: each step marks one more ancestor
            node = i.to(tl.int64)
            sees = cols == i[:, None]
            depth = tl.zeros([BLOCK_N], dtype=tl.int64)
            for _ in tl.static_range(ROUNDS):
                up = tl.load(parents_ptr + b * N + tl.maximum(node, 0), mask=inside & (node >= 0), other=-1)
                depth += (up >= 0).to(tl.int64)
                sees = sees | ((cols == up[:, None]) & (up[:, None] >= 0))
                node = up
        else:
            depth = i.to(tl.int64)
            sees = cols <= i[:, None]
        row = b * N + i
        tl.store(ids_ptr + row, token, mask=inside)
        tl.store(positions_ptr + row, L + depth, mask=inside)
        tl.store(out_slots_ptr + row, slot, mask=inside)
        tl.store(prefix_ptr + row, tl.where(live, L, 0).to(tl.int64), mask=inside)
        extra = tl.where(sees & live[:, None], slot[None, :], -1)
        tl.store(extra_ptr + row[:, None] * extra_stride + cols, extra, mask=inside[:, None] & (cols < N))


def verify_rows(tokens, parents, L, verify_slots, rounds: int, rows: dict, backend, widths=None) -> None:
    """`verify_rows_torch` as one kernel where kernels run (`use_kernels`). Same contract."""
    if not use_kernels(tokens):
        return verify_rows_torch(tokens, parents, L, verify_slots, rounds, rows, backend, widths)
    B, N = tokens.shape
    if B == 0:
        return None
    extra = rows["extra_slots"]
    tokens, verify_slots = tokens.contiguous(), verify_slots.contiguous()
    parents = tokens if parents is None else parents.contiguous()  # a chain reads no parent
    _verify_rows_kernel[(B,)](tokens, parents, L, verify_slots, rows["input_ids"], rows["positions"],
                              rows["out_slots"], rows["prefix_lens"], extra, extra.stride(0), N,
                              L if widths is None else widths, ROUNDS=rounds, TREE=parents is not tokens,
                              BLOCK_N=next_power_of_2(N), WIDTHS=widths is not None)  # fmt: skip
    return None


# ---- accept_commit ----------------------------------------------------------------------------------


def accept_commit_torch(tokens, parents, predict, walk, verify_slots, cur: dict, nxt: dict, log: dict,
                        ext: dict, backend) -> None:  # fmt: skip
    """Accept and commit one cycle of ``B`` requests; write the next state, the logs and the extend's inputs.

    Shapes: ``tokens, predict, walk, verify_slots [B, N]`` (``walk``: the predictions the greedy walk
    follows, ``predict`` unless acceptance is forced), ``parents [B, N]`` or None (a chain).
    ``cur``: ``L, out_len [B]``, ``done [B]`` bool, ``cycle [1]``; ``nxt`` receives ``L, root, done,
    out_len, cycle, all_done [1]``. ``log``: ``out [B, O + 1]`` (column ``O`` a bin for masked writes),
    ``hist [C, B]``, ``max_new [B]``, ``stops [X]`` (-1 padded). ``ext`` receives, per (request, depth
    ``d < W``), the draft extend's ``input_ids, positions, out_slots, prefix_lens, feature_rows [B * W]``
    and ``last [B]`` (row ``keep - 1`` of each request), and a tree's KV moves ``src, dst [B * W]``
    (-1: none).
    """
    B, N = tokens.shape
    W = ext["input_ids"].shape[0] // B
    device = tokens.device
    width = torch.arange(W, device=device)
    if parents is None:
        run = 1 + (tokens[:, 1:] == walk[:, :-1]).long().cumprod(1).sum(1)  # [B]
        accept_index = torch.arange(B, device=device)[:, None] * N + width  # row d of request b
    else:
        accept_index, run = backend.verify_greedy(tokens, parents, walk, W)  # flat rows, -1 padded
    flat = accept_index.clamp(min=0)
    committed = predict.reshape(-1)[flat]  # [B, W]
    out_len, L, done = cur["out_len"], cur["L"], cur["done"]
    inside = width[None] < run[:, None]
    is_stop = (committed[:, :, None] == log["stops"][None, None, :]).any(-1) & inside
    stop_at = torch.where(is_stop.any(1), is_stop.long().argmax(1) + 1, W)
    room = log["max_new"] - out_len
    keep = torch.minimum(torch.minimum(run, stop_at), room).clamp(min=0)
    keep = torch.where(done, 0, keep)
    kept = width[None] < keep[:, None]
    finished = (is_stop & kept).any(1) | (out_len + keep >= log["max_new"])
    out = log["out"]
    bin_column = out.shape[1] - 1
    out.scatter_(1, torch.where(kept, out_len[:, None] + width, bin_column), committed)
    log["hist"].index_copy_(0, cur["cycle"], keep[None])
    if parents is not None:  # a tree's accepted rows move to [L, L + keep) (`plan_kv_move_padded`)
        rows = accept_index - torch.arange(B, device=device)[:, None] * N
        moves = kept & (rows != width[None]) & (accept_index >= 0)
        src = verify_slots.gather(1, rows.clamp(0, N - 1))
        dst = verify_slots.gather(1, width.clamp(max=N - 1).expand(B, -1))
        ext["src"].copy_(torch.where(moves, src, -1).reshape(-1))
        ext["dst"].copy_(torch.where(moves, dst, -1).reshape(-1))
    ext["input_ids"].copy_(committed.reshape(-1))
    ext["positions"].copy_((L[:, None] + width).reshape(-1))
    # row d's slot is verify row d's (L + d); a tree of N < W rows has none past N: those rows write no KV
    in_block = torch.where(width < N, verify_slots.gather(1, width.clamp(max=N - 1).expand(B, -1)), -1)
    ext["out_slots"].copy_(in_block.reshape(-1))
    ext["prefix_lens"].copy_((L[:, None] + width + 1).reshape(-1))
    ext["feature_rows"].copy_(flat.reshape(-1))
    ext["last"].copy_(torch.arange(B, device=device) * W + (keep - 1).clamp(min=0))
    now_done = done | finished
    nxt["L"].copy_(L + keep)
    nxt["root"].copy_(committed.gather(1, (keep - 1).clamp(min=0)[:, None])[:, 0])
    nxt["done"].copy_(now_done)
    nxt["all_done"].copy_(now_done.all()[None])
    nxt["out_len"].copy_(out_len + keep)
    nxt["cycle"].copy_(cur["cycle"] + 1)


if triton is not None:

    @triton.jit
    def _accept_commit_kernel(
        tokens_ptr, parents_ptr, predict_ptr, walk_ptr, slots_ptr,
        L_ptr, done_ptr, out_len_ptr, cycle_ptr, max_new_ptr, stops_ptr, num_stops,
        out_ptr, out_stride, hist_ptr,
        next_L_ptr, next_root_ptr, next_done_ptr, next_out_len_ptr, next_cycle_ptr, next_all_done_ptr,
        ext_ids_ptr, ext_positions_ptr, ext_slots_ptr, ext_prefix_ptr, ext_rows_ptr, last_ptr, src_ptr, dst_ptr,
        B, N, W,
        TREE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
        BLOCK_X: tl.constexpr,
    ):  # fmt: skip
        """One program for the whole batch: requests along the first axis, rows or depths along the second."""
        b = tl.arange(0, BLOCK_B).to(tl.int64)
        live = b < B
        i = tl.arange(0, BLOCK_N)[None, :]
        w = tl.arange(0, BLOCK_W)[None, :]
        block = live[:, None] & (i < N)
        token = tl.load(tokens_ptr + b[:, None] * N + i, mask=block, other=-1)
        walk = tl.load(walk_ptr + b[:, None] * N + i, mask=block, other=-2)
        if TREE:
            parent = tl.load(parents_ptr + b[:, None] * N + i, mask=block, other=-2)
        else:
            parent = i - 1  # a chain: row i's parent is row i - 1
        # the greedy walk from the root: at each depth, the first child whose token is the target's
        # prediction at the current node (siblings repeating a token: the lowest row)
        node = tl.zeros([BLOCK_B], dtype=tl.int64)
        alive = live
        run = tl.where(live, 1, 0).to(tl.int64)
        path = tl.where(w == 0, 0, -1).to(tl.int64) + tl.zeros([BLOCK_B, BLOCK_W], dtype=tl.int64)
        for d in tl.static_range(1, BLOCK_W):
            want = tl.sum(tl.where(i == node[:, None], walk, 0), axis=1)  # the prediction at the node
            match = block & (parent == node[:, None]) & (token == want[:, None]) & alive[:, None] & (d < W)
            child = tl.min(tl.where(match, i, BLOCK_N), axis=1).to(tl.int64)
            found = child < BLOCK_N
            alive = alive & found
            node = tl.where(found, child, node)
            run += found.to(tl.int64)
            path = tl.where((w == d) & found[:, None], child[:, None], path)
        depth_ok = live[:, None] & (w < W)
        if TREE:
            accept_index = tl.where(path >= 0, b[:, None] * N + path, -1)
        else:
            accept_index = b[:, None] * N + w  # a chain's row d, whatever the run
        flat = tl.maximum(accept_index, 0)
        committed = tl.load(predict_ptr + flat, mask=depth_ok, other=0)
        L = tl.load(L_ptr + b, mask=live, other=0)
        done = tl.load(done_ptr + b, mask=live, other=1) != 0
        out_len = tl.load(out_len_ptr + b, mask=live, other=0)
        max_new = tl.load(max_new_ptr + b, mask=live, other=0)
        is_stop = tl.zeros([BLOCK_B, BLOCK_W], dtype=tl.int1)
        for x in tl.static_range(BLOCK_X):
            stop = tl.load(stops_ptr + x, mask=x < num_stops, other=-1)
            is_stop = is_stop | ((committed == stop) & (x < num_stops))
        is_stop = is_stop & (w < run[:, None]) & depth_ok
        stop_at = tl.min(tl.where(is_stop, w + 1, W), axis=1).to(tl.int64)
        keep = tl.maximum(tl.minimum(tl.minimum(run, stop_at), max_new - out_len), 0)
        keep = tl.where(done, 0, keep)
        kept = depth_ok & (w < keep[:, None])
        finished = (tl.max((is_stop & kept).to(tl.int32), axis=1) > 0) | (out_len + keep >= max_new)
        tl.store(out_ptr + b[:, None] * out_stride + out_len[:, None] + w, committed, mask=kept)
        cycle = tl.load(cycle_ptr)
        tl.store(hist_ptr + cycle * B + b, keep, mask=live)
        if TREE:  # a tree's accepted rows move to [L, L + keep) (`plan_kv_move_padded`)
            row = accept_index - b[:, None] * N
            moves = depth_ok & (w < keep[:, None]) & (row != w) & (accept_index >= 0)
            src = tl.load(slots_ptr + b[:, None] * N + tl.minimum(tl.maximum(row, 0), N - 1), mask=depth_ok, other=-1)
            dst = tl.load(slots_ptr + b[:, None] * N + tl.minimum(w, N - 1), mask=depth_ok, other=-1)
            tl.store(src_ptr + b[:, None] * W + w, tl.where(moves, src, -1), mask=depth_ok)
            tl.store(dst_ptr + b[:, None] * W + w, tl.where(moves, dst, -1), mask=depth_ok)
        # the draft extend over the W rows: token d at L + d, its slot, the target features of its row
        ext = b[:, None] * W + w
        tl.store(ext_ids_ptr + ext, committed, mask=depth_ok)
        tl.store(ext_positions_ptr + ext, L[:, None] + w, mask=depth_ok)
        # past a tree's N rows (N < W) no slot of the request's block: no KV (never a neighbour's slot)
        ext_slot = tl.load(slots_ptr + b[:, None] * N + w, mask=depth_ok & (w < N), other=-1)
        tl.store(ext_slots_ptr + ext, ext_slot, mask=depth_ok)
        tl.store(ext_prefix_ptr + ext, L[:, None] + w + 1, mask=depth_ok)
        tl.store(ext_rows_ptr + ext, flat, mask=depth_ok)
        last = tl.maximum(keep - 1, 0)
        tl.store(last_ptr + b, b * W + last, mask=live)
        root = tl.sum(tl.where(w == last[:, None], committed, 0), axis=1)
        now_done = done | finished
        tl.store(next_L_ptr + b, L + keep, mask=live)
        tl.store(next_root_ptr + b, root, mask=live)
        tl.store(next_done_ptr + b, now_done, mask=live)
        tl.store(next_out_len_ptr + b, out_len + keep, mask=live)
        tl.store(next_cycle_ptr, cycle + 1)
        all_done = tl.min(tl.where(live, now_done.to(tl.int32), 1), axis=0) > 0
        tl.store(next_all_done_ptr, all_done)


MAX_KERNEL_REQUESTS = 256  # `accept_commit` holds the batch in one program's registers; larger: the twin


def accept_commit(tokens, parents, predict, walk, verify_slots, cur: dict, nxt: dict, log: dict, ext: dict,
                  backend) -> None:  # fmt: skip
    """`accept_commit_torch` as one kernel where kernels run (`use_kernels`). Same contract."""
    B, N = tokens.shape
    if not use_kernels(tokens) or B > MAX_KERNEL_REQUESTS:
        return accept_commit_torch(tokens, parents, predict, walk, verify_slots, cur, nxt, log, ext, backend)
    W = ext["input_ids"].shape[0] // B
    tree = parents is not None
    stops, out = log["stops"], log["out"]
    contiguous = [t.contiguous() for t in (tokens, predict, walk, verify_slots)]
    tokens, predict, walk, verify_slots = contiguous
    parents = parents.contiguous() if tree else tokens
    _accept_commit_kernel[(1,)](
        tokens, parents, predict, walk, verify_slots,
        cur["L"], cur["done"], cur["out_len"], cur["cycle"], log["max_new"], stops, stops.shape[0],
        out, out.stride(0), log["hist"],
        nxt["L"], nxt["root"], nxt["done"], nxt["out_len"], nxt["cycle"], nxt["all_done"],
        ext["input_ids"], ext["positions"], ext["out_slots"], ext["prefix_lens"], ext["feature_rows"], ext["last"],
        ext["src"], ext["dst"],
        B, N, W,
        # BLOCK_B at least 2: Triton 3.6 (the H100 image's) fails a tree's kernel at one request in its layout
        # pass (TritonGPURemoveLayoutConversions); padding requests cost nothing
        TREE=tree, BLOCK_B=max(2, next_power_of_2(B)), BLOCK_N=next_power_of_2(N), BLOCK_W=next_power_of_2(W),
        BLOCK_X=next_power_of_2(stops.shape[0]),
    )  # fmt: skip
    return None


# ---- the "all done" flag to the host ----------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _flag_to_host_kernel(src_ptr, dst_ptr):
        tl.store(dst_ptr, tl.load(src_ptr))


def flag_to_host(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Store the one-element CUDA tensor ``src`` into ``dst``, pinned host memory, with a kernel: a posted write
    through unified addressing, where a copy (``dst.copy_(src, non_blocking=True)``) is a copy-engine node of
    the cycle's graph, on whose completion the next replay waited ~12-16 µs (bench/results/
    scale_profile-H100-20261126-eefbb4f: the gap after the graph's last node). Returns whether it launched (a device
    or driver that does not reach ``dst`` from a kernel refuses at launch: the caller copies instead)."""
    if triton is None or not src.is_cuda or dst.is_cuda or not dst.is_pinned() or src.numel() != 1 or dst.numel() != 1:
        return False
    try:
        _flag_to_host_kernel[(1,)](src, dst, num_warps=1)
    except (ValueError, RuntimeError):  # e.g. "Pointer argument cannot be accessed from Triton (cpu tensor?)"
        return False
    return True
