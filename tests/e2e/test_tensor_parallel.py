"""Tensor parallelism, 2 ranks over gloo on the CPU: TP=2 greedy output equals the single-process engine.

One spawn of 2 processes runs every scenario (`speccycle.testing.tp_worker`): autoregressive, n-gram,
layer skip, EAGLE-1/3 (head replicated and sharded), chain and tree, in checked mode (invariants, and
the ranks' committed tokens and forward inputs compared every cycle); the forced-acceptance draft;
a rank-local seed; and a perturbed rank, which the divergence check must name. A small random Llama
with SmolLM2's awkward shape (3 KV heads, odd vocabulary), float32.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from speccycle.core import SpecConfig
from speccycle.engine.engine import Engine
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel
from speccycle.testing import tp_worker

WORLD_SIZE = 2
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    context = mp.start_processes(
        tp_worker.run, args=(WORLD_SIZE, str(out)), nprocs=WORLD_SIZE, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the {WORLD_SIZE} tensor-parallel ranks did not finish in {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    for rank, result in enumerate(results):
        assert "crash" not in result, f"rank {rank} crashed:\n{result['crash']}"
    return results


@pytest.fixture(scope="module")
def single_process() -> list[list[int]]:
    """TP=1: the plain engine's autoregressive greedy output."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = LlamaModel(tp_worker.CONFIG, tp_worker.weights())
        engine = Engine(model, PagedKVPool(num_pages=512, page_size=4), None, SpecConfig())
        return engine.generate_autoregressive(list(tp_worker.PROMPTS), tp_worker.NEW_TOKENS)
    finally:
        torch.set_num_threads(threads)


def test_shards_split_heads_by_kv_group_and_pad_the_vocabulary(ranks):
    shards = [r["shard"] for r in ranks]
    assert [s["kv_heads"] for s in shards] == [[0, 2], [2, 3]]
    assert [s["q_heads"] for s in shards] == [[0, 4], [4, 6]]
    assert [s["intermediate"] for s in shards] == [[0, 50], [50, 99]]
    assert [s["vocab"] for s in shards] == [[0, 51], [51, 101]]


def test_autoregressive_tp2_equals_tp1(ranks, single_process):
    for rank, result in enumerate(ranks):
        assert result["autoregressive"]["outputs"] == single_process, f"rank {rank}"


@pytest.mark.parametrize("case", list(tp_worker.CASES))
def test_speculative_tp2_equals_tp1(ranks, single_process, case):
    for rank, result in enumerate(ranks):
        assert result[case]["outputs"] == single_process, f"{case}: rank {rank} diverged from TP=1 greedy"
        assert result[case]["pages_free"], f"{case}: rank {rank} leaked KV pages"
    assert ranks[0][case]["tau"] == ranks[1][case]["tau"]


def test_forced_acceptance_accepts_drafts_chain_and_tree(ranks, single_process):
    for result in ranks:
        assert result["oracle-chain"]["outputs"] == single_process
        assert result["oracle-tree"]["outputs"] == single_process
        # p = 1: every cycle commits S + 1 = 5 tokens but the last; 23 tokens after prefill in 5 verifies.
        assert result["oracle-chain"]["tau"] == pytest.approx((tp_worker.NEW_TOKENS - 1) / 5)
        assert result["oracle-tree"]["tau"] > 1.5  # p = 0.8, S = 3: 2.95 expected


def test_a_deeper_head_is_refused_by_the_sharded_draft(ranks):
    for result in ranks:
        message = result["sharded_two_layers_error"]
        assert message is not None and "2 layers" in message and "--eagle-sharded" in message, message


def test_a_rank_local_seed_is_refused(ranks):
    for result in ranks:
        assert "rank 1 differs from rank 0" in result["seed_error"]


def test_divergence_check_names_the_perturbed_rank(ranks):
    for rank, result in enumerate(ranks):
        message = result["divergence"]
        assert message is not None, f"rank {rank}: the perturbed run finished without a divergence error"
        assert "committed tokens at cycle" in message and "rank 1 differs from rank 0" in message, message
        assert result["divergence_pages_free"], f"rank {rank} leaked pages after the divergence error"


def test_a_drifting_replicated_draft_is_caught_before_the_verify(ranks):
    for result in ranks:
        message = result["draft_divergence"]
        assert message is not None and "the inputs of a 3-layer forward" in message, message
        assert "rank 1 differs from rank 0" in message, message
