"""Forced acceptance for benchmarks: a lookup draft that knows the target's greedy continuation.

A random-weights model has no draft worth the name, so a benchmark of the verify side (tensor
parallelism, say) would see every draft rejected. `OracleDraft` is handed the target's own greedy
continuation of each prompt (run autoregressively once, beforehand) and proposes it: each proposed
token is the reference token with probability ``accept_prob``, else a wrong one. The greedy verify
then accepts a run of ``d`` drafts with probability ``p^d (1 - p)``, so ``tau = 1 + p + ... + p^S``
(less where the verify's numerics pick another token than the reference run did, which bf16 can).
It costs no forward, so what is timed is the target.

The coins come from one ``torch.Generator`` seeded by the caller: under tensor parallelism every rank
seeds it alike and draws in the same order, so every rank proposes the same tree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class OracleDraft:
    """`LookupDraft` over reference continuations: ``references[i]`` is prompt ``i`` plus its greedy output.

    A tree (``topk > 1``) has ``num_nodes``: wrong leaves under the root first, then the chain, so it
    costs the verify rows of a tree, accepts like the chain, and its accepted path needs a KV move.
    """

    kind = "lookup"

    def __init__(
        self, vocab_size: int, references: Sequence[Sequence[int]], accept_prob: float, generator: torch.Generator
    ) -> None:
        if not 0.0 <= accept_prob <= 1.0:
            raise ValueError(f"accept_prob={accept_prob} must lie in [0, 1]")
        if vocab_size < 2:
            raise ValueError("an oracle draft needs a vocabulary of at least 2 tokens to propose a wrong one")
        self.vocab_size, self.accept_prob, self.generator = vocab_size, accept_prob, generator
        self.references = [list(r) for r in references]

    def _reference(self, history: Sequence[int]) -> list[int]:
        """The reference sequence ``history`` is a prefix of (the longest match; empty if none)."""
        n = len(history)
        best: list[int] = []
        for ref in self.references:
            if len(ref) > n and len(ref) > len(best) and ref[:n] == list(history):
                best = ref
        return best[n:]

    def propose(self, request_ids, histories, num_steps: int, num_nodes: int, topk: int):
        """``num_steps`` chain nodes (fewer near the end of the reference), padded to ``num_nodes`` for a tree."""
        bs = len(histories)
        depth = min(num_steps, num_nodes)
        coins = torch.rand((bs, depth), generator=self.generator) < self.accept_prob  # [bs, S]
        shifts = torch.randint(1, self.vocab_size, (bs, num_nodes), generator=self.generator)  # never 0: wrong
        width = num_nodes if topk > 1 else depth
        tokens = torch.zeros((bs, width), dtype=torch.long)
        parents = torch.zeros((bs, width), dtype=torch.long)
        for b, history in enumerate(histories):
            wanted = self._reference(history)[:depth]
            wanted += [history[-1]] * (depth - len(wanted))  # past the reference: any token, rejected or not
            decoys = width - depth  # rows 1..decoys: wrong children of the root
            for i in range(decoys):
                tokens[b, i] = (wanted[0] + int(shifts[b, depth + i])) % self.vocab_size
                parents[b, i] = 0
            for i, token in enumerate(wanted):
                right = bool(coins[b, i])
                tokens[b, decoys + i] = token if right else (token + int(shifts[b, i])) % self.vocab_size
                parents[b, decoys + i] = 0 if i == 0 else decoys + i  # verify row of the previous chain node
        return tokens, parents
