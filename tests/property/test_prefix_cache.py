"""The prefix cache of `PagedKVPool` under random admit / decode / publish / finish / retract / evict sequences.

A Hypothesis state machine drives the pool the way the scheduler does, over a tiny vocabulary so that prompts
share prefixes often, with a pool small enough that reservations evict cached pages. Every cache of the pool
holds a fingerprint per slot: the target's ``(t[p], p)`` and a shifted draft's ``(t[p + 1], p)``, the pairing
that makes a page's last draft row depend on the next page's first token. After every step:

* the pool's accounting holds (`PagedKVPool.audit`): every page free, cached or one request's, reference
  counts equal to the requests holding each cached page, nothing leaked;
* every live request reads its own committed fingerprints at every position ``[0, L)`` in both caches, through
  pages shared or not: no request wrote a page another one reads;
* before any write (prefill rows, speculative scratch past ``L``, the commit) the machine checks that the page
  is not shared (`shared_pages`): a request only writes pages it owns alone.

At teardown every request is freed, a second free of one is refused, and one reservation of the whole pool
evicts every cached page.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from speccycle.core.ports import KVPoolExhausted
from speccycle.engine.errors import KVPoolError
from speccycle.engine.memory.kv_pool import PagedKVPool

VOCAB = 3  # few token ids: prefixes collide, pages are shared and partly agreeing pages copied
SYSTEM = ((0, 1, 2, 0, 1, 2, 0, 1, 2), (0, 1, 2, 0, 2, 2, 1))  # shared "system prompts", agreeing for 4 tokens
SCRATCH = 3  # speculative slots past L a cycle writes (verify rows, draft scratch)


class PrefixPoolMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(4, 14))
    def setup(self, page_size, num_pages):
        self.pool = PagedKVPool(num_pages=num_pages, page_size=page_size, prefix_cache=True)
        target = self.pool.add_cache("target", 1, 1, 2, torch.long)[0][0]  # [slots, 1, 2]: (token, position)
        draft = self.pool.add_cache("draft", 1, 1, 2, torch.long)[0][0]
        self.caches = {"target": target, "draft": draft}
        self.live: dict[int, list[int]] = {}  # request id -> tokens (the last one: the root, no KV yet)
        self.next_id = 0
        self.freed: list[int] = []

    # ---- helpers -----------------------------------------------------------------------------
    def _write(self, rid: int, positions: list[int], tokens: list[int] | None) -> None:
        """Write fingerprints at ``positions`` (None: speculative garbage), after checking no page is shared."""
        if not positions:
            return
        slots = self.pool.slots_for([rid], torch.tensor(positions)).tolist()
        shared = self.pool.shared_pages()
        P = self.pool.page_size
        hit = sorted({s // P for s in slots if s // P in shared})
        assert not hit, f"request {rid} is about to write pages {hit} that the prefix cache shares"
        for slot, p in zip(slots, positions):
            if tokens is None:
                self.caches["target"][slot, 0] = torch.tensor([-7, p])
                self.caches["draft"][slot, 0] = torch.tensor([-7, p])
            else:
                self.caches["target"][slot, 0] = torch.tensor([tokens[p], p])
                self.caches["draft"][slot, 0] = torch.tensor([tokens[p + 1], p])

    def _reserve(self, rid: int, num_tokens: int) -> bool:
        try:
            self.pool.allocate(rid, num_tokens)
            return True
        except KVPoolExhausted:
            return False

    def _prefill(self, rid: int, tokens: list[int], next_token: int) -> bool:
        """Attach the cached prefix, reserve, write the rest; False (request freed) when the pool is short."""
        cached = self.pool.attach_prefix(rid, tokens)
        assert 0 <= cached < len(tokens)
        self.live[rid] = tokens + [next_token]
        self._check_request(rid, cached)  # the cached prefix already holds this request's KV, both caches
        if not self._reserve(rid, len(tokens) + SCRATCH):
            self.pool.free(rid)
            del self.live[rid]
            return False
        self._write(rid, list(range(cached, len(tokens))), self.live[rid])
        return True

    def _check_request(self, rid: int, upto: int) -> None:
        tokens = self.live[rid]
        positions = list(range(upto))
        if not positions:
            return
        slots = self.pool.slots_for([rid], torch.tensor(positions))
        target = self.caches["target"][slots, 0]
        draft = self.caches["draft"][slots, 0]
        want_t = torch.tensor([[tokens[p], p] for p in positions])
        want_d = torch.tensor([[tokens[p + 1], p] for p in positions])
        assert torch.equal(target, want_t), f"request {rid}: target KV {target.tolist()} != {want_t.tolist()}"
        assert torch.equal(draft, want_d), f"request {rid}: draft KV {draft.tolist()} != {want_d.tolist()}"

    # ---- rules -------------------------------------------------------------------------------
    @rule(
        stem=st.sampled_from(SYSTEM) | st.lists(st.integers(0, VOCAB - 1), max_size=6).map(tuple),
        cut=st.integers(0, 9),
        tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
        next_token=st.integers(0, VOCAB - 1),
        reuse=st.booleans(),
    )
    def admit(self, stem, cut, tail, next_token, reuse):
        """A new request: a (cut) shared stem and a tail; with ``reuse``, a later turn of a live request (its
        tokens, then more). Its full committed pages are published after the prefill, as the scheduler does."""
        stem = list(stem[: len(stem) - cut % 3])
        if reuse and self.live:
            stem = list(self.live[min(self.live)])
        rid, self.next_id = self.next_id, self.next_id + 1
        if self._prefill(rid, stem + tail, next_token):
            self.pool.publish(rid, self.live[rid], len(self.live[rid]) - 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4))
    def decode(self, data, new):
        """One speculative cycle: reserve past L, scribble the scratch slots, commit ``len(new)`` tokens."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens = self.live[rid]
        L = len(tokens) - 1
        if not self._reserve(rid, L + len(new) + SCRATCH):
            return
        self._write(rid, list(range(L, L + len(new) + SCRATCH)), None)  # speculative rows
        self.live[rid] = tokens + new
        self._write(rid, list(range(L, L + len(new))), self.live[rid])  # the committed ones
        if data.draw(st.booleans()):
            self.pool.publish(rid, self.live[rid], L + len(new))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def publish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens = self.live[rid]
        self.pool.publish(rid, tokens, len(tokens) - 1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.free(rid)
        del self.live[rid]
        self.freed.append(rid)
        with pytest.raises(KVPoolError, match="double free"):
            self.pool.free(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def retract(self, data):
        """Free a request and admit it again over its tokens so far, as the scheduler resumes it."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens = self.live.pop(rid)
        self.pool.free(rid)
        self._prefill(rid, tokens[:-1], tokens[-1])

    @rule()
    def pressure(self):
        """A request that takes every page it can: cached pages nobody holds are evicted for it."""
        assume(self.pool.num_free_pages > 0)
        rid, self.next_id = self.next_id, self.next_id + 1
        free = self.pool.num_free_pages
        self.pool.allocate(rid, free * self.pool.page_size)
        assert self.pool.num_free_pages == 0
        self.pool.free(rid)

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def accounting_holds(self):
        if hasattr(self, "pool"):
            self.pool.audit()

    @invariant()
    def every_request_reads_its_own_kv(self):
        for rid, tokens in getattr(self, "live", {}).items():
            self._check_request(rid, len(tokens) - 1)

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for rid in list(self.live):
            self.pool.free(rid)
        self.pool.audit()
        assert self.pool.num_free_pages == self.pool.num_pages
        self.pool.allocate(-1, self.pool.num_pages * self.pool.page_size)  # evicts every cached page
        assert self.pool.num_cached_pages == 0
        self.pool.free(-1)
        self.pool.audit()


TestPrefixPoolMachine = PrefixPoolMachine.TestCase
