"""The frozen target over a padded batch: the features an EAGLE head reads, and the target's greedy labels.

`LlamaModel.forward` runs over a paged cache, one ragged row list per call; training wants dense
``[B, T]`` batches, so this runs the same weights (the same `DecoderLayer` parameters, the same
RMSNorm and RoPE) with plain causal attention. Feature index ``i`` is the residual stream entering
decoder layer ``i`` and ``n`` the last layer's output before the final norm, exactly as
`LlamaModel.feature_layers` defines them, so what the head learns from is what the engine feeds it.
Right padding is harmless: attention is causal, a padded position never feeds a real one.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F

from ..engine.models.llama import DecoderLayer, LlamaModel, apply_rope, rope_cos_sin


@attrs.frozen(eq=False)
class TargetOutputs:
    """Shapes: ``features [B, T, F]`` (F = H x len(feature_layers)), ``last [B, T, H]``, ``greedy [B, T]``."""

    features: torch.Tensor  # the concatenated residual streams the head reads
    last: torch.Tensor  # the last layer's output before the final norm (EAGLE-1's regression target)
    greedy: torch.Tensor  # int64: argmax of the target's logits at each position (predicts position + 1)


def _dense_layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H]; cos, sin: [T, D] (apply_rope broadcasts them over [B, T, heads, D])
    b, t, _ = x.shape
    q_size, kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    q, k, v = F.linear(layer.input_norm(x), layer.qkv_weight).split([q_size, kv_size, kv_size], dim=-1)
    q = apply_rope(q.view(b, t, layer.num_heads, layer.head_dim), cos, sin)
    k = apply_rope(k.view(b, t, layer.num_kv_heads, layer.head_dim), cos, sin)
    v = v.view(b, t, layer.num_kv_heads, layer.head_dim)
    group = layer.num_heads // layer.num_kv_heads  # K/V repeated per query head: every SDPA kernel takes that
    attn = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(group, dim=2).transpose(1, 2),
        v.repeat_interleave(group, dim=2).transpose(1, 2),
        is_causal=True,
    )  # [B, heads, T, D]
    h = x + F.linear(attn.transpose(1, 2).reshape(b, t, q_size), layer.o_weight)
    gate, up = F.linear(layer.post_attention_norm(h), layer.gate_up_weight).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, layer.down_weight)


@torch.no_grad()
def target_outputs(
    model: LlamaModel, input_ids: torch.Tensor, feature_layers: Sequence[int], logits_chunk: int = 8192
) -> TargetOutputs:
    """Run the whole target over ``input_ids [B, T]`` (causal, positions ``0..T-1``).

    The greedy labels are computed ``logits_chunk`` rows at a time: full-vocabulary logits of a
    training batch would not fit beside everything else.
    """
    c = model.config
    bad = [i for i in feature_layers if not 0 <= i <= c.num_layers]
    if bad or not feature_layers:
        raise ValueError(f"feature_layers {tuple(feature_layers)} must lie in [0, {c.num_layers}]")
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, model.dtype)
    x = F.embedding(input_ids, model.embed_weight)  # [B, T, H]
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        if i in feature_layers:
            captured[i] = x
        x = _dense_layer(layer, x, cos, sin)
    captured[c.num_layers] = x
    flat = x.reshape(b * t, -1)
    # argmax of the logits in the model dtype: the float32 copy `LlamaModel.logits` makes holds the same values
    head = model.lm_head_weight
    greedy = torch.cat([F.linear(model.norm(rows), head).argmax(-1) for rows in flat.split(logits_chunk)])
    return TargetOutputs(
        features=torch.cat([captured[i] for i in feature_layers], -1), last=x, greedy=greedy.view(b, t)
    )
