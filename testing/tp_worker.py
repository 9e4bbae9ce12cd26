"""The tensor-parallel test's worker: one process per rank (gloo, CPU), every scenario in one start.

`tests/e2e/test_tensor_parallel.py` spawns ``world_size`` of these; each writes ``rank{r}.json``
with its outputs per scenario, and the test compares them with the single-process engine's. Kept in
the package (not the test module) so spawned processes can import it by name.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import attrs
import torch

from ..core import SpecConfig
from ..engine.drafters.eagle import EagleConfig, EagleHead
from ..engine.drafters.oracle import OracleDraft
from ..engine.errors import ModelLoadError
from ..engine.models.llama import random_llama_weights
from ..engine.weights.weights_gguf import LlamaConfig

# SmolLM2's awkward shape in miniature: 3 KV heads (2:1 at TP=2), odd vocabulary and intermediate size,
# tied embeddings.
CONFIG = LlamaConfig(
    architecture="llama",
    vocab_size=101,
    hidden_size=48,
    intermediate_size=99,
    num_layers=3,
    num_heads=6,
    num_kv_heads=3,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=512,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_ids=(),
)
WEIGHT_SEED, WEIGHT_SCALE = 1, 0.2
PROMPTS = ([1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 11, 12, 40, 41, 42, 43])
NEW_TOKENS = 24

# name -> (draft, spec, extra build arguments)
CASES = {
    "ngram-chain": ("ngram", SpecConfig(num_steps=4, topk=1, page_size=4), {}),
    "ngram-tree": ("ngram", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=1), {}),
    "layerskip-chain": ("layerskip", SpecConfig(num_steps=3, topk=1, page_size=4), {"layerskip_layers": 2}),
    "layerskip-tree": (
        "layerskip",
        SpecConfig(num_steps=2, topk=2, num_draft_tokens=5, page_size=1),
        {"layerskip_layers": 1},
    ),
    "eagle1-replicated-tree": ("eagle", SpecConfig(num_steps=2, topk=2, num_draft_tokens=5, page_size=4), {"v": 1}),
    "eagle1-sharded-chain": ("eagle", SpecConfig(num_steps=3, topk=1, page_size=4), {"v": 1, "eagle_sharded": True}),
    "eagle3-sharded-tree": (
        "eagle",
        SpecConfig(num_steps=2, topk=2, num_draft_tokens=6, page_size=1),
        {"v": 3, "eagle_sharded": True},
    ),
    # a head of two decoder layers (`EagleConfig.num_layers`), replicated
    "eagle3-2layers-replicated-chain": ("eagle", SpecConfig(num_steps=3, topk=1, page_size=4), {"v": 3, "layers": 2}),
}


def weights() -> dict[str, torch.Tensor]:
    return random_llama_weights(CONFIG, seed=WEIGHT_SEED, scale=WEIGHT_SCALE)


def eagle_head(version: int, layers: int = 1) -> EagleHead:
    head_config = EagleConfig.for_target(CONFIG, version, draft_vocab_size=64 if version == 3 else None)
    head_config = attrs.evolve(head_config, num_layers=layers)
    return EagleHead.random(head_config, seed=2, target_vocab=CONFIG.vocab_size)


def run(rank: int, world_size: int, out_dir: str) -> None:
    """Entry point of one spawned rank (``torch.multiprocessing`` passes ``rank`` first).

    The ranks meet through a file in ``out_dir`` (a fresh directory), not a TCP port: a port picked free and
    released before rank 0 binds it may be taken meanwhile by another process (another test worker's ranks).
    """
    import datetime

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    if sys.platform == "linux":  # gloo otherwise picks the interface the hostname resolves to, absent in some sandboxes
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    result: dict = {}
    try:
        # the store itself, not a file:// URL, which torch reads without unquoting (a path with "@" or a space breaks)
        store = dist.FileStore(str(Path(out_dir, "rendezvous")), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))  # fmt: skip
        _scenarios(result)
    except BaseException:  # written for the test to show; the test fails on a missing result anyway
        result["crash"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def _scenarios(result: dict) -> None:
    from ..engine.tp.engine import RankDivergenceError, build_tp_engine, init_tp, shared_generator

    tp = init_tp("gloo", "cpu", timeout_s=120)
    w = weights()
    result["shard"] = attrs.asdict(build_tp_engine(tp, CONFIG, w, "none", kv_tokens=64).model.shard)

    engine = build_tp_engine(tp, CONFIG, w, "none", kv_tokens=2048)
    reference = [list(r.output) for r in engine.generate(PROMPTS, NEW_TOKENS, checked=True)[0]]
    result["autoregressive"] = {"outputs": reference}

    for name, (draft, spec, extra) in CASES.items():
        extra = dict(extra)
        if draft == "eagle":
            extra["eagle_head"] = eagle_head(extra.pop("v"), extra.pop("layers", 1))
        engine = build_tp_engine(tp, CONFIG, w, draft, spec=spec, kv_tokens=2048, **extra)
        results, stats = engine.generate(PROMPTS, NEW_TOKENS, checked=True)
        result[name] = {
            "outputs": [list(r.output) for r in results],
            "tau": stats.tau,
            "pages_free": engine.pool.num_free_pages == engine.pool.num_pages,
        }
    try:  # the sharded draft splits one layer only: a deeper head is refused with what to do
        build_tp_engine(tp, CONFIG, w, "eagle", kv_tokens=64, eagle_head=eagle_head(3, 2), eagle_sharded=True)
        result["sharded_two_layers_error"] = None
    except ModelLoadError as err:
        result["sharded_two_layers_error"] = str(err)

    # Forced acceptance: proposals are the reference continuation, coins from the shared stream. The tree
    # puts its decoys first, so accepted paths take KV moves.
    references = [list(p) + r for p, r in zip(PROMPTS, reference)]
    oracle_specs = {
        "oracle-chain": (SpecConfig(num_steps=4, topk=1, page_size=4), 1.0),
        "oracle-tree": (SpecConfig(num_steps=3, topk=2, num_draft_tokens=7, page_size=1), 0.8),
    }
    for name, (spec, accept_prob) in oracle_specs.items():
        generator = shared_generator(tp, seed=7)

        def oracle(engine, generator=generator, accept_prob=accept_prob):
            return OracleDraft(CONFIG.vocab_size, references, accept_prob=accept_prob, generator=generator)

        engine = build_tp_engine(tp, CONFIG, w, oracle, spec=spec, kv_tokens=2048)
        results, stats = engine.generate(PROMPTS, NEW_TOKENS, checked=True)
        result[name] = {"outputs": [list(r.output) for r in results], "tau": stats.tau}

    # A rank-local seed is refused.
    try:
        shared_generator(tp, seed=100 + tp.rank)
    except RankDivergenceError as err:
        result["seed_error"] = str(err)

    # Divergence: the last rank's verify logits are biased towards token 0; the check must name it.
    engine = build_tp_engine(tp, CONFIG, w, "ngram", spec=SpecConfig(num_steps=4, topk=1, page_size=4))
    if tp.rank == tp.world_size - 1:
        forward = engine.target.forward
        calls = [0]

        def perturbed(batch):
            out = forward(batch)
            calls[0] += 1
            if calls[0] > 2:
                out.logits[:, 0] += 1e4
            return out

        engine.target.forward = perturbed
    try:
        engine.generate(PROMPTS, NEW_TOKENS, check_ranks=True)
        result["divergence"] = None
    except RankDivergenceError as err:
        result["divergence"] = str(err)
    result["divergence_pages_free"] = engine.pool.num_free_pages == engine.pool.num_pages

    # A replicated draft head that drifts on one rank: caught at the verify's inputs, before the forward.
    # EAGLE-3 (its own replicated LM head): an EAGLE-1 head's logits pass through the target's
    # vocabulary-parallel head and its all_gather, which hands every rank the same (mixed) logits.
    head = eagle_head(3)
    if tp.rank == tp.world_size - 1:
        head.fc.add_(torch.randn(head.fc.shape, generator=torch.Generator().manual_seed(3)))
    spec = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)
    engine = build_tp_engine(tp, CONFIG, w, "eagle", spec=spec, eagle_head=head)
    try:
        engine.generate(PROMPTS, NEW_TOKENS, check_ranks=True)
        result["draft_divergence"] = None
    except RankDivergenceError as err:
        result["draft_divergence"] = str(err)
