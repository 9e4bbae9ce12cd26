"""Reference paged attention: the one attention rule of core.ports, in plain torch.

    a row of request b attends the slots of b's positions [0, prefix_len) (through b's page table)
    plus the slots listed in its `extra_slots` row, after every row has written its K/V to `out_slots`.

`plan_attention` turns a `ForwardBatch` into gather indices and a boolean mask once per forward;
`paged_attention` reuses them in every layer. Rows are regrouped per request into a padded
``[bs, Tq]`` block so one batched SDPA call per layer serves a ragged batch:

* keys of request b: its prefix slots (positions ``[0, max prefix_len of b's rows)``) followed by the
  extra slots of each of its rows (``Tq * M`` columns, row ``i`` owns columns ``[i * M, (i + 1) * M)``);
* mask[b, i, j]: key j is a prefix position below row i's ``prefix_len``, or one of row i's extra slots.

Extra slots are assumed disjoint from the row's prefix slots (tree ancestors sit at ``>= L``); a slot
listed twice would be attended twice.

One request on a CPU (batch 1: a decode step, a verify, a prefill) takes a compact layout instead: the
keys are the prefix positions followed by the distinct extra slots of all rows (``W + U`` columns, not
``W + Tq * M``: a chain verify of 17 rows attends 17 extra keys, not 289). When those slots form one
run of the cache (pages handed out in order, as a fresh pool does) every layer reads its keys as a
slice, without a gather; a prefill from position 0 runs SDPA's causal kernel (no mask, half the work);
and up to `SMALL_ROWS` rows (decode, verify) run two batched matmuls per layer instead of SDPA, which
on a CPU cost ~70% more at 2 rows than at 1. Indicative, 2-core CPU, SmolLM2-135M, 770 keys, per
layer: SDPA as before 180/275/340/355 us at 1/2/3/9 rows, the slice + matmuls ~145/140/160/280 us
(`bench/verify_profile.py`, docs/engine.md). Same keys, same mask: only the arithmetic order of the
attention differs (as it did between SDPA calls of different row counts).
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F

from ...core.ports import ForwardBatch
from ..errors import ForwardBatchError

_PAST_PAGES = (
    "a row's prefix_len reaches past the KV pages its request holds; allocate pages for positions "
    "[0, prefix_len) before the forward"
)


@attrs.frozen(eq=False)
class AttentionPlan:
    """Gather indices and mask of one forward, shared by all layers.

    Shapes: ``T`` rows, ``bs`` requests, ``Tq`` most rows of one request, ``Skv`` keys per request.
    """

    out_slots: torch.Tensor  # [T] int64, where each row writes its K/V
    row_flat: torch.Tensor | None  # [T] int64, row t's index in the padded [bs * Tq] block; None: identity
    key_slots: torch.Tensor  # [bs, Skv] int64, slots gathered as keys (padding: slot 0, masked off)
    mask: torch.Tensor  # [bs, 1, Tq, Skv] bool, True where the row attends the key
    bs: int
    tq: int
    # Key columns [0, prefix_width) are the prefix positions 0, 1, ...; the rest are extra slots.
    prefix_width: int = 0
    # The one-request layout (module docstring): keys are prefix positions, then distinct extra slots.
    compact: bool = False
    # Set when key_slots[0] is the run key_start, key_start + 1, ... (compact): keys read as a slice.
    key_start: int | None = None
    # "full": every row attends every key; "causal": row i attends keys [0, i] (Tq == Skv); "mask".
    mask_kind: str = "mask"
    bias: torch.Tensor | None = None  # [Tq, Skv] float32, 0 where attended, -inf elsewhere (small-row path)


# Rows up to which a one-request CPU forward runs its attention as two batched matmuls per layer
# instead of SDPA (a decode step, a verify); above, SDPA's flash kernel is faster.
SMALL_ROWS = 12


def plan_attention(batch: ForwardBatch) -> AttentionPlan:
    """Build the gather indices and the mask of ``batch`` (see the module docstring)."""
    row_request, prefix_lens, extra = batch.row_request, batch.prefix_lens, batch.extra_slots
    page_table, page_size = batch.page_table, batch.page_size
    device = row_request.device
    num_rows, bs = batch.num_rows, int(page_table.shape[0])
    _check_shapes(batch, num_rows, bs)
    if bs == 1 and num_rows and device.type == "cpu":
        plan = _plan_one_request(batch)
        if plan is not None:
            return plan

    # Regroup rows per request: rank of each row among its request's rows, in batch order.
    counts = torch.bincount(row_request, minlength=bs)  # [bs]
    tq = int(counts.max()) if num_rows else 0
    order = torch.sort(row_request, stable=True).indices  # [T]
    starts = torch.cumsum(counts, 0) - counts  # [bs]
    rank = torch.empty_like(row_request)
    rank[order] = torch.arange(num_rows, device=device) - starts[row_request[order]]
    row_flat = row_request * tq + rank  # [T]
    identity = bs * tq == num_rows and bool((row_flat == torch.arange(num_rows, device=device)).all())

    # Prefix keys: positions [0, longest prefix of the request's rows), through the page table.
    longest = torch.zeros(bs, dtype=torch.long, device=device).scatter_reduce(
        0, row_request, prefix_lens, reduce="amax"
    )  # [bs]
    width = int(longest.max()) if bs else 0
    positions = torch.arange(width, device=device)  # [Pmax]
    in_prefix = positions[None, :] < longest[:, None]  # [bs, Pmax]
    beyond_table = (positions // page_size >= page_table.shape[1])[None, :]  # [1, Pmax]
    if bool((in_prefix & beyond_table).any()):
        raise ForwardBatchError(_PAST_PAGES)
    pages = page_table[:, (positions // page_size).clamp(max=max(page_table.shape[1] - 1, 0))]
    if bool((in_prefix & (pages < 0)).any()):
        raise ForwardBatchError(_PAST_PAGES)
    prefix_slots = torch.where(in_prefix, pages * page_size + positions[None, :] % page_size, 0)

    # Extra keys: each row's extra slots, laid out per request in row order.
    m = int(extra.shape[1])
    extra_pad = torch.full((bs * tq, m), -1, dtype=torch.long, device=device)
    extra_pad[row_flat] = extra
    extra_pad = extra_pad.view(bs, tq * m)  # [bs, Tq * M]
    key_slots = torch.cat([prefix_slots, extra_pad.clamp(min=0)], dim=1)  # [bs, Skv]

    # Mask: prefix keys below the row's prefix_len; a row's own block of extra keys, where not -1.
    row_prefix = torch.zeros(bs * tq, dtype=torch.long, device=device)
    row_prefix[row_flat] = prefix_lens
    prefix_mask = positions[None, None, :] < row_prefix.view(bs, tq, 1)  # [bs, Tq, Pmax]
    own_block = torch.eye(tq, dtype=torch.bool, device=device)[:, :, None].expand(tq, tq, m).reshape(tq, tq * m)
    extra_mask = own_block[None] & (extra_pad >= 0)[:, None, :]  # [bs, Tq, Tq * M]: row i owns block i
    mask = torch.cat([prefix_mask, extra_mask], dim=2)  # [bs, Tq, Skv]

    valid = torch.zeros(bs * tq, dtype=torch.bool, device=device)
    valid[row_flat] = True
    attends = mask.view(bs * tq, -1).any(dim=1)
    if bool((valid & ~attends).any()):
        row = int(torch.nonzero((valid & ~attends)[row_flat])[0])
        raise ForwardBatchError(
            f"row {row} attends no key (prefix_len={int(prefix_lens[row])}, no extra slots); a causal "
            f"row needs prefix_len = position + 1"
        )
    if mask.shape[2]:
        mask.view(bs * tq, -1)[~valid, 0] = True  # padding rows attend one key: no NaN, result dropped
    return AttentionPlan(
        out_slots=batch.out_slots,
        row_flat=None if identity else row_flat,
        key_slots=key_slots,
        mask=mask[:, None],
        bs=bs,
        tq=tq,
        prefix_width=width,
    )


def _plan_one_request(batch: ForwardBatch) -> AttentionPlan | None:
    """The compact plan of a one-request batch (module docstring): keys are the prefix positions, then
    the distinct extra slots in slot order. None where an extra slot is also a prefix slot (the
    reference layout attends such a slot twice, the compact one would once)."""
    prefix_lens, extra, device = batch.prefix_lens, batch.extra_slots, batch.row_request.device
    page_table, page_size = batch.page_table[0], batch.page_size
    width = int(prefix_lens.max())
    positions = torch.arange(width, device=device)  # [W]
    page_index = positions // page_size
    if width and int(page_index[-1]) >= page_table.shape[0]:
        raise ForwardBatchError(_PAST_PAGES)
    pages = page_table[page_index]
    if bool((pages < 0).any()):
        raise ForwardBatchError(_PAST_PAGES)
    prefix_slots = pages * page_size + positions % page_size  # [W]
    listed = extra[extra >= 0]
    extra_keys = torch.unique(listed) if listed.numel() else listed  # [U], sorted
    if extra_keys.numel() and bool(torch.isin(extra_keys, prefix_slots).any()):
        return None
    key_slots = torch.cat([prefix_slots, extra_keys])  # [Skv]
    mask = positions[None, :] < prefix_lens[:, None]  # [Tq, W]
    if extra_keys.numel():
        mask = torch.cat([mask, (extra[:, :, None] == extra_keys[None, None, :]).any(dim=1)], dim=1)  # [Tq, Skv]
    attends = mask.any(dim=1)
    if not bool(attends.all()):
        row = int(torch.nonzero(~attends)[0])
        raise ForwardBatchError(
            f"row {row} attends no key (prefix_len={int(prefix_lens[row])}, no extra slots); a causal "
            f"row needs prefix_len = position + 1"
        )
    tq, skv = mask.shape
    start = int(key_slots[0])
    contiguous = int(key_slots[-1]) - start == skv - 1 and bool((key_slots.diff() == 1).all())
    return _with_mask(
        AttentionPlan(
            out_slots=batch.out_slots,
            row_flat=None,
            key_slots=key_slots[None],
            mask=mask[None, None],
            bs=1,
            tq=tq,
            prefix_width=width,
            compact=True,
            key_start=start if contiguous else None,
        )
    )


def _with_mask(plan: AttentionPlan) -> AttentionPlan:
    """``mask_kind`` and ``bias`` of a one-request plan from its mask."""
    mask = plan.mask[0, 0]  # [Tq, Skv]
    tq, skv = mask.shape
    if bool(mask.all()):
        kind = "full"
    elif tq == skv and bool((mask == torch.ones_like(mask).tril()).all()):
        kind = "causal"
    else:
        kind = "mask"
    bias = None
    if tq <= SMALL_ROWS and kind != "full":
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return attrs.evolve(plan, mask_kind=kind, bias=bias)


def restrict_to_window(plan: AttentionPlan, batch: ForwardBatch, window: int) -> AttentionPlan:
    """The plan of a sliding-window layer: a row at position ``p`` keeps the keys at positions ``> p - window``.

    Prefix key ``j`` of the plan sits at position ``j``, so the prefix columns are cut by position. A
    row's extra slots (its tree ancestors and itself) lie at positions ``[prefix_len, p]``; they are
    all inside the window when ``p - prefix_len < window``, which a row with extra slots must satisfy
    (tree depth below the window). Same keys, same gather: only the mask narrows.
    """
    if window < 1:
        raise ForwardBatchError(f"sliding window {window} must be >= 1")
    bs, tq, device = plan.bs, plan.tq, batch.positions.device
    extra = batch.extra_slots
    width = plan.prefix_width  # prefix columns (positions 0 .. width - 1)
    has_extra = (extra >= 0).any(dim=1) if extra.shape[1] else torch.zeros_like(batch.positions, dtype=torch.bool)
    too_deep = has_extra & (batch.positions - batch.prefix_lens >= window)
    if bool(too_deep.any()):
        row = int(torch.nonzero(too_deep)[0])
        raise ForwardBatchError(
            f"row {row} at position {int(batch.positions[row])} has extra slots and prefix_len "
            f"{int(batch.prefix_lens[row])}: a sliding window of {window} cannot place its extra keys; "
            f"keep tree depth below the window"
        )
    row_flat = plan.row_flat if plan.row_flat is not None else torch.arange(batch.num_rows, device=device)
    row_pos = torch.zeros(bs * tq, dtype=torch.long, device=device)  # padding rows at 0 keep key 0
    row_pos[row_flat] = batch.positions
    in_window = torch.arange(width, device=device)[None, :] > (row_pos[:, None] - window)  # [bs * Tq, Pmax]
    keep = torch.ones(bs * tq, plan.key_slots.shape[1], dtype=torch.bool, device=device)
    keep[:, :width] = in_window
    mask = plan.mask & keep.view(bs, 1, tq, -1)
    attends = mask.view(bs * tq, -1)[row_flat].any(dim=1)
    if not bool(attends.all()):
        row = int(torch.nonzero(~attends)[0])
        raise ForwardBatchError(f"row {row} attends no key inside the sliding window of {window}")
    windowed = attrs.evolve(plan, mask=mask)
    return _with_mask(windowed) if plan.compact else windowed


def _check_shapes(batch: ForwardBatch, num_rows: int, bs: int) -> None:
    for name in ("positions", "row_request", "out_slots", "prefix_lens"):
        shape = tuple(getattr(batch, name).shape)
        if shape != (num_rows,):
            raise ForwardBatchError(f"ForwardBatch.{name} has shape {shape}; it must be [T] = ({num_rows},)")
    if batch.extra_slots.dim() != 2 or batch.extra_slots.shape[0] != num_rows:
        raise ForwardBatchError(
            f"ForwardBatch.extra_slots has shape {tuple(batch.extra_slots.shape)}; it must be [T, M] with "
            f"T = {num_rows} (use shape ({num_rows}, 0) for causal rows)"
        )
    if num_rows and (int(batch.row_request.min()) < 0 or int(batch.row_request.max()) >= bs):
        raise ForwardBatchError(f"ForwardBatch.row_request must lie in [0, {bs}) (page_table has {bs} rows)")
    if batch.page_size < 1:
        raise ForwardBatchError(f"ForwardBatch.page_size={batch.page_size} must be >= 1")


def write_kv(
    plan: AttentionPlan, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write every row's K/V at its slot. Shapes: caches ``[num_slots, Hkv, D]``, ``k, v [T, Hkv, D]``."""
    k_cache.index_copy_(0, plan.out_slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, plan.out_slots, v.to(v_cache.dtype))


def paged_attention(
    plan: AttentionPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of every row over its keys, computed in float32.

    Shapes: ``q [T, H, D]``, caches ``[num_slots, Hkv, D]`` -> ``[T, H, D]`` in ``q.dtype``. Query head
    ``h`` reads KV head ``h // (H / Hkv)`` (Hugging Face's `repeat_kv` order). Uses torch's SDPA with a
    boolean mask, which never materializes the ``[Tq, Skv]`` scores of a long prefill on CPU.
    ``scale``: the factor on ``q . k`` (default ``1 / sqrt(D)``; Gemma 3 takes ``query_pre_attn_scalar ** -0.5``).
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    bs, tq = plan.bs, plan.tq
    skv = plan.key_slots.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if plan.compact:
        if plan.key_start is not None:
            k = k_cache.narrow(0, plan.key_start, skv)  # [Skv, Hkv, D], a view: no gather
            v = v_cache.narrow(0, plan.key_start, skv)
        else:
            k, v = k_cache.index_select(0, plan.key_slots[0]), v_cache.index_select(0, plan.key_slots[0])
        if tq <= SMALL_ROWS:
            return _attend_small(q, k, v, plan.bias, scale)
        return _attend_sdpa(q, k, v, plan, scale)

    if plan.row_flat is None:
        q_pad = q
    else:
        q_pad = q.new_zeros((bs * tq, num_heads, head_dim)).index_copy_(0, plan.row_flat, q)
    q_pad = q_pad.view(bs, tq, num_heads, head_dim).transpose(1, 2).float()  # [bs, H, Tq, D]
    flat_slots = plan.key_slots.reshape(-1)
    k = k_cache.index_select(0, flat_slots).view(bs, skv, num_kv_heads, head_dim).transpose(1, 2).float()
    v = v_cache.index_select(0, flat_slots).view(bs, skv, num_kv_heads, head_dim).transpose(1, 2).float()
    out = F.scaled_dot_product_attention(
        q_pad,
        k,
        v,
        attn_mask=plan.mask,
        scale=scale,
        enable_gqa=num_kv_heads != num_heads,
    )  # [bs, H, Tq, D]
    out = out.transpose(1, 2).reshape(bs * tq, num_heads, head_dim)
    if plan.row_flat is not None:
        out = out.index_select(0, plan.row_flat)
    return out.to(q.dtype)


def _attend_small(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention of a few rows of one request as two batched matmuls, one batch entry per KV head.

    Shapes: ``q [n, H, D]``, ``k, v [Skv, Hkv, D]`` (the request's keys in key order), ``bias [n, Skv]``
    (None: every row attends every key) -> ``[n, H, D]`` in ``q.dtype``. Query head ``h`` reads KV head
    ``h // g`` with ``g = H / Hkv``, so the ``g * n`` query rows of a KV head share one matmul.
    """
    n, num_heads, head_dim = q.shape
    skv, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    grouped = q.float().view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    grouped = grouped.reshape(num_kv_heads, group * n, head_dim)  # [Hkv, g * n, D]
    scores = torch.bmm(grouped, k.float().permute(1, 2, 0)).view(num_kv_heads, group, n, skv).mul_(scale)
    if bias is not None:
        scores.add_(bias)
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * n, skv)
    out = torch.bmm(probs, v.float().permute(1, 0, 2))  # [Hkv, g * n, D]
    return out.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim).to(q.dtype)


def _attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
    """SDPA over one request's keys read as a slice; a causal prefill without a mask. Shapes as `_attend_small`."""
    n, num_heads, head_dim = q.shape
    skv, num_kv_heads = k.shape[0], k.shape[1]
    out = F.scaled_dot_product_attention(
        q.float().view(1, n, num_heads, head_dim).transpose(1, 2),
        k.float().view(1, skv, num_kv_heads, head_dim).transpose(1, 2),
        v.float().view(1, skv, num_kv_heads, head_dim).transpose(1, 2),
        attn_mask=plan.mask if plan.mask_kind == "mask" else None,
        is_causal=plan.mask_kind == "causal",
        scale=scale,
        enable_gqa=num_kv_heads != num_heads,
    )  # [1, H, n, D]
    return out.transpose(1, 2).reshape(n, num_heads, head_dim).to(q.dtype)
