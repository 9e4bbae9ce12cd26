"""Grammar-constrained decoding in the cycle: each constrained request's token masks, computed on the host.

A request whose `SamplingParams.constraint` names a JSON schema, a regex or a Lark grammar gets a matcher at
prefill (`compile_request`, through `Ports.grammar`), held in its `GrammarState`. The target's distribution is
the masked one: every logits row the cycle reads for a constrained request first goes through the backend's
``apply_token_mask`` with the bitmask of the grammar's state at that row. Where each row of the table takes its
mask (the table's ``grammar`` column names these functions):

* ``next_masks``: the state after the committed tokens (the prefill's first token); ``draft_masks``, the
  same for the draft extend's depth-1 candidates;
* ``FrontierMasks``: each draft level's frontier nodes, the matcher walked along the node's branch and
  rolled back, so a forward draft proposes only tokens the grammar allows at each node;
* ``row_masks``: every verify row, row ``d``'s mask the state after the path to node ``d``; the verify
  applies them to the target's logits (greedy argmax and rejection sampling alike). A lookup draft, which
  cannot be masked, drops the rows past the last one the grammar allows;
* ``cut``: the accept cuts the committed run where the grammar stops (its end token) and fails a request
  whose token the grammar refuses (an empty mask: the grammar reached a dead end);
* ``advance``: the compact row moves each matcher over the committed tokens for good.

A node on a branch the grammar refuses is dead: the verify never accepts it (the target's mask at its parent
refuses its token), so its own mask is anything, all ones here. An empty mask (a grammar engine's error
state) is all ones too, so no row is all ``-inf``; the token it yields is refused by ``cut``.

An unconstrained request's masks are all ones, and a batch without constrained requests computes none.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ..core.ports import draft_kind, grammar_engine
from ..core.records import GrammarState, Request

INSTALL = "pip install 'speccycle[grammar]'"


class GrammarRefused(ValueError):
    """A request's grammar cannot run: it does not compile, the ports have no grammar engine, or the draft
    cannot be constrained. The request fails alone (the prefill turns this into its error)."""


def constrained(requests: Sequence[Request]) -> bool:
    """Whether any live request of the batch is constrained (holds a matcher)."""
    return any(r.grammar is not None and r.finish_reason is None for r in requests)


def mask_words(vocab_size: int) -> int:
    """Int32 words of one token bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def compile_request(request: Request, ports) -> Request:
    """The request with a fresh matcher standing after its output (a resumed request has some).

    Raises `GrammarRefused` naming what to do: no grammar engine in the ports, a block draft (it verifies
    unconstrained), a grammar the engine cannot compile, or an output the grammar refuses.
    """
    kind, source = request.sampling.constraint
    rid = request.request_id
    if grammar_engine(ports) is None:
        raise GrammarRefused(
            f"request {rid}: {kind} needs a grammar engine: give the engine a tokenizer and install llguidance "
            f"({INSTALL})"
        )
    if draft_kind(ports) == "block":
        raise GrammarRefused(f"request {rid}: block drafts verify without a grammar mask; use another draft for {kind}")
    try:
        matcher = ports.grammar.compile(kind, source)
    except ValueError as err:
        raise GrammarRefused(f"request {rid}: the {kind} does not compile: {err}") from None
    done = matcher.try_consume(request.output)
    if done != len(request.output):
        raise GrammarRefused(f"request {rid}: its output token {done} is refused by its {kind}; resubmit without it")
    return attrs.evolve(request, grammar=GrammarState(matcher=matcher, consumed=len(request.output)))


def _fill(matcher, row: torch.Tensor) -> None:
    matcher.fill_mask(row)
    if not bool(row.any()):  # no token allowed (an engine's error state): any; `cut` refuses what comes
        row.fill_(-1)


def _live(request: Request) -> bool:
    return request.grammar is not None and request.finish_reason is None


def next_masks(requests: Sequence[Request], words: int, device) -> torch.Tensor:
    """The bitmask after each request's committed tokens. Shapes: -> ``[bs, W]`` int32 (all ones: unconstrained)."""
    masks = torch.full((len(requests), words), -1, dtype=torch.int32)
    for b, request in enumerate(requests):
        if _live(request):
            _fill(request.grammar.matcher, masks[b])
    return masks.to(device)


def draft_masks(requests: Sequence[Request], words: int, device) -> torch.Tensor:
    """The draft extend's depth-1 masks: the state after the committed tokens, as `next_masks`; a step of its own
    so the draft side's masks are told apart from the target's (``bench/constrained.py`` turns them off to measure
    what they bring). Shapes: -> ``[bs, W]`` int32."""
    return next_masks(requests, words, device)


def path_masks(
    requests: Sequence[Request], paths: Sequence[Sequence[Sequence[int] | None]], words: int
) -> tuple[torch.Tensor, list[list[bool]]]:
    """The bitmask after each path (tokens past the committed ones; None: a dead node), and whether the grammar
    allows each path (an unconstrained request's always). Walks each request's matcher along the path and rolls
    it back. Shapes: ``paths [bs][P]`` -> ``[bs, P, W]`` int32 on the host, ``[bs][P]``."""
    width = max((len(p) for p in paths), default=0)
    masks = torch.full((len(requests), width, words), -1, dtype=torch.int32)
    live = []
    for b, request in enumerate(requests):
        if not _live(request):
            live.append([True] * len(paths[b]))
            continue
        matcher, allowed = request.grammar.matcher, []
        for i, path in enumerate(paths[b]):
            if path is None:
                allowed.append(False)
                continue
            done = matcher.try_consume(path)
            if done == len(path):
                _fill(matcher, masks[b, i])
            allowed.append(done == len(path))
            matcher.rollback(done)
        live.append(allowed)
    return masks, live


def _paths(tokens: list[int], parents: list[int], dead: list[bool], rows: Sequence[int], root: bool) -> list:
    """The token path from the root (excluded when ``root``, the committed last token) to each row; None where
    a row or an ancestor is dead."""
    out = []
    for row in rows:
        path, node = [], row
        while node >= 0 and not (root and parents[node] < 0):
            if dead[node]:
                path = None
                break
            path.append(tokens[node])
            node = parents[node]
        out.append(None if path is None else path[::-1])
    return out


def row_masks(
    requests: Sequence[Request],
    tokens: torch.Tensor,
    parents: torch.Tensor,
    padding: torch.Tensor | None,
    words: int,
    live: bool = False,
):
    """Every verify row's bitmask: row ``d``'s is the state after the path to node ``d`` (row 0, the root: after
    the committed tokens). Shapes: ``tokens``, ``parents [bs, N]`` -> ``[bs, N, W]`` int32 on ``tokens``' device;
    with ``live``, also whether the grammar allows each row's path ``[bs][N]`` (a lookup draft drops the rows
    past the last allowed one)."""
    bs, n = tokens.shape
    tok, par = tokens.tolist(), parents.tolist()
    pad = [[False] * n] * bs if padding is None else padding.tolist()
    paths = [
        _paths(tok[b], par[b], pad[b], range(n), root=True) if _live(requests[b]) else [None] * n for b in range(bs)
    ]
    masks, allowed = path_masks(requests, paths, words)
    return (masks.to(tokens.device), allowed) if live else masks.to(tokens.device)


class FrontierMasks:
    """The bitmask of each draft level's frontier nodes, for a forward draft's `draft_levels`.

    Level ``j``'s frontier node ``c`` (a candidate index, level order) stands after the tokens of its branch:
    the walk from ``c`` up the candidates' parents. Shapes: ``level`` takes the candidates so far (the lists
    of ``[bs, *]`` tensors `draft_levels` keeps) and ``frontier_cand [bs, K]`` -> ``[bs * K, W]`` int32.
    """

    def __init__(self, requests: Sequence[Request], words: int, topk: int):
        self.requests, self.words, self.topk = requests, words, topk

    def level(self, cand_tokens: list[torch.Tensor], cand_parents: list[torch.Tensor], frontier_cand) -> torch.Tensor:
        tokens = torch.cat(cand_tokens, 1)
        bs = tokens.shape[0]
        device = tokens.device
        if self.topk == 1:  # a chain: the frontier's branch is every level's candidate
            tok = tokens.tolist()
            paths = [[None if any(t < 0 for t in tok[b]) else tok[b]] for b in range(bs)]
        else:
            tok, par = tokens.tolist(), torch.cat(cand_parents, 1).tolist()
            cand = frontier_cand.tolist()
            paths = [
                _paths(tok[b], par[b], [t < 0 for t in tok[b]], cand[b], root=False)
                if _live(self.requests[b])
                else [None] * self.topk
                for b in range(bs)
            ]
        masks, _ = path_masks(self.requests, paths, self.words)
        return masks.reshape(bs * self.topk, self.words).to(device)


def cut(request: Request, tokens: Sequence[int]) -> tuple[int, str | None, str | None]:
    """Where the grammar ends a run of tokens the cycle is about to commit: ``(keep, reason, error)``.

    ``keep`` tokens stay: all of them (reason None), or up to the one after which the grammar is finished
    (``"stop"``); a token the grammar refuses fails the request (``"error"`` and the message). The matcher is
    rolled back: `advance` moves it for good.
    """
    if not _live(request):
        return len(tokens), None, None
    matcher = request.grammar.matcher
    kind = request.sampling.constraint[0]
    done = 0
    try:
        for token in tokens:
            if matcher.try_consume([token]) != 1:
                where = len(request.output) + done
                return done, "error", f"the {kind} allows no token at output position {where}"
            done += 1
            if matcher.is_stopped():
                return done, "stop", None
        return done, None, None
    finally:
        matcher.rollback(done)


def advance(request: Request, tokens: Sequence[int]) -> Request:
    """The request's matcher moved over its newly committed ``tokens`` (already cut by `cut`)."""
    if request.grammar is None or not tokens:
        return request
    done = request.grammar.matcher.try_consume(tokens)
    if done != len(tokens):
        raise RuntimeError(f"request {request.request_id}: the grammar refused committed token {done} after the cut")
    return attrs.evolve(request, grammar=attrs.evolve(request.grammar, consumed=request.grammar.consumed + done))


def check_matchers(requests: Sequence[Request], ports) -> list[str]:
    """What is wrong with the constrained requests' matchers (invariant 16): each stands after exactly its
    request's committed tokens, which a freshly compiled matcher accepts and leaves in the same state (equal
    masks). An empty list: nothing."""
    problems = []
    for request in requests:
        if request.grammar is None or request.finish_reason == "error":
            continue
        rid, output = request.request_id, request.output
        position = getattr(request.grammar.matcher, "position", request.grammar.consumed)  # where the engine counts
        if request.grammar.consumed != len(output) or position != len(output):
            stands = f"{request.grammar.consumed} tokens (its engine counts {position})"
            problems.append(f"request {rid}: its matcher stands after {stands}, not after the {len(output)} committed")
            continue
        fresh = ports.grammar.compile(*request.sampling.constraint)
        done = fresh.try_consume(output)
        if done != len(output):
            problems.append(f"request {rid}: the grammar refuses committed token {done}")
            continue
        words = mask_words(ports.target.vocab_size)
        ours, theirs = torch.zeros(words, dtype=torch.int32), torch.zeros(words, dtype=torch.int32)
        if not request.grammar.matcher.is_stopped():
            request.grammar.matcher.fill_mask(ours)
            fresh.fill_mask(theirs)
        if request.grammar.matcher.is_stopped() != fresh.is_stopped() or not torch.equal(ours, theirs):
            problems.append(f"request {rid}: its matcher does not stand where the committed tokens lead")
    return problems
