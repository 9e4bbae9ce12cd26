"""Forced acceptance in fused cycles (`bench.forced.ForcedFusedCycles`), eager vs graphed (GPU).

A small random Llama with a random EAGLE-3 head, a chain of 4 and a 32-node tree forced to tau 3: prints the
measured tau and the accept-length histogram of each, which should agree between eager and graphed cycles.

python -m bench.fused_forced_check
"""

from __future__ import annotations

import torch

from .forced import force_fused_acceptance
from .gpu_bench import LLAMA3_8B, random_eagle3_head, random_weights_on_device


def main() -> None:
    from speccycle.core import SpecConfig
    from speccycle.engine.drafters.eagle import EagleDraft
    from speccycle.engine.engine import Engine
    from speccycle.engine.memory.kv_pool import PagedKVPool
    from speccycle.engine.models.llama import LlamaModel
    from speccycle.engine.weights.weights_gguf import LlamaConfig

    config = LlamaConfig(**{**LLAMA3_8B, "hidden_size": 512, "intermediate_size": 1024, "num_layers": 8,
                            "num_heads": 8, "num_kv_heads": 2, "head_dim": 64})  # fmt: skip
    head = random_eagle3_head(config, "cuda", torch.bfloat16)
    model = LlamaModel(config, random_weights_on_device(config, "cuda", torch.bfloat16), dtype=torch.bfloat16,
                       device="cuda", feature_layers=head.config.feature_layers)  # fmt: skip
    prompt = list(range(100, 164))
    for spec in (
        SpecConfig(num_steps=4, page_size=16),
        SpecConfig(num_steps=5, topk=4, num_draft_tokens=32, page_size=16),
    ):
        for graphs in (False, True):
            pool = PagedKVPool(num_pages=64, page_size=16, device="cuda")
            engine = Engine(model, pool, lambda e, pool=pool: EagleDraft(head, model, pool), spec)
            from speccycle.engine.fast.path import accelerate

            accelerate(engine, graphs=graphs)
            force_fused_acceptance(engine, 3.0)
            results, stats = engine.generate([prompt], 48)
            print(
                spec.topk, "graphs" if graphs else "eager", round(stats.tau, 3), stats.accept_len_histogram, flush=True
            )


if __name__ == "__main__":
    main()
