"""Gemma 3 (text) in plain torch over the same `ForwardBatch` and paged KV cache as `LlamaModel`.

It follows Hugging Face's `Gemma3ForCausalLM` op for op, so float32 greedy decoding matches
`transformers` token for token. What differs from Llama:

* embeddings are multiplied by ``sqrt(hidden)`` (rounded to the model dtype, as Hugging Face does);
* every RMSNorm scales by ``1 + w`` in float32 before casting back (`GemmaRMSNorm`);
* RMSNorm on each query and key head (QK-norm) before RoPE;
* four norms per layer: ``h = x + norm(attn(norm(x)))``, ``out = h + norm(mlp(norm(h)))``;
* GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))``;
* attention scale ``query_pre_attn_scalar ** -0.5``; ``head_dim`` 256, not ``hidden / heads``;
* sliding layers (``config.layer_types``) attend keys at positions ``> p - sliding_window`` and use
  RoPE base ``rope_local_theta``; global layers attend everything with ``rope_theta``;
* optional final logit softcapping ``cap * tanh(logits / cap)``.

The KV pool keeps every position for the sliding layers too (no window eviction): the window is a
mask (`attention.restrict_to_window`), so tree verify and paging are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...core.ports import ForwardBatch, ModelOutput
from ..kernels.attention import AttentionPlan, paged_attention, plan_attention, restrict_to_window, write_kv
from ..weights.weights_gguf import LlamaConfig, expected_shapes
from .llama import LlamaModel, apply_rope, rope_cos_sin, set_projections


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` in float32, then cast to ``x``'s dtype (Hugging Face's `Gemma3RMSNorm`).

    ``weight`` is Hugging Face's (zero-centred); the ``1 + w`` factor is kept in float32.
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(1.0 + weight.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.scale).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    """One Gemma 3 block (module docstring). Q, K and V share one matmul, gate and up another."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], index: int) -> None:
        super().__init__()
        c, prefix = config, f"model.layers.{index}."
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.sliding = c.is_sliding(index)
        self.scale = c.attention_scale

        def norm(name: str) -> GemmaRMSNorm:
            return GemmaRMSNorm(weights[prefix + name + ".weight"], c.rms_norm_eps)

        self.input_norm = norm("input_layernorm")
        self.q_norm, self.k_norm = norm("self_attn.q_norm"), norm("self_attn.k_norm")
        self.post_attention_norm = norm("post_attention_layernorm")
        self.pre_feedforward_norm = norm("pre_feedforward_layernorm")
        self.post_feedforward_norm = norm("post_feedforward_layernorm")
        set_projections(self, weights, prefix)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        # x: [T, hidden]; plan: this layer's (windowed for a sliding layer); cos, sin: this layer's RoPE base
        num_rows = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(self.input_norm(x), self.qkv_weight).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(self.q_norm(q.view(num_rows, self.num_heads, self.head_dim)), cos, sin)  # [T, H, D]
        k = apply_rope(self.k_norm(k.view(num_rows, self.num_kv_heads, self.head_dim)), cos, sin)  # [T, Hkv, D]
        v = v.reshape(num_rows, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        k_cache, v_cache = kv
        write_kv(plan, k_cache, v_cache, k, v)
        attn = paged_attention(plan, q, k_cache, v_cache, scale=self.scale)  # [T, H, D]
        h = x + self.post_attention_norm(F.linear(attn.reshape(num_rows, q_size), self.o_weight))
        gate, up = F.linear(self.pre_feedforward_norm(h), self.gate_up_weight).chunk(2, dim=-1)  # [T, I] each
        mlp = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_weight)
        return h + self.post_feedforward_norm(mlp)


class Gemma3Model(LlamaModel):
    """Gemma 3 over paged KV: `LlamaModel`'s interface (``forward(batch, kv, num_layers)``, ``logits``,
    ``feature_layers``, ``embed_weight``), Gemma's layers (module docstring).

    A layer-skip draft (``num_layers < config.num_layers``) runs the first layers with their own
    local/global types, so it is the same network cut short.
    """

    architectures = ("gemma3",)

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        feature_layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, weights, dtype=dtype, device=device, feature_layers=feature_layers)
        # Hugging Face keeps sqrt(hidden) as a float32 buffer and casts it to the weights' dtype per forward.
        self.register_buffer(
            "embed_scale", torch.tensor(config.hidden_size**0.5).to(device=self.device, dtype=dtype), persistent=False
        )

    def _make_layer(self, config: LlamaConfig, weights: dict[str, torch.Tensor], index: int) -> nn.Module:
        return Gemma3DecoderLayer(config, weights, index)

    def _make_norm(self, weight: torch.Tensor, eps: float) -> nn.Module:
        return GemmaRMSNorm(weight, eps)

    @torch.no_grad()
    def forward(
        self,
        batch: ForwardBatch,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        num_layers: int | None = None,
    ) -> ModelOutput:
        """As `LlamaModel.forward`: the first ``num_layers`` layers, final norm, LM head (softcapped)."""
        depth, capture = self._layers_to_run(kv, num_layers)
        c = self.config
        plan = plan_attention(batch)
        sliding = [c.is_sliding(i) for i in range(depth)]
        local_plan = restrict_to_window(plan, batch, c.sliding_window) if any(sliding) else None
        rope_global = rope_cos_sin(batch.positions, c.head_dim, c.rope_theta, self.dtype)
        rope_local = rope_cos_sin(batch.positions, c.head_dim, c.rope_local_theta or c.rope_theta, self.dtype)
        x = F.embedding(batch.input_ids, self.embed_weight) * self.embed_scale  # [T, hidden]
        features: dict[int, torch.Tensor] = {}
        for i in range(depth):
            if i in capture:
                features[i] = x
            cos, sin = rope_local if sliding[i] else rope_global
            x = self.layers[i](x, cos, sin, local_plan if sliding[i] else plan, kv[i])
        features[depth] = x
        return ModelOutput(
            logits=self.logits(x, batch.logits_rows), hidden=torch.cat([features[i] for i in capture], -1)
        )

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm, LM head, softcap (in the model dtype, as Hugging Face). ``[T, hidden]`` -> ``[R, V]`` float32."""
        if rows is not None:
            x = x.index_select(0, rows)
        logits = F.linear(self.norm(x), self.lm_head_weight)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def random_gemma3_weights(config: LlamaConfig, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Random float32 weights of Gemma 3's names and shapes, for tests (norm weights near 0: scale ``1 + w``)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * scale for name, shape in expected_shapes(config).items()}
