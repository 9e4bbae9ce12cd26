"""Invariant 14 for the cycle's ops: each `CudaBackend` kernel equals its `TorchBackend` reference.

Integer outputs (ids, rows, masks, slots, moved bytes) exactly; softmax probabilities to float32
rounding. Runs on CPU under ``TRITON_INTERPRET=1`` (CI) and on a GPU as is, at small shapes with a
few seeds each (the interpreter runs every program in Python). Ties, NaNs, ``-inf`` rows, unaligned
vocabularies, chains, trees, ``P > 1`` page tables and overlapping moves all appear.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from speccycle.backends.torch import TorchBackend
from speccycle.core import tree as tree_ref

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from speccycle.backends.cuda import argmax, kv, topk  # noqa: E402
from speccycle.backends.cuda.ops import CudaBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
fast, ref = CudaBackend(), TorchBackend()
SEEDS = [0, 1, 2]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_parents(rng: random.Random, bs: int, n: int, chain: bool = False) -> torch.Tensor:
    rows = [[-1] + [i - 1 if chain else rng.randrange(i) for i in range(1, n)] for _ in range(bs)]
    return torch.tensor(rows, dtype=torch.long, device=DEVICE)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# ---- argmax: K == 1 draft and greedy verify ------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", SEEDS)
def test_argmax_equals_torch_with_ties(dtype, seed):
    gen, rng = _gen(seed), random.Random(seed)
    for rows, vocab in [(1, 1), (3, 7), (4, 100), (2, 2500)]:
        logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
        for r in range(rows):  # the maximum again, at a later and at an earlier index
            top = int(logits[r].float().argmax())
            logits[r, rng.randrange(vocab)] = logits[r, top]
        logits = logits.to(DEVICE)
        expected = logits.argmax(-1)
        for chunks in (None, 1, 2, 3):
            assert _equal(argmax.vocab_argmax(logits, chunks), expected), (vocab, chunks)
        assert _equal(fast.greedy_predict(logits), ref.greedy_predict(logits))
        for got, want in zip(fast.select_topk(logits, 1), ref.select_topk(logits, 1)):
            assert _equal(got, want)


def test_argmax_all_ties_nan_and_minus_inf_rows():
    logits = torch.zeros(5, 2100)
    logits[1] = float("-inf")
    logits[2, 1500] = float("nan")
    logits[2, 1800] = float("nan")
    logits[3, 7] = float("inf")
    logits[3, 2000] = float("nan")  # NaN beats +inf, as torch.argmax has it
    logits[4, 2099] = 1.0  # the last element of an unaligned tail
    logits = logits.to(DEVICE)
    for chunks in (1, 2, 3):
        assert _equal(argmax.vocab_argmax(logits, chunks), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top1_probability_equals_the_torch_reference(dtype):
    """`vocab_top1_probability` (the chain's confidence, `SpecConfig.draft_floor`) against
    `TorchBackend.top1_probability`: draft-vocabulary rows, a peaked and a flat row, an unaligned tail; a row of
    ``-inf`` and a row with a NaN give 0 in both."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, 2100, generator=gen) * 4).to(dtype)
    logits[1] = 0.0  # flat: 1 / 2100
    logits[2, 17] = 60.0  # peaked: ~1
    logits[3] = float("-inf")
    logits[4, 5] = float("nan")
    logits[5, 2099] = 30.0  # the top in the unaligned tail
    want = TorchBackend().top1_probability(logits)
    got = argmax.vocab_top1_probability(logits.to(DEVICE)).cpu()
    assert got.dtype == torch.float32 and got.shape == (7,)
    assert float(got[3]) == float(want[3]) == 0.0 and float(got[4]) == float(want[4]) == 0.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert abs(float(got[1]) - 1 / 2100) < 1e-7 and float(got[2]) > 0.999
    assert torch.equal(CudaBackend().top1_probability(logits.to(DEVICE)).cpu(), got)


# ---- softmax top-K ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_topk_equals_softmax_topk(seed):
    gen = _gen(seed)
    for rows, vocab, k in [(3, 4, 2), (5, 37, 4), (2, 2100, 3), (1, 300, 8)]:
        logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DEVICE)
        probs, ids = fast.select_topk(logits, k)
        want_probs, want_ids = ref.select_topk(logits, k)
        assert _equal(ids, want_ids)
        torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("k", [1, 4])
def test_topk_over_a_draft_vocabulary_maps_ids_and_writes_out(k):
    """``vocab_map`` (a draft vocabulary's column -> the target's id) is applied inside the merge kernel and
    ``out=`` buffers are written in place: the same values as the reference's ``vocab_map[ids]``, into the
    very tensors passed (strided ``out`` views take the copy fallback)."""
    gen = _gen(11)
    for rows, vocab in [(3, 37), (2, 2100)]:
        logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DEVICE)
        vocab_map = torch.randperm(5 * vocab, generator=gen)[:vocab].to(DEVICE)  # any order, not increasing
        want_probs, want_ids = ref.select_topk(logits, k, vocab_map)
        assert _equal(want_ids, vocab_map[ref.select_topk(logits, k)[1]])
        probs, ids = fast.select_topk(logits, k, vocab_map)
        assert _equal(ids, want_ids)
        torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)
        for out in (
            (torch.full((rows, k), -1.0, device=DEVICE), torch.full((rows, k), -1, dtype=torch.long, device=DEVICE)),
            (torch.full((k, rows), -1.0, device=DEVICE).t(), torch.full((k, rows), -1, device=DEVICE).t()),
        ):
            got = fast.select_topk(logits, k, vocab_map, out=out)
            assert got[0] is out[0] and got[1] is out[1]
            assert _equal(out[1], want_ids)
            torch.testing.assert_close(out[0], want_probs, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="vocab_map must be int64"):
        topk.softmax_topk(logits, 3, vocab_map[:-1])
    with pytest.raises(ValueError, match="out= needs"):
        ref.select_topk(logits, 3, out=(torch.empty(1, 3), torch.empty(1, 3, dtype=torch.long)))


def test_topk_low_precision_and_ties():
    # Distinct bfloat16 logits (multiples of 0.5 below 128 are exact): same ids as the reference.
    gen = _gen(3)
    logits = (torch.stack([torch.randperm(200, generator=gen) for _ in range(3)]) * 0.5).to(torch.bfloat16)
    logits = logits.to(DEVICE)
    probs, ids = fast.select_topk(logits, 4)
    want_probs, want_ids = ref.select_topk(logits, 4)
    assert _equal(ids, want_ids)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)
    # Equal logits: the same probabilities as the reference, equal ones ordered lowest index first.
    tied = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]], device=DEVICE)
    probs, ids = fast.select_topk(tied, 3)
    assert ids.tolist() == [[1, 3, 4], [0, 1, 2]]
    torch.testing.assert_close(probs, ref.select_topk(tied, 3)[0], rtol=1e-5, atol=1e-7)
    # A NaN row still names ids inside the vocabulary.
    nan_ids = topk.softmax_topk(torch.full((1, 9), float("nan"), device=DEVICE), 3)[1]
    assert ((nan_ids >= 0) & (nan_ids < 9)).all()


# ---- tree build -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_expand_frontier_equals_reference(seed):
    gen = _gen(seed)
    for bs, k in [(1, 1), (3, 2), (2, 3), (2, 4)]:
        frontier = torch.rand(bs, k, generator=gen)
        child_p = torch.rand(bs, k, k, generator=gen)
        child_p = (child_p * 4).round() / 4  # many exact ties: the stable order decides
        child_ids = torch.randint(0, 1000, (bs, k, k), generator=gen)
        args = [t.to(DEVICE) for t in (frontier, child_p, child_ids)]
        for got, want in zip(fast.expand_frontier(*args, k), ref.expand_frontier(*args, k)):
            assert _equal(got, want)


@pytest.mark.parametrize("seed", SEEDS)
def test_advance_frontier_equals_reference(seed):
    """The level's expand plus its bookkeeping in one launch: every output equal to the torch composition,
    ties included, with and without the next level's slots and the hidden states (bfloat16 rows copied as
    is), from a strided next-own view (a column block of the cycle's draft slots) and an expanded frontier."""
    gen = _gen(seed)
    # 600 columns: three copying programs a request (`HIDDEN_COLUMNS` 256), the last one partly masked
    for bs, k, depth, width in [(1, 2, 1, 0), (3, 2, 2, 5), (2, 3, 1, 7), (2, 4, 3, 40), (2, 3, 2, 600)]:
        frontier = torch.rand(bs, k, generator=gen)
        child_p = (torch.rand(bs, k, k, generator=gen) * 4).round() / 4  # many exact ties
        child_ids = torch.randint(0, 1000, (bs, k, k), generator=gen)
        frontier_cand = (3 + torch.arange(k)).expand(bs, k)
        path = torch.randint(0, 500, (bs, k, depth), generator=gen)
        slots = torch.randint(0, 500, (bs, 2, k), generator=gen)
        hidden = torch.randn(bs * k, width, generator=gen).to(torch.bfloat16) if width else None
        for next_own in (slots[:, 1, :], None):
            args = [frontier, child_p, child_ids, frontier_cand, 7, path, hidden, next_own, k]
            on_device = [t.to(DEVICE) if torch.is_tensor(t) else t for t in args]
            got, want = fast.advance_frontier(*on_device), ref.advance_frontier(*args)
            for name, a, b in zip(got._fields, got, want):
                assert (a is None) == (b is None), name
                if a is not None:
                    assert _equal(a.cpu(), b), name
            assert got.path.shape[2] == depth + (next_own is not None)


def _candidates(rng: random.Random, gen, bs: int, steps: int, k: int, monotone: bool):
    """Level-ordered candidates like the draft's: K roots' children, then K * K per level."""
    sizes = [k] + [k * k] * (steps - 1)
    parents, scores = [], []
    for level, size in enumerate(sizes):
        start = sum(sizes[:level])
        prev_start, prev_size = start - (sizes[level - 1] if level else 0), sizes[level - 1] if level else 0
        for _ in range(size):
            parent = -1 if level == 0 else prev_start + rng.randrange(prev_size)
            parents.append(parent)
    num = len(parents)
    cand_parents = torch.tensor([parents] * bs, dtype=torch.long)
    raw = (torch.rand(bs, num, generator=gen) * 8).round() / 8  # ties
    if monotone:  # a child's score never exceeds its parent's, as in EAGLE-2
        scores = raw.clone()
        for c in range(num):
            if parents[c] >= 0:
                scores[:, c] = scores[:, parents[c]] * raw[:, c]
        raw = scores
    tokens = torch.randint(0, 500, (bs, num), generator=gen)
    roots = torch.randint(0, 500, (bs,), generator=gen)
    return [t.to(DEVICE) for t in (roots, tokens, raw, cand_parents)]


@pytest.mark.parametrize("seed", SEEDS)
def test_rerank_tree_equals_reference(seed):
    rng, gen = random.Random(seed), _gen(seed)
    for bs, steps, k, n in [(2, 2, 2, 3), (2, 3, 2, 9), (1, 4, 3, 20), (2, 3, 4, 21)]:
        for monotone in (True, False):
            args = _candidates(rng, gen, bs, steps, k, monotone)
            for got, want in zip(fast.rerank_tree(*args, n), ref.rerank_tree(*args, n)):
                assert _equal(got, want), (steps, k, n, monotone)


@pytest.mark.parametrize("seed", SEEDS)
def test_tree_mask_full_and_packed(seed):
    rng = random.Random(seed)
    for n in [1, 2, 7, 9, 17, 33]:
        parents = _random_parents(rng, 3, n, chain=n == 9)
        assert _equal(fast.tree_mask(parents), ref.tree_mask(parents))
        assert _equal(fast.tree_mask_packed(parents), ref.tree_mask_packed(parents))
        assert _equal(tree_ref.unpack_mask(fast.tree_mask_packed(parents), n), ref.tree_mask(parents))


# ---- verify and accept ------------------------------------------------------------------------------
def _verified(rng: random.Random, gen, bs: int, n: int, width: int, chain: bool = False):
    parents = _random_parents(rng, bs, n, chain)
    tokens = torch.randint(0, 2, (bs, n), generator=gen).to(DEVICE)  # two tokens: long accepted paths
    predict = torch.randint(0, 2, (bs, n), generator=gen).to(DEVICE)
    return tokens, parents, predict, width


@pytest.mark.parametrize("seed", SEEDS)
def test_verify_greedy_equals_reference(seed):
    rng, gen = random.Random(seed), _gen(seed)
    cases = [(3, 1, 1, False), (2, 1, 4, False), (4, 5, 5, True), (6, 9, 4, False), (4, 20, 9, False)]
    for bs, n, width, chain in cases:
        args = _verified(rng, gen, bs, n, width, chain)
        for got, want in zip(fast.verify_greedy(*args), ref.verify_greedy(*args)):
            assert _equal(got, want), (n, width)


@pytest.mark.parametrize("seed", SEEDS)
def test_verify_greedy_chain_equals_reference(seed):
    rng, gen = random.Random(seed), _gen(seed)
    for bs, n, width in [(3, 1, 1), (2, 5, 5), (4, 3, 6), (1, 7, 7)]:
        tokens, _, predict, _ = _verified(rng, gen, bs, n, width, chain=True)
        got = fast.verify_greedy_chain(tokens, predict, width)
        want = ref.verify_greedy_chain(tokens, predict, width)
        assert _equal(got[0], want[0]) and _equal(got[1], want[1]), (n, width)


@pytest.mark.parametrize("bs", [3, 4])  # 3: lanes past the batch stay masked
@pytest.mark.parametrize("seed", SEEDS[:2])
def test_gather_accepted_and_fill_bonus(seed, bs):
    rng, gen = random.Random(seed), _gen(seed)
    n, width = 9, 5
    accept_index, accept_len = ref.verify_greedy(*_verified(rng, gen, bs, n, width))
    rows = [
        torch.randint(0, 100, (bs * n,), generator=gen),
        torch.randn(bs * n, 6, generator=gen).to(torch.bfloat16),
        torch.randn(bs * n, 2, 3, generator=gen),
        torch.randint(-5, 5, (bs * n, 3), generator=gen, dtype=torch.int32),
    ]
    for value in rows:
        value = value.to(DEVICE)
        assert _equal(fast.gather_accepted(value, accept_index), ref.gather_accepted(value, accept_index))
    predict = fast.gather_accepted(rows[0].to(DEVICE), accept_index)
    assert _equal(fast.fill_bonus(predict, accept_len, width), ref.fill_bonus(predict, accept_len, width))
    with pytest.raises(ValueError, match="bs \\* stride"):
        fast.fill_bonus(predict, accept_len, n)  # the N stride of SGLang PR 26866


def test_verify_block_routes_to_its_kernel():
    gen = _gen(4)
    candidates = torch.randint(0, 2, (5, 6), generator=gen).to(DEVICE)
    target = torch.randint(0, 2, (5, 6), generator=gen).to(DEVICE)
    for got, want in zip(fast.verify_block(candidates, target), ref.verify_block(candidates, target)):
        assert _equal(got, want)


# ---- slots and compaction ---------------------------------------------------------------------------
def _page_table(rng: random.Random, bs: int, tokens: int, page_size: int) -> torch.Tensor:
    pages_each = -(-tokens // page_size)
    free = list(range(bs * pages_each + 5))
    rng.shuffle(free)
    table = torch.full((bs, pages_each + 2), -1, dtype=torch.long)  # -1 padded, like the pools'
    for b in range(bs):
        table[b, :pages_each] = torch.tensor([free.pop() for _ in range(pages_each)])
    return table.to(DEVICE)


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_slots_for_positions(page_size):
    rng, gen = random.Random(page_size), _gen(page_size)
    bs, steps, k, n = 3, 4, 2, 7
    seq_lens = torch.randint(1, 30, (bs,), generator=gen).to(DEVICE)
    table = _page_table(rng, bs, 30 + n, page_size)
    verify_positions = seq_lens[:, None] + torch.arange(n, device=DEVICE)
    scratch = tree_ref.draft_scratch_positions(seq_lens, steps, k, 0)  # [bs, S - 1, K]
    for positions in (verify_positions, scratch):
        got = fast.slots_for_positions(table, positions, page_size)
        assert _equal(got, ref.slots_for_positions(table, positions, page_size))
        # covered: the host vouches for the reservation, the same slots without the device-to-host check
        assert _equal(fast.slots_for_positions(table, positions, page_size, covered=True), got)
    past = torch.full((bs, 1), (table.shape[1] - 1) * page_size, dtype=torch.long, device=DEVICE)
    with pytest.raises(IndexError, match="reserve"):
        fast.slots_for_positions(table, past, page_size)


def _engine_buffer(gen, num_slots: int) -> torch.Tensor:
    """The engine's target cache view: ``[layers, 2, slots, Hkv, D]`` seen slot-major (not contiguous)."""
    storage = torch.randn(3, 2, num_slots, 2, 4, generator=gen).to(torch.bfloat16).to(DEVICE)
    return storage.view(6, num_slots, 2, 4).transpose(0, 1)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_plan_and_move_kv_equal_reference(page_size, seed):
    rng, gen = random.Random(seed), _gen(seed)
    bs, n, width = 4, 12, 6
    accept_index, accept_len = ref.verify_greedy(*_verified(rng, gen, bs, n, width))
    seq_lens = torch.randint(0, 9, (bs,), generator=gen).to(DEVICE)
    table = _page_table(rng, bs, 9 + n, page_size)
    verify_slots = ref.slots_for_positions(table, seq_lens[:, None] + torch.arange(n, device=DEVICE), page_size)
    src, dst = fast.plan_kv_move(accept_index, accept_len, verify_slots)
    want_src, want_dst = ref.plan_kv_move(accept_index, accept_len, verify_slots)
    assert _equal(src, want_src) and _equal(dst, want_dst)
    num_slots = int(table.max() + 1) * page_size
    for buf in (_engine_buffer(gen, num_slots), torch.randn(num_slots, 5, generator=gen).to(DEVICE)):
        expected = buf.clone()
        ref.move_kv([expected], want_src, want_dst)
        fast.move_kv([buf], src, dst)
        assert _equal(buf, expected)


def test_move_kv_reads_before_it_writes_and_skips_padding():
    gen = _gen(7)
    buf = _engine_buffer(gen, 12)
    expected = buf.clone()
    src = torch.tensor([3, 2, 1, 9], device=DEVICE)  # 3 -> 2 while 2 -> 1 and 1 -> 0: a chain of overlaps
    dst = torch.tensor([2, 1, 0, 11], device=DEVICE)
    ref.move_kv([expected], src, dst)
    got = buf.clone()
    fast.move_kv([got], src, dst)
    assert _equal(got, expected)
    padded_src, padded_dst = torch.tensor([3, -1, 2, 1, 9, -1]), torch.tensor([2, 5, 1, 0, 11, -1])
    got = buf.clone()
    kv.move_kv([got], padded_src.to(DEVICE), padded_dst.to(DEVICE))
    assert _equal(got, expected)
