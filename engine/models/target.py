"""`LlamaTarget`: the `TargetModel` port over a `LlamaModel` and the pool's target cache.

pool = PagedKVPool(num_pages=512, page_size=16)
target = LlamaTarget.from_gguf(default_model_path(), pool)
out = target.forward(batch)          # writes KV at batch.out_slots, returns logits and features
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ...core.ports import ForwardBatch, ModelOutput
from ..memory.kv_pool import TARGET_CACHE, LayerKV, PagedKVPool
from ..weights.weights_gguf import LlamaConfig, load_gguf
from .llama import LlamaModel


class LlamaTarget:
    """A `TargetModel` (core.ports): ``vocab_size`` and ``forward(batch) -> ModelOutput``.

    ``hidden`` of the output holds the model's features (``feature_layers`` of the `LlamaModel`).
    """

    def __init__(self, model: LlamaModel, kv: Sequence[LayerKV]) -> None:
        if len(kv) != model.config.num_layers:
            raise ValueError(
                f"the target cache has {len(kv)} layers and the model {model.config.num_layers}; build it "
                f"with pool.add_cache('target', num_layers={model.config.num_layers}, ...)"
            )
        self.model = model
        self.kv = list(kv)
        self.vocab_size = model.config.vocab_size
        self.device = model.device

    @property
    def config(self) -> LlamaConfig:
        return self.model.config

    @classmethod
    def from_weights(
        cls,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        pool: PagedKVPool,
        dtype: torch.dtype = torch.float32,
        feature_layers: Sequence[int] | None = None,
        cache_name: str = TARGET_CACHE,
    ) -> LlamaTarget:
        """Build the model on the pool's device and add its KV cache to the pool as ``cache_name``."""
        from .catalog import build_model

        model = build_model(config, weights, dtype=dtype, device=pool.device, feature_layers=feature_layers)
        kv = pool.add_cache(cache_name, config.num_layers, config.num_kv_heads, config.head_dim, dtype)
        return cls(model, kv)

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike,
        pool: PagedKVPool,
        dtype: torch.dtype = torch.float32,
        feature_layers: Sequence[int] | None = None,
    ) -> LlamaTarget:
        """Load a GGUF file (see `weights_gguf.load_gguf`) and build the target over ``pool``."""
        config, weights = load_gguf(path, dtype=dtype)
        return cls.from_weights(config, weights, pool, dtype=dtype, feature_layers=feature_layers)

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """Write each row's K/V at ``out_slots``, attend per core.ports, return logits and features."""
        return self.model.forward(batch, self.kv)
