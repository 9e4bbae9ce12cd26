"""DFlash: a block draft conditioned on the target's hidden states, one non-causal forward per block.

* **Context (extend).** The target's features at each committed position ``p`` (several layers
  concatenated, like EAGLE-3) are projected and normalized, ``c_p = norm(fc(f_p))``; every draft layer
  turns ``c_p`` into its own K/V at ``p`` ("KV injection"). No layer is run over the context, so the
  extend costs two small matmuls per layer.
* **Block (propose).** Rows ``[root, mask, ..., mask]`` at ``L .. L + B - 1``: the root's embedding
  (the target's table) and a learned mask embedding. In each layer the rows attend the context K/V
  ``[0, L)`` and the K/V of every row of the block, in both directions. The draft's final norm and the
  target's LM head give every masked row a guess for the token at its own position.

The cycle side is `speccycle.statemachine.block`. `DFlashDraft.random` builds a draft with random
weights (lossless whatever its weights: the verify decides).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ...core.ports import ForwardBatch, ModelOutput
from ..errors import ModelLoadError
from ..kernels.attention import paged_attention, plan_attention, write_kv
from ..memory.kv_pool import PagedKVPool
from ..models.llama import LlamaModel, RMSNorm, apply_rope, rope_cos_sin


@attrs.frozen
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    feature_layers: tuple[int, ...] = attrs.field(converter=tuple)  # target residual streams, concatenated
    block_size: int = 8

    def __attrs_post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: a block holds the root and at least one candidate")
        if not self.feature_layers:
            raise ValueError("DFlash reads at least one target feature layer")

    @classmethod
    def for_target(cls, target_config, block_size: int = 8, num_layers: int = 1) -> DFlashConfig:
        """Shaped like the target's layers; features from up to three layers spread over its depth."""
        n = target_config.num_layers
        picks = sorted({max(1, round(1 + i * (n - 1) / 2)) for i in range(3)}) if n > 1 else [1]
        return cls(
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_layers=num_layers,
            num_heads=target_config.num_heads,
            num_kv_heads=target_config.num_kv_heads,
            head_dim=target_config.head_dim,
            rope_theta=target_config.rope_theta,
            rms_norm_eps=target_config.rms_norm_eps,
            feature_layers=tuple(picks),
            block_size=block_size,
        )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        shapes = {
            "fc.weight": (h, h * len(self.feature_layers)),
            "context_norm.weight": (h,),
            "mask_embedding": (h,),
            "norm.weight": (h,),
        }
        for layer in range(self.num_layers):
            p = f"layers.{layer}."
            shapes.update(
                {
                    p + "input_layernorm.weight": (h,),
                    p + "q_proj.weight": (self.num_heads * d, h),
                    p + "k_proj.weight": (self.num_kv_heads * d, h),
                    p + "v_proj.weight": (self.num_kv_heads * d, h),
                    p + "o_proj.weight": (h, self.num_heads * d),
                    p + "post_attention_layernorm.weight": (h,),
                    p + "gate_proj.weight": (i, h),
                    p + "up_proj.weight": (i, h),
                    p + "down_proj.weight": (h, i),
                }
            )
        return shapes


class _BlockLayer(nn.Module):
    """One DFlash layer: K/V from the injected context or from the block's rows; bidirectional in the block."""

    def __init__(self, config: DFlashConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.c = config
        self.input_norm = RMSNorm(w[prefix + "input_layernorm.weight"], config.rms_norm_eps)
        self.post_norm = RMSNorm(w[prefix + "post_attention_layernorm.weight"], config.rms_norm_eps)
        self.q = nn.Parameter(w[prefix + "q_proj.weight"], requires_grad=False)
        kv = torch.cat([w[prefix + "k_proj.weight"], w[prefix + "v_proj.weight"]])
        self.kv = nn.Parameter(kv, requires_grad=False)
        self.o = nn.Parameter(w[prefix + "o_proj.weight"], requires_grad=False)
        self.gate_up = nn.Parameter(
            torch.cat([w[prefix + "gate_proj.weight"], w[prefix + "up_proj.weight"]]), requires_grad=False
        )
        self.down = nn.Parameter(w[prefix + "down_proj.weight"], requires_grad=False)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shapes: ``x [T, H]`` (normalized) -> ``k, v [T, Hkv, D]``, k rotated."""
        c, rows = self.c, x.shape[0]
        k, v = F.linear(x, self.kv).chunk(2, dim=-1)
        k = apply_rope(k.view(rows, c.num_kv_heads, c.head_dim), cos, sin)
        return k, v.reshape(rows, c.num_kv_heads, c.head_dim)

    def forward(self, x, cos, sin, plan, cache) -> torch.Tensor:
        c, rows = self.c, x.shape[0]
        h = self.input_norm(x)
        q = apply_rope(F.linear(h, self.q).view(rows, c.num_heads, c.head_dim), cos, sin)
        k, v = self.key_value(h, cos, sin)
        write_kv(plan, cache[0], cache[1], k, v)
        attn = paged_attention(plan, q, cache[0], cache[1]).reshape(rows, c.num_heads * c.head_dim)
        x = x + F.linear(attn, self.o)
        gate, up = F.linear(self.post_norm(x), self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)


class DFlashDraft:
    """A `BlockDraft` (core.ports) over the target's `LlamaModel` (embedding and LM head shared).

    The target must return the features ``config.feature_layers``. ``mask_token_id`` is the vocabulary
    size: no token of the target's, the rows the draft fills in.
    """

    kind = "block"

    def __init__(
        self,
        config: DFlashConfig,
        weights: dict[str, torch.Tensor],
        target_model: LlamaModel,
        kv_pool: PagedKVPool,
        dtype: torch.dtype = torch.float32,
        cache_name: str = "draft",
    ) -> None:
        if target_model.config.architecture != "llama":
            architecture = target_model.config.architecture
            raise ValueError(f"DFlash drafts run over Llama-architecture targets, not {architecture!r}")
        expected = config.weight_shapes()
        wrong = [k for k, s in expected.items() if k not in weights or tuple(weights[k].shape) != s]
        if wrong:
            raise ModelLoadError(f"DFlash weights do not fit its config: missing or misshapen {wrong[:5]}")
        if config.hidden_size != target_model.config.hidden_size:
            raise ModelLoadError(
                f"DFlash hidden size {config.hidden_size} != the target's {target_model.config.hidden_size}"
            )
        if tuple(target_model.feature_layers or ()) != config.feature_layers:
            raise ValueError(
                f"the target returns features {target_model.feature_layers}, DFlash reads {config.feature_layers}: "
                "build the target with feature_layers=config.feature_layers"
            )
        self.config, self.dtype, self.target_model = config, dtype, target_model
        self.vocab_size = target_model.config.vocab_size
        self.block_size = config.block_size
        self.mask_token_id = self.vocab_size
        device = target_model.device
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.fc = w["fc.weight"]
        self.context_norm = RMSNorm(w["context_norm.weight"], config.rms_norm_eps)
        self.mask_embedding = w["mask_embedding"]
        self.norm = RMSNorm(w["norm.weight"], config.rms_norm_eps)
        self.layers = [_BlockLayer(config, w, f"layers.{i}.") for i in range(config.num_layers)]
        self.kv = kv_pool.add_cache(cache_name, config.num_layers, config.num_kv_heads, config.head_dim, dtype)

    @classmethod
    def random(cls, config: DFlashConfig, target_model: LlamaModel, kv_pool: PagedKVPool, seed: int = 0, **kwargs):
        gen = torch.Generator().manual_seed(seed)
        weights = {}
        for name, shape in config.weight_shapes().items():
            if name.endswith("norm.weight"):
                weights[name] = torch.ones(shape)
            else:
                weights[name] = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
        return cls(config, weights, target_model, kv_pool, **kwargs)

    @torch.inference_mode()
    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor) -> None:
        """Write every layer's context K/V at the rows' slots. ``target_hidden [T, F]``."""
        c = self.config
        context = self.context_norm(F.linear(target_hidden.to(self.dtype), self.fc))  # [T, H]
        cos, sin = rope_cos_sin(batch.positions, c.head_dim, c.rope_theta, self.dtype)
        slots = batch.out_slots
        for layer, cache in zip(self.layers, self.kv):
            k, v = layer.key_value(context, cos, sin)
            cache[0].index_copy_(0, slots, k.to(cache[0].dtype))
            cache[1].index_copy_(0, slots, v.to(cache[1].dtype))

    @torch.inference_mode()
    def propose(self, batch: ForwardBatch) -> ModelOutput:
        """The block forward; logits ``[R, V]`` of ``batch.logits_rows`` (all rows when None)."""
        c = self.config
        masked = batch.input_ids == self.mask_token_id
        x = F.embedding(batch.input_ids.masked_fill(masked, 0), self.target_model.embed_weight)
        x = torch.where(masked[:, None], self.mask_embedding.expand_as(x), x)  # [T, H]
        cos, sin = rope_cos_sin(batch.positions, c.head_dim, c.rope_theta, self.dtype)
        plan = plan_attention(batch)
        for layer, cache in zip(self.layers, self.kv):
            x = layer(x, cos, sin, plan, cache)
        rows = x if batch.logits_rows is None else x.index_select(0, batch.logits_rows)
        logits = F.linear(self.norm(rows), self.target_model.lm_head_weight).float()
        return ModelOutput(logits=logits, hidden=None)
