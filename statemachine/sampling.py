"""Sampling in the cycle: per-request parameters and random streams, draft draws, the sampling verify.

The transitions call these helpers only when a batch holds a sampled request (``temperature > 0``);
an all-greedy batch runs exactly the greedy code. In a mixed batch the greedy requests keep their
greedy results (``select_topk``, the EAGLE-2 rerank, ``verify_greedy``) and the sampled requests'
rows are overwritten with theirs, so a greedy request decodes the same tokens whatever shares its batch.

**Random streams.** Every draw of a sampled request comes from a counter-based generator keyed by a hash of
``(seed, counter, stream, level)`` (`stream_keys`, then splitmix64 from the key: `uniforms_from_keys`; no
`torch.Generator`): ``counter`` is the number of tokens the request had committed
when the draw was made (strictly increasing from cycle to cycle), ``stream`` says what the draw is
for (the first token, draft candidates, acceptance coins, the final sample) and ``level`` the draft
tree level. So the draws are a function of the record alone: a seeded request reproduces its output
whatever batch it runs in and however often it is run, and the draft's draws are independent of the
verify's (the verify's losslessness needs that). A request without a seed gets a fresh one at prefill.

**What a sampled draft does** (docs/sampling.md has the why). A forward draft processes its logits
with the request's own temperature, top-k and top-p into ``q`` and draws each node's ``K`` children
*without replacement* from ``q`` (Gumbel-top-k), keeping ``q`` per tree row for the verify. A sampled
tree is laid out in level order (the first ``N - 1`` candidates), never reranked: EAGLE-2's global
rerank keeps or drops drawn children by their own probabilities, which conditions the draws and
makes the verify lossy. A lookup draft's proposals are point masses (``draft_probs=None``).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import attrs
import torch

from ..backends.torch.sampling import BELOW_ONE as _BELOW_ONE
from ..backends.torch.sampling import GAMMA as _GAMMA
from ..backends.torch.sampling import MUL1 as _MUL1
from ..backends.torch.sampling import MUL2 as _MUL2
from ..backends.torch.sampling import TINY as _TINY
from ..backends.torch.sampling import keyed_uniforms, splitmix64_tensor
from ..core.records import DraftTree, Request

STREAM_FIRST, STREAM_DRAFT, STREAM_COINS, STREAM_FINAL = 0, 1, 2, 3

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, counter: int, stream: int, level: int = 0) -> int:
    """The 64-bit key of one draw, on the host: `stream_keys` of one request (the tests' reference)."""
    h = _splitmix64(seed & _MASK64)
    for word in (counter, stream, level):
        h = _splitmix64(h ^ (word & _MASK64))
    return h


def key_uniforms(key: int, count: int) -> list[float]:
    """`uniforms_from_keys` of one key, on the host (the tests' reference)."""
    out = []
    for i in range(count):
        bits = _splitmix64((key + i * _GAMMA) & _MASK64) >> 40
        out.append(min(max(bits * 2.0**-24, _TINY), _BELOW_ONE))
    return out


def stream_keys(seed: torch.Tensor, counter: torch.Tensor, stream: int, level: int = 0) -> torch.Tensor:
    """The key of one draw per request: a splitmix64 chain over ``(seed, counter, stream, level)``, on the device.

    ``counter`` is the request's committed count at the draw (``len(output)``). Shapes: ``[m]`` int64 -> ``[m]``.
    """
    h = splitmix64_tensor(seed)
    for word in (counter, stream, level):
        h = splitmix64_tensor(h ^ word)
    return h


def uniforms_from_keys(keys: torch.Tensor, count: int, backend=None) -> torch.Tensor:
    """``count`` uniforms per key, strictly inside ``(0, 1)``: element ``i`` is the top 24 bits of
    ``splitmix64(key + i * gamma)`` (the splitmix64 sequence from ``key``) times ``2**-24``, clamped to
    ``[tiny, 1 - 2**-24]`` as `safe_uniform` clamps `torch.rand`. Integer ops only: no generator, no host value, so a
    CUDA graph captures it and the eager and static executors draw the same numbers. ``backend``: its
    ``uniforms_from_keys`` (the CUDA backend's is one kernel of the same bits); None: the torch reference,
    `backends.torch.sampling.keyed_uniforms`.

    Shapes: ``keys [m]`` int64 -> ``[m, count]`` float32.
    """
    if backend is not None:
        return backend.uniforms_from_keys(keys, count)
    return keyed_uniforms(keys, count)


def with_seed(request: Request) -> Request:
    """A sampled request without a seed gets a fresh one, so every later draw is a function of the record."""
    if request.sampling.greedy or request.sampling.seed is not None:
        return request
    return attrs.evolve(request, sampling=attrs.evolve(request.sampling, seed=secrets.randbits(63)))


@attrs.frozen(eq=False)
class SampledRows:
    """The sampled requests of a batch and their parameters, one entry per request it holds (``m``).

    The eager table holds the sampled requests alone (``mask`` None). A static cycle holds every request of its
    buffers (``index`` their rows ``0..B-1``) and ``mask`` says which sample: the work runs on every row (no
    value-dependent shape) and a greedy request keeps its greedy results (`torch.where`).
    """

    index: torch.Tensor  # [m] int64: their rows in the batch
    temperature: torch.Tensor  # [m] float32
    top_k: torch.Tensor  # [m] int64
    top_p: torch.Tensor  # [m] float32
    min_p: torch.Tensor  # [m] float32
    seed: torch.Tensor  # [m] int64
    counter: torch.Tensor  # [m] int64: the committed count (len(output)) the draws are keyed by
    mask: torch.Tensor | None = None  # [m] bool: which sample (None: all)

    def flat_rows(self, per_request: int) -> torch.Tensor:
        """Rows ``b * r + i`` (``i < r``) of every sampled request ``b``. Shapes: -> ``[m * r]``."""
        offsets = torch.arange(per_request, device=self.index.device)
        return (self.index[:, None] * per_request + offsets[None, :]).reshape(-1)

    def process(self, logits: torch.Tensor, per_request: int, backend) -> torch.Tensor:
        """Each request's temperature, min-p, top-k and top-p on its ``r`` rows. Shapes: ``[m * r, V]`` -> same."""
        return backend.process_logits(
            logits,
            self.temperature.repeat_interleave(per_request),
            self.top_k.repeat_interleave(per_request),
            self.top_p.repeat_interleave(per_request),
            self.min_p.repeat_interleave(per_request),
        )

    def uniforms(self, shape: tuple[int, ...], stream: int, level: int = 0, backend=None) -> torch.Tensor:
        """Per request, uniforms of ``shape`` from its key (`stream_keys`; made by ``backend``, `uniforms_from_keys`).
        Shapes: -> ``[m, *shape]`` float32."""
        count = 1
        for size in shape:
            count *= size
        keys = stream_keys(self.seed, self.counter, stream, level)
        return uniforms_from_keys(keys, count, backend).view(-1, *shape)


def sampled_rows(requests: Sequence[Request], device: torch.device | str) -> SampledRows | None:
    """The batch's sampled requests, or None when every request is greedy (the greedy code runs alone)."""
    picked = [(i, r) for i, r in enumerate(requests) if not r.sampling.greedy]
    if not picked:
        return None
    for _, r in picked:
        if r.sampling.seed is None:
            raise ValueError(
                f"request {r.request_id} samples without a seed: prefill gives every sampled request one "
                "(start requests from an Admitted record)"
            )
    params = [r.sampling for _, r in picked]
    return SampledRows(
        index=torch.tensor([i for i, _ in picked], dtype=torch.long, device=device),
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        seed=torch.tensor([p.seed for p in params], dtype=torch.long, device=device),
        counter=torch.tensor([len(r.output) for _, r in picked], dtype=torch.long, device=device),
    )


# ---- prefill -----------------------------------------------------------------------------------
def sample_first(
    requests: Sequence[Request], logits: torch.Tensor, greedy_first: torch.Tensor, backend
) -> tuple[torch.Tensor, RowLogprobs]:
    """The first token: greedy requests keep ``argmax``, sampled requests draw from their processed ``p``.

    Shapes: ``logits [bs, V]``, ``greedy_first [bs]`` -> ``first [bs]``, its `RowLogprobs` (one row a request).
    """
    rows = sampled_rows(requests, logits.device)
    first, probs = greedy_first, None
    if rows is not None:
        probs = rows.process(logits[rows.index], 1, backend)  # [m, V]
        noise = rows.uniforms((logits.shape[-1],), STREAM_FIRST, 0, backend)
        drawn = backend.sample_without_replacement(probs, 1, noise)[:, 0]
        first = greedy_first.clone()
        first[rows.index] = torch.where(drawn >= 0, drawn, greedy_first[rows.index])  # -1: non-finite logits
    return first, row_logprobs(requests, logits, first, rows, probs, 1)


# ---- draft -------------------------------------------------------------------------------------
def draw_children(
    rows: SampledRows,
    logits: torch.Tensor,
    per_request: int,
    topk_p: torch.Tensor,
    topk_index: torch.Tensor,
    level: int,
    backend,
    parent_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled requests replace their ``select_topk`` candidates with ``K`` draws without replacement from ``q``.

    ``logits`` holds ``r = per_request`` rows per request (1 for the draft extend, ``K`` for a draft
    step), each the draft's output at one node; ``level`` is the tree level the children form (0:
    depth 1). A node whose own token is padding (``parent_tokens < 0``) gets padding children.
    ``topk_p`` of a drawn child is ``q(child)``, so cumulative scores stay draft probabilities.

    Shapes: ``logits [bs * r, V]``, ``topk_p``, ``topk_index [bs * r, K]`` -> the same two, and
    ``q [bs * r, V]`` float32 (zero rows for greedy requests).
    """
    vocab = logits.shape[-1]
    flat = rows.flat_rows(per_request)  # [m * r]
    q_sampled = rows.process(logits[flat], per_request, backend)  # [m * r, V]
    uniforms = rows.uniforms((per_request, vocab), STREAM_DRAFT, level, backend).reshape(-1, vocab)
    ids = backend.sample_without_replacement(q_sampled, topk_index.shape[-1], uniforms)  # [m * r, K], -1 padded
    if parent_tokens is not None:
        ids = torch.where(parent_tokens[flat][:, None] < 0, -1, ids)  # padding begets padding
    probs = torch.where(ids >= 0, q_sampled.gather(1, ids.clamp(min=0)), 0.0).to(topk_p.dtype)
    if rows.mask is not None:  # every row of a static batch (``flat`` is every row): greedy rows keep theirs
        sampled = rows.mask.repeat_interleave(per_request)[:, None]  # [B * r, 1]
        q = torch.where(sampled, q_sampled, 0.0)
        return torch.where(sampled, probs, topk_p), torch.where(sampled, ids, topk_index), q
    topk_p, topk_index = topk_p.clone(), topk_index.clone()
    topk_p[flat], topk_index[flat] = probs, ids
    q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    q[flat] = q_sampled
    return topk_p, topk_index, q


def store_rows(draft_probs: torch.Tensor, q: torch.Tensor, rows: torch.Tensor) -> None:
    """Write each node's ``q`` at its verify row (rows ``>= N``, nodes left out of the tree, are skipped).

    No boolean index (a static cycle runs it): a skipped node writes row 0's own value back to row 0 (row 0 is
    the root's, never a node's: every writer there writes the value it read before the write).

    Shapes: ``draft_probs [bs, N, V]`` (written in place: it is being built), ``q [bs, K, V]``, ``rows [bs, K]``.
    """
    bs, n, vocab = draft_probs.shape
    batch = torch.arange(bs, device=rows.device)[:, None].expand_as(rows)
    kept = rows < n
    values = torch.where(kept[..., None], q.to(draft_probs.dtype), draft_probs[:, :1])
    draft_probs.index_put_((batch, torch.where(kept, rows, 0)), values)


def level_order_tree(
    root_tokens: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_scores: torch.Tensor,
    cand_parents: torch.Tensor,
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sampled tree: the first ``N - 1`` candidates in level order, never reranked.

    Candidates come level by level, each node's children in draw order, so the rows keep parents
    before children and siblings in draw order (the order the tree verify relies on), and whether a
    node is kept depends on its place, never on its own token (a rerank by score would condition
    the draws). Padding candidates (token -1) stay -1: the caller marks them.

    Shapes: ``root_tokens [bs]``, ``cand_* [bs, C]`` (``cand_parents``: a candidate index, -1 for the
    root) -> ``tokens [bs, N]``, ``parents [bs, N]`` (-1 for the root), ``scores [bs, N]``, as `rerank_tree`.
    """
    keep = num_draft_tokens - 1
    if keep > cand_tokens.shape[1]:
        raise ValueError(f"num_draft_tokens - 1 = {keep} exceeds the {cand_tokens.shape[1]} candidates")
    kept_parents = cand_parents[:, :keep]
    root_parent = torch.full_like(root_tokens[:, None], -1)
    parents = torch.cat([root_parent, torch.where(kept_parents >= 0, kept_parents + 1, 0)], 1)
    tokens = torch.cat([root_tokens[:, None], cand_tokens[:, :keep]], 1)
    scores = torch.cat([torch.ones_like(cand_scores[:, :1]), cand_scores[:, :keep]], 1)
    return tokens, parents, scores


# ---- verify ------------------------------------------------------------------------------------
def verify_sampled(
    rows: SampledRows,
    tree: DraftTree,
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    accept_width: int,
    is_chain: bool,
    accept_index: torch.Tensor,
    accept_len: torch.Tensor,
    predict: torch.Tensor,
    backend,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless verify of the sampled requests; their rows of the greedy results are replaced.

    ``p`` is the target's processed distribution at every row; ``q`` is ``draft_probs`` (None: point
    masses, a lookup draft). A chain request without padding takes `verify_chain_sampling`, every other
    request `verify_tree_sampling` (chosen per request, so its result never depends on its batch). Coins are
    ``uniforms[b, row]``, the final token's Gumbel noise one ``[V]`` block per request, from the request's own
    streams. A static batch (``rows.mask``) verifies every request and keeps the greedy results of the greedy
    ones: both verifies run (a chain's padding is known only on the device) and each request takes its own.

    Shapes: ``tree [bs, N]``, ``draft_probs [bs, N, V]``, ``logits [bs * N, V]``, greedy
    ``accept_index [bs, S + 1]``, ``accept_len [bs]``, ``predict [bs * N]`` -> the merged three and the
    sampled requests' ``p [m * N, V]``.
    """
    bs, n = tree.tokens.shape
    vocab = logits.shape[-1]
    m = rows.index.shape[0]
    static = rows.mask is not None
    p = rows.process(logits[rows.flat_rows(n)], n, backend)  # [m * N, V]
    q = None if draft_probs is None else draft_probs[rows.index]  # [m, N, V]
    tokens = tree.tokens[rows.index]
    coins = rows.uniforms((n,), STREAM_COINS, 0, backend)  # [m, N]
    noise = rows.uniforms((vocab,), STREAM_FINAL, 0, backend)  # [m, V]
    padding = None if tree.padding is None else tree.padding[rows.index]
    if static:  # a greedy request's rows are padding here: its tree verify walks nothing (its result is dropped)
        dropped = ~rows.mask[:, None] & (torch.arange(n, device=tokens.device) > 0)[None, :]
        padding = dropped if padding is None else padding | dropped
    padded = None if padding is None else padding.any(1)  # [m]
    depth = torch.arange(accept_width, device=tokens.device)[None, :]
    chain = tree_part = None
    if is_chain and (static or padded is None or not bool(padded.all())):
        draft_q = None if q is None else q[:, : n - 1]
        c_len, c_predict = backend.verify_chain_sampling(tokens[:, 1:], draft_q, p.view(m, n, vocab), coins, noise)
        chain = (torch.where(depth < c_len[:, None], depth, -1), c_len, c_predict.reshape(m, n))  # rows 0..len-1
    if not is_chain or (padded is not None and (static or bool(padded.any()))):
        t_tokens = tokens if padding is None else torch.where(padding, -1, tokens)
        t_index, t_len, t_predict = backend.verify_tree_sampling(
            t_tokens, tree.parents[rows.index], q, p.view(m, n, vocab), accept_width, coins, noise
        )
        base = (torch.arange(m, device=tokens.device) * n)[:, None]
        tree_part = (torch.where(t_index >= 0, t_index - base, -1), t_len, t_predict.view(m, n))
    if chain is None or tree_part is None:
        s_rows, s_len, s_predict = chain or tree_part
    else:  # a chain request with padding takes the tree verify
        on = padded[:, None]
        s_rows, s_len, s_predict = (torch.where(on if c.dim() > 1 else padded, t, c) for c, t in zip(chain, tree_part))
    s_index = torch.where(s_rows >= 0, s_rows + rows.index[:, None] * n, -1)
    if static:  # ``index`` is every row: the greedy requests keep their greedy results
        sampled = rows.mask[:, None]
        accept_index = torch.where(sampled, s_index, accept_index)
        predict = torch.where(sampled, s_predict, predict.view(bs, n)).view(-1)
        return accept_index, torch.where(rows.mask, s_len, accept_len), predict, p
    accept_index, accept_len, predict = accept_index.clone(), accept_len.clone(), predict.clone()
    accept_index[rows.index] = s_index
    accept_len[rows.index] = s_len
    predict.view(bs, n)[rows.index] = s_predict
    return accept_index, accept_len, predict, p


# ---- logprobs ----------------------------------------------------------------------------------
@attrs.frozen(eq=False)
class RowLogprobs:
    """What a verify (or the prefill) reports per row: ``log p(token)`` and the ``n`` most likely alternatives.

    ``n`` is the batch's largest ``top_logprobs``; a request keeps its own first ``top_logprobs`` columns and
    drops entries of probability 0 (``-inf``). Each is None when no request asks for it.
    """

    logprobs: torch.Tensor | None = None  # [R] float32
    top_logprobs: torch.Tensor | None = None  # [R, n] float32, descending (ties: lower id first)
    top_ids: torch.Tensor | None = None  # [R, n] int64


def row_logprobs(
    requests: Sequence[Request],
    logits: torch.Tensor,
    tokens: torch.Tensor,
    rows: SampledRows | None,
    sampled_probs: torch.Tensor | None,
    per_request: int,
) -> RowLogprobs:
    """``log p(token)`` of every row and, where asked, the top ``n`` of ``log p``.

    A sampled request's ``p`` is the distribution its tokens are committed from (after temperature, min-p,
    top-k, top-p); a greedy request's is the softmax of its logits (its processed distribution is a point
    mass, whose log is 0). ``logits`` are the rows after `statemachine.logits.adjust` (penalties, bias, bad
    words, the processor), as the tokens were chosen from them. Rows with ``token < 0`` get 0.

    Shapes: ``logits [bs * r, V]``, ``tokens [bs * r]``, ``sampled_probs [m * r, V]`` -> `RowLogprobs`
    of ``bs * r`` rows.
    """
    want = any(r.sampling.logprobs for r in requests)
    top_n = max((r.sampling.top_logprobs for r in requests), default=0)
    if not want and not top_n:
        return RowLogprobs()
    log_p = torch.log_softmax(logits.float(), dim=-1)  # [bs * r, V]
    if rows is not None:
        flat = rows.flat_rows(per_request)
        log_p[flat] = torch.log(sampled_probs.float())
    logprobs = top_values = top_ids = None
    if want:
        safe = tokens.clamp(min=0)[:, None]
        logprobs = torch.where(tokens >= 0, log_p.gather(1, safe).squeeze(1), 0.0)
    if top_n:
        top_n = min(top_n, log_p.shape[-1])
        top_values, top_ids = log_p.sort(dim=-1, descending=True, stable=True)
        top_values, top_ids = top_values[:, :top_n].contiguous(), top_ids[:, :top_n].contiguous()
    return RowLogprobs(logprobs, top_values, top_ids)
