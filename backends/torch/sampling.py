"""Lossless speculative sampling, reference ops in plain torch: logits processing, random draws, chain verify.

Every random draw comes from an explicit tensor of uniforms, never from the global RNG: the cycle's from
`keyed_uniforms` (splitmix64 from each request's key), a caller's own from `safe_uniform` over a
`torch.Generator`. So a fast kernel fed the same uniforms must return the same tokens. Tree verification lives
in `sampling_tree.py`.

Terms (as in vLLM's rejection sampler): a draft token is *accepted* when the rejection test passes;
at the first rejection a *recovered* token is sampled from the residual ``normalize(max(p - q, 0))``;
when every draft is accepted a *bonus* token is sampled from the target at the last row. Either way
each request samples exactly one token of its own, the *final* token, so one ``[bs, V]`` block of
uniforms (``sample_uniforms``) serves every request whatever row it stops at.

Randomness layout (shared by chain and tree, so a chain verifies equal to the same chain as a tree):
``uniforms[b, r]`` is the acceptance coin of the draft token at verify row ``r`` (row 0, the root, has
no coin: that column is unused); ``sample_uniforms[b]`` is the Gumbel noise of the final token.
"""

from __future__ import annotations

import torch

# splitmix64 (Steele, Lea and Flood, 2014): the generator behind every keyed draw (`keyed_uniforms`)
GAMMA = 0x9E3779B97F4A7C15  # its increment
MUL1, MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
TINY = torch.finfo(torch.float32).tiny  # the clamps of `safe_uniform`: 0 itself can come from torch.rand ...
BELOW_ONE = 1.0 - 2.0**-24  # ... and the largest float32 below 1 (torch.rand returns multiples of 2**-24)


def signed64(c: int) -> int:
    """A 64-bit constant as the int64 whose two's complement bits it is (a tensor op takes no wider int)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic: the sign bits are masked off)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors: adds and multiplies wrap modulo 2**64."""
    x = x + signed64(GAMMA)
    x = (x ^ shift_right(x, 30)) * signed64(MUL1)
    x = (x ^ shift_right(x, 27)) * signed64(MUL2)
    return x ^ shift_right(x, 31)


def keyed_uniforms(keys: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` uniforms per key, strictly inside ``(0, 1)``: element ``i`` is the top 24 bits of
    ``splitmix64(key + i * GAMMA)`` (the splitmix64 sequence from ``key``) times ``2**-24``, clamped to
    ``[TINY, BELOW_ONE]`` as `safe_uniform` clamps `torch.rand`. Elementwise int64 ops only (about fifteen passes
    over ``[m, count]``; `backends.cuda.sampling.keyed_uniforms` is one kernel of the same bits).

    Shapes: ``keys [m]`` int64 -> ``[m, count]`` float32.
    """
    index = torch.arange(count, dtype=torch.long, device=keys.device) * signed64(GAMMA)
    bits = shift_right(splitmix64_tensor(keys[:, None] + index[None, :]), 40)
    return (bits.to(torch.float32) * 2.0**-24).clamp_(min=TINY, max=BELOW_ONE)


def _per_row(value: torch.Tensor | float | int, rows: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A per-row sampling parameter as a ``[R]`` tensor (a scalar applies to every row)."""
    return torch.as_tensor(value, dtype=dtype, device=device).expand(rows)


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int = 0,
    top_p: torch.Tensor | float = 1.0,
    min_p: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """Sampling distribution of each row: temperature, then min-p, then top-k, then top-p, renormalized.

    Parameters are per row, since one batch mixes requests. ``temperature <= 0`` makes the row one-hot
    at ``argmax(logits)`` (the first maximum): greedy decoding as a special case of sampling, so the
    sampling verify reproduces greedy verify. ``top_k == 0`` and ``top_p >= 1`` turn those filters off.
    Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (measured after
    top-k, on the renormalized distribution) and always keeps the most likely token. Min-p keeps the
    tokens whose probability (after temperature) is at least ``min_p`` times the largest. Ties at a
    rank cut keep the lower token id (stable sort).

    Apply it to the target and to the draft with the same parameters. The processed target defines
    the output (it must be exactly what non-speculative sampling would use). The verify is lossless
    for any draft distribution, provided ``draft_probs`` is the one the draft tokens were actually
    sampled from; processing the draft the same way keeps its support inside the target's (a draft
    token outside the target's top-k or top-p is a certain rejection), while verifying against a
    distribution other than the one sampled from (say, the draft before its top-k) is lossy.

    Shapes: ``logits [R, V]``, ``temperature [R]``, ``top_k [R]`` int, ``top_p [R]``, ``min_p [R]`` ->
    ``probs [R, V]`` float32.
    """
    rows, vocab = logits.shape
    device = logits.device
    temperature = _per_row(temperature, rows, device, torch.float32)
    top_k = _per_row(top_k, rows, device, torch.long)
    top_p = _per_row(top_p, rows, device, torch.float32)
    min_p = _per_row(min_p, rows, device, torch.float32)

    greedy = temperature <= 0  # [R]
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    probs = torch.softmax(scaled, dim=-1)  # [R, V]
    # min-p: a cut relative to the most likely token, before the rank cuts (0 keeps every token)
    probs = torch.where(probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True), probs, 0.0)

    # Both filters are rank cuts, so work in descending order and map the kept set back.
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [R, V]
    rank = torch.arange(vocab, device=device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [R]
    keep_sorted = rank < k[:, None]
    sorted_probs = sorted_probs * keep_sorted
    # Keep rank i while the mass strictly before it is below top_p: the smallest nucleus reaching top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    in_nucleus = mass_before < top_p[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
    # top_p >= 1 means "off": a cumsum that rounds to 1 early must not drop the tail.
    keep_sorted &= in_nucleus | (rank == 0) | (top_p[:, None] >= 1)
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)

    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab).to(torch.float32)
    return torch.where(greedy[:, None], one_hot, probs)


def safe_uniform(
    shape: tuple[int, ...] | torch.Size, generator: torch.Generator, device: torch.device | str | None = None
) -> torch.Tensor:
    """Uniforms strictly inside ``(0, 1)``: ``torch.rand`` clamped to ``[tiny, 1 - 2**-24]``.

    ``torch.rand`` can return exactly 0, and the consumers of a uniform break at the endpoints:

    - Gumbel noise ``g = -log(-log u)`` is ``-inf`` at ``u == 0`` and ``+inf`` at ``u == 1``. A key
      ``log p + g`` of ``-inf`` for a positive-probability token ties it with the zero-probability
      tokens (a one-hot row then has only ``-inf`` keys and argmax returns token 0, which has
      probability 0); ``+inf`` meets ``log 0 = -inf`` as ``nan``, which argmax picks.
    - The acceptance test ``u * q(x) < p(x)`` must reject a token with ``p(x) == 0`` whatever ``u``;
      with ``u > 0`` that holds even for a kernel that writes ``u <= p / q`` or compares in another
      rounding, and ``u < 1`` keeps ``p(x) == q(x)`` a certain acceptance.

    The clamp moves a mass of at most ``2**-24`` per endpoint, far below what any test can see.

    Shapes: ``shape`` -> ``shape`` float32.
    """
    device = generator.device if device is None else device
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    return u.clamp_(min=TINY, max=BELOW_ONE)


def gumbel_keys(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Perturbed log-probabilities ``log p - log(-log u)``; zero-probability tokens get ``-inf``.

    The argmax of the keys is a sample from ``probs`` (Gumbel-max); ``probs`` need not be normalized,
    since a common scale shifts every key equally.

    Shapes: ``probs [R, V]``, ``uniforms [R, V]`` in ``(0, 1)`` -> ``[R, V]`` float32.
    """
    return torch.log(probs.float()) - torch.log(-torch.log(uniforms))


def sample_without_replacement(probs: torch.Tensor, k: int, uniforms: torch.Tensor) -> torch.Tensor:
    """``k`` distinct tokens per row by Gumbel-top-k, in draw order.

    The tokens of the ``k`` largest keys ``log p + g`` (``g = -log(-log u)``), sorted by key, are
    distributed exactly as ``k`` sequential draws without replacement (Kool et al., 2019): column
    ``i`` is the ``i``-th draw, from ``p`` with the earlier columns removed and renormalized. The tree
    verify relies on that order (siblings in row order are successive draws). With ``k == 1`` this is
    ordinary categorical sampling (``argmax``, first index on an exact tie).

    A zero-probability token has key ``-inf`` and is never drawn. A row with fewer than ``k`` tokens
    of positive mass returns them all, in draw order, and pads the remaining columns with ``-1``:
    the draft ran out of candidates, and the tree verify treats a ``-1`` row as absent.

    Shapes: ``probs [R, V]``, ``uniforms [R, V]`` in ``(0, 1)`` (see `safe_uniform`) -> ``ids [R, k]`` int64.
    """
    vocab = probs.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k = {k} must lie in [1, V = {vocab}]")
    keys = gumbel_keys(probs, uniforms)  # [R, V]
    if k == 1:
        ids = keys.argmax(dim=-1, keepdim=True)
        top = keys.gather(1, ids)
    else:
        top, ids = keys.topk(k, dim=-1, sorted=True)
    return torch.where(top > -torch.inf, ids, -1)


def sample_categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row (Gumbel-max; -1 for a row without mass). Shapes: ``[R, V]``, ``[R, V]`` -> ``[R]``."""
    return sample_without_replacement(probs, 1, uniforms)[:, 0]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalize(max(p - q, 0))``: what the target still owes after the draft's proposal was rejected.

    A rejection happens with probability ``sum(max(q - p, 0)) = sum(max(p - q, 0))`` (both sum to 1),
    so where that mass is 0 (``p == q``) a rejection has probability 0 in exact arithmetic and is
    reachable only through float rounding (``p`` summing to a hair less than ``q``, so ``p <= q``
    everywhere yet ``p(x) < q(x)`` somewhere, where a coin can reject). Any choice there is
    lossless; we return ``p`` itself, which also equals ``q``, so the row still samples a token of
    positive target probability. A residual of tiny positive mass is rounding noise, but it is
    reached with probability equal to that mass, so its error is bounded by the same tiny number.

    Shapes: ``p [R, V]``, ``q [R, V]`` -> ``[R, V]`` float32.
    """
    residual = (p - q).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)  # [R, 1]
    return torch.where(mass > 0, residual / torch.where(mass > 0, mass, 1.0), p)


def verify_chain_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard speculative sampling (Leviathan et al., Chen et al., 2023) over a chain.

    Draft token ``j`` (verify row ``j + 1``) was sampled from ``q_j = draft_probs[:, j]``; it is accepted
    when ``uniforms[:, j + 1] * q_j(x) < p_j(x)``, i.e. with probability ``min(1, p_j(x) / q_j(x))``
    (multiplying avoids a division and keeps ``p(x) == 0`` a certain rejection, since ``u > 0``). At the
    first rejection, row ``j``, the recovered token is sampled from ``residual_distribution(p_j, q_j)``;
    if all ``S`` drafts are accepted the bonus token is sampled from ``p_S``. Both use
    ``sample_uniforms`` (Gumbel). Why that is lossless: row ``j`` emits ``y`` by acceptance with
    probability ``q(y) min(1, p(y)/q(y)) = min(p, q)(y)`` and by rejection with probability
    ``sum(max(p - q, 0)) * residual(y) = max(p - q, 0)(y)``; the two add to ``p(y)``.

    ``draft_probs=None`` marks point-mass proposals (a lookup draft: ``q = one_hot(x)``, so ``x`` is
    accepted with probability ``p(x)`` and a rejection samples ``p`` without ``x``), lossless for any
    proposal that does not depend on the coins (see `verify_tree_sampling`).

    ``validate`` checks that every draft token had positive draft probability (a token the draft
    could not have sampled voids the guarantee) and raises ``ValueError`` otherwise. Unvalidated (as a
    fast kernel runs) such a token is accepted iff ``p(x) > 0``: the ``q -> 0`` limit of the rule.

    ``predict[b, d]`` is the token committed after row ``d``: the accepted draft ``d`` for
    ``d < accept_len - 1``, the recovered or bonus token at ``d = accept_len - 1``, ``-1`` after.

    Shapes: ``draft_tokens [bs, S]``, ``draft_probs [bs, S, V]`` or None, ``target_probs [bs, S + 1, V]``,
    ``uniforms [bs, S + 1]``, ``sample_uniforms [bs, V]`` -> ``accept_len [bs]``, ``predict [bs, S + 1]``.
    """
    bs, num_steps = draft_tokens.shape
    device = draft_tokens.device
    check_shape("uniforms", uniforms, (bs, num_steps + 1))
    check_shape("sample_uniforms", sample_uniforms, (bs, target_probs.shape[-1]))
    if draft_probs is None:
        if validate and bool(((draft_tokens < 0) | (draft_tokens >= target_probs.shape[-1])).any()):
            raise ValueError(f"draft tokens must lie in [0, V = {target_probs.shape[-1]}); a chain has no padding")
        draft_probs = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1]).float()
        validate = False
    if validate:
        _validate_chain(draft_tokens, draft_probs, target_probs)
    p = target_probs.float()  # [bs, S + 1, V]
    q = draft_probs.float()  # [bs, S, V]

    tok = draft_tokens[:, :, None]  # [bs, S, 1]
    p_x = p[:, :num_steps].gather(2, tok).squeeze(2)  # [bs, S]
    q_x = q.gather(2, tok).squeeze(2)  # [bs, S]
    accepted = uniforms[:, 1:] * q_x < p_x  # [bs, S]
    correct_drafts = accepted.long().cumprod(dim=1).sum(dim=1)  # [bs]: accepted before the first rejection

    # The final token: recovered from the residual at the first rejected row, or the bonus from p_S.
    batch = torch.arange(bs, device=device)
    p_stop = p[batch, correct_drafts]  # [bs, V]
    if num_steps > 0:
        rejected = correct_drafts < num_steps
        q_stop = q[batch, correct_drafts.clamp(max=num_steps - 1)] * rejected[:, None]  # [bs, V]; 0 for bonus
    else:
        q_stop = torch.zeros_like(p_stop)
    final = sample_categorical(residual_distribution(p_stop, q_stop), sample_uniforms)  # [bs]

    step = torch.arange(num_steps + 1, device=device)[None, :]  # [1, S + 1]
    drafts = torch.cat([draft_tokens, draft_tokens.new_full((bs, 1), -1)], dim=1)  # [bs, S + 1]
    predict = torch.where(step < correct_drafts[:, None], drafts, -1)
    predict = torch.where(step == correct_drafts[:, None], final[:, None], predict)
    return correct_drafts + 1, predict


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Shape checks are free (no device sync), so they run even when ``validate`` is off."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {list(tensor.shape)}, expected {list(shape)}")


def _validate_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor) -> None:
    bs, num_steps = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs.shape != (bs, num_steps, vocab) or target_probs.shape != (bs, num_steps + 1, vocab):
        raise ValueError(
            f"expected draft_probs [bs, S, V] = {[bs, num_steps, vocab]} and target_probs [bs, S + 1, V], "
            f"got {list(draft_probs.shape)} and {list(target_probs.shape)}"
        )
    if bool(((draft_tokens < 0) | (draft_tokens >= vocab)).any()):
        raise ValueError(f"draft tokens must lie in [0, V = {vocab}); a chain has no padding")
    q_x = draft_probs.gather(2, draft_tokens[:, :, None]).squeeze(2)
    bad = (q_x <= 0).nonzero()
    if bad.numel():
        b, j = bad[0].tolist()
        raise ValueError(
            f"draft token {int(draft_tokens[b, j])} (request {b}, step {j}) has draft probability 0: it cannot "
            "have been sampled from draft_probs; pass the distribution the draft actually sampled from"
        )


def committed_logprobs(target_probs_rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log p(token)`` under the processed target distribution of each row, for logprob reporting.

    Use the distribution after `process_logits` (the one the token was committed from); a committed
    token always has ``p > 0``, so the result is finite. Padding entries (``token < 0``, as in
    ``predict``) get 0, so summing a request's row logprobs gives the sequence logprob.

    Shapes: ``target_probs_rows [M, V]``, ``tokens [M]`` -> ``[M]`` float32.
    """
    valid = tokens >= 0
    p = target_probs_rows.float().gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(valid, torch.log(p), 0.0)
