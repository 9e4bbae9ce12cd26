"""Prompt lookup: propose what followed the longest earlier match of the history's suffix.

No weights, no forward: a `LookupDraft`. Every earlier occurrence of the history's last token is a
*match*; its length ``m`` is how many tokens up to it agree with the history's suffix (at most
``max_ngram``). Matches rank by length, then by how many of the equally long matches agree on the
next token (a vote), then by recency. A match that ends ``p`` tokens before the end of the history
proposes the ``p`` tokens that followed it, repeated: the match says the text repeats with period
``p``, so a match inside a repeated run ("a a a a") still proposes a full continuation.

How much to propose can follow the evidence: a long match is usually a copy in progress and keeps
being accepted, a one-token match rarely is. With ``depth_per_match`` a match of length ``m``
proposes ``ceil(depth_per_match * m)`` tokens, at least ``min_depth`` and at most ``S``; matches
shorter than ``min_ngram`` propose nothing, and the verify is one row, a plain decode step. Where a
verify row costs time (`for_device`: on the 2-core development CPU a verify of 2 to 4 rows costs
~1.05-1.09 one-row forwards, 5 rows ~1.26, 9 ~1.44, 17 ~1.87) that trades a little tau for cheaper
verifies; measured in docs/ngram.md, ``bench/ngram_tau.py`` and ``bench/ngram_cost.py``.

For a chain (``topk == 1``) the best match's continuation is the draft; for a tree the continuations
of up to ``max_matches`` distinct matches, best first, merge into a trie, so guesses share their
common prefix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

# Replayed on SmolLM2-135M float32, 2 CPU threads (docs/ngram.md, bench/ngram_cost.py): on a CPU the
# engine's verify of 2 to 4 rows costs about a decode step (skinny linears, matmul attention) and 5 rows
# ~1.26, so every match proposes at least 3 tokens (4 rows) and a longer one 1.5 per matched token.
CPU_OPTIONS = {"min_ngram": 1, "depth_per_match": 1.5, "min_depth": 3}
CPU_NUM_STEPS = 16


class NgramDraft:
    """`LookupDraft` over prompt and output (see the module docstring for the rules).

    * ``max_ngram``: the longest suffix compared; a match's length saturates there.
    * ``min_ngram``: matches shorter than this propose nothing.
    * ``depth_per_match``: draft tokens per matched token; None: every match proposes ``S`` tokens.
    * ``min_depth``: the fewest tokens a match proposes (with ``depth_per_match``; at most ``S``).
    * ``max_matches``: continuations a tree merges.

    The defaults propose whenever something matches (most tau); `for_device` picks the measured
    options for a device.
    """

    kind = "lookup"

    def __init__(
        self,
        vocab_size: int,
        max_ngram: int = 32,
        min_ngram: int = 1,
        max_matches: int = 8,
        depth_per_match: float | None = None,
        min_depth: int = 1,
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        if max_matches < 1:
            raise ValueError(f"max_matches={max_matches} must be >= 1")
        if depth_per_match is not None and not depth_per_match > 0:
            raise ValueError(f"depth_per_match={depth_per_match} must be > 0, or None to always propose S tokens")
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram
        if min_depth < 1:
            raise ValueError(f"min_depth={min_depth} must be >= 1")
        self.max_matches, self.depth_per_match, self.min_depth = max_matches, depth_per_match, min_depth

    @classmethod
    def for_device(cls, vocab_size: int, device: str | torch.device, **options) -> NgramDraft:
        """The measured options for ``device``: on a CPU `CPU_OPTIONS` (``max(3, ceil(1.5 m))`` tokens for
        a match of ``m``, at most ``S``); elsewhere the defaults. ``options`` override either."""
        base = CPU_OPTIONS if torch.device(device).type == "cpu" else {}
        return cls(vocab_size, **{**base, **options})

    def matches(self, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Every earlier position ``e`` holding the history's last token, best first, with its match length.

        Shapes: ``ends [M]`` (``history[e] == history[-1]``, ``e < len - 1``), ``lengths [M]`` in
        ``[1, max_ngram]``: the largest ``m`` with ``history[e - m + 1 : e + 1] == history[-m:]``.
        Order: longest first; among equal lengths, the next token most of them agree on first; then
        the most recent first.
        """
        tokens = np.asarray(history, dtype=np.int64)
        size = len(tokens)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1]) if size > 1 else np.zeros(0, dtype=np.int64)
        if not len(ends):
            return ends, np.ones(0, dtype=np.int64)
        # All at once: column k compares the token k before each match with the token k before the end.
        back = np.arange(min(self.max_ngram, size))  # [W]
        before = ends[:, None] - back[None, :]  # [M, W]
        agree = (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[size - 1 - back][None, :])
        lengths = np.cumprod(agree, axis=1).sum(axis=1)  # the run of agreement from column 0 (always True)
        period = size - 1 - ends
        next_token = tokens[ends + 1]  # the first token each match proposes (ends + 1 < size)
        # votes: matches of the same length proposing the same next token
        key = lengths * (int(next_token.max()) + 1) + next_token
        _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
        order = np.lexsort((period, -counts[inverse], -lengths))  # last key sorts first
        return ends[order], lengths[order]

    def continuation(self, history: Sequence[int], end: int, length: int) -> list[int]:
        """``length`` tokens after the match ending at ``end``: what followed it, repeated with period
        ``len(history) - 1 - end`` where it runs into the end of the history."""
        period = len(history) - 1 - end
        return [int(history[end + 1 + i % period]) for i in range(length)]

    def draft_depth(self, match_length: int, num_steps: int) -> int:
        """Tokens a match of ``match_length`` proposes: ``ceil(depth_per_match * m)``, at least ``min_depth``,
        at most ``num_steps``."""
        if self.depth_per_match is None:
            return num_steps
        return min(num_steps, max(self.min_depth, math.ceil(self.depth_per_match * match_length)))

    def continuations(self, history: Sequence[int], length: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` distinct continuations of at most ``length`` tokens, best first."""
        ends, lengths = self.matches(history)
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for end, match_length in zip(ends.tolist(), lengths.tolist()):
            if match_length < self.min_ngram:
                break  # sorted longest first: every later match is shorter
            cont = self.continuation(history, end, self.draft_depth(match_length, length))
            if tuple(cont) not in seen:
                seen.add(tuple(cont))
                found.append(cont)
                if len(found) >= limit:
                    break
        return found

    def propose(self, request_ids, histories, num_steps: int, num_nodes: int, topk: int):
        """Up to ``num_nodes`` nodes per request; only as many as the batch's best match found."""
        limit = 1 if topk == 1 else self.max_matches
        tries = [_trie(self.continuations(history, num_steps, limit), num_nodes, topk) for history in histories]
        width = max((len(t) for t, _ in tries), default=0)
        for (node_tokens, node_parents), history in zip(tries, histories):
            while len(node_tokens) < width:  # a shorter guess than the batch's: pad, cheaply rejected
                node_parents.append(len(node_tokens) if topk == 1 else 0)
                node_tokens.append(history[-1])
        # One tensor for both (a copy per request cost ~5 us each on a CPU host): [2, bs, width]
        both = torch.tensor([[t for t, _ in tries], [p for _, p in tries]], dtype=torch.long)
        both = both.view(2, len(histories), width)
        return both[0], both[1]


def _trie(conts: list[list[int]], num_nodes: int, topk: int) -> tuple[list[int], list[int]]:
    """Merge continuations into a trie, nodes in insertion order (parents first), at most ``num_nodes``.

    A chain (``topk == 1``) takes the first continuation only. Row numbers count the root as row 0.
    """
    if topk == 1:
        first = conts[0][:num_nodes] if conts else []
        return list(first), list(range(len(first)))
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent row, token) -> row
    for cont in conts:
        row = 0
        for token in cont:
            key = (row, token)
            if key not in children:
                if len(tokens) >= num_nodes:
                    break
                tokens.append(token)
                parents.append(row)
                children[key] = len(tokens)
            row = children[key]
    return tokens, parents
