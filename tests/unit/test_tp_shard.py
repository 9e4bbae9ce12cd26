"""Tensor-parallel pieces that need no second process: the partition, world size 1, the oracle draft."""

from __future__ import annotations

import attrs
import pytest
import torch
from speccycle.core.ports import ForwardBatch
from speccycle.engine.drafters.oracle import OracleDraft
from speccycle.engine.greedy import extend_batch
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel, random_llama_weights
from speccycle.engine.tp.tp_group import TPGroup, digest
from speccycle.engine.tp.tp_model import TPLlamaModel, plan_shard
from speccycle.testing.tp_worker import CONFIG


def _cover(ranges: list[tuple[int, int]], total: int) -> bool:
    """Contiguous, in order, covering [0, total)."""
    return ranges[0][0] == 0 and ranges[-1][1] == total and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shards_cover_heads_intermediate_and_vocabulary(world_size):
    plans = [plan_shard(CONFIG, r, world_size) for r in range(world_size)]
    assert _cover([p.kv_heads for p in plans], CONFIG.num_kv_heads)
    assert _cover([p.q_heads for p in plans], CONFIG.num_heads)
    assert _cover([p.intermediate for p in plans], CONFIG.intermediate_size)
    assert _cover([p.vocab for p in plans], CONFIG.vocab_size)
    group = CONFIG.num_heads // CONFIG.num_kv_heads
    for p in plans:  # a rank's query heads are exactly those reading its KV heads
        assert p.q_heads == (p.kv_heads[0] * group, p.kv_heads[1] * group)
        local = p.local_config(CONFIG)
        assert local.vocab_size == CONFIG.vocab_size and local.hidden_size == CONFIG.hidden_size
        assert p.vocab_per_rank * world_size >= CONFIG.vocab_size


def test_more_ranks_than_kv_heads_replicate_each_kv_head():
    config = attrs.evolve(CONFIG, num_heads=8, num_kv_heads=2)
    plans = [plan_shard(config, r, 4) for r in range(4)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="multiple of 2"):
        plan_shard(config, 0, 3)
    with pytest.raises(ValueError, match="outside a tensor-parallel group"):
        plan_shard(config, 2, 2)


def test_world_size_one_equals_the_single_process_model_bit_for_bit():
    weights = random_llama_weights(CONFIG, seed=3, scale=0.2)
    reference, sharded = LlamaModel(CONFIG, weights), TPLlamaModel(CONFIG, weights, TPGroup())
    outputs = []
    for model in (reference, sharded):
        pool = PagedKVPool(num_pages=16, page_size=4)
        kv = pool.add_cache("target", CONFIG.num_layers, model.config.num_kv_heads, CONFIG.head_dim)
        batch: ForwardBatch = extend_batch(pool, [0, 1], [[5, 6, 7, 8, 9], [1, 100]], [0, 0], last_logits_only=False)
        outputs.append(model.forward(batch, kv))
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].hidden, outputs[1].hidden)


def test_a_misshapen_weight_is_named():
    weights = random_llama_weights(CONFIG, seed=3)
    weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(Exception, match="down_proj.weight has shape"):
        TPLlamaModel(CONFIG, weights, TPGroup())


def test_digest_is_stable_and_tells_sequences_apart():
    assert digest([1, 2, 3]) == digest(torch.tensor([1, 2, 3]))
    assert digest([1, 2, 3]) != digest([1, 2, 4])
    assert 0 <= digest([7]) < 2**63


def test_oracle_proposes_the_reference_with_probability_p():
    reference = [1, 2, 3, 10, 11, 12, 13, 14, 15]
    history = reference[:4]  # prompt [1, 2, 3] + first output token 10
    right = OracleDraft(50, [reference], 1.0, torch.Generator().manual_seed(0))
    tokens, parents = right.propose([0], [history], num_steps=3, num_nodes=3, topk=1)
    assert tokens.tolist() == [[11, 12, 13]] and parents.tolist() == [[0, 1, 2]]
    wrong = OracleDraft(50, [reference], 0.0, torch.Generator().manual_seed(0))
    tokens, _ = wrong.propose([0], [history], num_steps=3, num_nodes=3, topk=1)
    assert all(t != r for t, r in zip(tokens[0].tolist(), [11, 12, 13]))


def test_oracle_tree_puts_decoys_first_and_the_chain_after():
    reference = [1, 2, 3, 10, 11, 12, 13]
    draft = OracleDraft(50, [reference], 1.0, torch.Generator().manual_seed(0))
    tokens, parents = draft.propose([0], [reference[:4]], num_steps=2, num_nodes=5, topk=2)
    # nodes 0..2 are decoys under the root (rows 1..3); the chain is rows 4 -> 5
    assert parents.tolist() == [[0, 0, 0, 0, 4]]
    assert tokens[0, 3:].tolist() == [11, 12] and 11 not in tokens[0, :3].tolist()
