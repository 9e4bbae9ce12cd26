"""DFlash block drafts and MTP drafts on a small random Llama: lossless (invariant 10), and their contracts.

Random weights, so few drafts are accepted: these tests hold the cycle to exactness (checked mode,
invariant 13 on every block verify) and the drafts to their shapes and pairings. The property tests
(tests/property/test_recurrent_block.py) drive blocks with controlled agreement.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from speccycle.core import SpecConfig
from speccycle.engine.drafters.dflash import DFlashConfig, DFlashDraft
from speccycle.engine.drafters.mtp import MtpDraft
from speccycle.engine.engine import Engine
from speccycle.engine.greedy import extend_batch
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel, random_llama_weights
from speccycle.engine.weights.weights_gguf import LlamaConfig
from speccycle.statemachine import CycleError

LLAMA = LlamaConfig(
    architecture="llama",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
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
PROMPTS = [[5, 7, 9, 11, 13, 17, 19, 23, 29], [40, 41, 42], [3, 60, 61, 62, 63, 64]]
NEW_TOKENS = 20


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def weights():
    return random_llama_weights(LLAMA, seed=0, scale=0.3)


def _engine(weights, spec: SpecConfig, kind: str, **options) -> Engine:
    feature_layers = None
    if kind == "dflash":
        dflash = DFlashConfig.for_target(LLAMA, block_size=options.pop("block_size", spec.num_steps + 1), **options)
        feature_layers = dflash.feature_layers
    model = LlamaModel(LLAMA, weights, feature_layers=feature_layers)
    pool = PagedKVPool(num_pages=2048 // spec.page_size, page_size=spec.page_size)

    def build(engine: Engine):
        if kind == "dflash":
            return DFlashDraft.random(dflash, model, pool, seed=1)
        return MtpDraft.random(model, pool, seed=1, **options)

    return Engine(model, pool, build, spec)


@pytest.fixture(scope="module")
def autoregressive(weights):
    return _engine(weights, SpecConfig(), "mtp").generate_autoregressive(PROMPTS, NEW_TOKENS)


CASES = [
    ("dflash", SpecConfig(num_steps=3, page_size=1), {}),
    ("dflash", SpecConfig(num_steps=7, page_size=16), {"num_layers": 2}),
    ("mtp", SpecConfig(num_steps=3, page_size=1), {"num_modules": 1}),
    ("mtp", SpecConfig(num_steps=4, page_size=16), {"num_modules": 2}),
    ("mtp", SpecConfig(num_steps=2, page_size=4), {"num_modules": 3}),
]


@pytest.mark.parametrize(
    "kind, spec, options", CASES, ids=[f"{k}-S{s.num_steps}P{s.page_size}-{o}" for k, s, o in CASES]
)
def test_speculative_equals_autoregressive(weights, autoregressive, kind, spec, options):
    engine = _engine(weights, spec, kind, **dict(options))
    results, stats = engine.generate(PROMPTS, NEW_TOKENS, checked=True)  # one ragged batch
    assert [list(r.output) for r in results] == autoregressive, f"{kind} {spec} {options} diverged"
    assert stats.verifies > 0
    assert engine.pool.num_free_pages == engine.pool.num_pages, "KV pages leaked"


def test_a_block_draft_needs_a_chain_of_its_block_size(weights):
    engine = _engine(weights, SpecConfig(num_steps=3, page_size=1), "dflash", block_size=8)
    with pytest.raises(CycleError, match="block_size B=8 needs topk"):
        engine.generate(PROMPTS[:1], 4)


def test_mtp_is_chain_only(weights):
    engine = _engine(weights, SpecConfig(num_steps=3, topk=2, num_draft_tokens=5), "mtp", num_modules=1)
    with pytest.raises(ValueError, match="chain-only"):
        engine.generate(PROMPTS[:1], 4)


def test_mtp_extend_in_pieces_equals_one_extend(weights):
    """Module k > 1 reads module k - 1's output at the previous position, across extends too."""
    tokens = PROMPTS[0]
    outs = []
    for cuts in ([len(tokens)], [4, len(tokens) - 4], [1, 3, 2, len(tokens) - 6]):
        model = LlamaModel(LLAMA, weights)
        pool = PagedKVPool(num_pages=64, page_size=4)
        draft = MtpDraft.random(model, pool, num_modules=3, seed=2)
        features = torch.randn(len(tokens), LLAMA.hidden_size, generator=torch.Generator().manual_seed(0))
        start, hidden = 0, []
        for n in cuts:
            batch = extend_batch(pool, [0], [tokens[start : start + n]], [start], last_logits_only=False)
            hidden.append(draft.extend(batch, features[start : start + n]).hidden)
            start += n
        caches = [torch.cat([k.flatten(), v.flatten()]) for k, v in draft.kv]
        outs.append((torch.cat(hidden), caches))
    for hidden, caches in outs[1:]:
        torch.testing.assert_close(hidden, outs[0][0], rtol=1e-5, atol=1e-5)
        for cache, expected in zip(caches, outs[0][1]):
            torch.testing.assert_close(cache, expected, rtol=1e-5, atol=1e-5)


def test_dflash_block_is_non_causal_and_reads_only_its_context(weights):
    """Every masked row sees the whole block; nothing past the block's positions reaches it."""
    spec = SpecConfig(num_steps=3, page_size=1)
    dflash = DFlashConfig.for_target(LLAMA, block_size=4)
    model = LlamaModel(LLAMA, weights, feature_layers=dflash.feature_layers)
    pool = PagedKVPool(num_pages=64, page_size=1)
    draft = DFlashDraft.random(dflash, model, pool, seed=3)
    L = 6
    pool.allocate(0, L + spec.num_draft_tokens + 4)
    context = extend_batch(pool, [0], [list(range(10, 10 + L))], [0], last_logits_only=False)
    draft.extend(context, torch.randn(L, model.feature_size(), generator=torch.Generator().manual_seed(1)))
    slots = pool.slots_for([0], torch.arange(L, L + 4)[None])[0]
    block = attrs.evolve(
        extend_batch(pool, [0], [[7, draft.mask_token_id, draft.mask_token_id, draft.mask_token_id]], [L]),
        prefix_lens=torch.full((4,), L),
        extra_slots=slots.expand(4, 4).clone(),
        logits_rows=torch.arange(1, 4),
    )
    first = draft.propose(block).logits
    for k, v in draft.kv:  # garbage past the block must not matter
        far = pool.slots_for([0], torch.arange(L + 4, L + 8)[None])[0]
        k[far], v[far] = 1e3, -1e3
    assert torch.equal(draft.propose(block).logits, first)
    causal = attrs.evolve(block, extra_slots=torch.where(torch.ones(4, 4).tril().bool(), slots, -1))
    assert not torch.allclose(draft.propose(causal).logits, first), "the block forward must see later rows"
