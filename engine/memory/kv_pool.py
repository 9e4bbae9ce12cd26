"""The paged KV pool: pages of ``P`` slots, a free list, per-request page lists, and KV tensors.

A request's position ``p`` lives at slot ``page_table[p // P] * P + p % P``. The pool owns any number
of named caches (the target's layers, a draft's layers); they all share this one slot index space, so
a request's reservation covers its KV in every cache at once. Each layer's K and V is a slot-major
tensor ``[num_pages * P, num_kv_heads, head_dim]``; a layer writes row ``t`` at ``k[out_slots[t]]``.

    pool = PagedKVPool(num_pages=256, page_size=16)
    target_kv = pool.add_cache("target", num_layers=30, num_kv_heads=3, head_dim=64)
    pool.allocate(request_id=7, num_tokens=40)       # 3 pages
    pool.page_table([7])                              # [[p0, p1, p2]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...core.ports import KVPoolExhausted
from ..errors import KVPoolError

TARGET_CACHE = "target"

LayerKV = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [num_slots, num_kv_heads, head_dim]


class PagedKVPool:
    """A `KVPool` (core.ports) over ``num_pages`` pages of ``page_size`` slots, on one device."""

    def __init__(self, num_pages: int, page_size: int = 16, device: str | torch.device = "cpu") -> None:
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

    # ---- bookkeeping ---------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

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
        if needed > len(self._free):
            raise KVPoolExhausted(
                f"request {request_id} needs {needed} more KV pages ({num_tokens} tokens at page size "
                f"{self.page_size}) and the pool has {len(self._free)} free of {self.num_pages}: "
                f"retract or defer requests, or build the pool with more pages"
            )
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
            self._free.append(pages.pop())

    def free(self, request_id: int) -> None:
        """Free every page the request holds and forget it. A second free raises `KVPoolError`."""
        if request_id not in self._pages:
            raise KVPoolError(self._unknown(request_id, "free"))
        self._version += 1
        self._free.extend(reversed(self._pages.pop(request_id)))
        self._freed.add(request_id)

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
        width = max([1] + [len(pages) for pages in rows])
        table = torch.tensor([list(pages) + [-1] * (width - len(pages)) for pages in rows], dtype=torch.long)
        table = table.reshape(len(ids), width).to(device)
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
