"""Test doubles for recurrent targets and block drafts, in the spirit of `testing.models`.

`RecurrentHashTarget` is a `HashedNgramTarget` with a recurrent state: a rolling hash of every token
so far, kept in a real `RecurrentPool` and chained row to row exactly as a Mamba layer's state is.
Each row checks that the state it continues folds exactly the tokens its attention reads back from
the KV, so a verify row fed the wrong parent, or a commit of the wrong row, fails at once; its
next-token logits also depend on the state, so a wrong state changes the output.

`NoisyBlockDraft` is a `BlockDraft` (DFlash-like) whose block agrees with the target at a chosen
rate; it reads its context back from its own fingerprint cache and checks the block's attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.ports import ForwardBatch, ModelOutput
from ..engine.memory.recurrent_pool import RecurrentPool
from .models import _hash, _ngram_logits, read_contexts

_MOD = 2_147_483_647


def fold(tokens: Sequence[int], state: int = 0) -> int:
    """The rolling hash a `RecurrentHashTarget` keeps after ``tokens``."""
    for token in tokens:
        state = (state * 1_000_003 + token + 1) % _MOD
    return state


class RecurrentHashTarget:
    """`TargetModel` whose logits hash the last ``n`` tokens and the recurrent state; ``states`` is its pool.

    Hand ``target.states`` to `Ports.recurrent`. Features (``hidden``) are ``(token, position)``.
    """

    def __init__(self, pool, vocab_size: int = 32, n: int = 3, max_requests: int = 256, max_rows: int = 64):
        self.pool, self.vocab_size, self.n = pool, vocab_size, n
        self.device = torch.device("cpu")
        self.states = RecurrentPool(
            num_layers=1, state_shapes={"hash": (1,)}, max_requests=max_requests, max_rows=max_rows, dtype=torch.int64
        )

    def next_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        return _ngram_logits(tuple(tokens[-self.n :]) + (fold(tokens) % 7,), self.vocab_size)

    def greedy(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> list[int]:
        """Plain greedy decoding, the losslessness oracle."""
        tokens, out = list(prompt), []
        for _ in range(max_new_tokens):
            nxt = int(self.next_logits(tokens).argmax())
            out.append(nxt)
            tokens.append(nxt)
            if nxt in stop_token_ids:
                break
        return out

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        contexts = read_contexts(batch, self.pool.target, "target")
        plan = self.states.plan(batch)
        outside = self.states.parent_states("hash", 0, plan)[:, 0].tolist()
        parent_row, tokens = plan.parent_row.tolist(), batch.input_ids.tolist()
        new = [0] * batch.num_rows
        for t in plan.row_order.tolist():  # parents first
            parent = new[parent_row[t]] if parent_row[t] >= 0 else outside[t]
            new[t] = fold([tokens[t]], parent)
            if new[t] != fold(contexts[t]):
                raise AssertionError(
                    f"target: row {t} (position {int(batch.positions[t])}) continues a recurrent state that does not "
                    "fold the tokens it attends: the wrong verify row was committed or the wrong parent chained"
                )
        self.states.store("hash", 0, plan, torch.tensor(new, dtype=torch.long)[:, None])
        logits = torch.stack([self.next_logits(c) for c in contexts])
        hidden = torch.stack([batch.input_ids, batch.positions], dim=1).float()
        rows = batch.logits_rows
        return ModelOutput(logits=logits if rows is None else logits[rows], hidden=hidden)


class NoisyBlockDraft:
    """`BlockDraft` that proposes the target's greedy continuation, each token right with ``agreement``.

    Its extend stores ``(token, position)`` from the target's features into ``pool.draft`` (a DFlash
    context is built from target features too); ``propose`` checks the block's rows, positions and
    non-causal attention, reads the context back and continues it with its own guesses.
    """

    kind = "block"

    def __init__(self, target, block_size: int, agreement: float = 0.7, salt: int = 3):
        self.target, self.block_size, self.agreement, self.salt = target, block_size, agreement, salt
        self.vocab_size = target.vocab_size
        self.mask_token_id = target.vocab_size

    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor) -> None:
        if target_hidden is None or not torch.equal(target_hidden[:, 1].long(), batch.positions):
            raise AssertionError("block draft extend: the target feature must come from the row's own position")
        self.target.pool.draft[batch.out_slots] = torch.stack([target_hidden[:, 0].long(), batch.positions], dim=1)

    def _guess(self, history: list[int]) -> torch.Tensor:
        logits = self.target.next_logits(history).clone()
        h = _hash(history[-4:] + [len(history)], self.salt)
        if (h % 10_000) / 10_000 >= self.agreement:
            best = int(logits.argmax())
            other = (best + 1 + h % (self.vocab_size - 1)) % self.vocab_size
            logits[best], logits[other] = logits[other].clone(), logits[best].clone()
        return logits

    def propose(self, batch: ForwardBatch) -> ModelOutput:
        block, P = self.block_size, batch.page_size
        buffer = self.target.pool.draft
        logits = torch.zeros(batch.num_rows, self.vocab_size)
        for b in range(len(batch.request_ids)):
            rows = torch.nonzero(batch.row_request == b).squeeze(1)
            L = int(batch.positions[rows[0]])
            if rows.numel() != block or not torch.equal(batch.positions[rows], L + torch.arange(block)):
                raise AssertionError(f"block draft: request {b}'s block must be {block} rows at L + i")
            if not bool((batch.input_ids[rows[1:]] == self.mask_token_id).all()):
                raise AssertionError("block draft: rows after the root must carry mask_token_id")
            for t in rows.tolist():
                seen = sorted(s for s in batch.extra_slots[t].tolist() if s >= 0)
                if int(batch.prefix_lens[t]) != L or seen != sorted(batch.out_slots[rows].tolist()):
                    raise AssertionError("block draft: every row attends the context [0, L) and its whole block")
            prefix = torch.arange(L)
            fps = buffer[batch.page_table[b, prefix // P] * P + prefix % P]
            if not torch.equal(fps[:, 1], prefix):
                raise AssertionError(f"block draft: context positions {fps[:, 1].tolist()} are not 0..{L - 1}")
            history = fps[:, 0].tolist() + [int(batch.input_ids[rows[0]])]
            for t in rows[1:].tolist():
                logits[t] = self._guess(history)
                history.append(int(logits[t].argmax()))
        out = logits if batch.logits_rows is None else logits[batch.logits_rows]
        return ModelOutput(logits=out, hidden=None)
