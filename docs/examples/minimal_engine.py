"""A complete engine for speccycle in one file: a table language model, a prompt-lookup draft, a paged pool.

The target's next token is a fixed function of the last three tokens, ``TABLE[t[p-2], t[p-1], t[p]]``;
it reads the two earlier ones back from its KV cache, the way attention would, and checks that it sees
every position ``0..p`` once, so the cycle's slots, positions, masks and KV moves all have to be right
for its output to equal plain greedy decoding. The draft looks up the last token only, so it guesses
wrong often enough for trees, rejections and KV moves to happen. Run it:

    .venv/bin/python docs/examples/minimal_engine.py
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from speccycle.core import ForwardBatch, KVPoolExhausted, ModelOutput, Ports, Request, SamplingParams, SpecConfig
from speccycle.statemachine import generate

VOCAB = 16
TABLE = torch.randint(0, VOCAB, (VOCAB, VOCAB, VOCAB), generator=torch.Generator().manual_seed(0))  # [V, V, V]


def next_token(context: Sequence[int]) -> int:
    """The target's greedy next token after ``context`` (positions before 0 read as token 0)."""
    padded = [0, 0, *context]
    return int(TABLE[padded[-3], padded[-2], padded[-1]])


def greedy_decode(prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding, no speculation: the output the cycle must reproduce."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class PagedPool:
    """`KVPool`: fixed-size pages handed out from a free list; the "KV" of a slot is (token, position)."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self._free = list(range(num_pages))
        self._pages: dict[int, list[int]] = {}
        self.kv = torch.full((num_pages * page_size, 2), -1, dtype=torch.long)  # [num_slots, 2]

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_held(self, request_id: int) -> int:
        return len(self._pages.get(request_id, ()))

    def allocate(self, request_id: int, num_tokens: int) -> None:
        pages = self._pages.setdefault(request_id, [])
        need = -(-num_tokens // self.page_size) - len(pages)
        if need > len(self._free):
            raise KVPoolExhausted(f"request {request_id} needs {need} more pages, {len(self._free)} are free")
        pages.extend(self._free.pop() for _ in range(max(0, need)))

    def release(self, request_id: int, keep_tokens: int) -> None:
        pages = self._pages.get(request_id, [])
        while len(pages) > -(-keep_tokens // self.page_size):
            self._free.append(pages.pop())

    def free(self, request_id: int) -> None:
        self._free.extend(self._pages.pop(request_id))  # KeyError on a second free

    def page_table(self, request_ids: Sequence[int]) -> torch.Tensor:
        width = max([self.pages_held(r) for r in request_ids] + [1])
        table = torch.full((len(request_ids), width), -1, dtype=torch.long)
        for i, rid in enumerate(request_ids):
            table[i, : self.pages_held(rid)] = torch.tensor(self._pages.get(rid, []), dtype=torch.long)
        return table

    def target_buffers(self) -> Sequence[torch.Tensor]:
        return (self.kv,)  # what the cycle's KV moves copy, slot-major


class TableTarget:
    """`TargetModel`: writes each row's KV, attends as the ports' rule says, predicts from the last three."""

    device = torch.device("cpu")  # where its forward runs: the cycle builds its index tensors there

    def __init__(self, pool: PagedPool):
        self.pool, self.vocab_size = pool, VOCAB

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        kv, P = self.pool.kv, batch.page_size
        kv[batch.out_slots] = torch.stack([batch.input_ids, batch.positions], dim=1)  # every row writes first
        logits = torch.zeros(batch.num_rows, VOCAB)
        for t in range(batch.num_rows):
            # Attend the request's positions [0, prefix_len) through its page table, plus extra_slots.
            b, prefix = int(batch.row_request[t]), torch.arange(int(batch.prefix_lens[t]))
            extra = batch.extra_slots[t]
            slots = torch.cat([batch.page_table[b, prefix // P] * P + prefix % P, extra[extra >= 0]])
            seen = sorted((pos, tok) for tok, pos in kv[slots].tolist())  # (position, token) it attends
            pos = int(batch.positions[t])
            if [p for p, _ in seen] != list(range(pos + 1)):  # a real model would quietly compute garbage
                raise AssertionError(f"row {t} at position {pos} attends positions {[p for p, _ in seen]}")
            logits[t, next_token([tok for _, tok in seen[-3:]])] = 1.0
        rows = batch.logits_rows
        return ModelOutput(logits=logits if rows is None else logits[rows], hidden=None)


class PromptLookup:
    """`LookupDraft`: propose what followed earlier occurrences of the last token, as a trie."""

    kind = "lookup"
    vocab_size = VOCAB

    def propose(self, request_ids, histories, num_steps: int, num_nodes: int, topk: int):
        tokens = torch.zeros((len(histories), num_nodes), dtype=torch.long)
        parents = torch.zeros((len(histories), num_nodes), dtype=torch.long)
        for b, history in enumerate(histories):
            rows = [(-1, history[-1])]  # (parent row, token); row 0 is the root
            for guess in self._continuations(list(history), num_steps, topk):
                node = 0
                for token in guess:  # share the prefix of earlier guesses
                    child = next((i for i, row in enumerate(rows) if row == (node, token)), None)
                    if child is None and len(rows) > num_nodes:
                        break
                    if child is None:
                        rows.append((node, token))
                        child = len(rows) - 1
                    node = child
            while len(rows) <= num_nodes:  # out of guesses: any token will do, the verify rejects it
                rows.append((len(rows) - 1 if topk == 1 else 0, history[-1]))  # K == 1 stays a chain
            parents[b] = torch.tensor([parent for parent, _ in rows[1:]])
            tokens[b] = torch.tensor([token for _, token in rows[1:]])
        return tokens, parents

    @staticmethod
    def _continuations(history: list[int], length: int, limit: int) -> list[list[int]]:
        """What followed the last token's earlier occurrences, most recent first."""
        found = []
        for start in range(len(history) - 2, -1, -1):
            if history[start] == history[-1] and len(found) < limit:
                found.append(history[start + 1 : start + 1 + length])
        return found


def run(config: SpecConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int = 40) -> list[Request]:
    """Generate with speculation in checked mode; returns the finished requests."""
    num_pages = len(prompts) * (128 // config.page_size)  # room for 128 positions per request
    pool = PagedPool(num_pages=num_pages, page_size=config.page_size)
    ports = Ports(target=TableTarget(pool), draft=PromptLookup(), kv_pool=pool)
    requests = [Request(i, tuple(p), SamplingParams(max_new_tokens=max_new_tokens)) for i, p in enumerate(prompts)]
    verifies = []
    done = generate(requests, config, ports, checked=True, trace=lambda e: verifies.append(e.event == "verify"))
    assert pool.num_free_pages == num_pages, "a finished request kept KV pages"
    print(f"{config}: {sum(verifies)} verify forwards for {sum(len(r.output) for r in done)} tokens")
    return list(done)


def main() -> bool:
    prompts = [(1, 2, 3), (5, 7), (9, 9, 4, 2)]
    ok = True
    for config in (
        SpecConfig(num_steps=4, topk=1, page_size=4),  # a chain: N = S + 1 = 5
        SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4),  # a tree: KV moves after verify
    ):
        for request in run(config, prompts):
            same = list(request.output) == greedy_decode(request.prompt, request.sampling.max_new_tokens)
            ok &= same
            print(f"  request {request.request_id}: {list(request.output)[:12]}... equals greedy decoding: {same}")
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
