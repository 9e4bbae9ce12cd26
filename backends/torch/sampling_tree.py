"""Lossless tree verification for sampling: recursive rejection sampling over siblings drawn without replacement.

The reference in plain torch: one pass over the tree rows, vectorized over the batch. See
`verify_tree_sampling` for the rule and the proof that it commits tokens distributed as the target.
"""

from __future__ import annotations

import torch

from .sampling import check_shape, residual_distribution, sample_categorical


def verify_tree_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_width: int,
    uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree by recursive rejection sampling; return the accepted path and the committed tokens.

    The rule. The walk starts at the root with ``p = target_probs[b, 0]`` and ``q = draft_probs[b, 0]``
    and visits the children of the current row ``u`` in row order. Child ``c`` with token ``x`` is
    accepted when ``uniforms[b, c] * q(x) < p(x)`` (probability ``min(1, p(x) / q(x))``); the walk then
    moves to ``c`` with ``p, q = target_probs[b, c], draft_probs[b, c]``. On a rejection
    ``p <- normalize(max(p - q, 0))`` (the residual) and ``q <- normalize(q with x zeroed)`` (the next
    sibling was drawn without ``x``), and the next sibling is tried with the updated pair. When no child
    of ``u`` is accepted, or ``u`` has none, the final token is sampled from the current ``p`` with the
    Gumbel noise ``sample_uniforms[b]``.

    Preconditions (what "drafted" means). The children of row ``u``, in row order, are successive draws
    without replacement from ``draft_probs[b, u]``: `sample_without_replacement` returns them in that
    order. How many children ``u`` has must not depend on the drawn tokens (a fixed shape, or stopping
    when the draft runs out of mass, which `sample_without_replacement` marks by ``-1``); a rerank that
    keeps or drops sampled children by their own scores (EAGLE-2's global top-N) conditions the draws
    and voids the guarantee. ``target_probs[b, c]`` is the target's distribution given the path to ``c``.
    Rows with ``token < 0`` are padding: never accepted, as if absent. Children deeper than
    ``accept_width - 1`` are not visited (the walk stops there, as `TorchBackend.verify_greedy` does).

    Why the committed token is distributed as ``p``. Claim: from a state ``(p, q)`` with ``m`` children
    left to try, where the next child is drawn from ``q``, the token committed after ``u`` is
    distributed as ``p``. By induction on ``m``. For ``m = 0`` the token is sampled from ``p``. For
    ``m > 0`` the next child's token ``x ~ q`` is accepted with probability ``min(1, p(x)/q(x))``, so ``y``
    is committed by acceptance with probability ``q(y) min(1, p(y)/q(y)) = min(p, q)(y)``. A rejection
    happens with probability ``1 - sum(min(p, q)) = sum(max(p - q, 0)) = Z`` and leads to the state
    ``(max(p - q, 0) / Z, q')`` with ``m - 1`` children left, where ``q'`` depends on the rejected ``x``;
    but the next child is drawn from exactly that ``q'`` given ``x`` (without replacement), so by the
    induction hypothesis, given any ``x``, ``y`` is committed with probability ``max(p - q, 0)(y) / Z``.
    In total ``min(p, q)(y) + Z * max(p - q, 0)(y) / Z = p(y)``. The first committed token therefore
    follows the root's ``p``. Given it is the accepted child ``c``'s token, the walk continues from
    ``(target_probs[b, c], draft_probs[b, c])`` with ``c``'s children, drawn from ``draft_probs[b, c]``
    independently of the coins spent at ``u``, so the next token follows the target given the path;
    given it is the final sample, the next cycle samples from the same conditional. By induction every
    committed token follows the target's conditional distribution: the output distribution is the
    target's. (A chain is the case of one child per row; the rule is then standard speculative sampling.)

    Point masses (``draft_probs=None``): a lookup draft proposes tokens as a deterministic function of
    the committed history, so each child ``c`` is tested against ``q = one_hot(x_c)``: accepted with
    probability ``p(x_c)``; a rejection leaves ``p`` without ``x_c`` (the residual of ``p`` and the
    point mass) and the next sibling is tested against its own point mass (there is no ``q`` to update).
    The claim above holds with ``q = one_hot(x)``: ``x`` is committed by acceptance with probability
    ``p(x)``, and otherwise the rest of ``p`` follows, whatever the next proposal is, as long as it does
    not depend on the coins. Repeated siblings are allowed (a repeat has ``p = 0`` by then).

    Edge cases. A drafted token with ``q(x) == 0`` cannot have come from ``q``, nor can a repeated token
    among siblings (drawn without replacement, its updated ``q`` is 0). ``validate`` raises
    ``ValueError`` on both, and on parents that do not precede their rows. Unvalidated (as a fast
    kernel runs), ``q(x) == 0`` accepts iff ``p(x) > 0``, the ``q -> 0`` limit of ``min(1, p/q)``. A
    residual of zero mass is reachable only through rounding and falls back to ``p`` (see
    `residual_distribution`). ``q`` with every mass excluded stays all zero; no valid sibling can follow.

    Outputs. ``accept_index[b]`` holds the flat rows ``b * N + row`` of the accepted path, root first,
    ``-1`` padded to ``accept_width = S + 1``; ``accept_len`` counts them (accepted drafts + 1).
    ``predict`` at an accepted row is the token committed after it: the accepted child's token, and at
    the last accepted row the final sample; ``-1`` at every other row.

    Shapes: ``tokens [bs, N]``, ``parents [bs, N]`` (-1 for the root), ``draft_probs [bs, N, V]`` or None,
    ``target_probs [bs, N, V]``, ``uniforms [bs, N]`` (column ``c`` is row ``c``'s coin; column 0 unused),
    ``sample_uniforms [bs, V]`` -> ``accept_index [bs, S + 1]``, ``accept_len [bs]``, ``predict [bs * N]``.
    """
    bs, n = tokens.shape
    device = tokens.device
    check_shape("uniforms", uniforms, (bs, n))
    check_shape("sample_uniforms", sample_uniforms, (bs, target_probs.shape[-1]))
    point_mass = draft_probs is None
    if validate:
        _validate_tree(tokens, parents, draft_probs, target_probs, accept_width)

    current = torch.zeros(bs, dtype=torch.long, device=device)  # row the walk sits at
    accept_len = torch.ones(bs, dtype=torch.long, device=device)
    path = torch.full((bs, accept_width), -1, dtype=torch.long, device=device)  # rows in the N-block
    path[:, 0] = 0
    p = target_probs[:, 0].float().clone()  # [bs, V]: what the target still owes at `current`
    q = None if point_mass else draft_probs[:, 0].float().clone()  # [bs, V]: what the next sibling was drawn from

    # Parents precede children and siblings keep draw order, so one pass in row order meets every
    # child after its parent and every sibling after the earlier ones; a row is tried exactly when
    # the walk sits at its parent, and the walk never returns to a row it left.
    for c in range(1, n):
        trying = (parents[:, c] == current) & (tokens[:, c] >= 0) & (accept_len < accept_width)  # [bs]
        sel = trying.nonzero().squeeze(1)  # [m]
        if sel.numel() == 0:
            continue
        x = tokens[sel, c]  # [m]
        p_sel = p[sel]  # [m, V]
        q_sel = torch.nn.functional.one_hot(x, p.shape[-1]).float() if point_mass else q[sel]  # [m, V]
        p_x = p_sel.gather(1, x[:, None]).squeeze(1)
        q_x = q_sel.gather(1, x[:, None]).squeeze(1)
        accepted = uniforms[sel, c] * q_x < p_x  # [m]

        moved = sel[accepted]
        current[moved] = c
        path[moved, accept_len[moved]] = c
        accept_len[moved] += 1
        p[moved] = target_probs[moved, c].float()

        stayed = ~accepted
        p[sel[stayed]] = residual_distribution(p_sel[stayed], q_sel[stayed])
        if not point_mass:
            q[moved] = draft_probs[moved, c].float()
            q[sel[stayed]] = _exclude(q_sel[stayed], x[stayed])

    final = sample_categorical(p, sample_uniforms)  # [bs]: recovered (a residual) or bonus (a target row)

    batch_base = (torch.arange(bs, device=device) * n)[:, None]  # [bs, 1]
    on_path = path >= 0
    accept_index = torch.where(on_path, path + batch_base, -1)  # [bs, S + 1]
    # The token committed after path step d is the token of step d + 1, and the final sample after the last.
    next_tokens = tokens.gather(1, path[:, 1:].clamp(min=0))  # [bs, S]
    step = torch.arange(accept_width, device=device)[None, :]
    committed = torch.cat([next_tokens, next_tokens.new_full((bs, 1), -1)], dim=1)  # [bs, S + 1]
    committed = torch.where(step == (accept_len - 1)[:, None], final[:, None], committed)
    predict = torch.full((bs * n,), -1, dtype=torch.long, device=device)
    predict[accept_index[on_path]] = committed[on_path]
    return accept_index, accept_len, predict


def _exclude(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``q`` with token ``x`` removed, renormalized (all zero when nothing is left).

    Shapes: ``q [m, V]``, ``x [m]`` -> ``[m, V]``.
    """
    q = q.scatter(1, x[:, None], 0.0)
    mass = q.sum(dim=-1, keepdim=True)
    return q / torch.where(mass > 0, mass, 1.0)


def _validate_tree(
    tokens: torch.Tensor, parents: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, width: int
) -> None:
    """Raise ``ValueError`` on inputs no drafter could have produced. Host syncs: reference only."""
    bs, n = tokens.shape
    vocab = target_probs.shape[-1]
    q_shape = (bs, n, vocab) if draft_probs is None else draft_probs.shape
    if parents.shape != (bs, n) or q_shape != (bs, n, vocab) or target_probs.shape != (bs, n, vocab):
        raise ValueError(
            f"expected parents [bs, N] = {[bs, n]} and draft_probs, target_probs [bs, N, V]; got "
            f"{list(parents.shape)}, {list(q_shape)}, {list(target_probs.shape)}"
        )
    if width < 1:
        raise ValueError(f"accept_width = {width} must be >= 1 (it is S + 1)")
    rows = torch.arange(n, device=tokens.device)[None, :]
    drafted = (tokens >= 0) & (rows > 0)  # [bs, N]: non-root rows that are not padding
    if bool((tokens[:, 0] < 0).any()) or bool((tokens >= vocab).any()):
        raise ValueError(f"tokens must lie in [0, V = {vocab}) (-1 marks padding; the root is never padding)")
    if bool((parents[:, 0] != -1).any()) or bool((drafted & ((parents < 0) | (parents >= rows))).any()):
        raise ValueError("parents[b, 0] must be -1 and every drafted row's parent must precede it")

    if draft_probs is None:  # point masses: any proposal is one the draft "could" make, repeats included
        return
    batch = torch.arange(bs, device=tokens.device)[:, None]
    q_x = draft_probs[batch, parents.clamp(min=0), tokens.clamp(min=0)]  # [bs, N]: q of the parent at x
    bad = (drafted & (q_x <= 0)).nonzero()
    if bad.numel():
        b, c = bad[0].tolist()
        raise ValueError(
            f"row {c} of request {b} drafts token {int(tokens[b, c])}, which has probability 0 under its parent's "
            "draft distribution: it cannot have been sampled from it; pass the distribution the draft sampled from"
        )
    # Siblings drawn without replacement are distinct: sort (parent, token) keys and look at neighbours.
    keys = torch.where(drafted, parents * vocab + tokens, -1 - rows)  # padding gets unique negative keys
    keys = keys.sort(dim=-1).values
    dup = (keys[:, 1:] == keys[:, :-1]) & (keys[:, 1:] >= 0)
    if bool(dup.any()):
        b = int(dup.any(dim=1).nonzero()[0])
        raise ValueError(
            f"request {b} has two sibling rows with the same token: children must be drawn without replacement "
            "(see sample_without_replacement)"
        )
