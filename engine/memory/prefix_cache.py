"""A radix tree over full KV pages: the pool's prefix cache (`PagedKVPool(prefix_cache=True)`).

Each node is one page of ``P`` committed positions, keyed by the ``P + 1`` token ids at positions
``[k P, (k + 1) P]``: the page's own tokens and the first token of the next page. The extra token is there
for shifted drafts (EAGLE): the draft's KV at position ``p`` is computed from token ``t[p + 1]``, so the
page's last draft row depends on the next page's first token. A path from the root spells a prefix of
pages; a request whose tokens follow the path may read those pages instead of recomputing them.

The tree holds no tensors, only page ids, reference counts and a clock:

* ``refs``: how many requests hold the node's page in their page tables; ``subtree_refs``: the sum over
  the node and its descendants. A node whose ``subtree_refs`` is 0 is *evictable*: evicting leaves in LRU
  order reaches it, so the pool counts it as free (`PagedKVPool.num_free_pages`).
* ``last_used``: the clock when a request last matched or published the node; eviction takes the least
  recently used leaf first, then its parent once that is an unreferenced leaf.

A page in the tree is read-only: no request writes it again (checked mode, invariant 15). Pages are only
ever published full and committed (`PagedKVPool.publish`).
"""

from __future__ import annotations

import heapq
import itertools

import attrs


@attrs.define(eq=False)
class PageNode:
    """One cached page. ``tokens``: the ``P + 1`` ids it is keyed by (empty for the root)."""

    page: int
    tokens: tuple[int, ...]
    parent: PageNode | None
    children: dict[tuple[int, ...], PageNode] = attrs.field(factory=dict)
    refs: int = 0
    subtree_refs: int = 0
    last_used: int = 0


class PrefixTree:
    """The tree and its accounting; `PagedKVPool` owns one and moves pages between it and its free list."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = PageNode(page=-1, tokens=(), parent=None)
        self.nodes: dict[int, PageNode] = {}  # page id -> node
        self.evictable = 0  # nodes whose subtree_refs is 0
        self.evicted = 0  # pages evicted since the tree was made
        self._clock = itertools.count(1)

    def key(self, tokens, k: int) -> tuple[int, ...]:
        """The key of page ``k`` of ``tokens``: positions ``[k P, (k + 1) P]``."""
        P = self.page_size
        return tuple(tokens[k * P : (k + 1) * P + 1])

    def full_pages(self, num_tokens: int) -> int:
        """Pages a sequence of ``num_tokens`` ids can key: each needs its ``P`` tokens and the next one."""
        return max(0, (num_tokens - 1) // self.page_size)

    def touch(self, node: PageNode) -> None:
        node.last_used = next(self._clock)

    def add_ref(self, node: PageNode, delta: int) -> None:
        """A request took (``+1``) or dropped (``-1``) the node's page."""
        node.refs += delta
        if node.refs < 0:
            raise AssertionError(f"page {node.page}: reference count below zero (a double free)")
        walk = node
        while walk is not self.root:
            before = walk.subtree_refs
            walk.subtree_refs += delta
            if before == 0 and walk.subtree_refs > 0:
                self.evictable -= 1
            elif before > 0 and walk.subtree_refs == 0:
                self.evictable += 1
            walk = walk.parent

    def insert(self, parent: PageNode, tokens: tuple[int, ...], page: int) -> PageNode:
        """A new node for ``page`` under ``parent``, held by the request that published it (refs 1)."""
        if page in self.nodes:
            raise AssertionError(f"page {page} is already in the prefix cache")
        node = PageNode(page=page, tokens=tokens, parent=parent)
        parent.children[tokens] = node
        self.nodes[page] = node
        self.evictable += 1  # subtree_refs 0 until the publisher's reference lands
        self.add_ref(node, 1)
        self.touch(node)
        return node

    def longest_partial(self, parent: PageNode, tokens) -> tuple[PageNode | None, int]:
        """The child of ``parent`` that agrees longest with ``tokens`` (the next page's ids), and how long."""
        best, best_len = None, 0
        for key, child in parent.children.items():
            n = 0
            for a, b in zip(key, tokens):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = child, n
        return best, best_len

    def evict(self, count: int) -> list[int]:
        """Drop up to ``count`` unreferenced pages, least recently used leaves first; returns their ids."""
        heap = [(n.last_used, n.page) for n in self.nodes.values() if not n.children and n.subtree_refs == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < count:
            _, page = heapq.heappop(heap)
            node = self.nodes.pop(page)
            parent = node.parent
            del parent.children[node.tokens]
            self.evictable -= 1
            self.evicted += 1
            freed.append(page)
            if parent is not self.root and not parent.children and parent.subtree_refs == 0:
                heapq.heappush(heap, (parent.last_used, parent.page))
        return freed
