"""Hashed n-gram test models that read their context back from the KV they attend."""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import lru_cache

import torch

from ..core.ports import ForwardBatch, ModelOutput

_MULT, _STEP, _MOD = 2654435761, 40503, 65536


def _hash(tokens: Sequence[int], salt: int = 0) -> int:
    h = 2166136261 ^ salt
    for t in tokens:
        h = ((h ^ (t + 1)) * 16777619) & 0xFFFFFFFF
    return h


@lru_cache(maxsize=1 << 16)
def _ngram_logits(context: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    h = _hash(context)
    v = torch.arange(vocab_size, dtype=torch.long)
    # (h * a + v * b) mod 2^16 with b odd is distinct for distinct v < 2^16: no ties in the argmax.
    return ((h * _MULT + v * _STEP) % _MOD).float() / _MOD * 8.0


def ngram_logits(tokens: Sequence[int], vocab_size: int, n: int) -> torch.Tensor:
    """The hashed n-gram LM's next-token logits after ``tokens``. Shapes: -> ``[V]``."""
    return _ngram_logits(tuple(tokens[-n:]), vocab_size)


def read_contexts(batch: ForwardBatch, buffer: torch.Tensor, who: str) -> list[list[int]]:
    """Write each row's fingerprint, then read back what it attends, as a model would.

    Checks that the attended fingerprints hold positions ``0..p`` exactly once each and that the row
    sees itself last: a wrong slot, page table, position, mask or KV move breaks this.
    """
    buffer[batch.out_slots] = torch.stack([batch.input_ids, batch.positions], dim=1)
    P = batch.page_size
    contexts = []
    for t in range(batch.num_rows):
        b = int(batch.row_request[t])
        prefix = torch.arange(int(batch.prefix_lens[t]))
        slots = batch.page_table[b, prefix // P] * P + prefix % P
        extra = batch.extra_slots[t]
        fps = buffer[torch.cat([slots, extra[extra >= 0]])]
        fps = fps[fps[:, 1].argsort()]
        pos = int(batch.positions[t])
        if not torch.equal(fps[:, 1], torch.arange(pos + 1)):
            raise AssertionError(
                f"{who}: row {t} (request {batch.request_ids[b]}, position {pos}) attends positions "
                f"{fps[:, 1].tolist()}, expected 0..{pos}"
            )
        if int(fps[-1, 0]) != int(batch.input_ids[t]):
            raise AssertionError(f"{who}: row {t} does not see its own token last")
        contexts.append(fps[:, 0].tolist())
    return contexts


class HashedNgramTarget:
    """`TargetModel`: next-token logits are a hash of the last ``n`` tokens it reads from its KV.

    Its features (``hidden``) are ``(token, position)`` per row, so a draft can check its pairing.
    """

    def __init__(self, pool, vocab_size: int = 32, n: int = 3, nan_requests: Sequence[int] = ()):
        self.pool, self.vocab_size, self.n = pool, vocab_size, n
        self.nan_requests = set(nan_requests)
        self.device = torch.device("cpu")
        self.calls = 0

    def next_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        return ngram_logits(tokens, self.vocab_size, self.n)

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
        self.calls += 1
        contexts = read_contexts(batch, self.pool.target, "target")
        logits = torch.stack([self.next_logits(c) for c in contexts])
        for t in range(batch.num_rows):
            if batch.request_ids[int(batch.row_request[t])] in self.nan_requests:
                logits[t] = float("nan")
        hidden = torch.stack([batch.input_ids, batch.positions], dim=1).float()
        rows = batch.logits_rows
        return ModelOutput(logits=logits if rows is None else logits[rows], hidden=hidden)


class NoisyDraft:
    """`DraftModel` that agrees with a `HashedNgramTarget` on a chosen share of contexts.

    ``pairing="shifted"`` behaves like EAGLE (token ``t[p + 1]`` with feature ``f[p]`` at ``p``) and
    checks that pairing; ``"aligned"`` behaves like a standalone draft model. It records the
    positions of every forward (``step_positions``) for the position regression tests.

    Its hidden state per row is ``(token, position, the last n tokens it attended, -1 padded in front)``: its
    logits are a function of those tokens, so it computes them from a hidden state alone
    (``logits_from_hidden``), and its ``extend_hidden`` runs the extend without them: the draft extend of a
    cycle of ``S == 0`` defers its top-K (`core.ports.defers_first_level`).
    """

    kind = "forward"

    def __init__(self, target: HashedNgramTarget, agreement: float = 0.7, pairing: str = "shifted", salt: int = 1):
        self.target, self.agreement, self.pairing, self.salt = target, agreement, pairing, salt
        self.vocab_size = target.vocab_size
        self.step_positions: list[torch.Tensor] = []
        self.step_inputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _logits(self, context: list[int]) -> torch.Tensor:
        tail = context[-self.target.n :]
        logits = self.target.next_logits(tail).clone()
        h = _hash(tail, self.salt)
        if (h % 10_000) / 10_000 >= self.agreement:
            best = int(logits.argmax())
            other = (best + 1 + h % (self.vocab_size - 1)) % self.vocab_size
            logits[best], logits[other] = logits[other].clone(), logits[best].clone()
        return logits

    def _hidden(self, batch: ForwardBatch, contexts: list[list[int]]) -> torch.Tensor:
        n = self.target.n
        tails = torch.tensor([[-1] * (n - len(c[-n:])) + c[-n:] for c in contexts], dtype=torch.float32)
        return torch.cat([torch.stack([batch.input_ids, batch.positions], dim=1).float(), tails.view(-1, n)], 1)

    def _run(self, batch: ForwardBatch) -> ModelOutput:
        contexts = read_contexts(batch, self.target.pool.draft, f"draft ({self.pairing})")
        logits = torch.stack([self._logits(c) for c in contexts])
        rows = batch.logits_rows
        return ModelOutput(logits=logits if rows is None else logits[rows], hidden=self._hidden(batch, contexts))

    def _check_pairing(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> None:
        if self.pairing == "shifted":
            if target_hidden is None or not torch.equal(target_hidden[:, 1].long(), batch.positions):
                raise AssertionError("shifted draft extend: the target feature must come from the same position")

    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> ModelOutput:
        self._check_pairing(batch, target_hidden)
        return self._run(batch)

    def extend_hidden(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> torch.Tensor:
        """`extend` without its logits: the KV writes and the hidden state of every row."""
        self._check_pairing(batch, target_hidden)
        contexts = read_contexts(batch, self.target.pool.draft, f"draft ({self.pairing})")
        return self._hidden(batch, contexts)

    def logits_from_hidden(self, hidden: torch.Tensor) -> ModelOutput:
        """The logits `extend` gives a row of hidden state ``hidden``: those of the tokens it attended last."""
        tails = [[int(t) for t in row[2:].tolist() if t >= 0] for row in hidden]
        return ModelOutput(logits=torch.stack([self._logits(t) for t in tails]), hidden=None)

    def step(self, batch: ForwardBatch, parent_hidden: torch.Tensor | None) -> ModelOutput:
        self.step_positions.append(batch.positions.clone())
        self.step_inputs.append((batch.positions, batch.positions.clone()))
        if parent_hidden is None or not torch.equal(parent_hidden[:, 1].long(), batch.positions - 1):
            got = None if parent_hidden is None else parent_hidden[:, 1].long().tolist()
            raise AssertionError(
                f"draft step at positions {batch.positions.tolist()} was fed parents at {got}: "
                "a node's parent must sit one position before it"
            )
        return self._run(batch)


class TreeLookupDraft:
    """`LookupDraft` proposing random trees whose nodes follow the target with a chosen probability."""

    kind = "lookup"

    def __init__(self, target: HashedNgramTarget, agreement: float = 0.6, seed: int = 0):
        self.target, self.agreement, self.seed = target, agreement, seed
        self.vocab_size = target.vocab_size

    def propose(self, request_ids, histories, num_steps: int, num_nodes: int, topk: int):
        # Sometimes fewer nodes than allowed (the same count for the whole batch), as lookups do.
        rng = random.Random(hash((self.seed, tuple(request_ids), sum(map(len, histories)))))
        num_nodes = num_nodes if rng.random() < 0.6 else rng.randint(0, num_nodes)
        tokens = torch.zeros((len(request_ids), num_nodes), dtype=torch.long)
        parents = torch.zeros((len(request_ids), num_nodes), dtype=torch.long)
        for b, (rid, history) in enumerate(zip(request_ids, histories)):
            rng = random.Random(hash((self.seed, rid, len(history))))
            paths: list[list[int]] = [[]]  # tokens from the root to each row
            for i in range(num_nodes):
                candidates = [r for r, p in enumerate(paths) if len(p) < num_steps]
                parent = rng.choice(candidates) if topk > 1 and rng.random() < 0.5 else candidates[-1]
                context = list(history) + paths[parent]
                good = int(self.target.next_logits(context).argmax())
                token = good if rng.random() < self.agreement else rng.randrange(self.vocab_size)
                tokens[b, i], parents[b, i] = token, parent
                paths.append(paths[parent] + [token])
        return tokens, parents
