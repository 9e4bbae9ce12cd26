"""Join and split `Ready` batches between cycles (continuous batching at the record level)."""

from __future__ import annotations

import attrs
import torch

from ..core.config import SpecConfig
from ..core.records import Ready
from ..core.transfer import to_device


def _cat(a: Ready, b: Ready, what: str) -> torch.Tensor | None:
    """``what`` of ``a`` then ``b``. A batch whose requests all have ``speculate=False`` ran no draft extend
    (None): it contributes zero rows, which the draft never reads."""
    x, y = getattr(a, what), getattr(b, what)
    if x is None and y is None:
        return None
    parts = []
    for ready, value, other in ((a, x, y), (b, y, x)):
        if value is None:
            if any(r.sampling.speculate for r in ready.requests):
                raise ValueError(f"cannot merge batches: {what} is set in one and not the other (same draft for both?)")
            value = other.new_zeros((len(ready.requests), *other.shape[1:]))
        parts.append(value)
    return torch.cat(parts)


def _cat_draft_probs(a: Ready, b: Ready) -> torch.Tensor | None:
    """Sampled requests' draft distributions; a batch of greedy requests (None) contributes zero rows."""
    if a.draft_probs is None and b.draft_probs is None:
        return None
    vocab = (a.draft_probs if a.draft_probs is not None else b.draft_probs).shape[-1]
    parts = []
    for ready, probs in ((a, a.draft_probs), (b, b.draft_probs)):
        parts.append(probs if probs is not None else ready.seq_lens.new_zeros((len(ready.requests), vocab)).float())
    return torch.cat(parts)


def _pending(ready: Ready) -> Ready:
    """``ready`` with its depth-1 top-K pending (`Ready.topk_pending`): computed again from ``draft_hidden`` when
    a shape drafts (the table's ``first_level`` row)."""
    return attrs.evolve(ready, topk_p=None, topk_index=None, draft_probs=None, topk_pending=True)


def merge_ready(a: Ready, b: Ready) -> Ready:
    """One `Ready` batch holding the requests of ``a`` then ``b``. Both must share the config. Where one's depth-1
    top-K is pending (a cycle of ``S == 0`` deferred it), so is the merged batch's: the other's is set aside."""
    if a.config != b.config:
        raise ValueError(f"cannot merge batches with different configs: {a.config} and {b.config}")
    if not a.requests:
        return b
    if not b.requests:
        return a
    if a.topk_pending != b.topk_pending:
        a, b = _pending(a), _pending(b)
    clash = {r.request_id for r in a.requests} & {r.request_id for r in b.requests}
    if clash:
        raise ValueError(f"request ids {sorted(clash)} are in both batches")
    return Ready(
        config=a.config,
        requests=a.requests + b.requests,
        seq_lens=torch.cat([a.seq_lens, b.seq_lens]),
        root_tokens=torch.cat([a.root_tokens, b.root_tokens]),
        topk_p=_cat(a, b, "topk_p"),
        topk_index=_cat(a, b, "topk_index"),
        draft_hidden=_cat(a, b, "draft_hidden"),
        retired=a.retired + b.retired,
        draft_probs=_cat_draft_probs(a, b),
        topk_pending=a.topk_pending,
        retract=a.retract + b.retract,
    )


def select_ready(ready: Ready, indices: list[int]) -> Ready:
    """The `Ready` batch of ``ready.requests[i]`` for ``i`` in ``indices``, in that order (``retired`` kept, and
    ``retract`` as far as it names requests kept). The rows that take requests out (``retire``, ``retract``) select
    the rest this way after freeing their pages; so does an engine reading back a batch it loaded."""
    index = to_device(list(indices), ready.seq_lens.device)  # no wait for a cycle in flight

    def take(value: torch.Tensor | None) -> torch.Tensor | None:
        return None if value is None else value.index_select(0, index.to(value.device))

    return Ready(
        config=ready.config,
        requests=tuple(ready.requests[i] for i in indices),
        seq_lens=take(ready.seq_lens),
        root_tokens=take(ready.root_tokens),
        topk_p=take(ready.topk_p),
        topk_index=take(ready.topk_index),
        draft_hidden=take(ready.draft_hidden),
        retired=ready.retired,
        draft_probs=take(ready.draft_probs),
        topk_pending=ready.topk_pending,
        retract=tuple(r.request_id for r in (ready.requests[i] for i in indices) if r.request_id in ready.retract),
    )


def reshape(ready: Ready, config: SpecConfig, pool=None, pairing: str = "shifted") -> Ready:
    """The batch in another draft shape of its family for the next cycle: another ``S`` and ``N`` (``S == 0``: no
    draft), the same ``K`` and page size. What the batch carries between cycles (lengths, roots, the draft's
    depth-1 top-K and hidden state, a sampled request's ``q``) does not depend on ``S`` or ``N``, so only the
    config changes; a different ``K`` would need another top-K width from the draft extend, and is refused.

    A shallower shape reserves fewer positions past ``L``: given the KV ``pool`` (and the draft's ``pairing``),
    the pages a deeper shape reserved past them go back to it, so each request holds its next cycle's reservation
    (invariant 8); without a pool the caller gives them back.

    A batch whose depth-1 top-K a cycle of ``S == 0`` deferred (`Ready.topk_pending`) keeps it pending here; in a
    shape that drafts, the table's ``first_level`` row computes it from the draft's hidden state before the draft
    (`runner.run_cycle` and the scheduler step it; invariant 17)."""
    if not isinstance(config, SpecConfig):
        raise ValueError(f"config must be a SpecConfig, got {type(config).__name__}")
    old = ready.config
    if config.topk != old.topk or config.page_size != old.page_size:
        raise ValueError(
            f"cannot reshape a batch of topk (K)={old.topk}, page_size (P)={old.page_size} into K={config.topk}, "
            f"P={config.page_size}: a shape keeps the family's K (the draft state's width) and the pool's P"
        )
    if config == old:
        return ready
    extra = config.reserve_len(pairing)
    if pool is not None and extra < old.reserve_len(pairing):
        for request, length in zip(ready.requests, ready.seq_lens.tolist()):
            if pool.pages_held(request.request_id):
                pool.release(request.request_id, length + extra)
    return attrs.evolve(ready, config=config)
