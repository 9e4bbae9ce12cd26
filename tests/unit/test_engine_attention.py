"""The attention rule of core.ports on a tiny random Llama: ragged batches, trees, pages, features."""

from __future__ import annotations

import attrs
import pytest
import torch
from speccycle.core.ports import ForwardBatch
from speccycle.engine.errors import ForwardBatchError
from speccycle.engine.greedy import extend_batch, greedy_decode
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel, random_llama_weights
from speccycle.engine.models.target import LlamaTarget
from speccycle.testing.configs import TINY_LLAMA as TINY

# float32 logits of ~2: a one-request forward (compact CPU attention) and a ragged batch (SDPA) add in
# different orders; 2e-5 is ~80 ulp at that size.
ATOL = 2e-5


@pytest.fixture(scope="module")
def weights():
    return random_llama_weights(TINY, seed=0, scale=0.3)


def make_target(weights, page_size, num_pages=64, feature_layers=None):
    pool = PagedKVPool(num_pages=num_pages, page_size=page_size)
    return LlamaTarget.from_weights(TINY, weights, pool, feature_layers=feature_layers), pool


def causal_logits(weights, tokens, page_size=1):
    """Logits of every position of ``tokens`` run alone, in a fresh pool."""
    target, pool = make_target(weights, page_size)
    return target.forward(extend_batch(pool, [0], [tokens], [0], last_logits_only=False)).logits


def tokens_of(seed, n):
    return torch.randint(3, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def permuted(batch: ForwardBatch, order: torch.Tensor) -> ForwardBatch:
    """The same rows in another order (row_request still names each row's request)."""
    fields = ("input_ids", "positions", "row_request", "out_slots", "prefix_lens", "extra_slots")
    return attrs.evolve(batch, **{name: getattr(batch, name)[order] for name in fields})


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_ragged_batch_equals_each_request_alone(weights, page_size):
    a, b = tokens_of(1, 7), tokens_of(2, 12)
    target, pool = make_target(weights, page_size)
    pool.allocate(5, 2)  # interleave reservations so the requests' pages are not contiguous
    pool.allocate(6, 4)
    batch = extend_batch(pool, [5, 6], [a[:2], b[:4]], [0, 0], last_logits_only=False)
    first = target.forward(batch).logits
    batch = extend_batch(pool, [5, 6], [a[2:], b[4:]], [2, 4], last_logits_only=False)
    order = torch.randperm(batch.num_rows, generator=torch.Generator().manual_seed(0))
    rest = torch.empty(batch.num_rows, TINY.vocab_size)
    rest[order] = target.forward(permuted(batch, order)).logits  # rows out of request order
    got_a = torch.cat([first[:2], rest[:5]])
    got_b = torch.cat([first[2:], rest[5:]])
    torch.testing.assert_close(got_a, causal_logits(weights, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, causal_logits(weights, b), atol=ATOL, rtol=0)


def test_logits_rows_pick_rows(weights):
    target, pool = make_target(weights, 4)
    batch = extend_batch(pool, [0], [tokens_of(3, 9)], [0], last_logits_only=False)
    full = target.forward(batch).logits
    pool.free(0)
    batch = extend_batch(pool, [0], [tokens_of(3, 9)], [0], last_logits_only=False)
    rows = torch.tensor([8, 2, 5])
    picked = target.forward(attrs.evolve(batch, logits_rows=rows)).logits
    torch.testing.assert_close(picked, full[rows], atol=ATOL, rtol=0)


# A tree over verify rows 0..6 (row 0 the root): parent row of each row, -1 for the root.
PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def tree_batch(pool, request_ids, prefix_lens, tree_tokens):
    """Verify rows of several requests: row i at position L + depth(i), writing scratch slot L + i."""
    n = len(PARENTS)
    depth, paths = [0] * n, [[0]] * n
    for i in range(1, n):
        depth[i], paths[i] = depth[PARENTS[i]] + 1, [*paths[PARENTS[i]], i]
    rows = dict(input_ids=[], positions=[], row_request=[], out_slots=[], prefix_lens=[], extra_slots=[])
    for b, (rid, length, tokens) in enumerate(zip(request_ids, prefix_lens, tree_tokens)):
        pool.allocate(rid, length + n)
        slots = pool.slots_for([rid], torch.arange(length, length + n)[None])[0].tolist()
        for i in range(n):
            rows["input_ids"].append(tokens[i])
            rows["positions"].append(length + depth[i])
            rows["row_request"].append(b)
            rows["out_slots"].append(slots[i])
            rows["prefix_lens"].append(length)
            ancestors = [slots[j] for j in paths[i]]
            rows["extra_slots"].append(ancestors + [-1] * (4 - len(ancestors)))
    batch = ForwardBatch(
        **{name: torch.tensor(value, dtype=torch.long) for name, value in rows.items()},
        page_table=pool.page_table(request_ids),
        page_size=pool.page_size,
        request_ids=tuple(request_ids),
    )
    return batch, paths


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_rows_equal_their_causal_paths(weights, page_size):
    target, pool = make_target(weights, page_size)
    prompts = [tokens_of(10, 9), tokens_of(11, 5)]
    trees = [tokens_of(12, len(PARENTS)), tokens_of(13, len(PARENTS))]
    for rid, prompt in zip([0, 1], prompts):
        target.forward(extend_batch(pool, [rid], [prompt], [0]))
    batch, paths = tree_batch(pool, [0, 1], [len(p) for p in prompts], trees)
    logits = target.forward(batch).logits.view(2, len(PARENTS), -1)
    for b, (prompt, tree) in enumerate(zip(prompts, trees)):
        for i, path in enumerate(paths):
            reference = causal_logits(weights, prompt + [tree[j] for j in path], page_size)[-1]
            torch.testing.assert_close(logits[b, i], reference, atol=ATOL, rtol=0)


def test_greedy_decode_batched_equals_alone(weights):
    prompts = [tokens_of(20, 6), tokens_of(21, 11), tokens_of(22, 3)]
    target, pool = make_target(weights, 4)
    together = greedy_decode(target, pool, prompts, max_new_tokens=10)
    assert pool.num_free_pages == pool.num_pages
    alone = [greedy_decode(target, pool, [p], max_new_tokens=10)[0] for p in prompts]
    assert together == alone and all(len(o) == 10 for o in together)


def test_features_pick_the_residual_stream(weights):
    tokens = tokens_of(30, 6)
    features = (0, 2, TINY.num_layers)
    target, pool = make_target(weights, 2, feature_layers=features)
    out = target.forward(extend_batch(pool, [0], [tokens], [0], last_logits_only=False))
    assert out.hidden.shape == (6, TINY.hidden_size * len(features))
    plain, pool = make_target(weights, 2)
    default = plain.forward(extend_batch(pool, [0], [tokens], [0], last_logits_only=False)).hidden
    torch.testing.assert_close(out.hidden[:, -TINY.hidden_size :], default)  # default: final-norm input
    embeddings = weights["model.embed_tokens.weight"][torch.tensor(tokens)]
    torch.testing.assert_close(out.hidden[:, : TINY.hidden_size], embeddings)


def test_num_layers_runs_a_prefix_of_the_model(weights):
    tokens = tokens_of(40, 5)
    model = LlamaModel(TINY, weights)
    pool = PagedKVPool(num_pages=16, page_size=2)
    kv = pool.add_cache("draft", 1, TINY.num_kv_heads, TINY.head_dim)
    skip = model.forward(extend_batch(pool, [0], [tokens], [0], last_logits_only=False), kv, num_layers=1)
    small_config = attrs.evolve(TINY, num_layers=1)
    small_weights = {k: v for k, v in weights.items() if not k.startswith(("model.layers.1.", "model.layers.2."))}
    small_target, small_pool = make_target_for(small_config, small_weights)
    ref = small_target.forward(extend_batch(small_pool, [0], [tokens], [0], last_logits_only=False))
    torch.testing.assert_close(skip.logits, ref.logits, atol=ATOL, rtol=0)
    with pytest.raises(ForwardBatchError, match="kv has 1 layers"):
        model.forward(extend_batch(pool, [1], [tokens], [0]), kv)


def make_target_for(config, weights):
    pool = PagedKVPool(num_pages=16, page_size=2)
    return LlamaTarget.from_weights(config, weights, pool), pool


def test_bad_batches_raise_clear_errors(weights):
    target, pool = make_target(weights, 4)
    batch = extend_batch(pool, [0], [tokens_of(50, 3)], [0])
    with pytest.raises(ForwardBatchError, match="past the KV pages"):
        target.forward(attrs.evolve(batch, prefix_lens=batch.prefix_lens + 8))
    with pytest.raises(ForwardBatchError, match="attends no key"):
        target.forward(attrs.evolve(batch, prefix_lens=torch.zeros_like(batch.prefix_lens)))
    with pytest.raises(ForwardBatchError, match="extra_slots"):
        target.forward(attrs.evolve(batch, extra_slots=torch.zeros((1, 2), dtype=torch.long)))


def test_bfloat16_model_runs_and_stays_close(weights):
    tokens = tokens_of(60, 8)
    pool = PagedKVPool(num_pages=8, page_size=4)
    target = LlamaTarget.from_weights(TINY, weights, pool, dtype=torch.bfloat16)
    out = target.forward(extend_batch(pool, [0], [tokens], [0], last_logits_only=False))
    assert out.logits.dtype == torch.float32 and pool.cache()[0][0].dtype == torch.bfloat16
    torch.testing.assert_close(out.logits, causal_logits(weights, tokens), atol=0.5, rtol=0.05)  # bf16 rounding
