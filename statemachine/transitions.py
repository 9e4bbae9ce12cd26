"""What each row of the transition table does: ``run(record, ports, backend) -> record``.

Each function reads its input record and the ports, calls the backend ops its table row names, and
returns a new record; records are never mutated. The only mutable state is behind the ports (model
KV and the pool's pages).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections import Counter
from collections.abc import Sequence

import attrs
import torch

from ..core import shapes
from ..core.config import SpecConfig
from ..core.ports import (
    ForwardBatch,
    KVPool,
    KVPoolExhausted,
    ModelOutput,
    Ports,
    defers_first_level,
    draft_kind,
    draft_pairing,
    graphed_draft_levels,
    kv_knows,
    target_device,
)
from ..core.records import (
    Accepted,
    Admitted,
    Compacted,
    Drafted,
    DraftTree,
    ExtendRows,
    Ready,
    Request,
    RowOutputs,
    Verified,
)
from ..core.transfer import to_device
from ..core.tree import draft_position, draft_scratch_offsets, tree_depths
from . import grammar, sampling
from . import logits as row_logits
from .stops import cut_at_stops


class CycleError(RuntimeError):
    """A request cannot go on (bad input or a model that returned garbage)."""


def draft_offset(ports: Ports, config: SpecConfig) -> int:
    """Draft cache positions past ``L`` a family keeps: 1 for an aligned forward draft (the root)."""
    return config.draft_scratch_offset(draft_pairing(ports))  # lookup and block drafts: "shifted", 0


def is_forward(ports: Ports) -> bool:
    return draft_kind(ports) == "forward"


def reserve(pool: KVPool, request_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
    """Grow each request's pages to cover ``num_tokens``, all or nothing.

    Raises `KVPoolExhausted` before touching the pool when the pages do not fit, so an engine can
    retract or defer requests and call again with nothing to undo.
    """
    needed = 0
    for rid, tokens in zip(request_ids, num_tokens):
        needed += max(0, math.ceil(tokens / pool.page_size) - pool.pages_held(rid))
    if needed > pool.num_free_pages:
        raise KVPoolExhausted(
            f"the cycle needs {needed} more KV pages and the pool has {pool.num_free_pages} free: "
            "retract or defer requests, or give the pool more pages"
        )
    for rid, tokens in zip(request_ids, num_tokens):
        pool.allocate(rid, int(tokens))


def _batch(
    ports: Ports,
    request_ids: tuple[int, ...],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    row_request: torch.Tensor,
    out_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    extra_slots: torch.Tensor | None,
    page_table: torch.Tensor,
    logits_rows: torch.Tensor | None = None,
    prefill: bool = False,
) -> ForwardBatch:
    if extra_slots is None:
        extra_slots = shapes.no_extra_slots(input_ids.shape[0], input_ids.device)
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        row_request=row_request,
        out_slots=out_slots,
        prefix_lens=prefix_lens,
        extra_slots=extra_slots,
        page_table=page_table,
        page_size=ports.kv_pool.page_size,
        request_ids=request_ids,
        logits_rows=logits_rows,
        prefill=prefill,
    )


def _row_slots(backend, page_table, row_request, positions, page_size) -> torch.Tensor:
    """Slot of each ragged row through its request's page table. Shapes: ``[T]`` -> ``[T]``.

    The rows of a prefill and of a draft extend lie below ``L + reserve`` (their pages were reserved on the host
    first: invariant 8, which checked mode validates), so the backend skips its device-side coverage check and
    the host does not wait for the device here (`covered=True`)."""
    rows = page_table.index_select(0, row_request)
    return backend.slots_for_positions(rows, positions[:, None], page_size, covered=True)[:, 0]


def chain_mask(n: int, device) -> torch.Tensor:
    """``[n, n]`` bool, row ``i`` sees rows ``0..i`` (shared, read-only). A comparison, not ``tril``: on a
    CPU, ``tril`` always splits its work over the intra-op threads, and waking them cost ~0.6 ms per
    cycle (H100 host)."""
    return shapes.chain_mask(n, torch.device(device))


def _greedy(out: ModelOutput, backend) -> torch.Tensor:
    """``argmax`` of every logits row: the port's own reduction when it handed one over."""
    return out.greedy if out.greedy is not None else backend.greedy_predict(out.logits)


def _check_logits(out: ModelOutput, row_request: torch.Tensor, bs: int) -> list[bool]:
    """Per request: every logit finite. A NaN would otherwise become a bogus tree or token.

    The common case costs one reduction: the sum of all logits is finite only if every logit is (an
    infinity or NaN anywhere makes it inf or NaN). Only when it is not (a bad row, or finite logits
    whose sum overflows) are the rows checked one by one.
    """
    if out.finite is not None:
        if bool(out.finite.all()):
            return [False] * bs
        finite = out.finite
    else:
        if bool(torch.isfinite(out.logits.sum(dtype=torch.float32))):
            return [False] * bs
        finite = torch.isfinite(out.logits).all(-1)
    bad = torch.zeros(bs, dtype=torch.bool, device=finite.device)
    bad.index_put_((row_request.to(finite.device),), ~finite, accumulate=True)
    return bad.tolist()


def validate_request(request: Request, vocab_size: int, detokenizer=None) -> None:
    if len(request.prompt) == 0:
        raise CycleError(f"request {request.request_id}: the prompt is empty; give at least one token")
    prompt = request.prompt
    if not all(type(t) is int for t in prompt):  # plain ints pass at once (an ABC check per token costs ~1 us)
        not_ids = [t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if not_ids:
            raise CycleError(f"request {request.request_id}: the prompt holds {not_ids[:5]!r}, not int token ids")
    if request.sampling.stop_strings and detokenizer is None:
        raise CycleError(
            f"request {request.request_id}: stop strings need a tokenizer; give the engine one (Ports.detokenizer)"
        )
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = [t for t in prompt if not (0 <= t < vocab_size)]
        raise CycleError(
            f"request {request.request_id}: prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    named = [t for t in request.sampling.token_ids() if t >= vocab_size]
    if named:
        raise CycleError(
            f"request {request.request_id}: logit_bias / bad_words name token ids {named[:5]} outside the "
            f"vocabulary [0, {vocab_size})"
        )


def refuse_duplicate_ids(requests: Sequence[Request]) -> None:
    """A `ValueError` naming each request id that occurs more than once: the KV pool keys pages by request
    id, so two requests of one id would read and write each other's pages."""
    counts = Counter(r.request_id for r in requests)
    repeated = sorted(rid for rid, count in counts.items() if count > 1)
    if repeated:
        ids = ", ".join(map(str, repeated))
        what = f"request id {ids} is" if len(repeated) == 1 else f"request ids {ids} are each"
        raise ValueError(
            f"{what} given more than once in one batch (the KV pool keys pages by request id, so they would "
            "share pages): give each request its own id"
        )


# ---- prefill -----------------------------------------------------------------------------------
def prefill(rec: Admitted, ports: Ports, backend) -> Compacted:
    """Target extend over the prompts; the first token; the draft extend's rows (shifted by one).

    A request that already has output (one an engine retracted to free KV) is extended over prompt
    and output, and its next token appended: recomputing its KV resumes it where it stopped.

    A request that fails validation (empty prompt, ids outside the vocabulary, unsupported sampling)
    finishes at once with ``finish_reason="error"`` and its reason; the others go on. A batch that
    holds one request id twice is refused whole (`refuse_duplicate_ids`): every entry comes through here.

    A request with a prefix cache hit (``rec.cached``: its pages already hold the KV of its first ``c`` tokens,
    shared read-only pages) is extended over its tokens from position ``c`` only, attending the cached pages;
    its draft extend rows start at ``c`` too (the draft's KV of the cached positions is in those pages).
    """
    refuse_duplicate_ids(rec.requests)
    cached = _cached_lens(rec, ports)
    valid, refused = [], []
    for request in rec.requests:
        try:
            validate_request(request, ports.target.vocab_size, ports.detokenizer)
            if not request.sampling.greedy and draft_kind(ports) == "block":
                raise CycleError(
                    f"request {request.request_id}: temperature={request.sampling.temperature}; block drafts "
                    "verify greedily, pass temperature=0 or use another draft"
                )
            if request.sampling.constraint is not None:
                request = grammar.compile_request(request, ports)
            p = request.sampling
            if draft_kind(ports) == "block" and (p.adjusts_logits or not p.speculate or p.top_logprobs):
                raise CycleError(
                    f"request {request.request_id}: block drafts verify the raw greedy logits; penalties, logit "
                    "bias, bad words, a logits processor, speculate=False and top_logprobs need another draft"
                )
            valid.append(sampling.with_seed(request))
        except (CycleError, grammar.GrammarRefused) as err:
            refused.append(attrs.evolve(request, finish_reason="error", error=str(err)))
    if not valid:
        zeros = torch.zeros(len(refused), dtype=torch.long, device=_device(ports))
        extend = ExtendRows(input_ids=zeros[:0], positions=zeros[:0], row_request=zeros[:0], hidden=None)
        return Compacted(config=rec.config, requests=tuple(refused), seq_lens=zeros, root_tokens=zeros, extend=extend)
    done = _prefill_valid(
        attrs.evolve(rec, requests=tuple(valid), cached=tuple(cached[r.request_id] for r in valid)), ports, backend
    )
    if not refused:
        return done
    pad = torch.zeros(len(refused), dtype=torch.long, device=done.seq_lens.device)
    return attrs.evolve(
        done,
        requests=done.requests + tuple(refused),
        seq_lens=torch.cat([done.seq_lens, pad]),
        root_tokens=torch.cat([done.root_tokens, pad]),
    )


def _cached_lens(rec: Admitted, ports: Ports) -> dict[int, int]:
    """Each request's cached length (0 where ``rec.cached`` is empty), checked against its tokens and pages."""
    if not rec.cached:
        return {r.request_id: 0 for r in rec.requests}
    if len(rec.cached) != len(rec.requests):
        raise ValueError(f"Admitted.cached has {len(rec.cached)} lengths for {len(rec.requests)} requests")
    pool = ports.kv_pool
    for request, c in zip(rec.requests, rec.cached):
        n = len(request.tokens)
        if not 0 <= c < max(n, 1) or pool.pages_held(request.request_id) < math.ceil(c / pool.page_size):
            raise ValueError(
                f"request {request.request_id}: cached length {c} for {n} tokens and "
                f"{pool.pages_held(request.request_id)} pages: it must be below the token count and its pages must "
                "cover it (take it from the pool's attach_prefix)"
            )
    return {r.request_id: c for r, c in zip(rec.requests, rec.cached)}


def _prefill_valid(rec: Admitted, ports: Ports, backend) -> Compacted:
    cfg, target = rec.config, ports.target
    ids = tuple(r.request_id for r in rec.requests)
    offset = draft_offset(ports, cfg)
    lens = [len(r.tokens) for r in rec.requests]  # prompt + output: a resumed request recomputes both
    cached = list(rec.cached) if rec.cached else [0] * len(lens)
    reserve(ports.kv_pool, ids, [n + offset for n in lens])
    device = _device(ports)
    counts = [n - c for n, c in zip(lens, cached)]  # rows computed: the tokens past the cached prefix
    rows = sum(counts)
    # one copy to the device, not waited for (`core.transfer`): the host goes on while a cycle runs
    tokens = [t for r, c in zip(rec.requests, cached) for t in r.tokens[c:]]
    sent = to_device(lens + counts + cached + tokens, device)
    bs = len(lens)
    prompt_lens, row_counts = sent[:bs], sent[bs : 2 * bs]
    cached_lens, input_ids = sent[2 * bs : 3 * bs], sent[3 * bs :]
    row_request = torch.repeat_interleave(torch.arange(bs, device=device), row_counts, output_size=rows)
    starts = torch.cumsum(row_counts, 0) - row_counts
    positions = torch.arange(rows, device=device) - starts[row_request]
    if any(cached):
        positions = positions + cached_lens[row_request]
    page_table = ports.kv_pool.page_table(ids)
    out_slots = _row_slots(backend, page_table, row_request, positions, ports.kv_pool.page_size)
    last_rows = starts + row_counts - 1
    batch = _batch(
        ports, ids, input_ids, positions, row_request, out_slots, positions + 1, None, page_table, last_rows,
        prefill=True,
    )  # fmt: skip
    out = target.forward(batch)
    request_rows = torch.arange(len(lens), device=device)
    logits = row_logits.adjust(rec.requests, out.logits, request_rows)  # each prompt is its row's history
    first = _greedy(out, backend) if logits is out.logits else backend.greedy_predict(logits)  # [bs]
    if grammar.constrained(rec.requests):  # the first token under each request's grammar
        logits = backend.apply_token_mask(logits, grammar.next_masks(rec.requests, _words(ports), device))
        first = backend.greedy_predict(logits)
    first, logprobs = sampling.sample_first(rec.requests, logits, first, backend)  # sampled requests draw
    bad = _check_logits(out, request_rows, len(lens))

    requests = []
    reported = _reported(logprobs, len(lens), 1)
    for request, token, is_bad, lps in zip(rec.requests, first.tolist(), bad, reported):
        if is_bad:
            requests.append(_errored(request, "the target returned non-finite logits for the prompt"))
            continue
        keep, reason = cut_at_stops(request, [token], ports.detokenizer)
        _, stop, error = grammar.cut(request, [token])
        if error is not None:
            requests.append(_errored(request, error))
            continue
        request = grammar.advance(_with_logprobs(request, lps, 1), [token])
        requests.append(attrs.evolve(request, output=request.output + (token,), finish_reason=reason or stop))

    # Draft extend rows: shifted drafts see t[p + 1] at p, aligned drafts t[p] (root included).
    if offset == 0:
        next_ids = torch.cat([input_ids[1:], first[-1:]])
        next_ids[last_rows] = first
        extend = ExtendRows(
            input_ids=next_ids, positions=positions, row_request=row_request, hidden=out.hidden, prefill=True
        )
    else:
        extend = _aligned_prompt_rows(rec.requests, first, device, cached)
    return Compacted(
        config=cfg,
        requests=tuple(requests),
        seq_lens=prompt_lens,
        root_tokens=first,
        extend=extend,
    )


def _aligned_prompt_rows(requests: Sequence[Request], first: torch.Tensor, device, cached: Sequence[int]) -> ExtendRows:
    """The root and the tokens from each request's cached length ``c`` on, at positions ``c..n``."""
    tokens = [list(r.tokens[c:]) + [t] for r, t, c in zip(requests, first.tolist(), cached)]
    lens = torch.tensor([len(t) for t in tokens], dtype=torch.long, device=device)
    row_request = torch.repeat_interleave(torch.arange(len(tokens), device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    positions = torch.arange(int(lens.sum()), device=device) - starts[row_request]
    positions = positions + torch.tensor(list(cached), dtype=torch.long, device=device)[row_request]
    flat = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long, device=device)
    return ExtendRows(input_ids=flat, positions=positions, row_request=row_request, hidden=None, prefill=True)


def _reported(rows: sampling.RowLogprobs, bs: int, width: int) -> list[tuple[list, list, list]]:
    """Per request, its ``width`` rows' logprobs, top logprobs and top ids as lists (empty where not reported)."""

    def per_request(value, shape):
        return [[]] * bs if value is None else value.reshape(bs, *shape).tolist()

    n = 0 if rows.top_ids is None else rows.top_ids.shape[-1]
    return list(
        zip(
            per_request(rows.logprobs, (width,)),
            per_request(rows.top_logprobs, (width, n)),
            per_request(rows.top_ids, (width, n)),
        )
    )


def _with_logprobs(request: Request, reported: tuple[list, list, list], count: int) -> Request:
    """Append what ``count`` newly committed tokens report (`_reported`), as far as the request asked for it."""
    logprobs, top_values, top_ids = reported
    p = request.sampling
    if p.logprobs:
        request = attrs.evolve(request, logprobs=request.logprobs + tuple(float(x) for x in logprobs[:count]))
    if p.top_logprobs:
        top = tuple(
            tuple((int(t), float(v)) for t, v in zip(ids[: p.top_logprobs], values[: p.top_logprobs]) if v > -math.inf)
            for ids, values in zip(top_ids[:count], top_values[:count])
        )
        request = attrs.evolve(request, top_logprobs=request.top_logprobs + top)
    return request


def _words(ports: Ports) -> int:
    """Int32 words of a token bitmask over the target's vocabulary."""
    return grammar.mask_words(ports.target.vocab_size)


def _errored(request: Request, message: str) -> Request:
    return attrs.evolve(request, finish_reason="error", error=f"request {request.request_id}: {message}")


def _device(ports: Ports) -> torch.device:
    return target_device(ports)


# ---- retire ------------------------------------------------------------------------------------
def any_finished(rec: Compacted, ports: Ports) -> bool:
    return any(r.finish_reason is not None for r in rec.requests)


def none_finished(rec: Compacted, ports: Ports) -> bool:
    return not any_finished(rec, ports)


def retire(rec: Compacted, ports: Ports, backend) -> Compacted:
    """Finished requests leave the batch; every page they held is freed, once."""
    keep = [r.finish_reason is None for r in rec.requests]
    for request, kept in zip(rec.requests, keep):
        if not kept and ports.kv_pool.pages_held(request.request_id):  # refused requests never held pages
            ports.kv_pool.free(request.request_id)
        if not kept:
            ports.recurrent.free(request_id=request.request_id)
    device = rec.seq_lens.device
    keep_t = torch.tensor(keep, dtype=torch.bool, device=device)
    new_index = torch.cumsum(keep_t.long(), 0) - 1
    row_keep = keep_t[rec.extend.row_request]
    ext = rec.extend
    extend = ExtendRows(
        input_ids=ext.input_ids[row_keep],
        positions=ext.positions[row_keep],
        row_request=new_index[ext.row_request[row_keep]],
        hidden=None if ext.hidden is None else ext.hidden[row_keep],
        prefill=ext.prefill,
    )
    return attrs.evolve(
        rec,
        requests=tuple(r for r, k in zip(rec.requests, keep) if k),
        seq_lens=rec.seq_lens[keep_t],
        root_tokens=rec.root_tokens[keep_t],
        extend=extend,
        accept_len=None if rec.accept_len is None else rec.accept_len[keep_t],
        last_correct_step_indices=None
        if rec.last_correct_step_indices is None
        else rec.last_correct_step_indices[keep_t],
        retired=tuple(r for r, k in zip(rec.requests, keep) if not k),
    )


def retire_ready(rec: Ready, ports: Ports, backend) -> Ready:
    """Finished requests leave a `Ready` batch; every page they held is freed, once. A static cycle commits and
    runs the draft extend in one replay (`statemachine.static`), so its requests finish in a `Ready` record; a
    request cancelled between cycles (``finish_reason="cancelled"``, `Scheduler.cancel`) leaves the same way."""
    return _take_out(rec, [r.finish_reason is not None for r in rec.requests], ports)


def retracting(rec: Ready, ports: Ports) -> bool:
    """The engine names requests to take out, and none of the batch has finished (finished requests retire first)."""
    return bool(rec.retract) and none_finished(rec, ports)


def settled(rec: Ready, ports: Ports) -> bool:
    """No request of the batch has finished and none is to be retracted: the batch may draft."""
    return none_finished(rec, ports) and not rec.retract


def retract(rec: Ready, ports: Ports, backend) -> Ready:
    """The requests ``rec.retract`` names leave a `Ready` batch unfinished, their committed output kept; every page
    they held is freed, once. An engine short of KV pages takes requests out this way and queues them again: a
    readmission prefills prompt and output, which recomputes their KV (`prefill`)."""
    ids = set(rec.retract)
    unknown = ids - {r.request_id for r in rec.requests}
    if unknown:
        raise ValueError(f"Ready.retract names request ids {sorted(unknown)} that are not in the batch")
    return _take_out(rec, [r.request_id in ids for r in rec.requests], ports)


def _take_out(rec: Ready, leaving: list[bool], ports: Ports) -> Ready:
    """The `Ready` batch without the requests ``leaving`` marks, which go to ``retired`` with every page they held
    (KV and recurrent state) freed, once."""
    from .batching import select_ready

    gone = tuple(r for r, out in zip(rec.requests, leaving) if out)
    for request in gone:
        if ports.kv_pool.pages_held(request.request_id) or kv_knows(ports, request.request_id):
            ports.kv_pool.free(request.request_id)
        ports.recurrent.free(request_id=request.request_id)
    keep = [i for i, out in enumerate(leaving) if not out]
    return attrs.evolve(select_ready(rec, keep), retired=rec.retired + gone)


# ---- draft extend ------------------------------------------------------------------------------
def forward_draft(rec, ports: Ports) -> bool:
    return is_forward(ports)


def lookup_draft(rec, ports: Ports) -> bool:
    return draft_kind(ports) == "lookup"


def block_draft(rec, ports: Ports) -> bool:
    """A block draft (DFlash): one draft forward proposes the whole chain (`statemachine.block`)."""
    return draft_kind(ports) == "block"


def not_block_draft(rec, ports: Ports) -> bool:
    return not block_draft(rec, ports)


def defers(rec, ports: Ports) -> bool:
    """A cycle of ``S == 0`` over a draft that can compute its depth-1 top-K later from its hidden state
    (`core.ports.defers_first_level`): its draft extend skips the LM head and the top-K."""
    return not rec.config.drafts and defers_first_level(ports)


def extend_ready(rec: Compacted, ports: Ports) -> bool:
    return none_finished(rec, ports) and forward_draft(rec, ports) and not defers(rec, ports)


def extend_deferred(rec: Compacted, ports: Ports) -> bool:
    """A forward draft's extend in a cycle of ``S == 0`` that `defers` its top-K; no request finished."""
    return none_finished(rec, ports) and forward_draft(rec, ports) and defers(rec, ports)


def lookup_ready(rec: Compacted, ports: Ports) -> bool:
    return none_finished(rec, ports) and lookup_draft(rec, ports)


def block_ready(rec: Compacted, ports: Ports) -> bool:
    return none_finished(rec, ports) and block_draft(rec, ports)


def forward_draft_live(rec: Ready, ports: Ports) -> bool:
    """A forward draft, no request of the batch has finished (finished requests retire first), and a shape that
    drafts finds its depth-1 top-K computed (`first_level_due` runs first)."""
    return settled(rec, ports) and forward_draft(rec, ports) and not (rec.topk_pending and rec.config.drafts)


def first_level_due(rec: Ready, ports: Ports) -> bool:
    """A batch whose depth-1 top-K a cycle of ``S == 0`` deferred (`Ready.topk_pending`), now in a shape that drafts
    (``S >= 1``, `batching.reshape`): the top-K is computed before the draft."""
    return rec.topk_pending and rec.config.drafts and settled(rec, ports) and forward_draft(rec, ports)


def lookup_draft_live(rec: Ready, ports: Ports) -> bool:
    return settled(rec, ports) and lookup_draft(rec, ports)


def block_draft_live(rec: Ready, ports: Ports) -> bool:
    return settled(rec, ports) and block_draft(rec, ports)


def speculating(requests: Sequence[Request]) -> list[int] | None:
    """The batch indices of the requests that speculate, or None when all do (`SamplingParams.speculate`)."""
    if all(r.sampling.speculate for r in requests):
        return None
    return [b for b, r in enumerate(requests) if r.sampling.speculate]


def _scatter_rows(value: torch.Tensor | None, index: torch.Tensor, bs: int) -> torch.Tensor | None:
    """``value [m, ...]`` at rows ``index`` of a zero ``[bs, ...]`` tensor (None stays None)."""
    if value is None:
        return None
    full = value.new_zeros((bs, *value.shape[1:]))
    full[index] = value
    return full


def draft_extend(rec: Compacted, ports: Ports, backend) -> Ready:
    """The draft runs over the newly committed tokens; its last row per request gives depth 1.

    Requests with ``speculate=False`` take no part: the draft runs over the others' rows alone, and their
    `Ready` rows are zeros the draft never reads.
    """
    return _extend_speculating(rec, ports, backend, logits=True)


def draft_extend_deferred(rec: Compacted, ports: Ports, backend) -> Ready:
    """`draft_extend` in a cycle of ``S == 0`` that `defers` the top-K: the draft's layers over the newly committed
    tokens (its KV, and the hidden state of each request's last row) without its LM head; the `Ready` record's
    top-K is pending (`Ready.topk_pending`) until `first_level` computes it from that hidden state."""
    return _extend_speculating(rec, ports, backend, logits=False)


def _extend_speculating(rec: Compacted, ports: Ports, backend, logits: bool) -> Ready:
    bs = len(rec.requests)
    spec = speculating(rec.requests)
    if bs == 0 or spec == []:
        return _ready(rec, None, None, None)
    if spec is None:
        return _draft_extend(rec, ports, backend, logits)
    device = rec.seq_lens.device
    index = torch.tensor(spec, dtype=torch.long, device=device)
    where = torch.full((bs,), -1, dtype=torch.long, device=device)
    where[index] = torch.arange(len(spec), device=device)
    ext = rec.extend
    keep = (where[ext.row_request] >= 0).nonzero()[:, 0]
    sub_extend = ExtendRows(
        input_ids=ext.input_ids[keep],
        positions=ext.positions[keep],
        row_request=where[ext.row_request[keep]],
        hidden=None if ext.hidden is None else ext.hidden[keep],
        prefill=ext.prefill,
    )
    sub = attrs.evolve(
        rec,
        requests=tuple(rec.requests[b] for b in spec),
        seq_lens=rec.seq_lens[index],
        root_tokens=rec.root_tokens[index],
        extend=sub_extend,
    )
    ready = _draft_extend(sub, ports, backend, logits)
    return _ready(
        rec,
        _scatter_rows(ready.topk_p, index, bs),
        _scatter_rows(ready.topk_index, index, bs),
        _scatter_rows(ready.draft_hidden, index, bs),
        _scatter_rows(ready.draft_probs, index, bs),
        pending=not logits,
    )


def _draft_extend(rec: Compacted, ports: Ports, backend, logits: bool = True) -> Ready:
    cfg, bs = rec.config, len(rec.requests)
    ids = tuple(r.request_id for r in rec.requests)
    ext = rec.extend
    page_table = ports.kv_pool.page_table(ids)
    out_slots = _row_slots(backend, page_table, ext.row_request, ext.positions, ports.kv_pool.page_size)
    ones = torch.ones_like(ext.row_request)
    counts = torch.zeros(bs, dtype=torch.long, device=ext.row_request.device).index_add_(0, ext.row_request, ones)
    last_rows = torch.cumsum(counts, 0) - 1  # a count without `bincount`: no wait for the device
    batch = _batch(
        ports,
        ids,
        ext.input_ids,
        ext.positions,
        ext.row_request,
        out_slots,
        ext.positions + 1,
        None,
        page_table,
        last_rows,
        prefill=ext.prefill,
    )
    if not logits:  # the layers alone: the draft's KV and hidden state stay current, the top-K waits
        hidden = ports.draft.extend_hidden(batch, ext.hidden)
        return _ready(rec, None, None, hidden.index_select(0, last_rows), pending=True)
    out = ports.draft.extend(batch, ext.hidden)
    topk_p, topk_index, draft_probs = _depth_one(rec.requests, cfg, out, ports, backend)
    hidden = None if out.hidden is None else out.hidden.index_select(0, last_rows)
    return _ready(rec, topk_p, topk_index, hidden, draft_probs)


def _depth_one(requests, cfg: SpecConfig, out: ModelOutput, ports: Ports, backend):
    """The depth-1 candidates of ``out``'s logits (one row per request): ``(topk_p, topk_index, draft_probs)``. The
    logits take the requests' history-dependent changes and a constrained request's grammar mask after its committed
    tokens; greedy rows take the top-K, sampled rows draw K children from q (``draft_probs``: their q)."""
    bs = len(requests)
    rows = sampling.sampled_rows(requests, out.logits.device)
    _refuse_draft_vocabulary_when_sampled(out, rows)
    logits = _draft_adjust(requests, out, torch.arange(bs, device=out.logits.device), None)
    if grammar.constrained(requests):  # depth-1 candidates the grammar allows after the committed tokens
        masks = grammar.draft_masks(requests, _words(ports), logits.device)
        logits = backend.apply_token_mask(logits, masks, out.vocab_map)
    if rows is None and logits is out.logits and out.topk is not None and out.topk[1].shape[-1] == cfg.topk:
        topk_p, topk_index = out.topk  # taken inside the port's forward (`ModelOutput.topk`)
    else:
        topk_p, topk_index = backend.select_topk(logits, cfg.topk, out.vocab_map)
    if cfg.draft_floor:  # a chain cut by confidence: the top token's probability (`floor_widths`)
        topk_p = backend.top1_probability(logits)[:, None]
    draft_probs = None
    if rows is not None:  # sampled requests draw their depth-1 candidates from q, without replacement
        topk_p, topk_index, draft_probs = sampling.draw_children(rows, logits, 1, topk_p, topk_index, 0, backend)
    return topk_p, topk_index, draft_probs


def first_level(rec: Ready, ports: Ports, backend) -> Ready:
    """The depth-1 top-K a cycle of ``S == 0`` deferred (`draft_extend_deferred`), for a batch now in a shape that
    drafts: the draft's logits from each speculating request's hidden state (``logits_from_hidden``: exactly those
    its extend computes) through `_depth_one`, as the full extend takes them. Nothing else of the record changes."""
    bs = len(rec.requests)
    spec = speculating(rec.requests)
    if bs == 0 or spec == [] or rec.draft_hidden is None:
        return attrs.evolve(rec, topk_pending=False)
    index = None if spec is None else torch.tensor(spec, dtype=torch.long, device=rec.draft_hidden.device)
    requests = rec.requests if spec is None else tuple(rec.requests[b] for b in spec)
    hidden = rec.draft_hidden if index is None else rec.draft_hidden.index_select(0, index)
    out = ports.draft.logits_from_hidden(hidden)
    topk_p, topk_index, draft_probs = _depth_one(requests, rec.config, out, ports, backend)
    if index is not None:
        topk_p, topk_index = _scatter_rows(topk_p, index, bs), _scatter_rows(topk_index, index, bs)
        draft_probs = _scatter_rows(draft_probs, index, bs)
    return attrs.evolve(rec, topk_p=topk_p, topk_index=topk_index, draft_probs=draft_probs, topk_pending=False)


def _draft_adjust(requests, out: ModelOutput, row_request: torch.Tensor, paths) -> torch.Tensor:
    """The draft's logits after the requests' history-dependent changes (`statemachine.logits`), so that it
    proposes what the target will see; not for a draft over its own vocabulary (``vocab_map``: left as is,
    which costs acceptance, never exactness)."""
    if out.vocab_map is not None:
        return out.logits
    return row_logits.adjust(requests, out.logits, row_request, paths)


def skip_extend(rec: Compacted, ports: Ports, backend) -> Ready:
    """Lookup drafts keep no draft cache: nothing to extend."""
    return _ready(rec, None, None, None)


def _ready(rec: Compacted, topk_p, topk_index, hidden, draft_probs=None, pending: bool = False) -> Ready:
    return Ready(
        config=rec.config,
        requests=rec.requests,
        seq_lens=rec.seq_lens,
        root_tokens=rec.root_tokens,
        topk_p=topk_p,
        topk_index=topk_index,
        draft_hidden=hidden,
        retired=rec.retired,
        draft_probs=draft_probs,
        topk_pending=pending,
    )


# ---- draft -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _cycle_offsets(n: int, num_steps: int, topk: int, offset: int, device: torch.device) -> torch.Tensor:
    """Positions past ``L`` whose slots a cycle looks up: the ``N`` verify rows, then the draft scratch
    (`draft_scratch_positions` less ``L``, flattened). ``[N + (S - 1) K]`` (shared, read-only)."""
    return torch.cat([torch.arange(n, device=device), draft_scratch_offsets(num_steps, topk, offset, device).flatten()])


def _reserve_cycle(
    rec: Ready, ports: Ports, backend, scratch: int | None = None
) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reserve the cycle's slots. Returns the ids, the page table, the verify rows' slots ``[bs, N]`` and,
    given the draft's scratch ``offset``, the slots of `draft_scratch_positions` ``[bs, S - 1, K]`` (one
    lookup for both)."""
    cfg = rec.config
    ids = tuple(r.request_id for r in rec.requests)
    extra = cfg.reserve_len(draft_pairing(ports))  # lookup and block drafts: "shifted"
    reserve(ports.kv_pool, ids, [length + extra for length in rec.seq_lens.tolist()])
    page_table = ports.kv_pool.page_table(ids)
    n, L = cfg.num_draft_tokens, rec.seq_lens
    if scratch is None:
        positions = L[:, None] + shapes.arange(n, L.device)
        return ids, page_table, backend.slots_for_positions(page_table, positions, ports.kv_pool.page_size), None
    positions = L[:, None] + _cycle_offsets(n, cfg.num_steps, cfg.topk, scratch, L.device)
    slots = backend.slots_for_positions(page_table, positions, ports.kv_pool.page_size)
    return ids, page_table, slots[:, :n], slots[:, n:].view(L.shape[0], max(cfg.num_steps - 1, 0), cfg.topk)


def _refuse_draft_vocabulary_when_sampled(out: ModelOutput, rows) -> None:
    """Sampling draws from ``q`` over the target vocabulary; logits over a draft's own (``vocab_map``) are not it."""
    if out.vocab_map is not None and rows is not None:
        raise ValueError("a sampled draft needs logits over the target vocabulary (ModelOutput.vocab_map set)")


def floor_widths(
    confidence: torch.Tensor, floor: float, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain's verify rows per request at ``floor`` (`SpecConfig.draft_floor`): ``1 + #{d : c_1 ... c_d >= floor}``
    for ``confidence [bs, S]`` (each depth's top-1 probability, the backend's ``top1_probability``), every row where
    ``keep [bs]`` (sampled requests); and the chain's scores ``[bs, S + 1]`` (`DraftTree.scores`: the products, root
    1). The products never grow (each factor is at most 1): a prefix of rows stays. Returns ``(widths, scores)``."""
    scores = torch.cat([torch.ones_like(confidence[:, :1], dtype=torch.float32), confidence.float().cumprod(1)], 1)
    widths = 1 + (scores[:, 1:] >= floor).long().sum(1)
    if keep is not None:
        widths = torch.where(keep, confidence.shape[1] + 1, widths)
    return widths, scores


def draft_levels(
    ports: Ports,
    backend,
    cfg: SpecConfig,
    ids: tuple[int, ...],
    L: torch.Tensor,
    page_table: torch.Tensor,
    draft_slots: torch.Tensor,
    topk_p: torch.Tensor,
    topk_index: torch.Tensor,
    draft_hidden: torch.Tensor | None,
    rows=None,
    draft_probs: torch.Tensor | None = None,
    frontier_masks: grammar.FrontierMasks | None = None,
    requests: Sequence[Request] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``S - 1`` draft forwards of `draft_tree`: every candidate level, EAGLE-2 rescored.

    Returns ``cand_tokens, cand_scores, cand_parents [bs, C]`` (level order, ``C = K + (S - 1) K^2``;
    a chain: ``C = S`` tokens, and scores ``[bs, S]``, each depth's top-1 probability, under ``draft_floor``, else
    ``[bs, 1]``) and ``draft_positions [bs, S - 1]``. Greedy (``rows`` None), it has no host
    sync and no data-dependent shape, so an engine may capture it whole in a CUDA graph; sampled
    ``rows`` draw children and fill ``draft_probs`` in place. ``requests`` whose logits depend on their
    history (`statemachine.logits`) have each node's logits changed by its path first, as the verify will.
    (It builds its index tensors itself, none from `core.shapes`: a tensor first made inside a graph
    capture must not outlive it in a cache.)
    """
    adjusting = requests is not None and row_logits.any_adjusts(requests)
    S, K = cfg.num_steps, cfg.topk
    bs, device = L.shape[0], L.device
    offset = draft_offset(ports, cfg)
    row_request = torch.arange(bs, device=device)
    prefix_lens = L + offset
    if K > 1:  # K rows per request (expand and flatten: the same as repeat_interleave, cheaper on a CPU), made
        # contiguous once here: kernels read them at `ptr + row`, and at batch 1 the flattened view has stride 0,
        # which every level's attention copied again (two launches a level inside the fused cycle's graph)
        row_request = row_request[:, None].expand(bs, K).reshape(-1).contiguous()
        prefix_lens = prefix_lens[:, None].expand(bs, K).reshape(-1).contiguous()
    frontier_scores, frontier_tokens = topk_p, topk_index  # [bs, K]
    parent_hidden = None
    if draft_hidden is not None:
        parent_hidden = draft_hidden[:, None, :].expand(bs, K, draft_hidden.shape[-1])
    cand_tokens, cand_scores, cand_parents = (
        [frontier_tokens],
        [frontier_scores],
        [torch.full_like(frontier_tokens, -1)],
    )
    frontier_cand = torch.arange(K, device=device).expand(bs, K)
    frontier_paths = frontier_tokens[:, :, None] if adjusting else None  # [bs, K, depth]: each node's draft path
    positions_per_step = []
    if K > 1 and S > 1:
        # every frontier node's draft KV slots, root side first, its own last (`advance_frontier` extends them)
        path_slots = draft_slots[:, 0, :, None]  # [bs, K, 1]
        # every level's row positions at once, L + j + offset (row j contiguous: a port may read it flat)
        level_positions = prefix_lens[None, :] + torch.arange(S - 1, device=device)[:, None]  # [S - 1, bs * K]
    for j in range(S - 1):
        if K == 1:  # a chain's path is every level's slot so far. Contiguous: a port's kernel may read
            # them as flat arrays (the fused KV write does), and these are column slices of draft_slots.
            positions = draft_position(L, j + 1, offset)  # [bs]; computed, never advanced in place
            positions_per_step.append(positions)
            own, extra = draft_slots[:, j, 0].contiguous(), draft_slots[:, : j + 1, 0].contiguous()
        else:
            positions = level_positions[j]  # L + j + offset, K rows per request
            own = draft_slots[:, j, :]  # [bs, K]
            extra = path_slots.reshape(bs * K, j + 1)  # [bs * K, j + 1]: ancestors' and own
        # A sampled draft that ran out of mass left -1 (padding): any valid id feeds the forward.
        input_ids = frontier_tokens.reshape(-1) if rows is None else frontier_tokens.reshape(-1).clamp(min=0)
        batch = _batch(
            ports,
            ids,
            input_ids,
            positions,
            row_request,
            own.reshape(-1),
            prefix_lens,
            extra,
            page_table,
        )
        out = ports.draft.step(batch, None if parent_hidden is None else parent_hidden.reshape(bs * K, -1))
        _refuse_draft_vocabulary_when_sampled(out, rows)
        logits = out.logits
        if adjusting:
            logits = _draft_adjust(requests, out, row_request, frontier_paths.reshape(bs * K, -1))
        if frontier_masks is not None:  # each frontier node's children: what the grammar allows after its branch
            masks = frontier_masks.level(cand_tokens, cand_parents, frontier_cand)
            logits = backend.apply_token_mask(logits, masks, out.vocab_map)
        # [bs*K, K]; logits over the draft's own vocabulary (`vocab_map`) give the target's ids
        child_p, child_ids = backend.select_topk(logits, K, out.vocab_map)
        if rows is not None:
            child_p, child_ids, q = sampling.draw_children(
                rows, logits, K, child_p, child_ids, j + 1, backend, parent_tokens=frontier_tokens.reshape(-1)
            )
            sampling.store_rows(draft_probs, q.view(bs, K, -1), frontier_cand + 1 if K > 1 else frontier_cand + 1 + j)
        if K == 1:  # a chain: the child is the next frontier, nothing to rescore
            if cfg.draft_floor:  # the child's probability, for the verify's cut (`floor_widths`)
                cand_scores.append(backend.top1_probability(logits)[:, None])
            frontier_tokens = child_ids
            if adjusting:
                frontier_paths = torch.cat([frontier_paths, child_ids[:, :, None]], 2)
            cand_tokens.append(child_ids)
            if out.hidden is not None:
                parent_hidden = out.hidden.view(bs, 1, -1)
            continue
        child_p, child_ids = child_p.view(bs, K, K), child_ids.view(bs, K, K)
        # EAGLE-2 rescoring and the next level's frontier, paths and parent states (`core.tree.advance_frontier`)
        level = backend.advance_frontier(
            frontier_scores, child_p, child_ids, frontier_cand, K + j * K * K, path_slots, out.hidden,
            draft_slots[:, j + 1, :] if j + 2 < S else None, K,
        )  # fmt: skip
        if adjusting:  # the kept children's paths: their parent's, then their own token
            depth = frontier_paths.shape[2]
            children = torch.cat([frontier_paths[:, :, None, :].expand(bs, K, K, depth), child_ids[..., None]], 3)
            keep = (level.cand - (K + j * K * K))[:, :, None].expand(bs, K, depth + 1)
            frontier_paths = children.reshape(bs, K * K, depth + 1).gather(1, keep)
        cand_tokens.append(child_ids.reshape(bs, K * K))
        cand_scores.append(level.cum)
        cand_parents.append(level.parents)
        frontier_scores, frontier_tokens, frontier_cand, path_slots = level.scores, level.tokens, level.cand, level.path
        if level.hidden is not None:
            parent_hidden = level.hidden
    if positions_per_step:
        draft_positions = torch.stack(positions_per_step, 1)
    elif K > 1 and S > 1:
        draft_positions = level_positions[:, ::K].t()  # [bs, S - 1]: L + j + offset (a view: the fused cycle drops it)
    else:
        draft_positions = torch.empty((bs, 0), dtype=torch.long, device=device)
    if K == 1:  # a chain's scores: each depth's probability with a floor (`floor_widths`), else the first's
        scores = torch.cat(cand_scores, 1) if cfg.draft_floor else cand_scores[0]
        return torch.cat(cand_tokens, 1), scores, cand_parents[0], draft_positions
    return torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1), torch.cat(cand_parents, 1), draft_positions


def draft_tree(rec: Ready, ports: Ports, backend) -> Drafted:
    """``S - 1`` draft forwards over the frontier, EAGLE-2 rescoring, global rerank to ``N - 1``.

    Sampled requests draw each node's children without replacement from ``q`` and keep their tree in
    level order, never reranked (`statemachine.sampling`); their ``q`` per row goes to the verify.
    Requests with ``speculate=False`` get no draft forward: their tree is the root and ``N - 1`` padding
    rows (`DraftTree.widths` 1), which the verify forward skips.
    """
    cfg = rec.config
    S = cfg.num_steps
    L, device = rec.seq_lens, rec.seq_lens.device
    offset = draft_offset(ports, cfg)
    # draft_slots [bs, S-1, K]: the slots of draft_scratch_positions(L, S, K, offset)
    ids, page_table, verify_slots, draft_slots = _reserve_cycle(rec, ports, backend, offset)
    if not cfg.drafts:  # S == 0: the root alone (a plain decode step); the draft's state waits for the next shape
        bs, rows = len(rec.requests), sampling.sampled_rows(rec.requests, device)
        root = DraftTree(tokens=rec.root_tokens[:, None], parents=shapes.chain_parents(bs, 1, device),
                         depths=shapes.chain_depths(bs, 1, device))  # fmt: skip
        probs = None if rows is None or rec.draft_probs is None else rec.draft_probs[:, None]
        masks = None  # a grammar masks the root row too (the grammar after the committed tokens)
        if grammar.constrained(rec.requests):
            masks = grammar.row_masks(rec.requests, root.tokens, root.parents, None, _words(ports))
        return Drafted(config=cfg, requests=rec.requests, seq_lens=L, tree=root, verify_slots=verify_slots,
                       draft_slots=draft_slots, draft_positions=shapes.no_extra_slots(bs, device),
                       draft_probs=probs, token_masks=masks)  # fmt: skip
    spec = speculating(rec.requests)
    if spec is None:
        tree, draft_probs, draft_positions = _draft_rows(rec, ports, backend, ids, page_table, draft_slots)
    else:
        index = torch.tensor(spec, dtype=torch.long, device=device)
        sub = attrs.evolve(
            rec,
            requests=tuple(rec.requests[b] for b in spec),
            seq_lens=L[index],
            root_tokens=rec.root_tokens[index],
            topk_p=None if rec.topk_p is None else rec.topk_p[index],
            topk_index=None if rec.topk_index is None else rec.topk_index[index],
            draft_hidden=None if rec.draft_hidden is None else rec.draft_hidden[index],
            draft_probs=None if rec.draft_probs is None else rec.draft_probs[index],
        )
        sub_ids = tuple(ids[b] for b in spec)
        part = _draft_rows(sub, ports, backend, sub_ids, page_table[index], draft_slots[index]) if spec else None
        tree, draft_probs = _with_resting(rec, cfg, index, part)
        draft_positions = L[:, None] + offset + torch.arange(S - 1, device=device)[None, :]
    masks = None
    if grammar.constrained(rec.requests):  # each verify row's mask: the grammar after the path to its node
        masks = grammar.row_masks(rec.requests, tree.tokens, tree.parents, tree.padding, _words(ports))
    return Drafted(
        config=cfg,
        requests=rec.requests,
        seq_lens=L,
        tree=tree,
        verify_slots=verify_slots,
        draft_slots=draft_slots,
        draft_positions=draft_positions.contiguous(),
        draft_probs=draft_probs,
        token_masks=masks,
    )


def _draft_rows(rec: Ready, ports: Ports, backend, ids, page_table, draft_slots):
    """The draft forwards and the tree of every request of ``rec`` (all speculate): ``(DraftTree, draft_probs,
    draft_positions)``."""
    cfg, bs = rec.config, len(rec.requests)
    K, N = cfg.topk, cfg.num_draft_tokens
    L, device = rec.seq_lens, rec.seq_lens.device
    rows = sampling.sampled_rows(rec.requests, device)
    draft_probs = None  # [bs, N, V]: q of each verify row, for the sampled requests
    if rows is not None:
        if rec.draft_probs is None:
            raise CycleError("sampled requests reached the draft without the draft extend's draft_probs")
        draft_probs = rec.draft_probs.new_zeros((bs, N, rec.draft_probs.shape[-1]))
        draft_probs[:, 0] = rec.draft_probs
    levels = (ports, backend, cfg, ids, L, page_table, draft_slots, rec.topk_p, rec.topk_index, rec.draft_hidden)
    masked = grammar.constrained(rec.requests)
    frontier = grammar.FrontierMasks(rec.requests, _words(ports), K) if masked else None
    # A draft may run the greedy loop as one captured CUDA graph (engine.fast.path), calling draft_levels itself.
    adjusting = row_logits.any_adjusts(rec.requests)
    masked = grammar.constrained(rec.requests)
    frontier = grammar.FrontierMasks(rec.requests, _words(ports), K) if masked else None
    graphed = graphed_draft_levels(ports) if rows is None and not adjusting and not masked else None
    if graphed is not None:
        cand_tokens, cand_scores, cand_parents, draft_positions = graphed(draft_levels, *levels)
    else:
        cand_tokens, cand_scores, cand_parents, draft_positions = draft_levels(
            *levels, rows, draft_probs, frontier, rec.requests if adjusting else None
        )

    if K == 1:
        tokens = torch.cat([rec.root_tokens[:, None], cand_tokens], dim=1)  # `chain_tree`, parents shared
        parents, depths, scores = shapes.chain_parents(bs, N, device), shapes.chain_depths(bs, N, device), None
    else:
        cands = (rec.root_tokens, cand_tokens, cand_scores, cand_parents, N)
        tokens, parents, scores = backend.rerank_tree(*cands)
        if rows is not None:  # sampled requests: level order, no rerank (a rerank makes the verify lossy)
            sampled = torch.zeros(bs, dtype=torch.bool, device=device).index_fill_(0, rows.index, True)[:, None]
            s_tokens, s_parents, s_scores = sampling.level_order_tree(*cands)
            tokens = torch.where(sampled, s_tokens, tokens)
            parents = torch.where(sampled, s_parents, parents)
            scores = torch.where(sampled, s_scores, scores)
        depths = tree_depths(parents)
    padding = widths = None
    if rows is not None and bool((tokens < 0).any()):
        padding, tokens = tokens < 0, tokens.clamp(min=0)
    if K == 1 and cfg.draft_floor:  # rows past the draft's confidence are padding the verify skips
        sampled = None
        if rows is not None:
            sampled = torch.zeros(bs, dtype=torch.bool, device=device).index_fill_(0, rows.index, True)
        widths, scores = floor_widths(cand_scores, cfg.draft_floor, sampled)
        cut = shapes.arange(N, device)[None, :] >= widths[:, None]
        padding = cut if padding is None else padding | cut
    tree = DraftTree(tokens=tokens, parents=parents, depths=depths, scores=scores, padding=padding, widths=widths)
    return tree, draft_probs, draft_positions


def _with_resting(rec, cfg: SpecConfig, index: torch.Tensor, part) -> tuple[DraftTree, torch.Tensor | None]:
    """The batch's tree when only the requests at ``index`` speculated (``part``: their `_draft_rows`, None
    when none did): the others keep the root and ``N - 1`` padding rows (width 1), under the root in a tree
    and as the chain in a chain; their ``draft_probs`` rows are zero."""
    bs, N = len(rec.requests), cfg.num_draft_tokens
    device = rec.seq_lens.device
    tokens = torch.zeros((bs, N), dtype=torch.long, device=device)
    tokens[:, 0] = rec.root_tokens
    widths = torch.ones(bs, dtype=torch.long, device=device)
    widths[index] = N
    padding = (torch.arange(N, device=device)[None, :] >= widths[:, None]).clone()
    if cfg.is_chain:
        parents, depths, scores = shapes.chain_parents(bs, N, device), shapes.chain_depths(bs, N, device), None
    else:
        parents = torch.zeros((bs, N), dtype=torch.long, device=device)
        parents[:, 0] = -1
        scores = torch.zeros((bs, N), dtype=torch.float32, device=device)
        scores[:, 0] = 1.0
    draft_probs = None
    if part is not None:
        sub_tree, sub_probs, _ = part
        tokens[index] = sub_tree.tokens
        if not cfg.is_chain:
            parents[index] = sub_tree.parents
            scores[index] = sub_tree.scores.to(scores.dtype)
        elif sub_tree.scores is not None:  # a chain cut by draft_floor: its scores (the resting rows' ones)
            scores = torch.ones((bs, N), dtype=torch.float32, device=device)
            scores[index] = sub_tree.scores.to(scores.dtype)
        if sub_tree.padding is not None:
            padding[index] = sub_tree.padding
        if sub_tree.widths is not None:
            widths[index] = sub_tree.widths
        draft_probs = _scatter_rows(sub_probs, index, bs)
    if not cfg.is_chain:
        depths = tree_depths(parents)
    tree = DraftTree(tokens=tokens, parents=parents, depths=depths, scores=scores, padding=padding, widths=widths)
    return tree, draft_probs


def lookup_tree(rec: Ready, ports: Ports, backend) -> Drafted:
    """A lookup draft proposes up to ``N - 1`` nodes from each request's token history.

    It may propose fewer (the same number for the whole batch): with no match, the verify is one row
    per request, as costly as a plain decode step, instead of ``N`` rows of padding.
    """
    cfg, bs = rec.config, len(rec.requests)
    ids, _, verify_slots, _ = _reserve_cycle(rec, ports, backend)
    device = rec.seq_lens.device
    spec = speculating(rec.requests)
    asked = list(range(bs)) if spec is None else spec  # requests with speculate=False are not asked
    histories = [rec.requests[b].tokens for b in asked]
    if asked:
        tokens, parents = ports.draft.propose(
            tuple(ids[b] for b in asked), histories, cfg.num_steps, cfg.num_draft_tokens - 1, cfg.topk
        )
    else:
        tokens = parents = torch.empty((0, 0), dtype=torch.long, device=device)
    m = len(asked)
    if tokens.shape != parents.shape or tokens.shape[0] != m or tokens.shape[1] > cfg.num_draft_tokens - 1:
        raise CycleError(
            f"the lookup draft proposed tokens {tuple(tokens.shape)} / parents {tuple(parents.shape)}; "
            f"expected the same shape [bs={m}, n <= N - 1 = {cfg.num_draft_tokens - 1}]"
        )
    n = tokens.shape[1]
    widths = padding = None
    if spec is not None:  # the others: n padding rows (width 1), a chain in a chain, under the root in a tree
        index = torch.tensor(spec, dtype=torch.long, device=tokens.device)
        rest_parents = torch.arange(n, device=tokens.device).expand(bs, n) if cfg.is_chain else None
        full_tokens = torch.zeros((bs, n), dtype=tokens.dtype, device=tokens.device)
        full_parents = rest_parents.clone() if rest_parents is not None else full_tokens.clone()
        full_tokens[index], full_parents[index] = tokens, parents
        tokens, parents = full_tokens, full_parents
        widths = torch.ones(bs, dtype=torch.long, device=device)
        widths[index.to(device)] = n + 1
        padding = shapes.arange(n + 1, device)[None, :] >= widths[:, None]
    if tokens.numel():  # one copy back: the least and largest token, the least parent, row - parent
        gaps = shapes.arange(n, parents.device) - parents  # >= 0: each parent precedes its node (row i + 1)
        lo, hi, parent_lo, gap = torch.stack([tokens.min(), tokens.max(), parents.min(), gaps.min()]).tolist()
    if tokens.numel() and not (0 <= lo and hi < ports.target.vocab_size and parent_lo >= 0 and gap >= 0):
        raise CycleError(
            f"the lookup draft proposed token ids outside [0, {ports.target.vocab_size}) or a parent that does "
            "not precede its node: a draft must share the target's vocabulary and list parents first"
        )
    tokens = torch.cat([rec.root_tokens[:, None], tokens.to(device)], dim=1)
    parents = torch.cat([torch.full_like(rec.root_tokens[:, None], -1), parents.to(device)], dim=1)
    masks = None
    if grammar.constrained(rec.requests):  # proposals the grammar refuses are dead rows: never accepted, so the
        masks, live = grammar.row_masks(rec.requests, tokens, parents, padding, _words(ports), live=True)
        n = max(i for i in range(n + 1) if any(row[i] for row in live))  # rows past the last live one go
        tokens, parents, masks = tokens[:, : n + 1], parents[:, : n + 1], masks[:, : n + 1]
        if widths is not None:
            padding, widths = padding[:, : n + 1], widths.clamp(max=n + 1)
    verify_slots = verify_slots[:, : n + 1]
    chain = shapes.chain_parents(bs, n + 1, device)
    if torch.equal(parents, chain):  # the shared chain: the verify takes the chain walk
        parents, depths = chain, shapes.chain_depths(bs, n + 1, device)
    else:
        depths = tree_depths(parents)
    return Drafted(
        config=cfg,
        requests=rec.requests,
        seq_lens=rec.seq_lens,
        tree=DraftTree(tokens=tokens, parents=parents, depths=depths, padding=padding, widths=widths),
        verify_slots=verify_slots,
        draft_slots=shapes.no_extra_slots(bs, device).view(bs, 0, 1).expand(bs, 0, cfg.topk),
        draft_positions=shapes.no_extra_slots(bs, device),
        token_masks=masks,
    )


# ---- verify ------------------------------------------------------------------------------------
def target_verify_forward(rec: Drafted, ports: Ports, mask: torch.Tensor) -> tuple[ModelOutput, torch.Tensor]:
    """The target forward over every verify row (``[bs * N]``) at ``L + depth``; ``mask [bs, N, N]`` says which
    of its request's verify rows each row sees besides the prefix. Returns the output and ``row_request``."""
    bs, N = rec.tree.tokens.shape
    ids = tuple(r.request_id for r in rec.requests)
    L, device = rec.seq_lens, rec.seq_lens.device
    extra = torch.where(mask, rec.verify_slots[:, None, :], -1).reshape(bs * N, N)
    row_request = shapes.repeat_rows(bs, N, device)
    batch = _batch(
        ports,
        ids,
        rec.tree.tokens.reshape(-1),
        (L[:, None] + rec.tree.depths).reshape(-1),
        row_request,
        rec.verify_slots.reshape(-1),
        L.index_select(0, row_request),
        extra,
        ports.kv_pool.page_table(ids),
    )
    widths = rec.tree.widths
    if widths is None:
        return ports.target.forward(batch), row_request
    # Rows past a request's width (speculate=False: all but the root) are not run: a ragged forward, its
    # outputs put back at their flat rows (zeros at the skipped ones, which no walk accepts).
    kept = (shapes.arange(N, device)[None, :] < widths[:, None]).reshape(-1).nonzero()[:, 0]
    ragged = attrs.evolve(
        batch,
        input_ids=batch.input_ids[kept],
        positions=batch.positions[kept],
        row_request=row_request[kept],
        out_slots=batch.out_slots[kept],
        prefix_lens=batch.prefix_lens[kept],
        extra_slots=batch.extra_slots[kept],
    )
    out = ports.target.forward(ragged)
    full = ModelOutput(logits=_scatter_rows(out.logits, kept, bs * N), hidden=_scatter_rows(out.hidden, kept, bs * N))
    # the port's own reductions, where it handed them over (the host plane: on the host, beside the records)
    if out.greedy is not None:
        full = attrs.evolve(full, greedy=_scatter_rows(out.greedy, kept.to(out.greedy.device), bs * N))
    if out.finite is not None:  # a skipped row has no logit to be non-finite
        finite = torch.ones(bs * N, dtype=torch.bool, device=out.finite.device)
        full = attrs.evolve(full, finite=finite.index_copy_(0, kept.to(finite.device), out.finite))
    return full, row_request


def verify(rec: Drafted, ports: Ports, backend) -> Verified:
    """One target forward over ``[root, drafts]`` at ``L + depth`` with the tree mask; greedy walk.

    Sampled requests replace their greedy walk with lossless rejection sampling (chain or tree) against
    their processed target distribution (`statemachine.sampling.verify_sampled`).
    """
    cfg, bs = rec.config, len(rec.requests)
    N = rec.tree.tokens.shape[1]  # cfg.num_draft_tokens, or fewer when a lookup draft had less to offer
    L, device = rec.seq_lens, rec.seq_lens.device
    if cfg.is_chain:  # row i sees rows 0..i
        mask = shapes.chain_mask(N, device).expand(bs, N, N)
    else:
        mask = backend.tree_mask(rec.tree.parents)  # [bs, N, N]
    out, row_request = target_verify_forward(rec, ports, mask)
    # each row's logits as autoregressive decoding would see them after its path (`statemachine.logits`), then
    # the grammar's mask: row d's mask is the grammar after the path to node d
    logits = out.logits
    if row_logits.any_adjusts(rec.requests):
        logits = row_logits.adjust(rec.requests, logits, row_request, row_logits.tree_paths(rec.tree.tokens, mask))
    if rec.token_masks is not None:
        logits = backend.apply_token_mask(logits, rec.token_masks.flatten(0, 1))
    predict = _greedy(out, backend) if logits is out.logits else backend.greedy_predict(logits)  # [bs * N]
    tokens = rec.tree.tokens  # the greedy walk never accepts a padding row
    walk_tokens = tokens if rec.tree.widths is None else torch.where(rec.tree.padding, -1, tokens)
    if rec.tree.parents is shapes.chain_parents(bs, N, device):  # a chain (draft_tree, lookup_tree): its walk
        accept_index, accept_len = backend.verify_greedy_chain(walk_tokens, predict.view(bs, N), cfg.accept_width)
    else:
        accept_index, accept_len = backend.verify_greedy(
            walk_tokens, rec.tree.parents, predict.view(bs, N), cfg.accept_width
        )
    rows, target_probs = sampling.sampled_rows(rec.requests, device), None
    if rows is not None:
        accept_index, accept_len, predict, target_probs = sampling.verify_sampled(
            rows, rec.tree, rec.draft_probs, logits, cfg.accept_width, cfg.is_chain,
            accept_index, accept_len, predict, backend,
        )  # fmt: skip
    reported = sampling.row_logprobs(rec.requests, logits, predict, rows, target_probs, N)
    bad = _check_logits(out, row_request, bs)
    requests = tuple(
        _errored(r, "the target returned non-finite logits during verify") if b else r
        for r, b in zip(rec.requests, bad)
    )
    return Verified(
        config=cfg,
        requests=requests,
        seq_lens=L,
        tree=rec.tree,
        verify_slots=rec.verify_slots,
        rows=RowOutputs(
            predict=predict,
            hidden=out.hidden,
            logprobs=reported.logprobs,
            top_logprobs=reported.top_logprobs,
            top_ids=reported.top_ids,
        ),
        accept_index=accept_index,
        accept_len=accept_len,
    )


# ---- accept ------------------------------------------------------------------------------------
def gather_rows(rows: RowOutputs, accept_index: torch.Tensor, backend) -> RowOutputs:
    """Every per-row field of `RowOutputs`, gathered along the accepted path by one mechanism."""
    gathered = {}
    for field in attrs.fields(RowOutputs):
        value = getattr(rows, field.name)
        gathered[field.name] = None if value is None else backend.gather_accepted(value, accept_index)
    return RowOutputs(**gathered)


def accept(rec: Verified, ports: Ports, backend) -> Accepted:
    """Gather the accepted path, cut it at stops, read the bonus at stride ``S + 1``."""
    cfg = rec.config
    accepted_rows = gather_rows(rec.rows, rec.accept_index, backend)
    accept_len = rec.accept_len
    lens, reasons, requests = [], [], []
    committed_all = accepted_rows.predict.tolist()
    walked = accept_len.tolist()
    for request, committed, n in zip(rec.requests, committed_all, walked):
        keep, reason = 1, "error"
        if request.finish_reason != "error":
            keep, reason = cut_at_stops(request, committed[:n], ports.detokenizer)
            # the grammar's own end (its end token) or a token it refuses (a dead end: the request fails)
            at, stop, error = grammar.cut(request, committed[:keep])
            if error is not None:
                request, keep, reason = _errored(request, error), 1, "error"
            elif stop is not None:
                keep, reason = at, reason if at == keep and reason is not None else stop
        requests.append(request)
        lens.append(keep)
        reasons.append(reason)
    if lens != walked:  # a stop, the length limit or an error cut a run
        accept_len = torch.tensor(lens, dtype=torch.long, device=accept_len.device)
    bonus = backend.fill_bonus(accepted_rows.predict, accept_len, cfg.accept_width)
    return Accepted(
        config=cfg,
        requests=tuple(requests),
        seq_lens=rec.seq_lens,
        tree=rec.tree,
        verify_slots=rec.verify_slots,
        accept_index=rec.accept_index,
        accept_len=accept_len,
        accepted_rows=accepted_rows,
        bonus=bonus,
        finish_reasons=tuple(reasons),
    )


# ---- compact -----------------------------------------------------------------------------------
def compact(rec: Accepted, ports: Ports, backend) -> Compacted:
    """Move the accepted path's KV to ``[L, L + accept_len)``, commit, pick recurrent state."""
    cfg, bs = rec.config, len(rec.requests)
    L, device = rec.seq_lens, rec.seq_lens.device
    if cfg.is_chain:
        moves = None  # a chain's accepted row d already sits at L + d
    else:
        src, dst = backend.plan_kv_move(rec.accept_index, rec.accept_len, rec.verify_slots)
        backend.move_kv(ports.kv_pool.target_buffers(), src, dst)
        moves = (src, dst)
    last_correct = backend.last_correct_step_indices(rec.accept_index, rec.accept_len, rec.tree.tokens.shape[1])
    ids = tuple(r.request_id for r in rec.requests)
    ports.recurrent.commit(request_ids=ids, last_correct_step_indices=last_correct)

    committed = rec.accepted_rows.predict.tolist()
    lens = rec.accept_len.tolist()
    rows = rec.accepted_rows
    reported = _reported(sampling.RowLogprobs(rows.logprobs, rows.top_logprobs, rows.top_ids), bs, cfg.accept_width)
    requests = []
    for request, tokens, n, reason, lps in zip(rec.requests, committed, lens, rec.finish_reasons, reported):
        if request.finish_reason == "error":
            requests.append(request)
            continue
        request = grammar.advance(_with_logprobs(request, lps, n), tokens[:n])
        requests.append(attrs.evolve(request, output=request.output + tuple(tokens[:n]), finish_reason=reason))

    # Draft extend rows: the committed tokens (accepted rows d < accept_len of each request) at
    # L + offset + d, shifted drafts with the target features. Built as lists: one copy, no boolean index.
    offset = draft_offset(ports, cfg)
    width = cfg.accept_width
    flat, input_ids, positions, row_request = [], [], [], []
    for b, (tokens, n, length) in enumerate(zip(committed, lens, L.tolist())):
        flat += range(b * width, b * width + n)
        input_ids += tokens[:n]
        positions += range(length + offset, length + offset + n)
        row_request += [b] * n
    rows = torch.tensor([input_ids, positions, row_request, flat], dtype=torch.long, device=device)
    rows = rows.view(4, len(input_ids))
    hidden = rec.accepted_rows.hidden
    extend = ExtendRows(
        input_ids=rows[0],
        positions=rows[1],
        row_request=rows[2],
        hidden=None if hidden is None or offset == 1 else hidden.flatten(0, 1).index_select(0, rows[3]),
    )
    return Compacted(
        config=cfg,
        requests=tuple(requests),
        seq_lens=L + rec.accept_len,
        root_tokens=rec.bonus,
        extend=extend,
        kv_moves=moves,
        accept_len=rec.accept_len,
        last_correct_step_indices=last_correct,
    )
