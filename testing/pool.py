"""A paged KV pool whose "KV" is a fingerprint ``(token, position)`` per slot."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.ports import KVPoolExhausted


class FingerprintPool:
    """`KVPool` with two caches, target and draft, each ``[num_slots, 2]`` int64 (token, position)."""

    def __init__(self, num_pages: int, page_size: int = 1):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be >= 1")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self.target = torch.full((num_pages * page_size, 2), -1, dtype=torch.long)
        self.draft = torch.full((num_pages * page_size, 2), -1, dtype=torch.long)
        self.freed: list[int] = []  # request ids in the order they were freed

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_held(self, request_id: int) -> int:
        return len(self._pages.get(request_id, ()))

    def allocate(self, request_id: int, num_tokens: int) -> None:
        pages = self._pages.setdefault(request_id, [])
        need = -(-num_tokens // self.page_size) - len(pages)
        if need > len(self._free):
            raise KVPoolExhausted(f"request {request_id} needs {need} pages, {len(self._free)} free")
        for _ in range(max(0, need)):
            pages.append(self._free.pop())

    def release(self, request_id: int, keep_tokens: int) -> None:
        pages = self._pages.get(request_id, [])
        keep = -(-keep_tokens // self.page_size)
        while len(pages) > keep:
            self._free.append(pages.pop())

    def free(self, request_id: int) -> None:
        if request_id not in self._pages:
            raise KeyError(f"request {request_id} holds no pages: freed twice or never allocated")
        self._free.extend(reversed(self._pages.pop(request_id)))
        self.freed.append(request_id)

    def page_table(self, request_ids: Sequence[int]) -> torch.Tensor:
        width = max([len(self._pages.get(r, ())) for r in request_ids] + [1])
        table = torch.full((len(request_ids), width), -1, dtype=torch.long)
        for i, rid in enumerate(request_ids):
            pages = self._pages.get(rid, [])
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        return table

    def target_buffers(self) -> Sequence[torch.Tensor]:
        return (self.target,)

    def slot(self, request_id: int, position: int) -> int:
        pages = self._pages[request_id]
        return pages[position // self.page_size] * self.page_size + position % self.page_size
