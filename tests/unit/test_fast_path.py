"""The fast path (engine/fast/path.py, engine/fast/graphs.py) equals the reference path, on a tiny random Llama.

CPU: the static-buffer code runs eagerly (``graphs=False``), with the torch ops, and with the Triton
kernels under ``TRITON_INTERPRET=1``. Checked: forwards equal the reference (ragged extends, trees,
features, layer skip, EAGLE-1/3 drafts), padding rows never touch the cache, a call leaves its
inputs and the static input buffers as it found them, the graph-stepped decode equals
`greedy_decode`, and an `Engine(fast=True)` is lossless for every forward drafter.
"""

from __future__ import annotations

import os

import attrs
import pytest
import torch
from speccycle.core import SpecConfig
from speccycle.core.ports import ForwardBatch
from speccycle.engine.drafters.eagle import EagleConfig, EagleDraft, EagleHead
from speccycle.engine.drafters.layerskip import LlamaDraft
from speccycle.engine.engine import Engine
from speccycle.engine.fast.graphs import bucket
from speccycle.engine.fast.path import (
    FastEagleDraft,
    FastGreedyDecoder,
    FastLlamaDraft,
    FastOptions,
    FastTarget,
    accelerate,
)
from speccycle.engine.greedy import extend_batch, greedy_decode
from speccycle.engine.kernels.fused_ops import FoldedNormOps, TorchOps, TritonOps, triton_available
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel, random_llama_weights
from speccycle.engine.models.target import LlamaTarget
from speccycle.testing.configs import TINY_LLAMA as TINY

ATOL, RTOL = 1e-4, 1e-4  # float32, values up to ~20: reduction orders and rsqrt differ
# KV slots of the pools the Triton kernels run over. A fast forward's page table spans its pool, and the attention
# kernels launch a program per 64-slot chunk of it (`attention_triton.CHUNK`), live or not; the interpreter runs
# every one. 96 slots hold these tests' few tokens in two chunks, so the split-and-merge launch still runs (over pools
# of 512 slots the folded-norm engine tests took twice as long: 59 and 39 s against 29 and 20 s on two CPU cores).
POOL_SLOTS = 96
OPS = [TorchOps]
if triton_available() and os.environ.get("TRITON_INTERPRET") == "1":
    OPS += [TritonOps, FoldedNormOps]


@pytest.fixture(scope="module")
def weights():
    return random_llama_weights(TINY, seed=0, scale=0.3)


def tokens_of(seed, n):
    return torch.randint(3, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pair(weights, page_size, ops, feature_layers=None, num_pages=48, **options):
    """The same model twice: a reference target and a fast one, each with its own pool."""
    out = []
    for fast in (False, True):
        pool = PagedKVPool(num_pages=num_pages, page_size=page_size)
        target = LlamaTarget.from_weights(TINY, weights, pool, feature_layers=feature_layers)
        if fast:
            target = FastTarget(target, pool, FastOptions("cpu", graphs=False, ops=ops, max_rows=16, **options))
        out.append((target, pool))
    return out


def tree_batch(pool, rid, length, tokens, parents):
    """Verify rows of one request over a tree: row i at L + depth(i), slot of L + i, ancestors as extras."""
    n = len(parents)
    pool.allocate(rid, length + n)
    slots = pool.slots_for([rid], torch.arange(length, length + n)[None])[0]
    depth, extra = [0] * n, torch.full((n, n), -1, dtype=torch.long)
    for i in range(n):
        node = i
        while node >= 0:
            extra[i, node] = slots[node]
            node = parents[node]
        depth[i] = 0 if parents[i] < 0 else depth[parents[i]] + 1
    return ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=length + torch.tensor(depth),
        row_request=torch.zeros(n, dtype=torch.long),
        out_slots=slots,
        prefix_lens=torch.full((n,), length),
        extra_slots=extra,
        page_table=pool.page_table([rid]),
        page_size=pool.page_size,
        request_ids=(rid,),
    )


def snapshot(batch: ForwardBatch):
    return {
        f.name: getattr(batch, f.name).clone()
        for f in attrs.fields(ForwardBatch)
        if torch.is_tensor(getattr(batch, f.name))
    }


CASES = [(TorchOps, 1), (TorchOps, 4)] + [(ops, 4) for ops in OPS if ops is not TorchOps]  # the interpreter is slow


@pytest.mark.parametrize("ops,page_size", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_fast_target_equals_reference(weights, ops, page_size):
    pages = POOL_SLOTS // page_size
    (ref, ref_pool), (fast, fast_pool) = pair(weights, page_size, ops, feature_layers=(0, 2, 3), num_pages=pages)
    prompts = [tokens_of(1, 9), tokens_of(2, 13)]
    for pool in (ref_pool, fast_pool):
        pool.allocate(7, 3)  # scattered pages
    outs = {}
    for name, (target, pool) in {"ref": (ref, ref_pool), "fast": (fast, fast_pool)}.items():
        batch = extend_batch(pool, [0, 1], prompts, [0, 0], last_logits_only=False)  # 22 rows: chunks of 16 and 6
        prefill = target.forward(batch)
        # 30 rows, logits of each request's last row: rows 8 and 29, one in each chunk, and a chunk with none
        last = target.forward(extend_batch(pool, [3, 2], [tokens_of(3, 9), tokens_of(4, 21)], [0, 0]))
        assert last.logits.shape[0] == 2
        batch = extend_batch(pool, [0, 1], [[5, 6], [7]], [9, 13], last_logits_only=True)  # 3 rows, padded to 4
        before = snapshot(batch)
        extend = target.forward(batch)
        assert all(torch.equal(v, getattr(batch, k)) for k, v in before.items())
        tree = tree_batch(pool, 1, 14, [9, 10, 11, 12, 13, 14], [-1, 0, 0, 1, 1, 3])
        verify = target.forward(tree)
        outs[name] = (prefill, last, extend, verify)
    for got, want in zip(outs["fast"], outs["ref"]):
        torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got.hidden, want.hidden, atol=ATOL, rtol=RTOL)
    assert fast.graphs.eager_calls == 6  # every forward through the buffers: 2 + 2 prefill chunks, extend, verify
    ref_kv = torch.stack([torch.stack(kv) for kv in ref.kv])
    fast_kv = torch.stack([torch.stack(kv) for kv in fast.kv])
    torch.testing.assert_close(fast_kv, ref_kv, atol=ATOL, rtol=RTOL)  # padding rows wrote nothing


@pytest.mark.parametrize("ops", OPS, ids=lambda v: v.name)
def test_logits_in_the_model_dtype_are_the_float32_logits_values(weights, ops):
    """`ForwardBatch.logits_dtype=None` (a greedy verify's forward): a bfloat16 model's logits come back in bfloat16,
    the very values the float32 call returns widened, so their argmax (ties included) is the same; float32 stays the
    default."""
    pool = PagedKVPool(num_pages=POOL_SLOTS // 4, page_size=4)
    target = LlamaTarget.from_weights(TINY, weights, pool, dtype=torch.bfloat16)
    fast = FastTarget(target, pool, FastOptions("cpu", graphs=False, ops=ops, max_rows=16))
    batch = tree_batch(pool, 1, 14, [9, 10, 11, 12, 13, 14], [-1, 0, 0, 1, 1, 3])
    wide = fast.forward_static(batch, 32).logits
    own = fast.forward_static(attrs.evolve(batch, logits_dtype=None), 32).logits
    assert wide.dtype == torch.float32 and own.dtype == torch.bfloat16
    assert torch.equal(own.float(), wide)
    assert torch.equal(own.argmax(-1), wide.argmax(-1))


def test_static_buffers_leave_inputs_and_reset_padding(weights):
    """A smaller batch after a larger one: stale rows in the buffers are padding, never live rows."""
    (ref, ref_pool), (fast, fast_pool) = pair(weights, 2, TorchOps)
    for target, pool in ((ref, ref_pool), (fast, fast_pool)):
        target.forward(extend_batch(pool, [0, 1], [tokens_of(3, 5), tokens_of(4, 6)], [0, 0]))
    wide = [extend_batch(p, [0, 1], [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], [5, 6]) for p in (ref_pool, fast_pool)]
    narrow = [extend_batch(p, [1], [[12]], [12]) for p in (ref_pool, fast_pool)]
    for i, target in enumerate((ref, fast)):
        target.forward(wide[i])
    g = fast.graphs
    out_fast = fast.forward(narrow[1])
    out_ref = ref.forward(narrow[0])
    torch.testing.assert_close(out_fast.logits, out_ref.logits, atol=ATOL, rtol=RTOL)
    left, table_left = g.packed.clone(), g.table.clone()
    rows = bucket(max(1, g.min_rows))
    view = g._views(rows, 0, 1)
    assert int(view.out_slots[0]) == int(narrow[1].out_slots[0])
    assert bool((view.out_slots[1:] == -1).all() and (view.prefix_lens[1:] == 0).all())  # padding, not stale rows
    g._load(narrow[1], rows, 1, None)  # loading again gives what the forward left: it wrote no input
    assert torch.equal(g.packed, left) and torch.equal(g.table, table_left)


@pytest.mark.parametrize("ops", OPS, ids=lambda o: o.name)
def test_fast_drafts_equal_reference(weights, ops):
    pool_ref = PagedKVPool(num_pages=POOL_SLOTS // 4, page_size=4)
    pool_fast = PagedKVPool(num_pages=POOL_SLOTS // 4, page_size=4)
    model = LlamaModel(TINY, weights)
    featured = LlamaModel(TINY, weights, feature_layers=(1, 2, 3))
    options = FastOptions("cpu", graphs=False, ops=ops, max_rows=16)
    ref_skip = LlamaDraft(model, pool_ref, num_layers=2)
    fast_skip = FastLlamaDraft(LlamaDraft(model, pool_fast, num_layers=2), pool_fast, options)
    drafts = [(ref_skip, fast_skip)]
    # EAGLE-3 with its own LM head, over the target's, and a deeper head of two decoder layers
    for version, vocab, layers in ((1, None, 1), (3, 40, 1), (3, 0, 1), (3, 40, 2)):
        head_config = EagleConfig.for_target(TINY, version, draft_vocab_size=vocab)
        if version == 3:
            head_config = attrs.evolve(head_config, feature_layers=(1, 2, 3), num_layers=layers)
        head = EagleHead.random(head_config, seed=version, target_vocab=TINY.vocab_size)
        target_model = featured if version == 3 else model
        name = f"eagle{version}-{vocab}-{layers}"
        ref = EagleDraft(head, target_model, pool_ref, cache_name=name)
        fast = FastEagleDraft(EagleDraft(head, target_model, pool_fast, cache_name=name), pool_fast, options)
        drafts.append((ref, fast))
    features = 3 * TINY.hidden_size
    for index, (ref, fast) in enumerate(drafts):
        width = (
            features if getattr(ref, "head", None) is not None and ref.head.config.version == 3 else TINY.hidden_size
        )
        outs = []
        for draft, pool in ((ref, pool_ref), (fast, pool_fast)):
            rid = index  # the same request in each pool
            batch = extend_batch(pool, [rid], [tokens_of(rid, 6)], [0])
            hidden = torch.randn(6, width, generator=torch.Generator().manual_seed(rid))
            a = draft.extend(batch, hidden)
            tree = tree_batch(pool, rid, 6, [3, 4, 5, 6], [-1, 0, 0, 1])
            parent_hidden = torch.randn(4, TINY.hidden_size, generator=torch.Generator().manual_seed(5))
            b = draft.step(tree, parent_hidden)
            outs.append((a, b))
        for got, want in zip(outs[1], outs[0]):
            torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=RTOL)
            if want.hidden is not None:
                torch.testing.assert_close(got.hidden, want.hidden, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("ops", OPS, ids=lambda o: o.name)
def test_graph_stepped_decode_equals_greedy_decode(weights, ops):
    (ref, ref_pool), (fast, fast_pool) = pair(weights, 4, ops, num_pages=64)
    prompts = [tokens_of(5, 7), tokens_of(6, 3), tokens_of(7, 10)]
    steps = 12
    if ops is not TorchOps:  # the interpreter is slow
        prompts, steps = prompts[:2], 4
    want = greedy_decode(ref, ref_pool, prompts, max_new_tokens=steps, stop_token_ids=(2,))
    decoder = FastGreedyDecoder(fast, fast_pool, fast.options)
    got = decoder.decode(prompts, max_new_tokens=steps, stop_token_ids=(2,))
    assert got == want
    assert fast_pool.num_free_pages == fast_pool.num_pages


@pytest.mark.skipif(
    not (triton_available() and os.environ.get("TRITON_INTERPRET") == "1"), reason="the fused step's kernels"
)
def test_graph_stepped_decode_with_fused_step_equals_greedy_decode(weights):
    """The step's bookkeeping as Triton kernels (`engine.kernels.decode_step`, the CUDA default): same tokens,
    with a padding row (3 requests in a bucket of 4)."""
    (ref, ref_pool), (fast, fast_pool) = pair(weights, 4, TorchOps, num_pages=64)
    prompts, steps = [tokens_of(5, 7), tokens_of(6, 3), tokens_of(7, 10)], 6
    want = greedy_decode(ref, ref_pool, prompts, max_new_tokens=steps, stop_token_ids=(2,))
    decoder = FastGreedyDecoder(fast, fast_pool, fast.options)
    assert not decoder.loop.fused_step  # CPU default: the torch twins
    decoder.loop.fused_step = True
    assert decoder.decode(prompts, max_new_tokens=steps, stop_token_ids=(2,)) == want
    assert fast_pool.num_free_pages == fast_pool.num_pages


@pytest.mark.parametrize(
    "draft,spec",
    [
        ("layerskip", SpecConfig(num_steps=3, topk=1, page_size=4)),
        ("layerskip", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=1)),
        ("eagle", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)),
        ("ngram", SpecConfig(num_steps=4, topk=1, page_size=4)),
    ],
)
def test_fast_engine_is_lossless(weights, draft, spec):
    prompts = [tokens_of(11, 8) * 2, tokens_of(12, 5), tokens_of(13, 4)]  # 3 requests: one padding request
    model = LlamaModel(TINY, weights)
    pool = PagedKVPool(num_pages=-(-512 // spec.page_size), page_size=spec.page_size)

    def build(engine):
        from speccycle.engine.drafters.ngram import NgramDraft

        if draft == "layerskip":
            return LlamaDraft(model, pool, num_layers=2)
        if draft == "eagle":
            head = EagleHead.random(EagleConfig.for_target(TINY, 1), seed=3)
            return EagleDraft(head, model, pool)
        return NgramDraft(TINY.vocab_size)

    engine = Engine(model, pool, build, spec, fast=True)
    assert isinstance(engine.target, FastTarget)
    ar = engine.generate_autoregressive(prompts, 16)
    results, stats = engine.generate(prompts, 16, checked=True)
    assert [list(r.output) for r in results] == ar
    if draft in ("eagle", "ngram"):  # the static executor ran the cycles, checked (`statemachine.static`)
        assert engine.fused_cycles is not None and engine.fused_cycles.run_s > 0
    elif draft != "ngram":  # the draft loop ran over the padded static buffers
        assert engine.draft.level_runs > 0
    assert pool.num_free_pages == pool.num_pages
    reference = Engine(LlamaModel(TINY, weights), PagedKVPool(num_pages=512, page_size=1), None, SpecConfig())
    assert reference.generate_autoregressive(prompts, 16) == ar


@pytest.mark.skipif(FoldedNormOps not in OPS, reason="the Triton interpreter (TRITON_INTERPRET=1) or a GPU")
@pytest.mark.parametrize(
    "draft,spec",
    [
        ("layerskip", SpecConfig(num_steps=3, topk=1, page_size=4)),
        ("eagle", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)),
    ],
)
def test_fast_engine_with_folded_norms_is_lossless(weights, draft, spec):
    """`FoldedNormOps` (norm gains in the GEMM weights, the RMS factor after the GEMM, residual adds in the
    GEMMs) computes other roundings than the reference, but decode and verify rows run the same kernels:
    speculative output equals the same engine's autoregressive output, and the pool ends empty. (Two prompts of 8
    new tokens: under the interpreter this test took 110 and 218 s with three of 12, a third of the CI's time.)"""
    prompts = [tokens_of(11, 8) * 2, tokens_of(12, 5)]
    model = LlamaModel(TINY, weights)
    pool = PagedKVPool(num_pages=POOL_SLOTS // spec.page_size, page_size=spec.page_size)

    def build(engine):
        if draft == "layerskip":
            return LlamaDraft(model, pool, num_layers=2)
        return EagleDraft(EagleHead.random(EagleConfig.for_target(TINY, 1), seed=3), model, pool)

    engine = Engine(model, pool, build, spec)
    accelerate(engine, graphs=False, ops=FoldedNormOps)
    assert model.folded_norm_weights is not None
    ar = engine.generate_autoregressive(prompts, 8)
    results, stats = engine.generate(prompts, 8, checked=True)
    assert [list(r.output) for r in results] == ar and stats.verifies > 0
    assert pool.num_free_pages == pool.num_pages


@pytest.mark.parametrize("topk", [1, 2])
def test_static_draft_loop_equals_the_state_machine_loop(weights, topk):
    """`draft_levels` over padded static buffers == run directly, for 3 requests then 1 (padding grows)."""
    from speccycle.backends.torch import TorchBackend
    from speccycle.core import Ports
    from speccycle.core.tree import draft_scratch_positions
    from speccycle.statemachine.transitions import draft_levels

    spec = SpecConfig(num_steps=3, topk=topk, num_draft_tokens=4 if topk == 1 else 6, page_size=2)
    model = LlamaModel(TINY, weights)
    outs = []
    for fast in (False, True):
        pool = PagedKVPool(num_pages=128, page_size=2)
        draft = LlamaDraft(model, pool, num_layers=2)
        if fast:
            draft = FastLlamaDraft(draft, pool, FastOptions("cpu", graphs=False, max_rows=16))
        kv = pool.add_cache("target", TINY.num_layers, TINY.num_kv_heads, TINY.head_dim)
        ports = Ports(target=LlamaTarget(model, kv), draft=draft, kv_pool=pool)  # the loop runs no target forward
        prompts = [tokens_of(20 + i, 5 + 2 * i) for i in range(3)]
        lengths = torch.tensor([len(p) for p in prompts])
        for rid, p in enumerate(prompts):  # the draft's KV of each prompt (aligned: root included)
            draft.extend(extend_batch(pool, [rid], [p], [0]), None)
            pool.allocate(rid, len(p) + 8)
        got = []
        for ids in ((0, 1, 2), (1,)):
            L = lengths[list(ids)] - 1
            table = pool.page_table(list(ids))
            slots = pool.slots_for(list(ids), draft_scratch_positions(L, spec.num_steps, topk, 1).reshape(len(ids), -1))
            slots = slots.view(len(ids), spec.num_steps - 1, topk)
            top_p = torch.full((len(ids), topk), 0.5)
            top_i = torch.arange(topk).repeat(len(ids), 1) + 3
            args = (ports, TorchBackend(), spec, ids, L, table, slots, top_p, top_i, None)
            got.append(draft.run_draft_levels(draft_levels, *args) if fast else draft_levels(*args))
        outs.append(got)
        if fast:
            assert draft.level_runs == 2
    for want, got in zip(*outs):
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL)


def _layerskip_engine(weights, device="cpu"):
    """A fast layer-skip engine (chain of 3) on its own model and KV pool."""
    spec = SpecConfig(num_steps=3, topk=1, page_size=4)
    model = LlamaModel(TINY, weights, device=device)
    pool = PagedKVPool(num_pages=128, page_size=4, device=device)
    return Engine(model, pool, lambda engine: LlamaDraft(model, pool, num_layers=2), spec, fast=True)


def test_graph_pool_is_per_engine_and_dies_with_it(weights):
    """Each engine captures into its own `GraphPool` (never a process-wide handle), shared by its target, draft
    and decode graphs; dropping the engine frees the pool (and so every graph in it), and a new engine works."""
    import gc
    import weakref

    from speccycle.engine.fast.graphs import ForwardGraphs, GraphPool

    prompts = [tokens_of(31, 6), tokens_of(32, 9)]
    first = _layerskip_engine(weights)
    pool = first.fast_options.graph_pool
    assert isinstance(pool, GraphPool) and pool.num_graphs == 0  # made lazily: no CUDA state on CPU
    owners = (first.target.graphs, first.draft.graphs, first.fast_decoder.loop)
    assert all(owner.graph_pool is pool for owner in owners)
    want = first.generate_autoregressive(prompts, 8)
    second = _layerskip_engine(weights)
    assert second.fast_options.graph_pool is not pool
    alone = ForwardGraphs(second.target.graphs.compute, device="cpu", num_slots=64, page_size=4, vocab_size=64)
    assert alone.graph_pool is not pool and alone.graph_pool is not second.fast_options.graph_pool
    dead = weakref.ref(pool)
    del first, owners, pool
    gc.collect()
    assert dead() is None, "a dropped engine must not keep its graph pool (and its graphs) alive"
    results, _ = second.generate(prompts, 8, checked=True)
    assert [list(r.output) for r in results] == want == second.generate_autoregressive(prompts, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_new_engine_captures_after_a_dropped_one(weights):
    """On CUDA: build, run (captures), drop and collect an engine, then a new one captures again (the retired
    pool of the dropped engine is never reused: the allocator asserts ``use_count > 0`` if it is)."""
    import gc

    prompts = [tokens_of(41, 6), tokens_of(42, 9), tokens_of(43, 4), tokens_of(44, 7)]
    outputs = []
    for _ in range(3):
        engine = _layerskip_engine(weights, device="cuda")
        ar = engine.generate_autoregressive(prompts[:1], 8) + engine.generate_autoregressive(prompts, 8)
        results, _ = engine.generate(prompts[:1], 8)
        assert [list(r.output) for r in results] == ar[:1]
        batch, _ = engine.generate(prompts, 8)  # a batch of 4: its prefill and verify graphs
        assert engine.fast_options.graph_pool.num_graphs > 0
        outputs.append((ar, [list(r.output) for r in batch]))
        del engine, results, batch
        gc.collect()  # the dropped engine's graphs die now; its pool is retired (no empty_cache)
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize(
    "spec",
    [SpecConfig(num_steps=4, topk=1, page_size=4), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=1)],
    ids=["chain-P4", "tree-P1"],
)
def test_host_control_plane_is_lossless(weights, spec):
    """Greedy ngram cycles with their records on the host (`engine.fast.host_control`) equal autoregressive
    decoding, free every page, and take the argmax the fast target computed beside its logits."""
    from speccycle.core import SamplingParams
    from speccycle.engine.drafters.ngram import NgramDraft
    from speccycle.engine.fast.host_control import HostBackend, HostPool, HostTarget

    prompts = [tokens_of(21, 6) * 3, tokens_of(22, 5), tokens_of(23, 9)]
    model = LlamaModel(TINY, weights)
    pool = PagedKVPool(num_pages=-(-512 // spec.page_size), page_size=spec.page_size)
    engine = Engine(model, pool, lambda e: NgramDraft(TINY.vocab_size), spec)
    from speccycle.engine.fast.path import accelerate

    accelerate(engine, graphs=False, host_control=True, fused=False)  # fused: the static executor instead
    ports, backend = engine._cycle_ports(None)
    assert isinstance(ports.target, HostTarget) and isinstance(ports.kv_pool, HostPool)
    assert isinstance(backend, HostBackend)
    sampled = engine._cycle_ports(SamplingParams(temperature=0.8, seed=1))[0]
    assert not isinstance(sampled.target, HostTarget)  # sampling reads the logits: the device's ports

    summaries = []
    forward = HostTarget.forward

    def spy(self, batch):
        out = forward(self, batch)
        reference = engine.backend.greedy_predict(out.logits)
        summaries.append(torch.equal(out.greedy, reference) and bool(out.finite.all()))
        return out

    HostTarget.forward = spy
    try:
        ar = engine.generate_autoregressive(prompts, 16)
        results, stats = engine.generate(prompts, 16, checked=True)
    finally:
        HostTarget.forward = forward
    assert [list(r.output) for r in results] == ar
    assert summaries and all(summaries)
    assert stats.tau > 1.0  # the repeated prompt gives the lookup something to find
    assert pool.num_free_pages == pool.num_pages


@pytest.mark.parametrize(
    "spec",
    [SpecConfig(num_steps=4, topk=1, page_size=4), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=1)],
    ids=["chain-P4", "tree-P1"],
)
@pytest.mark.parametrize("draft", ["eagle1", "eagle3", "layerskip"])
def test_host_control_plane_runs_forward_drafts(weights, draft, spec):
    """Greedy cycles of a fast forward draft with their records on the host equal autoregressive decoding and
    free every page; the records hold no hidden state (row references), and every draft level's top-K, taken
    inside the draft's graphs, equals the reference selection: the extend's of its logits (handed over in
    `ModelOutput.topk`), the levels' as `draft_levels` over the same inputs with the reference backend computes
    them."""
    from speccycle.backends.torch import TorchBackend
    from speccycle.core import SamplingParams
    from speccycle.core.records import Drafted, Ready
    from speccycle.engine.fast.host_control import HostBackend, HostDraft
    from speccycle.engine.fast.path import accelerate
    from speccycle.statemachine.transitions import draft_levels

    prompts = [tokens_of(51, 6) * 2, tokens_of(52, 5), tokens_of(53, 9)]  # 3 requests: one padding request
    features = (1, 2, 3) if draft == "eagle3" else None
    model = LlamaModel(TINY, weights, feature_layers=features)
    pool = PagedKVPool(num_pages=-(-512 // spec.page_size), page_size=spec.page_size)

    def build(engine):
        if draft == "layerskip":
            return LlamaDraft(model, pool, num_layers=2)
        version = 3 if draft == "eagle3" else 1
        config = EagleConfig.for_target(TINY, version, draft_vocab_size=40 if version == 3 else None)
        if version == 3:
            config = attrs.evolve(config, feature_layers=features)
        return EagleDraft(EagleHead.random(config, seed=version, target_vocab=TINY.vocab_size), model, pool)

    engine = Engine(model, pool, build, spec)
    accelerate(engine, graphs=False, ops=TorchOps, host_control=True)
    ports, backend = engine._cycle_ports(None)
    assert isinstance(ports.draft, HostDraft) and isinstance(backend, HostBackend)
    for sampling in (SamplingParams(temperature=0.8, seed=1), SamplingParams(logprobs=True)):  # read the logits
        assert not isinstance(engine._cycle_ports(sampling)[0].draft, HostDraft)
    reference = TorchBackend()
    checks = {"extend": 0, "levels": 0, "ready": 0, "cycles": 0}
    extend, levels = HostDraft.extend, HostDraft.run_draft_levels

    drafts = set()

    def spy_extend(self, batch, target_hidden):
        drafts.add(self)
        out = extend(self, batch, target_hidden)
        probs, ids = out.topk  # taken inside the extend's graph, handed over in its output
        want = reference.select_topk(out.logits, ids.shape[1])  # the 'device' is the CPU: the logits are readable
        assert torch.equal(probs, want[0]) and torch.equal(ids, want[1])
        checks["extend"] += 1
        return out

    def spy_levels(self, fn, ports, backend, cfg, ids, L, page_table, draft_slots, topk_p, topk_index, hidden):
        got = levels(self, fn, ports, backend, cfg, ids, L, page_table, draft_slots, topk_p, topk_index, hidden)
        fed = None if hidden is None else self.hidden.rows(hidden).gather(torch.float32)
        args = (self.device_ports, reference, cfg, ids, L, page_table, draft_slots, topk_p, topk_index, fed)
        with torch.no_grad():
            want = draft_levels(*args)  # rewrites the same scratch slots with the same values
        assert all(g.device.type == "cpu" for g in got)
        for name, g, w in zip(("tokens", "scores", "parents", "positions"), got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            if name == "scores":
                torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
            else:
                assert torch.equal(g, w), name
        checks["levels"] += 1
        return got

    def on_step(record):
        checks["cycles"] += isinstance(record, Drafted)
        if isinstance(record, Ready) and record.draft_hidden is not None:  # references, not hidden states
            assert record.draft_hidden.dtype == torch.long and record.draft_hidden.shape[1] == 2
            checks["ready"] += 1

    HostDraft.extend, HostDraft.run_draft_levels = spy_extend, spy_levels
    try:
        ar = engine.generate_autoregressive(prompts, 16)
        results, stats = engine.generate(prompts, 16, checked=True, on_step=on_step)
    finally:
        HostDraft.extend, HostDraft.run_draft_levels = extend, levels
    assert [list(r.output) for r in results] == ar
    assert pool.num_free_pages == pool.num_pages
    assert checks["extend"] == checks["levels"] == checks["cycles"] == engine.draft.level_runs > 0
    (host_draft,) = drafts  # one port; it keeps nothing between the extend and the draft but the record
    assert not any(name.startswith("_ahead") for name in vars(host_draft))
    assert (checks["ready"] > 0) == (draft != "layerskip")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize(
    "draft,spec",
    [
        ("eagle1", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)),
        ("layerskip", SpecConfig(num_steps=4, topk=1, page_size=4)),
    ],
)
def test_host_control_plane_forward_drafts_on_cuda(weights, draft, spec):
    """On CUDA with graphs: a fast forward draft on the host plane gives the autoregressive output and the
    device plane's, frees every page, and syncs twice per cycle (the verify's copy back, the draft's), twice
    more around the prefill (its target forward, the first draft extend; one more than first counted, seen on
    an H100)."""
    from speccycle.engine.fast.host_control import HostDraft

    prompts = [tokens_of(61, 6) * 2, tokens_of(62, 5), tokens_of(63, 9)]
    model = LlamaModel(TINY, weights, device="cuda")
    pool = PagedKVPool(num_pages=128, page_size=spec.page_size, device="cuda")

    def build(engine):
        if draft == "layerskip":
            return LlamaDraft(model, pool, num_layers=2)
        return EagleDraft(EagleHead.random(EagleConfig.for_target(TINY, 1), seed=3, device="cuda"), model, pool)

    engine = Engine(model, pool, build, spec, fast=True)
    assert engine.host_control and isinstance(engine._cycle_ports(None)[0].draft, HostDraft)
    ar = engine.generate_autoregressive(prompts, 16)
    host, _ = engine.generate(prompts, 16, checked=True)
    engine.host_control = False
    device, _ = engine.generate(prompts, 16)
    engine.host_control = True
    assert [list(r.output) for r in host] == [list(r.output) for r in device] == ar
    assert pool.num_free_pages == pool.num_pages
    engine.generate(prompts[:1], 16)  # every graph of batch 1 captured
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        results, stats = engine.generate(prompts[:1], 16)
    counts = {e.key: e.count for e in prof.key_averages() if "Synchronize" in e.key}
    syncs = counts.get("cudaStreamSynchronize", 0) + counts.get("cudaDeviceSynchronize", 0)
    assert list(results[0].output) == ar[0]
    assert syncs <= 2 + 2 * stats.verifies, (counts, stats.verifies)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the fused cycles need a GPU")
@pytest.mark.parametrize(
    "spec",
    [SpecConfig(num_steps=4, topk=1, page_size=4), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)],
)
def test_two_layer_eagle3_head_on_cuda(weights, spec):
    """A deeper EAGLE-3 head (`EagleConfig.num_layers` 2) through the fast path's graphs and the device-resident
    cycles: the autoregressive output, every page freed."""
    prompts = [tokens_of(71, 6) * 2, tokens_of(72, 5)]
    features = (1, 2, 3)
    model = LlamaModel(TINY, weights, device="cuda", feature_layers=features)
    pool = PagedKVPool(num_pages=128, page_size=spec.page_size, device="cuda")
    config = attrs.evolve(EagleConfig.for_target(TINY, 3, draft_vocab_size=40), feature_layers=features, num_layers=2)
    head = EagleHead.random(config, seed=5, device="cuda", target_vocab=TINY.vocab_size)
    engine = Engine(model, pool, lambda e: EagleDraft(head, model, pool), spec, fast=True)
    assert len(engine.draft.extra_kv) == 1
    ar = engine.generate_autoregressive(prompts, 16)
    results, stats = engine.generate(prompts, 16, checked=True)  # every boundary of every replay validated
    assert [list(r.output) for r in results] == ar and stats.verifies > 0
    assert pool.num_free_pages == pool.num_pages
    # the graphs captured the table's rows for the config (the accept_commit fusion standing for three)
    from speccycle.statemachine import transitions as t
    from speccycle.statemachine.static import expand
    from speccycle.statemachine.table import TABLE

    fused = engine.fused_cycles
    assert fused.use_graphs and fused.replays > 0
    want = tuple(next(r for r in TABLE if r.run is f) for f in (t.draft_tree, t.verify, t.accept, t.compact))
    assert expand(fused.steps) == want + (next(r for r in TABLE if r.run is t.draft_extend),)
    results, _ = engine.generate(prompts, 16)  # unchecked: the same graphs, the same output
    assert [list(r.output) for r in results] == ar


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the fused cycles need a GPU")
@pytest.mark.parametrize(
    "spec",
    [SpecConfig(num_steps=4, topk=1, page_size=4), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)],
)
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "pipelined"])
def test_the_scheduler_replays_the_captured_cycle_as_its_batch_changes(weights, spec, checked):
    """`FusedCycles.step` under CUDA graphs: requests of different budgets leave and a waiting one joins, so the
    batch moves between graph buckets (three requests padded to four, then two, then one); checked at every
    boundary of every replay, or unchecked and pipelined (the next cycle launched from the device's state before
    the last is collected); each output is the autoregressive one, every page goes back."""
    from speccycle.core.config import SamplingParams
    from speccycle.engine.serving.scheduler import Scheduler

    prompts = [tokens_of(81, 6) * 2, tokens_of(82, 5), tokens_of(83, 7), tokens_of(84, 4)]
    budgets = (16, 5, 11, 8)
    model = LlamaModel(TINY, weights, device="cuda")
    pool = PagedKVPool(num_pages=256, page_size=spec.page_size, device="cuda")
    head = EagleHead.random(EagleConfig.for_target(TINY, 1), seed=3, device="cuda")
    engine = Engine(model, pool, lambda e: EagleDraft(head, model, pool), spec, fast=True)
    ar = [engine.generate_autoregressive([p], n)[0] for p, n in zip(prompts, budgets)]
    scheduler = Scheduler.from_engine(engine, checked=checked, max_batch_size=3)
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets)]
    scheduler.run()
    assert [list(scheduler.finished[i].output) for i in ids] == ar
    assert (scheduler.stats.pipelined_cycles > 0) == (not checked)
    fused = engine.fused_cycles
    # checked: each step reloads the batch into the bucket of its size; pipelined: a finished request's row stays,
    # done, until a request joins, so the batch need not reach the bucket of one
    buckets = {key[0] for key in fused._batches}
    assert fused.use_graphs and fused.replays > 0 and ({4, 2, 1} if checked else {4, 2}) <= buckets
    assert pool.num_free_pages == pool.num_pages


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the fused cycles need a GPU")
@pytest.mark.parametrize(
    "spec",
    [SpecConfig(num_steps=4, topk=1, page_size=4), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)],
)
def test_the_captured_cycle_serves_sampled_and_greedy_requests_in_one_batch(weights, spec):
    """`FusedCycles.step` under CUDA graphs with sampled requests (temperature, top-k, top-p, seeds) beside greedy
    ones, checked at every boundary of every replay, and unchecked and pipelined (`FusedCycles.launch_next`): the
    scheduler's outputs equal the eager table's (the same scheduler without the fused cycles) token for token, the
    greedy ones are the autoregressive ones; the sampled batches ran on graphs of their own, the greedy request
    left alone at the end on the greedy ones."""
    from speccycle.core.config import SamplingParams
    from speccycle.engine.serving.scheduler import Scheduler

    prompts = [tokens_of(91, 6) * 2, tokens_of(92, 5), tokens_of(93, 7), tokens_of(94, 4)]
    params = [
        SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, seed=5),
        SamplingParams(max_new_tokens=6),
        SamplingParams(max_new_tokens=9, temperature=1.0, top_p=0.9, seed=6),
        SamplingParams(max_new_tokens=24),
    ]
    model = LlamaModel(TINY, weights, device="cuda")
    pool = PagedKVPool(num_pages=256, page_size=spec.page_size, device="cuda")
    head = EagleHead.random(EagleConfig.for_target(TINY, 1), seed=3, device="cuda")
    engine = Engine(model, pool, lambda e: EagleDraft(head, model, pool), spec, fast=True)
    outputs = {}
    for mode in ("checked", "pipelined", "eager"):
        kwargs = {"fused_cycles": None} if mode == "eager" else {}
        scheduler = Scheduler.from_engine(engine, checked=mode == "checked", max_batch_size=3, **kwargs)
        ids = [scheduler.submit(p, sp) for p, sp in zip(prompts, params)]
        scheduler.run()
        outputs[mode] = [list(scheduler.finished[i].output) for i in ids]
        assert (scheduler.stats.fused_cycles > 0) == (mode != "eager")
    assert outputs["checked"] == outputs["pipelined"] == outputs["eager"]
    for b in (1, 3):
        assert outputs["eager"][b] == engine.generate_autoregressive([prompts[b]], params[b].max_new_tokens)[0]
    fused = engine.fused_cycles
    assert fused.use_graphs and fused.replays > 0
    # sampled batches ran on buffers that serve sampling, the greedy request alone at the end on greedy ones
    assert {bt.buffers.sampling is not None for bt in fused._batches.values()} == {True, False}
    assert pool.num_free_pages == pool.num_pages


def test_an_unknown_blas_library_is_refused_with_the_choices(weights, monkeypatch):
    """``SPECCYCLE_BLAS``: a name the fast path does not take is refused before anything is swapped, on any
    device; a known one leaves a CPU engine's GEMMs to torch (the choice applies on CUDA only)."""
    from speccycle.engine.fast.path import accelerate

    model = LlamaModel(TINY, weights)
    engine = Engine(model, PagedKVPool(num_pages=16, page_size=4), None, SpecConfig(num_steps=3, topk=1, page_size=4))
    target = engine.target
    monkeypatch.setenv("SPECCYCLE_BLAS", "cublas-lt")
    with pytest.raises(ValueError, match="choose one of cublaslt, cublas, torch"):
        accelerate(engine, graphs=False)
    assert engine.target is target
    monkeypatch.setenv("SPECCYCLE_BLAS", "cublaslt")
    accelerate(engine, graphs=False)
    assert isinstance(engine.target, FastTarget) and engine.fast_options.blas is None


def test_blas_scope_sets_the_library_for_the_fast_forwards_and_puts_it_back(monkeypatch):
    """`fast.path.blas_scope`: torch's preferred BLAS library is the fast path's inside (cuBLASLt by default) and what
    it was after, also when the forward raises; ``torch`` and ``None`` touch nothing; an unset variable is the
    default."""
    import torch
    from speccycle.engine.fast import path as fast

    state = {"now": torch._C._BlasBackend.Cublas, "sets": []}

    def preferred(backend=None):
        if backend is not None:
            state["now"] = backend
            state["sets"].append(backend)
        return state["now"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    lt, cublas = torch._C._BlasBackend.Cublaslt, torch._C._BlasBackend.Cublas
    with fast.blas_scope("cublaslt"):
        assert state["now"] == lt
    assert state["now"] == cublas and state["sets"] == [lt, cublas]
    with pytest.raises(RuntimeError, match="inside"):
        with fast.blas_scope("cublaslt"):
            raise RuntimeError("inside")
    assert state["now"] == cublas
    state["sets"].clear()
    for choice in ("cublas", "torch", None):  # already the library, or nothing to set: no call
        with fast.blas_scope(choice):
            assert state["now"] == cublas
    assert state["sets"] == []
    monkeypatch.delenv("SPECCYCLE_BLAS", raising=False)
    assert fast.blas_choice() == fast.DEFAULT_BLAS == "cublaslt"


def _int8_grid_head(dtype=torch.float32):
    """An EAGLE-3 head whose GEMM weights lie on the int8-rowwise grid and whose post-attention gain is 1 (so the
    folded gate-up is the gate-up): its int8 forms are exact, and the int8 path computes what the reference does."""
    from speccycle.engine.drafters.eagle_storage import dequantize_rowwise, quantize_rowwise

    config = attrs.evolve(EagleConfig.for_target(TINY, 3, draft_vocab_size=40), feature_layers=(1, 2, 3))
    head = EagleHead.random(config, seed=7, dtype=dtype, target_vocab=TINY.vocab_size)
    with torch.no_grad():
        for w in (head.fc, head.qkv, head.o, head.gate_up, head.down, head.lm_head):
            w.copy_(dequantize_rowwise(*quantize_rowwise(w)))
        head.post_norm.weight.fill_(1.0)
    return head


@pytest.mark.skipif(FoldedNormOps not in OPS, reason="the Triton interpreter (TRITON_INTERPRET=1) or a GPU")
@pytest.mark.parametrize("max_rows", [32, 4], ids=["int8", "extend-dense"])
def test_int8_draft_weights_compute_the_heads_draft(max_rows, monkeypatch):
    """``draft_weights='int8'`` (`fast.path.HeadGemms`, `engine.kernels.int8_linear`): on a head whose weights are on
    the int8 grid, the fast extend and tree step give the reference draft's logits and hidden states (float32: IEEE
    products); with `fast.path.INT8_MAX_ROWS` at 4 the 6-row extend takes the dense weights and the 4-row step the int8
    ones."""
    from speccycle.engine.fast import path as fast
    from speccycle.engine.fast.path import DraftWeight, HeadGemms

    monkeypatch.setattr(fast, "INT8_MAX_ROWS", max_rows)

    head = _int8_grid_head()
    featured = LlamaModel(TINY, random_llama_weights(TINY, seed=0, scale=0.3), feature_layers=(1, 2, 3))
    pool_ref, pool_fast = PagedKVPool(num_pages=32, page_size=4), PagedKVPool(num_pages=32, page_size=4)
    options = FastOptions("cpu", graphs=False, ops=FoldedNormOps, max_rows=16, draft_weights="int8")
    ref = EagleDraft(head, featured, pool_ref, cache_name="int8")
    fast = FastEagleDraft(EagleDraft(head, featured, pool_fast, cache_name="int8"), pool_fast, options)
    assert isinstance(fast.gemms, HeadGemms) and fast.gemms.kind == "int8"
    dense = (head.fc, head.qkv, head.o, head.folded_gate_up, head.down, head.lm_head)  # the folded gate-up: the ops'
    held = [getattr(fast.gemms, n) for n in ("fc", "qkv", "o", "gate_up", "down", "lm_head")]
    assert all(isinstance(w, DraftWeight) and w.dense is d for w, d in zip(held, dense))  # the head's own, no copy
    assert fast.gemms.int8_bytes == sum(w.numel() + 4 * w.shape[0] for w in dense)  # a byte a weight, a scale a row
    outs = []
    for draft, pool in ((ref, pool_ref), (fast, pool_fast)):
        batch = extend_batch(pool, [0], [tokens_of(0, 6)], [0])
        a = draft.extend(batch, torch.randn(6, 3 * TINY.hidden_size, generator=torch.Generator().manual_seed(0)))
        tree = tree_batch(pool, 0, 6, [3, 4, 5, 6], [-1, 0, 0, 1])
        b = draft.step(tree, torch.randn(4, TINY.hidden_size, generator=torch.Generator().manual_seed(5)))
        outs.append((a, b))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got.hidden, want.hidden, atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(FoldedNormOps not in OPS, reason="the Triton interpreter (TRITON_INTERPRET=1) or a GPU")
def test_fast_engine_with_an_int8_draft_is_lossless(weights):
    """An engine whose EAGLE-3 head drafts from int8 weights (a random head, not on the grid: its drafts differ from
    the head's) still gives its autoregressive output, and frees every page. (6 new tokens: the random head's drafts
    are rejected, so each of the five cycles takes the same path; under the interpreter 8 took 20 s.)"""
    prompts = [tokens_of(13, 6) * 2]
    spec = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)
    model = LlamaModel(TINY, weights, feature_layers=(1, 2, 3))
    pool = PagedKVPool(num_pages=POOL_SLOTS // 4, page_size=4)
    config = attrs.evolve(EagleConfig.for_target(TINY, 3, draft_vocab_size=40), feature_layers=(1, 2, 3))
    head = EagleHead.random(config, seed=9, target_vocab=TINY.vocab_size)
    engine = Engine(model, pool, lambda e: EagleDraft(head, model, pool), spec)
    accelerate(engine, graphs=False, ops=FoldedNormOps, draft_weights="int8")
    assert engine.draft.gemms.kind == "int8"
    ar = engine.generate_autoregressive(prompts, 6)
    results, stats = engine.generate(prompts, 6, checked=True)
    assert [list(r.output) for r in results] == ar and stats.verifies > 0
    assert pool.num_free_pages == pool.num_pages


def test_engines_over_one_head_share_its_int8_forms():
    """`fast.path.int8_form`: a second `HeadGemms` over the same head reuses the int8 forms (no second copy); a weight
    changed in place since is quantized again."""
    from speccycle.engine.fast.path import HeadGemms

    head = _int8_grid_head(torch.bfloat16)
    first = HeadGemms.of(head, FoldedNormOps, "int8", torch.device("cpu"))
    second = HeadGemms.of(head, FoldedNormOps, "int8", torch.device("cpu"))
    for name in ("fc", "qkv", "o", "gate_up", "down", "lm_head"):
        assert getattr(first, name).int8 is getattr(second, name).int8
    before = first.qkv.int8
    with torch.no_grad():
        head.qkv.mul_(2)
    third = HeadGemms.of(head, FoldedNormOps, "int8", torch.device("cpu"))
    assert third.qkv.int8 is not before and torch.equal(third.qkv.int8.q, before.q)
    assert torch.allclose(third.qkv.int8.scale, 2 * before.scale) and third.o.int8 is first.o.int8


def test_draft_weights_choice_and_refusals(monkeypatch):
    """``auto`` takes int8 on CUDA for a half-precision EAGLE-3 head under folded ops, the head's dtype elsewhere
    (CPU, float32 heads, unfolded ops, EAGLE-1); int8 asked where the folded EAGLE-3 layer does not run is refused
    with what to pass; an unknown choice is refused with the choices, from the options and from the environment."""
    from speccycle.engine.fast.path import HeadGemms, draft_weights_choice

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    head = _int8_grid_head()
    assert HeadGemms.of(head, FoldedNormOps, "auto", cpu).kind == "dtype"
    assert HeadGemms.of(head, FoldedNormOps, "auto", cuda).kind == "dtype"  # a float32 head: a parity run
    half = _int8_grid_head(torch.bfloat16)
    assert HeadGemms.of(half, FoldedNormOps, "auto", cuda).kind == "int8"
    assert HeadGemms.of(half, TorchOps, "auto", cuda).kind == "dtype"
    assert HeadGemms.of(half, FoldedNormOps, "dtype", cuda).lm_head is half.lm_head
    with pytest.raises(ValueError, match="pass draft_weights='dtype'"):
        HeadGemms.of(head, TorchOps, "int8", cpu)
    eagle1 = EagleHead.random(EagleConfig.for_target(TINY, 1), seed=3)
    with pytest.raises(ValueError, match="EAGLE-1"):
        HeadGemms.of(eagle1, FoldedNormOps, "int8", cuda)
    assert HeadGemms.of(eagle1, FoldedNormOps, "auto", cuda).kind == "dtype"
    with pytest.raises(ValueError, match="choose one of auto, int8, dtype"):
        FastOptions("cpu", graphs=False, draft_weights="fp8")
    monkeypatch.setenv("SPECCYCLE_DRAFT_WEIGHTS", "fp8")
    with pytest.raises(ValueError, match="SPECCYCLE_DRAFT_WEIGHTS='fp8': choose one of auto, int8, dtype"):
        FastOptions("cpu", graphs=False)
    monkeypatch.setenv("SPECCYCLE_DRAFT_WEIGHTS", "int8")
    assert draft_weights_choice() == "int8" and FastOptions("cpu", graphs=False).draft_weights == "int8"
    monkeypatch.delenv("SPECCYCLE_DRAFT_WEIGHTS")
    assert FastOptions("cpu", graphs=False).draft_weights == "auto"


def test_int8_draft_gemms_take_the_dense_weight_above_int8_max_rows(monkeypatch):
    """`fast.path.INT8_MAX_ROWS`: up to it a `DraftWeight` is multiplied in int8, above it the head's own tensor goes to
    the op set's GEMM (where cuBLAS beats the int8 kernel's large tiles); plain tensors always go to the op set."""
    from speccycle.engine.fast import path as fast
    from speccycle.engine.kernels.int8_linear import Int8Rowwise

    calls = []
    monkeypatch.setattr(fast, "int8_linear", lambda x, q, out_dtype=None: calls.append(("int8", x.shape[0])) or x)
    monkeypatch.setattr(fast, "int8_linear_add", lambda x, a, q: calls.append(("int8+", a.shape[0])) or x)

    class Ops:
        linear = staticmethod(lambda x, w, out_dtype=None: calls.append(("dense", x.shape[0], w)) or x)
        linear_add = staticmethod(lambda x, a, w: calls.append(("dense+", a.shape[0], w)) or x)

    dense = torch.randn(8, 4)
    weight = fast.DraftWeight(Int8Rowwise.from_weight(dense), dense)
    limit = fast.INT8_MAX_ROWS
    for rows in (1, limit, limit + 1):
        fast._linear(Ops, torch.zeros(rows, 4), weight)
        fast._linear_add(Ops, torch.zeros(rows, 8), torch.zeros(rows, 4), weight)
    fast._linear(Ops, torch.zeros(1, 4), dense)
    assert calls == [("int8", 1), ("int8+", 1), ("int8", limit), ("int8+", limit), ("dense", limit + 1, dense),
                     ("dense+", limit + 1, dense), ("dense", 1, dense)]  # fmt: skip
