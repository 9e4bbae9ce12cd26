"""The paged KV pool: pages of ``P`` slots, a free list, per-request page lists, and KV tensors.

A request's position ``p`` lives at slot ``page_table[p // P] * P + p % P``. The pool owns any number
of named caches (the target's layers, a draft's layers); they all share this one slot index space, so
a request's reservation covers its KV in every cache at once. Each layer's K and V is a slot-major
tensor ``[num_pages * P, num_kv_heads, head_dim]``; a layer writes row ``t`` at ``k[out_slots[t]]``.

    pool = PagedKVPool(num_pages=256, page_size=16)
    target_kv = pool.add_cache("target", num_layers=30, num_kv_heads=3, head_dim=64)
    pool.allocate(request_id=7, num_tokens=40)       # 3 pages
    pool.page_table([7])                              # [[p0, p1, p2]]

With ``prefix_cache=True`` the pool also keeps committed full pages after their request is freed, in a radix
tree keyed by their tokens (`engine.memory.prefix_cache`): ``attach_prefix`` gives a new request the pages of
the longest cached prefix of its tokens (shared, read-only, reference counted) and a private copy of the
first page that only partly agrees; ``publish`` puts a request's full committed pages into the tree;
unreferenced cached pages count as free and are evicted, least recently used first, when a reservation
needs them. Every cache of the pool (target and drafts) is indexed by the same slots, so a shared page
carries the target's and the draft's KV of those positions at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from ...core.ports import KVPoolExhausted
from ...core.transfer import to_device
from ..errors import KVPoolError
from .prefix_cache import PageNode, PrefixTree

TARGET_CACHE = "target"

LayerKV = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [num_slots, num_kv_heads, head_dim]


class PagedKVPool:
    """A `KVPool` (core.ports) over ``num_pages`` pages of ``page_size`` slots, on one device."""

    def __init__(
        self, num_pages: int, page_size: int = 16, device: str | torch.device = "cpu", prefix_cache: bool = False
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise KVPoolError(f"num_pages={num_pages} and page_size={page_size} must both be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        # Popped from the end: a fresh pool hands out pages 0, 1, 2, ... which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._freed: set[int] = set()
        self._storage: dict[str, torch.Tensor] = {}  # name -> [num_layers, 2, num_slots, Hkv, D]
        # The last page table built, reused until a page changes hands: a cycle asks for the same
        # table up to three times (draft, verify, draft extend) and most cycles allocate nothing.
        self._version = 0
        self._table: tuple | None = None  # (version, request_ids, device, table)
        self._tree: PrefixTree | None = PrefixTree(page_size) if prefix_cache else None
        # per request: the tree node keyed by each of its leading pages, matched or published (a node's page
        # may be another request's copy of the same tokens, when both computed them)
        self._paths: dict[int, list[PageNode]] = {}

    # ---- bookkeeping ---------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        """Pages a reservation can take: the free list and the cached pages no request holds (evicted on demand)."""
        return len(self._free) + (self._tree.evictable if self._tree is not None else 0)

    @property
    def prefix_caching(self) -> bool:
        return self._tree is not None

    @property
    def num_evicted_pages(self) -> int:
        """Cached pages evicted (taken back for reservations or dropped) since the pool was made."""
        return self._tree.evicted if self._tree is not None else 0

    @property
    def num_cached_pages(self) -> int:
        """Pages in the prefix cache, held by requests or not (0 without a prefix cache)."""
        return len(self._tree.nodes) if self._tree is not None else 0

    def pages_held(self, request_id: int) -> int:
        """Pages the request holds now (0 for an unknown or freed request)."""
        return len(self._pages.get(request_id, ()))

    def has_request(self, request_id: int) -> bool:
        """Whether the request is allocated and not yet freed (it may hold 0 pages after a release)."""
        return request_id in self._pages

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, request_id: int, num_tokens: int) -> None:
        """Grow the request's pages to cover positions ``[0, num_tokens)``; never shrinks.

        All or nothing: raises `KVPoolExhausted` before taking any page when too few are free.
        """
        if num_tokens < 0:
            raise KVPoolError(f"request {request_id}: num_tokens={num_tokens} must be >= 0")
        pages = self._pages.get(request_id, [])
        needed = self.pages_needed(num_tokens) - len(pages)
        if needed > self.num_free_pages:
            raise KVPoolExhausted(
                f"request {request_id} needs {needed} more KV pages ({num_tokens} tokens at page size "
                f"{self.page_size}) and the pool has {self.num_free_pages} free of {self.num_pages}: "
                f"retract or defer requests, or build the pool with more pages"
            )
        if needed > len(self._free):  # take unreferenced cached pages, least recently used first
            self._free.extend(self._tree.evict(needed - len(self._free)))
        self._pages[request_id] = pages
        self._freed.discard(request_id)
        if needed > 0:
            self._version += 1
        for _ in range(max(0, needed)):
            pages.append(self._free.pop())

    def release(self, request_id: int, keep_tokens: int) -> None:
        """Free the request's pages past those covering ``[0, keep_tokens)``; the request stays known."""
        if request_id not in self._pages:
            raise KVPoolError(self._unknown(request_id, "release"))
        if keep_tokens < 0:
            raise KVPoolError(f"request {request_id}: keep_tokens={keep_tokens} must be >= 0")
        pages = self._pages[request_id]
        keep = self.pages_needed(keep_tokens)
        if len(pages) > keep:  # a release that frees no page leaves the cached page table valid
            self._version += 1
        while len(pages) > keep:
            self._drop(pages.pop())
        path = self._paths.get(request_id)
        if path is not None and len(path) > keep:
            del path[keep:]

    def free(self, request_id: int) -> None:
        """Free every page the request holds and forget it. A second free raises `KVPoolError`."""
        if request_id not in self._pages:
            raise KVPoolError(self._unknown(request_id, "free"))
        self._version += 1
        for page in reversed(self._pages.pop(request_id)):
            self._drop(page)
        self._paths.pop(request_id, None)
        self._freed.add(request_id)

    def _drop(self, page: int) -> None:
        """A request lets go of ``page``: a cached page loses a reference, a private one goes back to the free list."""
        node = self._tree.nodes.get(page) if self._tree is not None else None
        if node is None:
            self._free.append(page)
        else:
            self._tree.add_ref(node, -1)

    # ---- prefix cache --------------------------------------------------------------------------
    def attach_prefix(self, request_id: int, tokens: Sequence[int]) -> int:
        """Give a request that holds no page the cached pages of the longest prefix of ``tokens``; returns how
        many tokens' KV it now holds (its cached length, at most ``len(tokens) - 1``: the prefill computes at least
        the last token).

        Full pages are shared (read-only, reference counted). Where the next cached page agrees with ``tokens``
        only in part, the request gets a private copy of that page's agreeing slots in every cache
        (copy-on-write) when a free page is at hand. 0 without a prefix cache.
        """
        if self._tree is None:
            return 0
        if self._pages.get(request_id):
            raise KVPoolError(
                f"request {request_id} already holds {len(self._pages[request_id])} KV pages: attach_prefix is for "
                "a request before its prefill; free it first"
            )
        tree, P = self._tree, self.page_size
        pages: list[int] = []
        path: list[PageNode] = []
        node = tree.root
        for k in range(tree.full_pages(len(tokens))):
            child = node.children.get(tree.key(tokens, k))
            if child is None:
                break
            tree.add_ref(child, 1)
            tree.touch(child)
            pages.append(child.page)
            path.append(child)
            node = child
        self._pages[request_id] = pages
        self._paths[request_id] = path
        self._freed.discard(request_id)
        if pages:
            self._version += 1
        cached = len(pages) * P
        source, agree = tree.longest_partial(node, tokens[cached:])
        copy = agree - 1  # slot j's draft KV needs token j + 1 to agree too
        if source is None or copy < 1:
            return cached
        tree.add_ref(source, 1)  # pinned: the page taken for the copy must not be this one
        try:
            if self.num_free_pages < 1:
                return cached
            self.allocate(request_id, cached + 1)
            tree.touch(source)
            src = torch.arange(copy, device=self.device) + source.page * P
            dst = torch.arange(copy, device=self.device) + pages[-1] * P
            for storage in self._storage.values():  # [layers, 2, slots, Hkv, D]
                storage[:, :, dst] = storage[:, :, src]
        finally:
            tree.add_ref(source, -1)
        return cached + copy

    def cached_pages(self, tokens: Sequence[int]) -> int:
        """How many full pages of ``tokens`` the prefix cache holds (a look: no reference taken, nothing touched)."""
        if self._tree is None:
            return 0
        tree, node, count = self._tree, self._tree.root, 0
        for k in range(tree.full_pages(len(tokens))):
            node = node.children.get(tree.key(tokens, k))
            if node is None:
                break
            count += 1
        return count

    def publish(self, request_id: int, tokens: Sequence[int], num_tokens: int) -> int:
        """Put the request's full pages of positions ``[0, num_tokens)`` into the prefix cache; returns how many
        pages went in. ``tokens``: the request's ids, at least through position ``num_tokens`` (a page is keyed
        by its tokens and the next one). Call it only for positions whose KV is final in every cache (committed
        and drafted over): the pages become read-only. A page whose tokens another request published first
        stays private (it is freed with the request). 0 without a prefix cache.
        """
        if self._tree is None:
            return 0
        if request_id not in self._pages:
            raise KVPoolError(self._unknown(request_id, "publish"))
        tree, pages = self._tree, self._pages[request_id]
        path = self._paths.setdefault(request_id, [])
        limit = min(tree.full_pages(len(tokens)), num_tokens // self.page_size, len(pages))
        node = path[-1] if path else tree.root
        added = 0
        for k in range(len(path), limit):
            key = tree.key(tokens, k)
            child = node.children.get(key)
            if child is None:
                child = tree.insert(node, key, pages[k])
                added += 1
            else:
                tree.touch(child)
            path.append(child)
            node = child
        return added

    def drop_cached_pages(self) -> int:
        """Evict every cached page no request holds (a cold cache); returns how many went back to the free list."""
        if self._tree is None:
            return 0
        dropped = self._tree.evict(len(self._tree.nodes))
        self._free.extend(dropped)
        return len(dropped)

    def shared_pages(self) -> frozenset[int]:
        """The pages in the prefix cache: read-only, no request may write them (empty without a prefix cache)."""
        return frozenset(self._tree.nodes) if self._tree is not None else frozenset()

    def audit(self) -> None:
        """Raise `KVPoolError` unless every page is in exactly one place (free, cached or one request's private
        page) and each cached page's reference count is the number of requests holding it."""
        held: dict[int, int] = {}
        for pages in self._pages.values():
            for page in pages:
                held[page] = held.get(page, 0) + 1
        cached = self._tree.nodes if self._tree is not None else {}
        free = self._free
        problems = []
        if len(set(free)) != len(free):
            problems.append("a page is on the free list twice")
        for page in free:
            if page in held or page in cached:
                problems.append(f"page {page} is free and {'held' if page in held else 'cached'}")
        for page, count in held.items():
            node = cached.get(page)
            if node is None and count > 1:
                problems.append(f"private page {page} is held by {count} requests")
            if node is not None and node.refs != count:
                problems.append(f"cached page {page} counts {node.refs} references, {count} requests hold it")
        for page, node in cached.items():
            if node.refs and page not in held:
                problems.append(f"cached page {page} counts {node.refs} references and no request holds it")
        lent = len(free) + len(cached) + sum(1 for page in held if page not in cached)
        if lent != self.num_pages:
            problems.append(f"{self.num_pages - lent} of {self.num_pages} pages are nowhere (leaked)")
        if self._tree is not None:
            evictable = sum(1 for node in cached.values() if node.subtree_refs == 0)
            if evictable != self._tree.evictable:
                problems.append(f"{evictable} cached pages are unreferenced, the tree counts {self._tree.evictable}")
        if problems:
            raise KVPoolError("KV pool accounting broken: " + "; ".join(problems[:5]))

    def _unknown(self, request_id: int, verb: str) -> str:
        if request_id in self._freed:
            return f"cannot {verb} request {request_id}: it was already freed (double free)"
        return f"cannot {verb} request {request_id}: it never allocated KV pages; call allocate first"

    def pages(self, request_id: int) -> list[int]:
        """A copy of the request's page ids, in position order."""
        return list(self._pages.get(request_id, ()))

    def page_table(self, request_ids: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
        """Page ids of each request, -1 padded, on ``device`` (default the pool's): ``[bs, max(1, max_pages)]``.

        The table is read-only to its callers: the same tensor is handed out again until a page is
        allocated, released or freed.
        """
        device = self.device if device is None else torch.device(device)
        ids = tuple(request_ids)
        cached = self._table
        if cached is not None and cached[0] == self._version and cached[1] == ids and cached[2] == device:
            return cached[3]
        rows = [self._pages.get(r, ()) for r in ids]
        lens = [len(pages) for pages in rows]
        width = max([1, *lens])
        # one flat array scattered under a mask: a third of the time of a padded nested list (64 requests)
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=sum(lens))
        table = np.full((len(ids), width), -1, dtype=np.int64)
        table[np.arange(width)[None, :] < np.asarray(lens, dtype=np.int64)[:, None]] = flat
        table = to_device(torch.from_numpy(table), device)  # no wait for the GPU's queued work
        self._table = (self._version, ids, device, table)
        return table

    def slots_for(self, request_ids: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        """Slot of each position of each request.

        Shapes: ``positions [bs, X]`` (or ``[X]`` with one request) -> same shape, int64. Raises
        `KVPoolError` for a position past the pages its request holds.
        """
        flat = positions.reshape(len(request_ids), -1).to(device=self.device, dtype=torch.long)
        slots = slots_from_page_table(self.page_table(request_ids), flat, self.page_size)
        return slots.reshape(positions.shape)

    # ---- tensors -------------------------------------------------------------------------------
    def add_cache(
        self,
        name: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> list[LayerKV]:
        """Allocate a zeroed cache of ``num_layers`` (k, v) pairs, each ``[num_slots, Hkv, D]``."""
        if name in self._storage:
            raise KVPoolError(f"the pool already has a cache named {name!r}; pick another name")
        shape = (num_layers, 2, self.num_slots, num_kv_heads, head_dim)
        self._storage[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self.cache(name)

    def cache(self, name: str = TARGET_CACHE) -> list[LayerKV]:
        """The per-layer ``(k, v)`` views of cache ``name``, each ``[num_slots, Hkv, D]`` contiguous."""
        if name not in self._storage:
            raise KVPoolError(f"the pool has no cache named {name!r}; it has {sorted(self._storage)}")
        storage = self._storage[name]
        return [(storage[layer, 0], storage[layer, 1]) for layer in range(storage.shape[0])]

    def cache_names(self) -> list[str]:
        return list(self._storage)

    def target_buffers(self) -> Sequence[torch.Tensor]:
        """The target cache as one slot-major view ``[num_slots, num_layers * 2, Hkv, D]``.

        ``buf[dst] = buf[src]`` on it moves every layer's K and V in one indexing op.
        """
        return (self.slot_major(TARGET_CACHE),)

    def slot_major(self, name: str) -> torch.Tensor:
        """Cache ``name`` viewed ``[num_slots, num_layers * 2, Hkv, D]`` (a view: writes land in the cache)."""
        if name not in self._storage:
            raise KVPoolError(f"the pool has no cache named {name!r}; add it with add_cache({name!r}, ...)")
        storage = self._storage[name]
        layers, _, slots, heads, dim = storage.shape
        return storage.view(layers * 2, slots, heads, dim).transpose(0, 1)


def slots_from_page_table(page_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot of each position through each request's page table.

    Shapes: ``page_table [bs, max_pages]``, ``positions [bs, X]`` -> ``[bs, X]`` int64. Raises
    `KVPoolError` where a position lies past the pages its request holds.
    """
    page_index = positions // page_size
    if bool((page_index >= page_table.shape[1]).any()) or bool((positions < 0).any()):
        raise KVPoolError("a position lies outside the pages its request holds; allocate before assigning slots")
    pages = page_table.gather(1, page_index)
    if bool((pages < 0).any()):
        raise KVPoolError("a position lies past the pages its request holds; allocate before assigning slots")
    return pages * page_size + positions % page_size
