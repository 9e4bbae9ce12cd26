"""Vectorized hashed n-gram models: the `HashedNgramTarget` language model at thousands of requests a batch.

The statistical tests of lossless sampling run tens of thousands of independent requests through the
cycle; the per-row Python of `HashedNgramTarget` would take minutes. These models compute the same
logits with tensor ops: `BatchedNgramTarget` returns exactly `ngram_logits(context)` for the context
it reads back from its KV, so the target's distribution after any prefix is known exactly
(`HashedNgramTarget.next_logits`). `BatchedNgramDraft` mixes those logits with a salted copy, so it
agrees with the target only in part. Both read their context through the page table and the extra
slots, as a model attends, and check the positions they find.
"""

from __future__ import annotations

import torch

from ..core.ports import ForwardBatch, ModelOutput
from .models import _MOD, _MULT, _STEP, HashedNgramTarget


def hashed_logits(context: torch.Tensor, vocab_size: int, salt: int = 0) -> torch.Tensor:
    """`ngram_logits` of many contexts at once (salt 0: exactly its values).

    Shapes: ``context [T, n]`` int64, oldest token first, ``-1`` for absent tokens (before position 0)
    -> ``[T, V]`` float32.
    """
    h = torch.full(context.shape[:1], 2166136261 ^ salt, dtype=torch.long, device=context.device)
    for i in range(context.shape[1]):
        token = context[:, i]
        h = torch.where(token >= 0, ((h ^ (token + 1)) * 16777619) & 0xFFFFFFFF, h)
    vocab = torch.arange(vocab_size, device=context.device)
    # (h * a + v * b) mod 2^16: int64 products wrap, and wrapping keeps the low 16 bits exact.
    return ((h[:, None] * _MULT + vocab[None, :] * _STEP) & (_MOD - 1)).float() / _MOD * 8.0


def read_tails(batch: ForwardBatch, buffer: torch.Tensor, n: int, who: str) -> torch.Tensor:
    """Write each row's fingerprint ``(token, position)``, then read the last ``n`` tokens it attends.

    Position ``q`` of row ``t`` comes through the page table when ``q < prefix_len`` and from the
    row's extra slots otherwise; a position the row cannot see, or a slot holding another position,
    raises. Shapes: -> ``[T, n]`` int64, oldest first, ``-1`` before position 0.
    """
    buffer[batch.out_slots] = torch.stack([batch.input_ids, batch.positions], dim=1)
    device = batch.input_ids.device
    want = batch.positions[:, None] - torch.arange(n - 1, -1, -1, device=device)[None, :]  # [T, n]
    valid = want >= 0
    page_size = batch.page_size
    pages = batch.page_table[batch.row_request]  # [T, max_pages]
    safe = want.clamp(min=0)
    page = pages.gather(1, (safe // page_size).clamp(max=pages.shape[1] - 1))
    from_prefix = valid & (want < batch.prefix_lens[:, None]) & (page >= 0)
    slots = torch.where(from_prefix, page * page_size + safe % page_size, 0)
    found = from_prefix
    extra = batch.extra_slots  # [T, M]
    if extra.shape[1]:
        extra_pos = torch.where(extra >= 0, buffer[extra.clamp(min=0), 1], -2)  # [T, M]
        match = extra_pos[:, None, :] == want[:, :, None]  # [T, n, M]
        from_extra = match.any(-1) & valid & ~from_prefix
        pick = extra.gather(1, match.float().argmax(-1))  # [T, n]
        slots = torch.where(from_extra, pick, slots)
        found = found | from_extra
    fingerprints = buffer[slots]  # [T, n, 2]
    bad = valid & (~found | (fingerprints[..., 1] != want))
    if bool(bad.any()) or not torch.equal(fingerprints[:, -1, 0], batch.input_ids):
        row = int(bad.any(-1).nonzero()[0]) if bool(bad.any()) else 0
        raise AssertionError(
            f"{who}: row {row} (position {int(batch.positions[row])}) cannot read positions "
            f"{want[row].tolist()} back from its KV, or does not see its own token"
        )
    return torch.where(valid, fingerprints[..., 0], -1)


class BatchedNgramTarget(HashedNgramTarget):
    """`HashedNgramTarget` with a vectorized forward (same logits; ``next_logits`` is the exact oracle)."""

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        self.calls += 1
        logits = hashed_logits(read_tails(batch, self.pool.target, self.n, "target"), self.vocab_size)
        hidden = torch.stack([batch.input_ids, batch.positions], dim=1).float()
        rows = batch.logits_rows
        return ModelOutput(logits=logits if rows is None else logits[rows], hidden=hidden)


class BatchedNgramDraft:
    """`DraftModel`: ``(1 - mix) * target logits + mix * salted logits`` of the context in its own KV.

    ``pairing="shifted"`` (EAGLE: token ``t[p + 1]`` at position ``p``, its last ``n`` input tokens are
    the sequence's last ``n``) or ``"aligned"``; both read the same context, so ``mix = 0`` is a draft
    whose ``q`` equals the target's ``p``. Shifted drafts check the feature pairing like `NoisyDraft`.
    """

    kind = "forward"

    def __init__(self, target: HashedNgramTarget, mix: float = 0.5, pairing: str = "shifted", salt: int = 7):
        self.target, self.mix, self.pairing, self.salt = target, mix, pairing, salt
        self.vocab_size = target.vocab_size

    def logits(self, context: torch.Tensor) -> torch.Tensor:
        """Shapes: ``context [T, n]`` (as `hashed_logits`) -> ``[T, V]``."""
        own = hashed_logits(context, self.vocab_size)
        other = hashed_logits(context, self.vocab_size, self.salt)
        return (1 - self.mix) * own + self.mix * other

    def _run(self, batch: ForwardBatch) -> ModelOutput:
        tails = read_tails(batch, self.target.pool.draft, self.target.n, f"draft ({self.pairing})")
        logits = self.logits(tails)
        hidden = torch.stack([batch.input_ids, batch.positions], dim=1).float()
        rows = batch.logits_rows
        return ModelOutput(logits=logits if rows is None else logits[rows], hidden=hidden)

    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> ModelOutput:
        if self.pairing == "shifted" and (
            target_hidden is None or not torch.equal(target_hidden[:, 1].long(), batch.positions)
        ):
            raise AssertionError("shifted draft extend: the target feature must come from the same position")
        return self._run(batch)

    def step(self, batch: ForwardBatch, parent_hidden: torch.Tensor | None) -> ModelOutput:
        if parent_hidden is None or not torch.equal(parent_hidden[:, 1].long(), batch.positions - 1):
            raise AssertionError("draft step: a node's parent must sit one position before it")
        return self._run(batch)
