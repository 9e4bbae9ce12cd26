"""Block drafts (DFlash): the extend, draft and verify rows of a draft that proposes a whole block.

A block draft keeps a context built from the target's features (its extend) and proposes the
``B - 1`` tokens after the root from one non-causal forward over ``[root, mask x (B - 1)]`` at
positions ``L .. L + B - 1``. The target verifies the block as a chain (``N == B``, ``S == B - 1``,
``K == 1``), with ``target[i]`` its token after row ``i``:

    correct_len = cumprod(candidates[:, 1:] == target[:, :-1]).sum()     # in [0, B - 1]
    bonus       = target[correct_len]
    accept_len  = correct_len + 1                                         # committed tokens

Accept and compact are the cycle's own: a chain's accepted rows already sit at ``L + d``, and the
compact's extend rows (positions ``L + i`` with the target's features) are the draft's next context.
"""

from __future__ import annotations

import torch

from ..core.config import SpecConfig
from ..core.ports import Ports
from ..core.records import Compacted, Drafted, DraftTree, Ready, RowOutputs, Verified
from ..core.tree import chain_tree
from .transitions import (
    CycleError,
    _batch,
    _check_logits,
    _errored,
    _greedy,
    _ready,
    _reserve_cycle,
    _row_slots,
    chain_mask,
    target_verify_forward,
)


def check_block_config(cfg: SpecConfig, draft) -> None:
    """A block of ``B`` rows is a chain of ``N == B`` verify rows and ``S == B - 1`` draft tokens."""
    block = draft.block_size
    if not cfg.is_chain or cfg.num_draft_tokens != block:
        raise CycleError(
            f"a block draft with block_size B={block} needs topk (K)=1 and num_steps (S)=B - 1={block - 1}; "
            f"the config has S={cfg.num_steps}, K={cfg.topk}, N={cfg.num_draft_tokens}"
        )


def block_extend(rec: Compacted, ports: Ports, backend) -> Ready:
    """The draft writes its context from the target's features of the newly committed tokens."""
    bs = len(rec.requests)
    if bs == 0:
        return _ready(rec, None, None, None)
    ext = rec.extend
    if ext.hidden is None:
        raise CycleError("a block draft's extend needs the target's features: the target returned hidden=None")
    ids = tuple(r.request_id for r in rec.requests)
    page_table = ports.kv_pool.page_table(ids)
    out_slots = _row_slots(backend, page_table, ext.row_request, ext.positions, ports.kv_pool.page_size)
    batch = _batch(
        ports, ids, ext.input_ids, ext.positions, ext.row_request, out_slots, ext.positions + 1, None, page_table
    )
    ports.draft.extend(batch, ext.hidden)
    return _ready(rec, None, None, None)


def draft_block(rec: Ready, ports: Ports, backend) -> Drafted:
    """Reserve the cycle's slots; one non-causal draft forward over ``[root, mask x (B - 1)]`` at ``L + i``."""
    cfg, bs, draft = rec.config, len(rec.requests), ports.draft
    check_block_config(cfg, draft)
    ids, page_table, verify_slots, _ = _reserve_cycle(rec, ports, backend)
    block, L, device = cfg.num_draft_tokens, rec.seq_lens, rec.seq_lens.device
    rows = torch.arange(block, device=device)
    input_ids = torch.full((bs, block), draft.mask_token_id, dtype=torch.long, device=device)
    input_ids[:, 0] = rec.root_tokens
    # Non-causal: every row of a block attends the context [0, L) and every row of its block.
    extra = verify_slots[:, None, :].expand(bs, block, block).reshape(bs * block, block)
    masked_rows = (torch.arange(bs, device=device)[:, None] * block + rows[None, 1:]).reshape(-1)  # [bs * (B - 1)]
    batch = _batch(
        ports,
        ids,
        input_ids.reshape(-1),
        (L[:, None] + rows).reshape(-1),
        torch.arange(bs, device=device).repeat_interleave(block),
        verify_slots.reshape(-1),
        L.repeat_interleave(block),
        extra,
        page_table,
        masked_rows,
    )
    candidates = backend.greedy_predict(draft.propose(batch).logits).view(bs, block - 1)
    tokens, parents = chain_tree(rec.root_tokens, candidates)
    return Drafted(
        config=cfg,
        requests=rec.requests,
        seq_lens=L,
        tree=DraftTree(tokens=tokens, parents=parents, depths=rows.expand(bs, block)),
        verify_slots=verify_slots,
        draft_slots=torch.empty((bs, 0, 1), dtype=torch.long, device=device),
        draft_positions=torch.empty((bs, 0), dtype=torch.long, device=device),
    )


def verify_block(rec: Drafted, ports: Ports, backend) -> Verified:
    """One target forward over the block as a chain; ``correct_len`` by `verify_block`, greedy."""
    cfg, bs = rec.config, len(rec.requests)
    block = rec.tree.tokens.shape[1]
    L, device = rec.seq_lens, rec.seq_lens.device
    causal = chain_mask(block, device)
    out, row_request = target_verify_forward(rec, ports, causal.expand(bs, block, block))
    predict = _greedy(out, backend)  # [bs * B]: target[i] of each block
    correct_len, _ = backend.verify_block(rec.tree.tokens, predict.view(bs, block))
    accept_len = correct_len + 1
    depth = torch.arange(cfg.accept_width, device=device)[None, :]
    flat = torch.arange(bs, device=device)[:, None] * block + depth
    accept_index = torch.where(depth < accept_len[:, None], flat, -1)
    bad = _check_logits(out, row_request, bs)
    requests = []
    for request, is_bad in zip(rec.requests, bad):
        if is_bad:
            request = _errored(request, "the target returned non-finite logits during verify")
        elif not request.sampling.greedy:
            request = _errored(request, "block drafts verify greedily; pass temperature=0")
        requests.append(request)
    return Verified(
        config=cfg,
        requests=tuple(requests),
        seq_lens=L,
        tree=rec.tree,
        verify_slots=rec.verify_slots,
        rows=RowOutputs(predict=predict, hidden=out.hidden),
        accept_index=accept_index,
        accept_len=accept_len,
    )
