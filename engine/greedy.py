"""Plain (non-speculative) greedy decoding through the paged pool: the baseline the cycle must equal.

`extend_batch` builds the causal `ForwardBatch` of a ragged extend (prefill, or one decode token per
request); `greedy_decode` prefills a batch of prompts and decodes one token per request per forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..core.ports import ForwardBatch, TargetModel
from .memory.kv_pool import PagedKVPool, slots_from_page_table


def extend_batch(
    pool: PagedKVPool,
    request_ids: Sequence[int],
    tokens: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    last_logits_only: bool = True,
    prefill: bool = False,
) -> ForwardBatch:
    """A causal extend: request ``b`` feeds ``tokens[b]`` at positions ``start_positions[b] + i``.

    Allocates the pages the rows need. Each row attends ``[0, position + 1)``. With
    ``last_logits_only`` the batch asks for logits of each request's last row only (``R = bs``). ``prefill``:
    the rows are whole prompts (`ForwardBatch.prefill`), as the prefill transition marks its own, so an
    autoregressive baseline prefills with the kernel the speculative cycle's prefill takes.
    """
    device = pool.device
    lengths = [len(t) for t in tokens]
    if any(n == 0 for n in lengths):
        raise ValueError(f"extend_batch: every request needs at least one token, got lengths {lengths}")
    for request_id, start, n in zip(request_ids, start_positions, lengths):
        pool.allocate(request_id, start + n)
    input_ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long, device=device)  # [T]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(start_positions, lengths)]).to(device)  # [T]
    row_request = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)  # [T]
    page_table = pool.page_table(request_ids)  # [bs, max_pages]
    out_slots = slots_from_page_table(page_table[row_request], positions[:, None], pool.page_size)[:, 0]
    last_rows = torch.cumsum(torch.tensor(lengths), 0).to(device) - 1  # [bs]
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        row_request=row_request,
        out_slots=out_slots,
        prefix_lens=positions + 1,
        extra_slots=torch.empty((len(positions), 0), dtype=torch.long, device=device),
        page_table=page_table,
        page_size=pool.page_size,
        request_ids=tuple(request_ids),
        logits_rows=last_rows if last_logits_only else None,
        prefill=prefill,
    )


def greedy_decode(
    target: TargetModel,
    pool: PagedKVPool,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    first_request_id: int = 0,
    pick: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[list[int]]:
    """Greedy continuation of each prompt: one prefill forward, then one forward per new token.

    Requests that hit a stop token (kept in the output) leave the batch. Frees their pages at the end.
    ``pick`` chooses each live request's next token from its logits (``[live, V] -> [live]``; default
    argmax): a sampler turns this into plain sampling (`train.data.EngineGenerator`).
    """
    pick = pick or (lambda logits: logits.argmax(dim=-1))
    request_ids = [first_request_id + i for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    batch = extend_batch(pool, request_ids, prompts, [0] * len(prompts), prefill=True)
    next_tokens = pick(target.forward(batch).logits).tolist()
    lengths = [len(p) for p in prompts]
    live = list(range(len(prompts)))
    try:
        while live:
            still = []
            for b, token in zip(live, next_tokens):
                outputs[b].append(token)
                if token not in stop_token_ids and len(outputs[b]) < max_new_tokens:
                    still.append(b)
            live = still
            if not live:
                break
            batch = extend_batch(
                pool, [request_ids[b] for b in live], [[outputs[b][-1]] for b in live], [lengths[b] for b in live]
            )
            for b in live:
                lengths[b] += 1
            next_tokens = pick(target.forward(batch).logits).tolist()
    finally:
        for request_id in request_ids:
            if pool.has_request(request_id):
                pool.free(request_id)
    return outputs
