"""Reference ops of recurrent (Mamba-style) layers over chains and trees, in plain torch.

A recurrent layer carries a state from token to token. During a cycle its rows form a tree: each
verify row continues the state of its *parent* row (the root continues the request's committed
state), so a sibling never sees its sibling's token. Both ops below take that structure as parent
links, so one code path serves a prefill (every row's parent is the previous row), a chain and a
tree. The fast versions (`speccycle.backends.cuda.recurrent`) are tested equal to these.

Vocabulary: ``T`` rows, ``bs`` requests (segments), ``Dm`` channels, ``Ns`` state size, ``W`` the
convolution width, ``R`` request state slots, ``Q`` stored row states.
"""

from __future__ import annotations

import torch

COMMITTED = -1  # parent_src: the request's committed state
PREVIOUS = -2  # parent_src: the state of the previous row of the segment (a chain link)


def conv_tree(
    xs: torch.Tensor,
    parent_row: torch.Tensor,
    parent_window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution along each row's ancestor path.

    Row ``t`` convolves ``[x of its W - 1 nearest ancestors, x_t]``. Ancestors inside the batch are
    followed through ``parent_row``; past the topmost in-batch ancestor ``e`` (``parent_row[e] == -1``)
    the older inputs come from ``parent_window[e]``, the window that row's external parent left.

    Shapes: ``xs [T, C]``, ``parent_row [T]`` (batch row or -1), ``parent_window [T, C, W - 1]``
    (read only where ``parent_row == -1``; oldest column first), ``weight [C, W]``, ``bias [C]`` ->
    ``out [T, C]`` (before the activation), ``windows [T, C, W - 1]``: each row's own window, the
    state its children continue.
    """
    num_rows, width = xs.shape[0], weight.shape[1]
    top = torch.arange(num_rows, device=xs.device)  # the current in-batch ancestor
    outside = torch.zeros(num_rows, dtype=torch.long, device=xs.device)  # columns taken from the window
    columns = [xs]
    for _ in range(width - 1):
        up = parent_row[top]
        inside = (outside == 0) & (up >= 0)
        top = torch.where(inside, up, top)
        outside = torch.where(inside, outside, outside + 1)
        column = (width - 1 - outside).clamp(0, width - 2)  # parent_window column, newest is W - 2
        from_window = parent_window[top, :, :].gather(2, column[:, None, None].expand(-1, xs.shape[1], 1))[:, :, 0]
        columns.append(torch.where(inside[:, None], xs[top], from_window))
    window = torch.stack(columns[::-1], dim=2)  # [T, C, W], oldest first
    out = (window * weight[None]).sum(-1) + bias
    return out, window[:, :, 1:]


def selective_scan_tree(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    row_order: torch.Tensor,
    seg_starts: torch.Tensor,
    parent_src: torch.Tensor,
    init_states: torch.Tensor,
    init_slot: torch.Tensor,
    row_states: torch.Tensor,
    store_index: torch.Tensor,
    final_slot: torch.Tensor,
) -> torch.Tensor:
    """The selective-scan step of every row, each continuing its parent's state.

    ``h_t = exp(dt_t * A) * h_parent + (dt_t * x_t) B_t``, ``y_t = h_t C_t + D x_t`` (``dt`` already
    positive, ``A`` negative). Segment ``b`` is rows ``row_order[seg_starts[b]:seg_starts[b + 1]]``, in
    an order where parents come first. ``parent_src[t]``: `COMMITTED` (``init_states[init_slot[b]]``),
    `PREVIOUS` (the previous row of the segment) or an index into ``row_states``. Row ``t``'s state is
    stored at ``row_states[store_index[t]]`` where that is ``>= 0``; after its last row, segment ``b``'s
    state is written to ``init_states[final_slot[b]]`` where that is ``>= 0`` (a commit, in place).

    Shapes: ``x, dt [T, Dm]``, ``A [Dm, Ns]``, ``B, C [T, Ns]``, ``D [Dm]``, ``row_order [T]``,
    ``seg_starts [bs + 1]``, ``parent_src [T]``, ``init_states [R, Dm, Ns]``, ``init_slot [bs]``,
    ``row_states [Q, Dm, Ns]``, ``store_index [T]``, ``final_slot [bs]`` -> ``y [T, Dm]`` float32.
    States are kept in float32 whatever the buffers' dtype.
    """
    num_rows = x.shape[0]
    device = x.device
    y = torch.zeros(num_rows, x.shape[1], dtype=torch.float32, device=device)
    counts = seg_starts[1:] - seg_starts[:-1]
    if num_rows == 0 or counts.numel() == 0:
        return y
    A32, D32 = A.float(), D.float()
    h = init_states[init_slot].float()  # [bs, Dm, Ns]: the running state of each segment
    for i in range(int(counts.max())):
        seg = torch.nonzero(counts > i).squeeze(1)
        rows = row_order[seg_starts[seg] + i]
        src = parent_src[rows]
        stored = row_states[src.clamp(min=0)].float() if row_states.shape[0] else h[seg]
        committed = init_states[init_slot[seg]].float()
        pick = src[:, None, None]
        parent = torch.where(pick == PREVIOUS, h[seg], torch.where(pick == COMMITTED, committed, stored))
        dt_r, x_r = dt[rows].float(), x[rows].float()
        decay = torch.exp(dt_r[:, :, None] * A32[None])
        state = decay * parent + (dt_r * x_r)[:, :, None] * B[rows].float()[:, None, :]
        y[rows] = (state * C[rows].float()[:, None, :]).sum(-1) + D32 * x_r
        h[seg] = state
        keep = store_index[rows]
        row_states[keep[keep >= 0]] = state[keep >= 0].to(row_states.dtype)
    done = (final_slot >= 0) & (counts > 0)
    init_states[final_slot[done]] = h[done].to(init_states.dtype)
    return y
