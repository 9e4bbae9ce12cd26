"""Prompt lookup: propose what followed the longest earlier match of the history's suffix.

No weights, no forward: a `LookupDraft`. For a chain it proposes the continuation of the best
match; for a tree it merges the continuations of several matches (longest suffix first, most recent
first) into a trie, so different guesses share their common prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class NgramDraft:
    """`LookupDraft` over prompt and output. ``max_ngram`` .. ``min_ngram``: suffix lengths tried."""

    kind = "lookup"

    def __init__(self, vocab_size: int, max_ngram: int = 4, min_ngram: int = 1, max_matches: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.vocab_size, self.max_ngram, self.min_ngram, self.max_matches = (
            vocab_size,
            max_ngram,
            min_ngram,
            max_matches,
        )

    def continuations(self, history: Sequence[int], length: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` continuations of ``length`` tokens or fewer, best first."""
        tokens = np.asarray(history, dtype=np.int64)
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # earlier windows only
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            for start in hits[::-1]:  # most recent first
                cont = tokens[start + n : start + n + length].tolist()
                if cont and tuple(cont) not in seen:
                    seen.add(tuple(cont))
                    found.append(cont)
                    if len(found) >= limit:
                        return found
        return found

    def propose(self, request_ids, histories, num_steps: int, num_nodes: int, topk: int):
        """Up to ``num_nodes`` nodes per request; only as many as the batch's best match found."""
        limit = 1 if topk == 1 else self.max_matches
        tries = [_trie(self.continuations(history, num_steps, limit), num_nodes, topk) for history in histories]
        width = max((len(t) for t, _ in tries), default=0)
        tokens = torch.zeros((len(histories), width), dtype=torch.long)
        parents = torch.zeros((len(histories), width), dtype=torch.long)
        for b, ((node_tokens, node_parents), history) in enumerate(zip(tries, histories)):
            while len(node_tokens) < width:  # a shorter guess than the batch's: pad, cheaply rejected
                node_parents.append(len(node_tokens) if topk == 1 else 0)
                node_tokens.append(history[-1])
            tokens[b] = torch.tensor(node_tokens, dtype=torch.long)
            parents[b] = torch.tensor(node_parents, dtype=torch.long)
        return tokens, parents


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
