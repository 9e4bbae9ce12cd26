"""What the trainer measures is what the cycle drafts: every tree the real cycle builds equals the training head.

`test_train.py` checks the unrolled training head against `EagleDraft.extend` and `EagleDraft.step` on
hand-built batches. This runs the real cycle (prefill, draft extend, draft forwards, verify, accept,
compact, draft extend over the accepted rows) with a head trained until some drafts are accepted, and at
every verify of every request recomputes the draft with the trainer's `TrainableEagleHead.unroll` over the
committed sequence plus the node's ancestors: the anchor is ``L - 1`` (the bonus token ``t[L]`` with the
target feature ``f[L - 1]``) and step ``s`` reads the depth-``s`` node. Chains: each draft token is the
unrolled step's argmax; trees: each node's cumulative score is the product of the unrolled steps'
probabilities along its path. A shift, a wrong feature row after a verify, a wrong draft position or
prefix would break it, on the trainer's side or the engine's.

Measured with the SmolLM2 heads trained on an H100 (`docs/training.md`, "Teacher-forced accuracy and
tau"), the same check holds on the real model: 247 of 247 verifies drafted exactly the teacher-forced tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from speccycle.core import Drafted, SpecConfig
from speccycle.engine.drafters.eagle import EagleDraft
from speccycle.engine.engine import Engine
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel, random_llama_weights
from speccycle.engine.weights.weights_gguf import LlamaConfig
from speccycle.train.data import EngineGenerator, SelfDistilledData
from speccycle.train.features import target_outputs
from speccycle.train.head import TrainableEagleHead
from speccycle.train.trainer import TrainConfig, batch_loss, collate, draft_ids, draft_vocabulary, head_config

TINY = LlamaConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=8,  # EAGLE-3 reads layers (2, 4, 5)
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=512,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(255,),
)
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def weights():
    return random_llama_weights(TINY, seed=3, scale=0.25)  # varied greedy continuations, not one repeated token


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (int(n),), generator=gen).tolist() for n in (5, 7, 9, 6, 8, 4)]


@pytest.fixture(scope="module", params=[(1, 0), (3, 96), (3, 0)], ids=["eagle1", "eagle3", "eagle3full"])
def trained_head(request, weights, prompts) -> TrainableEagleHead:
    """A head trained on the target's greedy answers to the first three prompts (the others stay unseen).

    ``eagle3full``: EAGLE-3 over the target's final norm and LM head (``draft_vocab_size == 0``).
    """
    version, vocab = request.param
    seen = prompts[:3]
    answers = EngineGenerator(TINY, weights, "cpu", torch.float32, TINY.eos_token_ids)(seen, NEW_TOKENS, 0.0)
    data = SelfDistilledData.from_sequences([(i, p, r) for i, (p, r) in enumerate(zip(seen, answers))], 256)
    cfg = TrainConfig(version=version, ttt_steps=4, draft_vocab_size=vocab, intermediate_size=64, ce_chunk_rows=256)
    hcfg = head_config(TINY, cfg)
    d2t = draft_vocabulary(data, cfg.draft_vocab_size, TINY.vocab_size) if vocab else None
    head = TrainableEagleHead.init(hcfg, d2t, seed=0, std=0.05)
    t2d = draft_ids(head, TINY.vocab_size)
    model = LlamaModel(TINY, weights, feature_layers=hcfg.feature_layers if version == 3 else None)
    ids, lengths, prompt_lens = collate(data, np.arange(len(data)), 640, "cpu")
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(12):
        loss, _ = batch_loss(head, model, ids, lengths, prompt_lens, cfg, t2d)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head


def _unrolled_probs(head, model, sequence: list[int], path: list[int], feature_layers) -> torch.Tensor:
    """Draft probabilities (over the target's vocabulary) of the unrolled step ``len(path)`` at anchor ``L - 1``.

    ``sequence``: the committed tokens, bonus last (``L + 1`` of them); ``path``: the tokens of depths
    ``1..len(path)`` fed to the later steps.
    """
    ids = torch.tensor([sequence + path])
    anchor = len(sequence) - 2
    with torch.no_grad():
        features = target_outputs(model, ids, feature_layers).features
        hidden = head.unroll(model, ids, features, len(path) + 1)[-1][0, anchor]
        logits = head.logits(model, hidden[None]).float()[0]
    probs = torch.softmax(logits, -1)
    if head.config.target_lm_head:
        return probs
    full = probs.new_zeros(TINY.vocab_size)
    full[head.draft_to_target] = probs
    return full


@pytest.mark.parametrize(
    "spec",
    [SpecConfig(num_steps=4, page_size=4), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)],
    ids=["chain", "tree"],
)
@pytest.mark.parametrize("plane", ["reference", "host"])
def test_every_cycle_draft_equals_the_trained_heads_unrolled_draft(weights, prompts, trained_head, spec, plane):
    """``host``: the fast path with the records on the host (`engine.fast.host_control`, the 'device' a CPU): the
    draft reads the target's features by row references and runs its levels over static buffers."""
    head, version = trained_head, trained_head.config.version
    feature_layers = head.config.feature_layers
    model = LlamaModel(TINY, weights, feature_layers=feature_layers if version == 3 else None)
    draft_head = head.to_eagle_head()
    engine = Engine(
        model, PagedKVPool(num_pages=256, page_size=4), lambda e: EagleDraft(draft_head, e.model, e.pool), spec
    )
    if plane == "host":
        from speccycle.engine.fast.host_control import HostDraft
        from speccycle.engine.fast.path import accelerate
        from speccycle.engine.kernels.fused_ops import TorchOps

        accelerate(engine, graphs=False, ops=TorchOps, host_control=True)
        assert isinstance(engine._cycle_ports(None)[0].draft, HostDraft)
    trees = []  # (committed tokens, L, tokens, parents, scores) per request per verify

    def on_step(record):
        if isinstance(record, Drafted):
            for b, request in enumerate(record.requests):
                tree = record.tree
                scores = None if tree.scores is None else tree.scores[b].tolist()
                trees.append((list(request.tokens), int(record.seq_lens[b]), tree.tokens[b].tolist(),
                              tree.parents[b].tolist(), scores))  # fmt: skip

    results, stats = engine.generate(prompts, NEW_TOKENS, on_step=on_step)
    assert [list(r.output) for r in results] == engine.generate_autoregressive(prompts, NEW_TOKENS)
    histogram = stats.accept_len_histogram  # drafts accepted and rejected: extends of one and of several rows
    assert histogram.get(1, 0) > 0 and sum(n for k, n in histogram.items() if k > 2) > 0, histogram
    for committed, L, tokens, parents, scores in trees:
        assert len(committed) == L + 1 and committed[-1] == tokens[0]  # the root is the bonus token t[L]
        for node in range(1, len(tokens)):
            path = []
            up = parents[node]
            while up > 0:
                path.insert(0, tokens[up])
                up = parents[up]
            probs = _unrolled_probs(head, model, committed, path, feature_layers)
            if scores is None:  # a chain: the draft's argmax (near-ties allowed, the attention sums differ)
                assert float(probs[tokens[node]]) >= float(probs.max()) - 1e-5, (L, node, path)
                continue
            # a tree: the node is among its parent's top K, its score the product of the path's probabilities
            assert float(probs[tokens[node]]) >= float(probs.topk(spec.topk).values[-1]) - 1e-5, (L, node, path)
            score = float(probs[tokens[node]])
            for depth in range(len(path)):
                score *= float(_unrolled_probs(head, model, committed, path[:depth], feature_layers)[path[depth]])
            assert scores[node] == pytest.approx(score, rel=1e-4, abs=1e-6), (L, node, path)
