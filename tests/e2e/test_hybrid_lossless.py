"""Greedy losslessness (invariant 10) on a hybrid attention + Mamba model with random weights.

A ragged batch of three prompts through the whole cycle, chain and tree, ``P`` 1 and 16, with a
layer-skip draft (whose own Mamba layers draft trees too) and an n-gram draft; the output must equal
the hybrid model's own autoregressive greedy decoding. Checked mode validates every invariant,
including the recurrent pool's state lengths (12), at every transition.
"""

from __future__ import annotations

import pytest
import torch
from speccycle.core import Ports, Request, SamplingParams, SpecConfig
from speccycle.engine.drafters.ngram import NgramDraft
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.memory.recurrent_pool import RecurrentPools
from speccycle.engine.models.hybrid import (
    HybridConfig,
    HybridSkipDraft,
    HybridTarget,
    hybrid_greedy,
    random_hybrid_weights,
)
from speccycle.engine.weights.weights_gguf import LlamaConfig
from speccycle.statemachine import generate

LLAMA = LlamaConfig(
    architecture="llama",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)
CONFIG = HybridConfig(llama=LLAMA, layer_types=("attention", "mamba", "attention", "mamba"))
PROMPTS = [[5, 7, 9, 11, 13, 17, 19, 23, 29], [40, 41, 42, 43], [3, 60, 61, 62, 63, 64]]
NEW_TOKENS = 20


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def weights():
    return random_hybrid_weights(CONFIG, seed=0, scale=0.2)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def autoregressive(weights):
    pool = PagedKVPool(num_pages=512, page_size=4, device=_device())
    target = HybridTarget.from_weights(CONFIG, weights, pool)
    out = hybrid_greedy(target, pool, PROMPTS, NEW_TOKENS)
    assert target.states.num_free_slots == target.states.max_requests
    return out


def _run(weights, spec: SpecConfig, draft: str, scan=None, prompts=PROMPTS, new_tokens=NEW_TOKENS):
    pool = PagedKVPool(num_pages=2048 // spec.page_size, page_size=spec.page_size, device=_device())
    target = HybridTarget.from_weights(CONFIG, weights, pool, max_rows=spec.num_draft_tokens)
    if scan is not None:
        target.model.scan = scan
    pools = [target.states]
    if draft == "ngram":
        drafter = NgramDraft(LLAMA.vocab_size)
    else:
        drafter = HybridSkipDraft(target.model, pool, num_layers=int(draft[-1]), max_rows=64)
        pools += [drafter.states] if drafter.states is not None else []
    recurrent = RecurrentPools(*pools)
    committed = []
    commit = recurrent.commit

    def recording_commit(*, request_ids, last_correct_step_indices):
        committed.extend(last_correct_step_indices.tolist())
        commit(request_ids=request_ids, last_correct_step_indices=last_correct_step_indices)

    recurrent.commit = recording_commit
    ports = Ports(target=target, draft=drafter, kv_pool=pool, recurrent=recurrent)
    requests = [Request(i, tuple(p), SamplingParams(max_new_tokens=new_tokens)) for i, p in enumerate(prompts)]
    done = generate(requests, spec, ports, checked=True)
    assert pool.num_free_pages == pool.num_pages, "KV pages leaked"
    assert all(p.num_free_slots == p.max_requests for p in pools), "recurrent state slots leaked"
    return [list(r.output) for r in done], committed


CASES = [
    ("layerskip2", SpecConfig(num_steps=3, topk=1, page_size=1)),
    ("layerskip2", SpecConfig(num_steps=4, topk=1, page_size=16)),
    ("layerskip3", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=1)),
    ("layerskip3", SpecConfig(num_steps=3, topk=3, num_draft_tokens=10, page_size=16)),
    ("layerskip1", SpecConfig(num_steps=3, topk=2, num_draft_tokens=7, page_size=16)),
    ("ngram", SpecConfig(num_steps=4, topk=1, page_size=16)),
    ("ngram", SpecConfig(num_steps=3, topk=2, num_draft_tokens=8, page_size=1)),
]


@pytest.mark.parametrize(
    "draft, spec", CASES, ids=[f"{d}-S{s.num_steps}K{s.topk}N{s.num_draft_tokens}P{s.page_size}" for d, s in CASES]
)
def test_hybrid_speculative_equals_autoregressive(weights, autoregressive, draft, spec):
    outputs, committed = _run(weights, spec, draft)
    assert outputs == autoregressive, f"{draft} {spec}: diverged from the hybrid model's greedy decoding"
    if draft.startswith("layerskip"):  # the rollback was exercised: accepted runs of several lengths
        assert len(set(committed)) >= 2, committed


def test_hybrid_tree_commits_rows_off_the_first_branch(weights, autoregressive):
    """In a tree, the accepted row is often not row ``accept_len - 1``: the state must come from the tree."""
    spec = SpecConfig(num_steps=3, topk=3, num_draft_tokens=10, page_size=16)
    outputs, committed = _run(weights, spec, "layerskip3")
    assert outputs == autoregressive
    assert max(committed) > spec.num_steps, f"no accepted row beyond depth S: {committed}"


def test_hybrid_with_the_triton_scan_equals_autoregressive(weights, autoregressive):
    """The Triton scan kernel in the whole cycle (interpreted on CPU: ``TRITON_INTERPRET=1``)."""
    pytest.importorskip("triton")
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel needs a GPU or TRITON_INTERPRET=1")
    from speccycle.backends.cuda.recurrent import selective_scan_tree

    spec = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)
    outputs, _ = _run(weights, spec, "layerskip2", scan=selective_scan_tree, prompts=PROMPTS[1:2], new_tokens=8)
    assert outputs == [autoregressive[1][:8]]
