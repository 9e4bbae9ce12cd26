"""`RecurrentPool`: its errors, keyword-only port, tracking snapshots and prefix reuse, on a Mamba-only model."""

from __future__ import annotations

import attrs
import pytest
import torch
from speccycle.core import ForwardBatch
from speccycle.core.ports import RecurrentStatePool
from speccycle.engine.greedy import extend_batch
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.memory.recurrent_pool import RecurrentPool, RecurrentPools, RecurrentStateError
from speccycle.engine.models.hybrid import HybridConfig, HybridTarget, random_hybrid_weights
from speccycle.engine.weights.weights_gguf import LlamaConfig

LLAMA = LlamaConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=256,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)
MAMBA_ONLY = HybridConfig(llama=LLAMA, layer_types=("mamba", "mamba"), d_state=4, d_conv=3, dt_rank=4)
TOKENS = [5, 9, 14, 3, 27, 8, 41, 30, 12, 6, 50, 22, 17]


@pytest.fixture(scope="module")
def weights():
    return random_hybrid_weights(MAMBA_ONLY, seed=1, scale=0.3)


def _target(weights, snapshot_interval=0):
    kv = PagedKVPool(num_pages=64, page_size=4)
    return HybridTarget.from_weights(MAMBA_ONLY, weights, kv, max_rows=8, snapshot_interval=snapshot_interval), kv


def _prefill(target, kv, request_id, tokens, start=0):
    return target.forward(extend_batch(kv, [request_id], [tokens], [start], last_logits_only=False)).logits


def _chain_verify(kv, request_id, tokens, start) -> ForwardBatch:
    """A verify batch of a chain: row i at ``start + i`` attends rows 0..i."""
    n = len(tokens)
    kv.allocate(request_id, start + n)
    slots = kv.slots_for([request_id], torch.arange(start, start + n)[None])[0]
    extra = torch.where(torch.ones(n, n, dtype=torch.bool).tril(), slots, -1)
    return ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(start, start + n),
        row_request=torch.zeros(n, dtype=torch.long),
        out_slots=slots,
        prefix_lens=torch.full((n,), start),
        extra_slots=extra,
        page_table=kv.page_table([request_id]),
        page_size=kv.page_size,
        request_ids=(request_id,),
    )


def _state_after(weights, tokens):
    target, kv = _target(weights)
    _prefill(target, kv, 0, tokens)
    slot = target.states._slot[0]
    return {name: states[:, slot].clone() for name, states in target.states.states.items()}


def test_the_pools_are_recurrent_state_pools():
    pool = RecurrentPool(num_layers=1, state_shapes={"h": (2,)}, max_requests=2, max_rows=4)
    assert isinstance(pool, RecurrentStatePool) and isinstance(RecurrentPools(pool), RecurrentStatePool)


def test_commit_and_free_take_keyword_arguments_only():
    """SGLang's multi-layer worker once passed these in the wrong position order."""
    pool = RecurrentPool(num_layers=1, state_shapes={"h": (2,)}, max_requests=2, max_rows=4)
    with pytest.raises(TypeError):
        pool.commit((0,), torch.tensor([0]))
    with pytest.raises(TypeError):
        pool.free(0)


def test_errors_say_what_went_wrong(weights):
    target, kv = _target(weights)
    pool = target.states
    with pytest.raises(RecurrentStateError, match="holds 0 verify rows"):
        _prefill(target, kv, 0, TOKENS[:3])
        pool.commit(request_ids=(0,), last_correct_step_indices=torch.tensor([0]))
    with pytest.raises(RecurrentStateError, match="must feed positions 3"):
        _prefill(target, kv, 0, TOKENS[5:6], start=5)
    with pytest.raises(RecurrentStateError, match="exceed max_rows=8"):
        target.forward(_chain_verify(kv, 0, TOKENS[:9], 3))
    target.forward(_chain_verify(kv, 0, TOKENS[:2], 3))
    with pytest.raises(RecurrentStateError, match="holds 2 verify rows"):
        pool.commit(request_ids=(0,), last_correct_step_indices=torch.tensor([2]))
    pool.free(request_id=0)
    pool.free(request_id=99)  # never held state (refused before prefill): nothing to do
    with pytest.raises(RecurrentStateError, match="double free"):
        pool.free(request_id=0)


def test_a_speculative_row_needs_a_parent(weights):
    target, kv = _target(weights)
    _prefill(target, kv, 0, TOKENS[:3])
    batch = _chain_verify(kv, 0, TOKENS[:3], 3)
    orphan = batch.extra_slots.clone()
    orphan[2, 1] = -1  # row 2 no longer attends its parent
    with pytest.raises(RecurrentStateError, match="position 5 has no parent"):
        target.forward(attrs.evolve(batch, extra_slots=orphan))


def test_tracking_snapshots_from_prefill_and_from_the_accepted_path(weights):
    target, kv = _target(weights, snapshot_interval=4)
    _prefill(target, kv, 0, TOKENS[:10])
    assert target.states.snapshots(request_id=0) == [4, 8]
    for length in (4, 8):
        snap = target.states.snapshot_state(request_id=0, length=length)
        expected = _state_after(weights, TOKENS[:length])
        for name in snap:
            torch.testing.assert_close(snap[name], expected[name], rtol=1e-5, atol=1e-6)
    # A verify of rows at positions 10..13; rows 0..2 accepted: the state after 12 tokens is on the path.
    target.forward(_chain_verify(kv, 0, TOKENS[10:13] + [1], 10))
    target.states.commit(request_ids=(0,), last_correct_step_indices=torch.tensor([2]))
    assert target.states.state_len(request_id=0) == 13
    assert target.states.snapshots(request_id=0) == [4, 8, 12]
    snap = target.states.snapshot_state(request_id=0, length=12)
    expected = _state_after(weights, TOKENS[:12])
    for name in snap:
        torch.testing.assert_close(snap[name], expected[name], rtol=1e-5, atol=1e-6)


def test_prefix_reuse_restores_a_snapshot_and_continues(weights):
    target, kv = _target(weights, snapshot_interval=4)
    full = _prefill(target, kv, 0, TOKENS[:11])
    target.states.restore(request_id=1, from_request_id=0, length=8)
    rest = _prefill(target, kv, 1, TOKENS[8:11], start=8)  # only the tokens past the shared prefix
    torch.testing.assert_close(rest, full[8:], rtol=1e-5, atol=1e-5)
    with pytest.raises(RecurrentStateError, match="has snapshots at \\[4, 8\\]"):
        target.states.restore(request_id=2, from_request_id=0, length=6)
