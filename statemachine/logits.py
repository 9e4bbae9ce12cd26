"""Every change a request's token history makes to a logits row, in one place.

A row of logits predicts the token after a history: at prefill the request's prompt (and any output it
resumes with); at a verify row ``d`` the request's committed tokens followed by the draft tokens on the
tree path from the root to row ``d`` (row 0, the root, is the last committed token); at a draft node the
committed tokens and the draft path to that node. `adjust` changes each row exactly as autoregressive
decoding would change the logits after that history, so a verify row holds what the target alone would
have sampled from there, and the speculative walk stays lossless (docs: sampling).

The changes, in order (each one off by default, `SamplingParams.adjusts_logits` says whether any is on):

1. ``repetition_penalty`` ``r``: every token seen in the prompt or the output (path included) has a
   positive logit divided by ``r`` and a negative one multiplied by ``r``;
2. ``frequency_penalty`` and ``presence_penalty``: minus ``frequency * count`` and ``presence * (count > 0)``,
   ``count`` the token's occurrences in the output (the prompt does not count);
3. ``logit_bias``: added per token id;
4. ``bad_words``: a one-token word is masked (``-inf``); a longer word masks its last token when the
   history ends with the rest of it;
5. ``logits_processor(history, row)``: the caller's own change, called once per row on the host with the
   row's history (a tuple of token ids) and its logits ``[V]`` float32, returning a new ``[V]`` row.

Steps 1-4 run batched over the rows on the logits' device, on the columns each row's history and
parameters name (its prompt, output, path, bias and ban tokens) rather than the whole vocabulary; step
4's longer words compare each row's last tokens (its committed tail, then its path) with each word.
Step 5 reads each row's history on the host, one call per row. The output is float32 logits;
temperature, min-p, top-k and top-p (`process_logits`) come after. A mask that depends on the history
(a grammar) belongs here too: it is one more step over the same rows and paths.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import torch

from ..core.records import Request


def any_adjusts(requests: Sequence[Request]) -> bool:
    """Whether some request of the batch changes its logits by its history (otherwise `adjust` is the identity)."""
    return any(r.sampling.adjusts_logits for r in requests)


def tree_paths(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each verify row's path below the root, in depth order: ``tokens[j]`` for every ancestor-or-self ``j >= 1``.

    ``mask[b, i, j]`` says that row ``i`` sees row ``j`` (its ancestors and itself); ancestors have lower rows
    than their descendants, so row order is depth order. Shapes: ``tokens [bs, N]``, ``mask [bs, N, N]`` ->
    ``[bs * N, N - 1]`` int64, -1 where ``j`` is not on row ``i``'s path.
    """
    bs, n = tokens.shape
    paths = torch.where(mask[:, :, 1:], tokens[:, None, 1:], -1)
    return paths.reshape(bs * n, n - 1)


def adjust(
    requests: Sequence[Request],
    logits: torch.Tensor,
    row_request: torch.Tensor,
    paths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits after each row's history-dependent changes (module docstring); ``logits`` itself when none.

    Row ``i`` belongs to ``requests[row_request[i]]`` and its history is that request's ``tokens`` followed
    by ``paths[i]``'s entries ``>= 0`` (None: no path). Rows of requests without changes are returned as
    they are (float32). Shapes: ``logits [R, V]``, ``row_request [R]``, ``paths [R, D]`` -> ``[R, V]``.
    """
    picked = [b for b, r in enumerate(requests) if r.sampling.adjusts_logits]
    if not picked:
        return logits
    device = logits.device
    rows_v, vocab = logits.shape
    out = logits.float().clone()
    slot = torch.full((len(requests),), -1, dtype=torch.long)
    slot[picked] = torch.arange(len(picked))
    slot_of_row = slot.to(device)[row_request]  # [R]: the row's index among the picked requests, -1 elsewhere
    rows = (slot_of_row >= 0).nonzero()[:, 0]  # [r]
    rr = slot_of_row[rows]  # [r]
    params = [requests[b].sampling for b in picked]
    tensor = lambda values: torch.tensor(values, dtype=torch.float32, device=device)  # noqa: E731

    # Only the tokens a row's history or parameters name can change. Per picked request, those tokens sorted
    # (``vocab`` pads: it sorts last and is never written) and what each carries: its count in the output,
    # whether the prompt holds it, its bias, whether it is banned, ``[m, U]`` each. A row adds its path.
    chosen = [requests[b] for b in picked]
    columns = _request_columns(requests, chosen, vocab, device)
    cols, count, in_prompt, bias, banned = (c[rr] for c in columns)  # [r, U] each
    if paths is not None and paths.shape[1]:
        path = paths[rows]  # [r, D], -1 off the path
        count = count + (cols[:, :, None] == path[:, None, :]).sum(-1)
        # path tokens the request names nowhere else: their count is the path's alone (a repeat writes the same)
        known = cols.gather(1, torch.searchsorted(cols, path.clamp(min=0)).clamp(max=cols.shape[1] - 1)) == path
        fresh = (path >= 0) & ~known
        cols = torch.cat([cols, torch.where(fresh, path, vocab)], 1)
        count = torch.cat([count, (path[:, :, None] == path[:, None, :]).sum(-1).float()], 1)
        in_prompt = torch.cat([in_prompt, torch.zeros_like(fresh)], 1)
        bias = torch.cat([bias, torch.zeros_like(path, dtype=torch.float32)], 1)
        banned = torch.cat([banned, torch.zeros_like(fresh)], 1)
    valid = cols < vocab  # [r, W]
    at = (rows[:, None].expand_as(cols)[valid], cols[valid])
    x, count, seen = out[at], count[valid], (count[valid] > 0) | in_prompt[valid]
    per_entry = rr[:, None].expand_as(cols)[valid]
    repetition = tensor([p.repetition_penalty for p in params])[per_entry]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - tensor([p.frequency_penalty for p in params])[per_entry] * count
    x = x - tensor([p.presence_penalty for p in params])[per_entry] * (count > 0)
    out[at] = (x + bias[valid]).masked_fill(banned[valid], -torch.inf)

    if any(len(w) > 1 for p in params for w in p.bad_words):
        _ban_word_ends(chosen, out, rows, rr, paths)
    if any(p.logits_processor is not None for p in params):
        _call_processors(chosen, out, rows, rr, paths)
    return out


_memo: list = [None, None]  # the last batch's requests tuple (held, so its id stays its own) and its columns


def _request_columns(requests, chosen, vocab: int, device) -> tuple[torch.Tensor, ...]:
    """Per picked request, `_named`'s lists padded to ``[m, U]`` tensors (tokens padded with ``vocab``).

    One cycle's transitions (draft extend, draft levels, verify) pass the same ``requests`` tuple, so the last
    tuple's columns are kept and reused (the records are frozen: the same tuple holds the same requests)."""
    if _memo[0] is requests and _memo[1][0].device == torch.device(device) and _memo[1][5] == vocab:
        return _memo[1][:5]
    table = [_named(r) for r in chosen]
    lengths = torch.tensor([len(t[0]) for t in table])
    width = int(lengths.max())
    filled = torch.arange(width)[None, :] < lengths[:, None]  # [m, U]

    def column(k: int, fill, dtype) -> torch.Tensor:
        padded = torch.full((len(table), width), fill, dtype=dtype)
        padded[filled] = torch.tensor(list(itertools.chain.from_iterable(t[k] for t in table)), dtype=dtype)
        return padded.to(device)

    columns = (
        column(0, vocab, torch.long),
        column(1, 0, torch.float32),
        column(2, False, torch.bool),
        column(3, 0.0, torch.float32),
        column(4, False, torch.bool),
    )
    _memo[0], _memo[1] = requests, (*columns, vocab)
    return columns


def _named(request: Request) -> tuple[list, list, list, list, list]:
    """The tokens ``request``'s prompt, output, bias and one-token bans name, sorted, with their output count,
    prompt membership, bias and ban (lists of one length)."""
    p = request.sampling
    output = Counter(request.output)
    prompt = set(request.prompt)
    bias = dict(p.logit_bias)
    bans = {w[0] for w in p.bad_words if len(w) == 1}
    tokens = sorted(prompt | output.keys() | bias.keys() | bans)
    return (
        tokens,
        [output[t] for t in tokens],
        [t in prompt for t in tokens],
        [bias.get(t, 0.0) for t in tokens],
        [t in bans for t in tokens],
    )


def _ban_word_ends(chosen, out, rows, rr, paths) -> None:
    """Bad words of several tokens: mask a word's last token on every row whose history ends with the rest.

    Each row's last ``W`` history tokens (``W``: the longest prefix) are its request's committed tail and
    then its path, the path's gaps squeezed out; then one comparison per distinct word. ``out`` in place.
    """
    device = out.device
    width = max(len(w) - 1 for r in chosen for w in r.sampling.bad_words)
    tails = [list(r.tokens[-width:]) for r in chosen]
    tail = torch.tensor([[-1] * (width - len(t)) + t for t in tails], dtype=torch.long, device=device)[rr]
    if paths is not None and paths.shape[1]:
        tail = torch.cat([tail, paths[rows]], 1)  # [r, W + D], -1 where no token
    valid = tail >= 0
    after = valid.flip(1).cumsum(1).flip(1)  # valid tokens at or after each column
    keep = valid & (after <= width)
    history = torch.full((tail.shape[0], width + 1), -1, dtype=torch.long, device=device)  # column W: a sink
    history.scatter_(1, torch.where(keep, width - after, width), torch.where(keep, tail, -1))
    history = history[:, :width]  # [r, W]: the last W tokens, oldest first, -1 padded on the left
    words = {w for r in chosen for w in r.sampling.bad_words if len(w) > 1}
    for word in words:
        has = torch.tensor([word in r.sampling.bad_words for r in chosen], device=device)[rr]
        prefix = torch.tensor(word[:-1], dtype=torch.long, device=device)
        hit = has & (history[:, width - len(prefix) :] == prefix).all(1)
        out[rows[hit], word[-1]] = -torch.inf


def _call_processors(chosen, out, rows, rr, paths) -> None:
    """The callers' processors, row by row on the host with each row's history (``out`` in place)."""
    rr_list, row_list = rr.tolist(), rows.tolist()
    path_list = paths[rows].tolist() if paths is not None and paths.shape[1] else [[]] * len(row_list)
    for row, i, path in zip(row_list, rr_list, path_list):
        request = chosen[i]
        processor = request.sampling.logits_processor
        if processor is None:
            continue
        history = request.tokens + tuple(t for t in path if t >= 0)
        new = processor(history, out[row].clone())
        if not isinstance(new, torch.Tensor) or tuple(new.shape) != (out.shape[1],):
            raise ValueError(
                f"request {request.request_id}: logits_processor returned {type(new).__name__} "
                f"{tuple(getattr(new, 'shape', ()))}; return a logits row of shape [{out.shape[1]}]"
            )
        out[row] = new.to(out.device, torch.float32)
