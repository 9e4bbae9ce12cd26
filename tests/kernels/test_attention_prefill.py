"""The prefill attention kernel equals its torch twin (`paged_attention_rows_torch`) on a prefill's rows.

Cases: several prompts in one batch (blocks that hold the end of one prompt and the start of the next, a prompt
longer than a block of rows and of keys), a cached prefix (rows from position ``c`` on, attending the cached
pages), scattered pages of several sizes, grouped-query heads, padding rows (``prefix_len == 0``: zeros), rows
in any order; a batch with extra slots goes to the rows kernel, bitwise. float32 on the interpreter (CI), and
bfloat16 too on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from speccycle.engine.kernels.attention_triton import paged_attention_rows_torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

import attrs  # noqa: E402
from speccycle.engine.drafters.eagle import EagleConfig, EagleDraft, EagleHead  # noqa: E402
from speccycle.engine.fast.path import FastEagleDraft, FastOptions, FastTarget  # noqa: E402
from speccycle.engine.greedy import extend_batch  # noqa: E402
from speccycle.engine.kernels import attention_prefill, fused_ops  # noqa: E402
from speccycle.engine.kernels.attention_prefill import (  # noqa: E402
    paged_attention_prefill_exact,
    paged_attention_prefill_triton,
)
from speccycle.engine.kernels.attention_triton import paged_attention_rows_triton  # noqa: E402
from speccycle.engine.memory.kv_pool import PagedKVPool  # noqa: E402
from speccycle.engine.models.llama import LlamaModel, random_llama_weights  # noqa: E402
from speccycle.engine.models.target import LlamaTarget  # noqa: E402
from speccycle.testing.configs import TINY_LLAMA  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _prefill(seed, lens, cached, page_size, num_heads, num_kv_heads, head_dim, dtype, pad=0, order=None):
    """Requests of ``lens`` tokens whose first ``cached`` are in the pool already: their remaining rows, causal
    (``prefix_len = position + 1``), then ``pad`` padding rows. Returns the arguments of the kernels."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // page_size)
    num_pages = len(lens) * width + 2
    perm = torch.randperm(num_pages, generator=gen)
    table = perm[: len(lens) * width].view(len(lens), width).clone()
    row_request, positions = [], []
    for b, (n, c) in enumerate(zip(lens, cached)):
        row_request += [b] * (n - c)
        positions += list(range(c, n))
    row_request = torch.tensor(row_request + [0] * pad, dtype=torch.long)
    prefix_lens = torch.tensor([p + 1 for p in positions] + [0] * pad, dtype=torch.long)
    if order is not None:
        perm_rows = torch.randperm(len(row_request), generator=gen)
        row_request, prefix_lens = row_request[perm_rows], prefix_lens[perm_rows]
    t = len(row_request)
    slots = num_pages * page_size
    q = torch.randn(t, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    extra = torch.empty(t, 0, dtype=torch.long)
    args = (q, k, v, row_request, prefix_lens, extra, table, page_size)
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args), width * page_size


CASES = [
    # lens, cached, page_size, heads, kv heads, head dim
    ((5, 70, 23), (0, 0, 0), 16, 4, 2, 16),
    ((130,), (0,), 16, 3, 1, 32),
    ((44, 44, 47, 66), (0, 16, 0, 32), 4, 4, 4, 16),
    ((1, 2, 3, 200), (0, 1, 0, 64), 8, 6, 2, 16),
]


KERNELS = {"flash": paged_attention_prefill_triton, "exact": paged_attention_prefill_exact}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("lens, cached, page_size, heads, kv_heads, head_dim", CASES)
def test_prefill_kernel_equals_torch_twin(kernel, lens, cached, page_size, heads, kv_heads, head_dim):
    args, bound = _prefill(0, lens, cached, page_size, heads, kv_heads, head_dim, torch.float32, pad=5)
    got = KERNELS[kernel](*args)
    want = paged_attention_rows_torch(*args, bound)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert not got[-5:].any(), "padding rows (prefix_len 0) return zeros"


@pytest.mark.parametrize("kernel", KERNELS)
def test_prefill_kernel_any_row_order(kernel):
    """Rows out of order (several requests in every block): still each row's own attention."""
    args, bound = _prefill(1, (37, 90, 12), (0, 8, 0), 16, 4, 2, 16, torch.float32, pad=3, order="shuffle")
    torch.testing.assert_close(KERNELS[kernel](*args), paged_attention_rows_torch(*args, bound), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_with_extra_slots_take_the_rows_kernel(kernel):
    """A batch with extra slots is not a prefill's: the call is the rows kernel's, bit for bit."""
    (q, k, v, row_request, prefix_lens, _, table, page_size), _ = _prefill(
        2, (20, 9), (0, 0), 16, 4, 2, 16, torch.float32
    )
    extra = torch.full((q.shape[0], 2), -1, dtype=torch.long, device=q.device)
    extra[0, 0] = int(table[0, 0]) * page_size  # one row also attends the first slot of its first page
    args = (q, k, v, row_request, prefix_lens, extra, table, page_size)
    assert torch.equal(KERNELS[kernel](*args), paged_attention_rows_triton(*args))


def test_exact_kernels_programs_per_block_change_no_bit():
    """The exact kernel's programs per (block, head) only move chunks between programs: one program walking a
    block's three chunks, two taking every other one, and the default give the same bits."""
    args, _ = _prefill(7, (150, 9), (16, 0), 16, 2, 1, 16, torch.float32, pad=3)
    want = paged_attention_prefill_exact(*args)
    for programs in (1, 2):
        assert torch.equal(paged_attention_prefill_exact(*args, programs_per_block=programs), want), programs
    with pytest.raises(ValueError, match="programs_per_block=0"):
        paged_attention_prefill_exact(*args, programs_per_block=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_non_finite_value_stays_in_its_own_request(kernel):
    """A request whose cached values hold an inf (an overflowed prompt) shares 16-row blocks with its neighbours;
    their rows stay finite and are the bits they have with that value finite, as with the rows kernel (which
    never loads another row's keys): a row updates its state only from a key block where it owns a key."""
    args, _ = _prefill(6, (21, 9, 40), (0, 0, 0), 8, 4, 2, 16, torch.float32)
    q, k, v, row_request, prefix_lens, extra, table, page_size = args
    clean = KERNELS[kernel](*args)
    poisoned = v.clone()
    poisoned[int(table[0, 1]) * page_size + 3] = float("inf")  # request 0's key at position 11
    got = KERNELS[kernel](q, k, poisoned, row_request, prefix_lens, extra, table, page_size)
    others = row_request != 0
    assert torch.isfinite(got[others]).all(), "another request's rows caught the inf"
    assert torch.equal(got[others], clean[others])
    # request 0's own last row attends the inf and fails (its earlier rows, which share key blocks with it, may too)
    assert not torch.isfinite(got[20]).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_bfloat16(kernel, head_dim):
    """bfloat16 products (the interpreter takes them through float32, as the rows kernel does), float32 sums."""
    lens = (767, 44, 233, 85) if torch.cuda.is_available() else (70, 9, 33)
    cached = (0, 0, 32, 0) if torch.cuda.is_available() else (0, 0, 16)
    args, bound = _prefill(3, lens, cached, 16, 9 if head_dim == 64 else 4, 3 if head_dim == 64 else 2, head_dim,
                           torch.bfloat16, pad=7)  # fmt: skip
    got = KERNELS[kernel](*args).float()
    want = paged_attention_rows_torch(*args, bound).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bitwise on the GPU's products (the interpreter's BLAS is not)"
)
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(kernel):
    """Whether a prompt is prefilled with others, alone, or in two chunks, each of its rows gets the same bits:
    the property that keeps a request's output independent of the batch it was admitted with."""
    args, _ = _prefill(4, (300, 44, 97), (0, 0, 16), 16, 9, 3, 64, torch.bfloat16)
    q, k, v, row_request, prefix_lens, extra, table, page_size = args
    attend = KERNELS[kernel]
    whole = attend(*args)
    starts = [0, 300, 344]
    for b, (lo, hi) in enumerate(zip(starts, starts[1:] + [q.shape[0]])):
        alone = attend(
            q[lo:hi], k, v, torch.zeros_like(row_request[lo:hi]), prefix_lens[lo:hi], extra[lo:hi], table[b : b + 1],
            page_size,
        )  # fmt: skip
        assert torch.equal(alone, whole[lo:hi]), f"request {b} alone"
    for cut in (37, 128, 301):
        parts = [
            attend(q[a:z], k, v, row_request[a:z], prefix_lens[a:z], extra[a:z], table, page_size)
            for a, z in ((0, cut), (cut, q.shape[0]))
        ]
        assert torch.equal(torch.cat(parts), whole), f"chunks cut at row {cut}"


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bitwise on the GPU's products (the interpreter's BLAS is not)"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "lens, cached, heads, kv_heads",
    [
        ((767, 44, 233, 85, 5), (0, 0, 32, 0, 0), 9, 3),  # SmolLM2's heads; rows of 1 to 12 chunks
        ((2100, 130), (1900, 0), 9, 3),  # past 2,048 keys the rows' chunks grow to 128 keys (some rows' only)
        ((300, 61, 1), (0, 48, 0), 8, 8),  # no grouping
    ],
)
def test_exact_kernel_rows_are_the_decode_kernels_bits(lens, cached, heads, kv_heads, dtype):
    """Each prefill row of the exact kernel is bitwise the row the decode's kernel (`attention_triton`'s rows
    kernel) computes at its position: in order and shuffled, with padding rows; so KV a decode wrote and KV a
    prefill wrote hold the same bits, and a prefix-cache hit or a recompute changes no output."""
    for order in (None, "shuffle"):
        args, _ = _prefill(5, lens, cached, 16, heads, kv_heads, 64, dtype, pad=9, order=order)
        exact = paged_attention_prefill_exact(*args)
        rows = paged_attention_rows_triton(*args)
        mismatched = (exact != rows).any(dim=2).any(dim=1).nonzero()[:, 0]
        assert mismatched.numel() == 0, f"{order}: rows {mismatched[:8].tolist()} differ of {len(rows)}"


def test_the_default_prefill_attention_keeps_the_decode_kernels_bits(monkeypatch):
    """``SPECCYCLE_PREFILL_ATTENTION`` unset: the exact kernel where the decode takes the rows kernel (heads below
    ``TILES_MIN_HEAD_DIM``), the decode's own kernel (tiles) above; `BatchInvariantOps` takes the same."""
    monkeypatch.delenv("SPECCYCLE_PREFILL_ATTENTION", raising=False)
    monkeypatch.delenv("SPECCYCLE_ATTENTION", raising=False)
    attend = fused_ops.triton_prefill_attention()
    assert attend.keywords["decode"] is fused_ops.paged_attention_auto
    for head_dim, kernel in ((64, "exact"), (fused_ops.TILES_MIN_HEAD_DIM, "tiles")):
        args, _ = _prefill(6, (40, 7), (0, 0), 16, 4, 2, head_dim, torch.float32)
        got = attend(*args)
        want = paged_attention_prefill_exact(*args) if kernel == "exact" else fused_ops.paged_attention_auto(*args)
        assert torch.equal(got, want), kernel
        assert torch.equal(fused_ops.BatchInvariantOps.prefill_attention(*args), want), f"batch-invariant, {kernel}"


# ---- the fast forward takes it for a prefill's rows, and only for those ----------------------------------------
WIDE = attrs.evolve(TINY_LLAMA, hidden_size=64, head_dim=16)  # heads of 16: the kernel's smallest


class _Counting(fused_ops.TritonOps):
    calls = {"prefill": 0, "decode": 0}

    @staticmethod
    def prefill_attention(*args):
        _Counting.calls["prefill"] += 1
        return fused_ops.TritonOps.prefill_attention(*args)

    @staticmethod
    def attention(*args):
        _Counting.calls["decode"] += 1
        return fused_ops.TritonOps.attention(*args)


class _CountingFolded(_Counting):
    fold_norms = True
    rope_write_kv = fused_ops.FoldedNormOps.rope_write_kv
    silu_mul = fused_ops.FoldedNormOps.silu_mul
    linear = fused_ops.FoldedNormOps.linear
    linear_add = fused_ops.FoldedNormOps.linear_add


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors: the Triton interpreter")
@pytest.mark.parametrize("ops", [_Counting, _CountingFolded], ids=["triton", "folded"])
def test_fast_forward_prefills_with_the_prefill_kernel(ops):
    """A prefill (chunked: 16-row buffers) through the fast forward equals the reference forward and calls the
    prefill kernel once a layer a chunk; a decode after it calls the decode's kernel only."""
    weights = random_llama_weights(WIDE, seed=1, scale=0.3)
    prompts = [[3 + (5 * i) % 60 for i in range(13)], [4 + (7 * i) % 59 for i in range(9)]]
    outs = []
    for fast in (False, True):
        pool = PagedKVPool(num_pages=64, page_size=4)
        target = LlamaTarget.from_weights(WIDE, weights, pool)
        if fast:
            target = FastTarget(target, pool, FastOptions("cpu", graphs=False, ops=ops, max_rows=16))
        ops.calls.update(prefill=0, decode=0)
        prefill = target.forward(extend_batch(pool, [0, 1], prompts, [0, 0], last_logits_only=False, prefill=True))
        counts = dict(ops.calls)
        decode = target.forward(extend_batch(pool, [0, 1], [[9], [8]], [13, 9], last_logits_only=False))
        outs.append((prefill, decode, counts, dict(ops.calls)))
    (ref_prefill, ref_decode, _, _), (prefill, decode, counts, after) = outs
    torch.testing.assert_close(prefill.logits, ref_prefill.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode.logits, ref_decode.logits, atol=1e-4, rtol=1e-4)
    assert counts == {"prefill": 2 * WIDE.num_layers, "decode": 0}  # 22 rows: two chunks
    assert after == {"prefill": 2 * WIDE.num_layers, "decode": WIDE.num_layers}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors: the Triton interpreter")
@pytest.mark.parametrize("ops", [_Counting, _CountingFolded], ids=["triton", "folded"])
def test_draft_extend_over_a_prompt_takes_the_prefill_kernel(ops):
    """An EAGLE-3 head (two layers) extending over prompts (`ExtendRows.prefill`, a prefill's draft extend) equals
    the reference head and calls the prefill kernel once a layer; its extend over a cycle's committed rows calls the
    decode's kernel only."""
    weights = random_llama_weights(WIDE, seed=2, scale=0.3)
    model = LlamaModel(WIDE, weights, feature_layers=(1, 2, 3))
    config = attrs.evolve(EagleConfig.for_target(WIDE, 3, draft_vocab_size=0), feature_layers=(1, 2, 3), num_layers=2)
    head = EagleHead.random(config, seed=3, target_vocab=WIDE.vocab_size)
    prompts = [[3 + (5 * i) % 60 for i in range(13)], [4 + (7 * i) % 59 for i in range(9)]]
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(22, 3 * WIDE.hidden_size, generator=gen)
    step_hidden = torch.randn(2, 3 * WIDE.hidden_size, generator=gen)
    outs = []
    for fast in (False, True):
        pool = PagedKVPool(num_pages=64, page_size=4)
        draft = EagleDraft(head, model, pool, cache_name="draft")
        if fast:
            draft = FastEagleDraft(draft, pool, FastOptions("cpu", graphs=False, ops=ops, max_rows=32))
        ops.calls.update(prefill=0, decode=0)
        prompt = draft.extend(extend_batch(pool, [0, 1], prompts, [0, 0], prefill=True), hidden)
        counts = dict(ops.calls)
        later = draft.extend(extend_batch(pool, [0, 1], [[9], [8]], [13, 9]), step_hidden)
        outs.append((prompt, later, counts, dict(ops.calls)))
    (ref_prompt, ref_later, _, _), (prompt, later, counts, after) = outs
    for got, want in ((prompt, ref_prompt), (later, ref_later)):
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert counts == {"prefill": config.num_layers, "decode": 0}
    assert after == {"prefill": config.num_layers, "decode": config.num_layers}


def test_bad_prefill_settings_are_refused(monkeypatch):
    monkeypatch.setenv("SPECCYCLE_PREFILL_BLOCK_M", "abc")
    with pytest.raises(ValueError, match="SPECCYCLE_PREFILL_BLOCK_M='abc': choose 16, 32 or 64"):
        attention_prefill._block_m()
    monkeypatch.setenv("SPECCYCLE_PREFILL_ATTENTION", "flash")
    with pytest.raises(ValueError, match="SPECCYCLE_PREFILL_ATTENTION='flash': choose one of exact, prefill, rows"):
        fused_ops.triton_prefill_attention()
