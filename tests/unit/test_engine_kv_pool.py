"""PagedKVPool: page accounting, page tables, slots, caches, and the errors it raises."""

from __future__ import annotations

import pytest
import torch
from speccycle.core.ports import KVPool, KVPoolExhausted
from speccycle.engine.errors import KVPoolError
from speccycle.engine.memory.kv_pool import PagedKVPool, slots_from_page_table


def test_pool_is_a_kvpool():
    assert isinstance(PagedKVPool(num_pages=4, page_size=2), KVPool)


def test_allocate_rounds_up_to_pages_and_never_shrinks():
    pool = PagedKVPool(num_pages=8, page_size=4)
    pool.allocate(request_id=1, num_tokens=5)  # ceil(5 / 4) = 2 pages
    assert pool.pages_held(1) == 2 and pool.num_free_pages == 6
    pool.allocate(1, 8)  # still 2 pages
    assert pool.pages_held(1) == 2
    pool.allocate(1, 3)  # asking for less keeps what it has
    assert pool.pages_held(1) == 2
    pool.allocate(1, 9)
    assert pool.pages_held(1) == 3 and pool.num_free_pages == 5
    pool.allocate(2, 0)  # a request with no pages yet is known
    assert pool.has_request(2) and pool.pages_held(2) == 0


def test_release_keeps_the_pages_covering_keep_tokens():
    pool = PagedKVPool(num_pages=8, page_size=4)
    pool.allocate(1, 16)
    first_two = pool.pages(1)[:2]
    pool.release(1, keep_tokens=5)
    assert pool.pages(1) == first_two and pool.num_free_pages == 6
    pool.release(1, keep_tokens=0)
    assert pool.pages_held(1) == 0 and pool.has_request(1)
    pool.free(1)
    assert pool.num_free_pages == 8 and not pool.has_request(1)


def test_page_table_is_padded_with_minus_one():
    pool = PagedKVPool(num_pages=8, page_size=2)
    pool.allocate(10, 3)  # pages 0, 1
    pool.allocate(20, 6)  # pages 2, 3, 4
    table = pool.page_table([20, 10, 30])
    assert table.dtype == torch.int64
    assert table.tolist() == [[2, 3, 4], [0, 1, -1], [-1, -1, -1]]


def test_page_table_is_reused_until_a_page_changes_hands():
    pool = PagedKVPool(num_pages=8, page_size=2)
    pool.allocate(1, 3)
    pool.allocate(2, 1)
    first = pool.page_table([1, 2])
    assert pool.page_table([1, 2]) is first  # nothing changed: the same table
    pool.allocate(1, 4)  # still 2 pages: nothing changed hands
    assert pool.page_table([1, 2]) is first
    assert pool.page_table([2, 1]).tolist() == [[first[1, 0].item(), -1], first[0].tolist()]
    first = pool.page_table([1, 2])
    pool.release(1, 3)  # keeps both pages: nothing changed hands
    assert pool.page_table([1, 2]) is first
    for change in (lambda: pool.allocate(2, 3), lambda: pool.release(1, 1), lambda: pool.free(1)):
        before = pool.page_table([1, 2]).clone()
        change()
        after = pool.page_table([1, 2])
        expected = [pool.pages(r) + [-1] * (after.shape[1] - pool.pages_held(r)) for r in (1, 2)]
        assert after.tolist() == expected and not torch.equal(after, before)


def test_slots_follow_the_page_table():
    pool = PagedKVPool(num_pages=8, page_size=4)
    pool.allocate(1, 4)  # page 0
    pool.allocate(2, 4)  # page 1
    pool.allocate(1, 8)  # page 2: request 1's pages are not contiguous
    slots = pool.slots_for([1], torch.arange(8)[None])[0]
    assert slots.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    with pytest.raises(KVPoolError, match="outside the pages"):
        pool.slots_for([1], torch.tensor([[8]]))
    table = torch.tensor([[3, -1]])
    with pytest.raises(KVPoolError, match="past the pages"):
        slots_from_page_table(table, torch.tensor([[4]]), 4)


def test_exhaustion_names_needed_and_free_pages_and_takes_nothing():
    pool = PagedKVPool(num_pages=4, page_size=2)
    pool.allocate(1, 4)
    with pytest.raises(KVPoolExhausted, match=r"needs 3 more KV pages .* has 2 free"):
        pool.allocate(2, 6)
    assert pool.num_free_pages == 2 and pool.pages_held(2) == 0


def test_double_free_and_unknown_requests_raise():
    pool = PagedKVPool(num_pages=4, page_size=2)
    pool.allocate(1, 2)
    pool.free(1)
    with pytest.raises(KVPoolError, match="already freed"):
        pool.free(1)
    with pytest.raises(KVPoolError, match="never allocated"):
        pool.free(99)
    with pytest.raises(KVPoolError, match="never allocated"):
        pool.release(99, 0)
    pool.allocate(1, 2)  # a freed id may come back
    pool.free(1)


def test_conservation_over_random_operations():
    generator = torch.Generator().manual_seed(0)
    pool = PagedKVPool(num_pages=32, page_size=3)
    held: dict[int, int] = {}
    for _ in range(300):
        rid = int(torch.randint(0, 6, (1,), generator=generator))
        op = int(torch.randint(0, 3, (1,), generator=generator))
        tokens = int(torch.randint(0, 40, (1,), generator=generator))
        try:
            if op == 0:
                pool.allocate(rid, tokens)
                held[rid] = max(held.get(rid, 0), -(-tokens // 3))
            elif op == 1 and rid in held:
                pool.release(rid, tokens)
                held[rid] = min(held[rid], -(-tokens // 3))
            elif op == 2 and rid in held:
                pool.free(rid)
                del held[rid]
        except KVPoolExhausted:
            pass
        assert {r: pool.pages_held(r) for r in held} == held
        assert pool.num_free_pages + sum(held.values()) == 32
        owned = [p for r in held for p in pool.pages(r)]
        assert len(owned) == len(set(owned))  # no page handed out twice


def test_caches_are_slot_major_and_target_buffers_move_every_layer():
    pool = PagedKVPool(num_pages=4, page_size=2)
    target = pool.add_cache("target", num_layers=3, num_kv_heads=2, head_dim=5)
    draft = pool.add_cache("draft", num_layers=1, num_kv_heads=2, head_dim=5)
    assert len(target) == 3 and len(draft) == 1
    k0, v0 = target[0]
    assert k0.shape == (8, 2, 5) and k0.is_contiguous()
    for layer, (k, v) in enumerate(target):
        k[3] = layer + 1
        v[3] = -(layer + 1)
    (buffer,) = pool.target_buffers()
    assert buffer.shape == (8, 6, 2, 5)
    buffer[torch.tensor([6])] = buffer[torch.tensor([3])]  # what backend.move_kv does
    for layer, (k, v) in enumerate(target):
        assert torch.all(k[6] == layer + 1) and torch.all(v[6] == -(layer + 1))
    assert torch.all(draft[0][0] == 0)  # other caches untouched
    with pytest.raises(KVPoolError, match="already has a cache"):
        pool.add_cache("target", 1, 1, 1)
    with pytest.raises(KVPoolError, match="no cache named"):
        pool.cache("nope")


def test_bad_sizes_raise():
    with pytest.raises(KVPoolError, match="must both be >= 1"):
        PagedKVPool(num_pages=0, page_size=16)
    with pytest.raises(KVPoolError, match=">= 0"):
        PagedKVPool(num_pages=2, page_size=1).allocate(1, -1)


# ---- prefix cache ------------------------------------------------------------------------------
def _cached_pool(num_pages: int = 8, page_size: int = 2) -> PagedKVPool:
    pool = PagedKVPool(num_pages=num_pages, page_size=page_size, prefix_cache=True)
    pool.add_cache("target", 1, 1, 1)
    return pool


def test_prefix_pages_are_shared_keyed_by_the_next_token_and_counted_free_once_unreferenced():
    pool = _cached_pool()
    tokens = [5, 6, 7, 8, 9, 10]
    assert pool.attach_prefix(0, tokens) == 0
    pool.allocate(0, 6)
    assert pool.publish(0, tokens, 6) == 2  # pages [5, 6] and [7, 8]: each needs its next token; [9, 10] has none
    assert pool.shared_pages() == frozenset(pool.pages(0)[:2])
    assert pool.attach_prefix(1, [5, 6, 7, 8, 9, 1]) == 4  # both pages, no computing them again
    assert pool.pages(1) == pool.pages(0)[:2]
    assert pool.attach_prefix(2, [5, 6, 7, 3]) == 2  # page [7, 8] agrees for one token: only [5, 6]
    # page [7, 8] is keyed by 9 after it: a shifted draft's KV at position 3 was computed from token 9, so a
    # request going on with 1 gets page [5, 6] and a private copy of position 2 only
    assert pool.attach_prefix(3, [5, 6, 7, 8, 1]) == 3
    assert pool.pages(3)[0] == pool.pages(0)[0] and pool.pages(3)[1] not in pool.shared_pages()
    pool.free(0)
    assert pool.num_free_pages == 8 - 2 - 1  # the cached pages requests 1-3 hold, request 3's copy
    for rid in (1, 2, 3):
        pool.free(rid)
    assert pool.num_free_pages == 8 and pool.num_cached_pages == 2  # unreferenced cached pages count as free
    pool.audit()
    assert pool.drop_cached_pages() == 2 and pool.num_cached_pages == 0 and pool.attach_prefix(4, tokens) == 0
    pool.free(4)
    pool.audit()


def test_a_partly_agreeing_page_is_copied_into_a_private_page():
    pool = _cached_pool(page_size=4)
    storage = pool.slot_major("target")  # [slots, 2, 1, 1]
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    pool.attach_prefix(0, tokens)
    pool.allocate(0, 9)
    storage[pool.slots_for([0], torch.arange(9))] = torch.arange(9.0)[:, None, None, None] + 100
    pool.publish(0, tokens, 8)
    # agrees with page 1 ([5, 6, 7, 8] + 9) for 3 tokens: 2 slots copied (slot j's draft KV needs token j + 1)
    assert pool.attach_prefix(1, [1, 2, 3, 4, 5, 6, 7, 0, 0]) == 6
    assert pool.pages(1)[0] == pool.pages(0)[0] and pool.pages(1)[1] not in pool.shared_pages()
    copied = storage[pool.slots_for([1], torch.arange(6))][:, 0, 0, 0]
    assert copied.tolist() == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
    pool.free(0)
    pool.free(1)
    pool.audit()


def test_eviction_takes_least_recently_used_unreferenced_leaves_and_never_a_held_page():
    pool = _cached_pool(num_pages=6, page_size=1)
    for rid, tokens in enumerate([[1, 2, 0], [3, 4, 0], [5, 6, 0]]):  # 2 cached pages each, a chain per request
        pool.attach_prefix(rid, tokens)
        pool.allocate(rid, 2)
        pool.publish(rid, tokens, 2)
    pages = {rid: pool.pages(rid) for rid in range(3)}
    pool.free(1)
    pool.free(2)
    assert pool.attach_prefix(3, [5, 6, 0]) == 2  # request 2's pages used again: request 1's are the least recent
    # requests 0 (the oldest pages, still held) and 3 hold 4 pages; 2 more: request 1's (leaf first, then its parent)
    pool.allocate(9, 2)
    assert set(pool.pages(9)) == set(pages[1]) and pool.num_evicted_pages == 2
    assert pool.num_free_pages == 0 and pool.num_cached_pages == 4
    with pytest.raises(KVPoolExhausted):
        pool.allocate(9, 3)
    pool.audit()


def test_attach_prefix_refuses_a_request_that_holds_pages_and_publish_an_unknown_one():
    pool = _cached_pool()
    pool.allocate(0, 3)
    with pytest.raises(KVPoolError, match="free it first"):
        pool.attach_prefix(0, [1, 2, 3])
    with pytest.raises(KVPoolError, match="never allocated"):
        pool.publish(7, [1, 2, 3], 2)
    plain = PagedKVPool(num_pages=4, page_size=2)
    assert plain.attach_prefix(0, [1, 2, 3]) == 0 and plain.publish(0, [1, 2, 3], 2) == 0 and not plain.shared_pages()
