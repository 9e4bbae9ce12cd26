"""A trainable EAGLE head: the inference `EagleHead`'s function, dense over ``[B, T]``, unrolled over draft steps.

The parameters are the tensors of the head's safetensors file, under the same names (float32
masters); `to_eagle_head` packs them into the engine's `EagleHead`, unchanged. The forward is the
engine's (`EagleDraft._run` and `EagleHead.layer`) op for op, with EAGLE's shifted pairing:

* step 0 (the draft extend): the row of anchor ``k`` sits at position ``k`` and reads token
  ``t[k + 1]`` with the target's feature ``f[k]`` (EAGLE-3: ``fc(f[k])``);
* step ``s >= 1`` (draft forward ``s - 1``): the row of anchor ``k`` sits at position ``k + s``,
  reads token ``t[k + s + 1]`` with its own step ``s - 1`` output as the hidden state, and attends
  the step-0 keys of positions ``[0, k]`` plus its own earlier steps' keys at anchor ``k`` and itself,
  which is what a draft forward at ``L + s - 1`` sees at inference (prefix ``[0, L)``, ancestors, self).

Unrolling the draft over its own hidden states while training is EAGLE-3's "training-time test".

A deeper head (`EagleConfig.num_layers`) runs its further layers after the first at every step, each with
the same step-masked attention over its own keys; a step's output is the last layer's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.drafters.eagle import EagleConfig, EagleHead, _shapes, extra_layer_prefix, normalize_features
from ..engine.models.llama import LlamaModel, apply_rope, rope_cos_sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The engine's `RMSNorm`: normalize in float32, cast back, scale."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def step_mask(length: int, step: int, device) -> torch.Tensor:
    """Which keys the rows of step ``step`` attend. Shape ``[T, T * (step + 1)]`` bool.

    Key block 0 holds the step-0 keys (causal: anchor ``k`` sees ``[0, k]``); block ``j >= 1`` the
    step-``j`` keys, of which anchor ``k`` sees only its own (the diagonal).
    """
    idx = torch.arange(length, device=device)
    blocks = [idx[None, :] <= idx[:, None]] + [idx[None, :] == idx[:, None]] * step
    return torch.cat(blocks, dim=1)


def shift_left(x: torch.Tensor, by: int, fill: int | float | bool = 0) -> torch.Tensor:
    """``out[:, k] = x[:, k + by]``, ``fill`` past the end. Shape ``[B, T, ...]`` kept."""
    if by == 0:
        return x
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out


class TrainableEagleHead(nn.Module):
    """EAGLE-1 or EAGLE-3 head weights as float32 parameters, named as in the head's file.

    An EAGLE-3 head with ``draft_vocab_size == 0`` has no norm, LM head or id map of its own: its logits
    come from the target's frozen final norm and LM head, as EAGLE-1's do (`lm_input`).
    """

    def __init__(self, config: EagleConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        shapes = _shapes(config)
        missing = sorted(set(shapes) - set(weights))
        if missing:
            raise ValueError(f"EAGLE-{config.version} weights lack {missing}")
        self.params = nn.ParameterDict(
            {
                name.replace(".", "__"): nn.Parameter(weights[name].detach().float().clone())
                for name in shapes
                if name != "draft_to_target"
            }
        )
        if not config.target_lm_head:
            self.register_buffer("draft_to_target", weights["draft_to_target"].detach().long().clone())

    @classmethod
    def init(
        cls, config: EagleConfig, draft_to_target: torch.Tensor | None = None, seed: int = 0, std: float = 0.02
    ) -> TrainableEagleHead:
        """Fresh weights: linear layers ``N(0, std)`` (as transformers initializes Llama), norms 1."""
        gen = torch.Generator().manual_seed(seed)
        weights = {}
        for name, shape in _shapes(config).items():
            if name == "draft_to_target":
                if draft_to_target is None or tuple(draft_to_target.shape) != shape:
                    raise ValueError(f"EAGLE-3 needs draft_to_target of shape {shape} (the draft vocabulary ids)")
                weights[name] = draft_to_target
            elif name.endswith("norm.weight"):
                weights[name] = torch.ones(shape)
            else:
                weights[name] = torch.randn(shape, generator=gen) * std
        return cls(config, weights)

    @classmethod
    def from_eagle_head(cls, head: EagleHead) -> TrainableEagleHead:
        return cls(head.config, head.state())

    def w(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def state(self) -> dict[str, torch.Tensor]:
        """The weights under their file names."""
        out = {name.replace("__", "."): p.detach() for name, p in self.params.items()}
        if not self.config.target_lm_head:
            out["draft_to_target"] = self.draft_to_target
        return out

    def to_eagle_head(self, dtype: torch.dtype = torch.float32, device="cpu") -> EagleHead:
        return EagleHead(self.config, {k: v.cpu() for k, v in self.state().items()}, dtype, device)

    def num_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Size of the head's file in ``dtype`` (the id map stays int64)."""
        size = torch.tensor([], dtype=dtype).element_size()
        total = sum(p.numel() for p in self.params.values()) * size
        return total + (0 if self.config.target_lm_head else self.draft_to_target.numel() * 8)

    # ---- forward -------------------------------------------------------------------------------
    def _layer(self, x: torch.Tensor, embed: torch.Tensor, step: int, keys: list, values: list) -> torch.Tensor:
        """`EagleHead.layer`'s first layer over ``[B, T, H]`` rows of one step; ``keys``/``values`` collect each
        step's K/V."""
        c, w = self.config, self.w
        eps = c.rms_norm_eps
        if c.version == 3:
            attn_in = torch.cat(
                [rms_norm(embed, w("layer.embed_norm.weight"), eps), rms_norm(x, w("layer.hidden_norm.weight"), eps)],
                -1,
            )
        else:
            attn_in = rms_norm(x, w("layer.input_layernorm.weight"), eps)
        names = {n: f"layer.{n}_proj.weight" for n in ("q", "k", "v", "o", "gate", "up", "down")}
        return self._block(x, attn_in, names, "layer.post_attention_layernorm.weight", step, keys, values)

    def _extra_layer(self, index: int, x: torch.Tensor, step: int, keys: list, values: list) -> torch.Tensor:
        """Decoder layer ``index >= 1`` (a plain Llama layer over ``[B, T, H]``), as `llama.DecoderLayer`."""
        p = extra_layer_prefix(index)
        attn_in = rms_norm(x, self.w(p + "input_layernorm.weight"), self.config.rms_norm_eps)
        names = {n: f"{p}self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")}
        names.update({n: f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")})
        return self._block(x, attn_in, names, p + "post_attention_layernorm.weight", step, keys, values)

    def _block(
        self, x: torch.Tensor, attn_in: torch.Tensor, names: dict, post_norm: str, step: int, keys: list, values: list
    ) -> torch.Tensor:
        """Attention over ``attn_in`` (the step-masked keys of every step so far), residual, MLP, residual."""
        c, w = self.config, self.w
        b, t, _ = x.shape
        eps = c.rms_norm_eps
        q = F.linear(attn_in, w(names["q"])).view(b, t, c.num_heads, c.head_dim)
        k = F.linear(attn_in, w(names["k"])).view(b, t, c.num_kv_heads, c.head_dim)
        v = F.linear(attn_in, w(names["v"])).view(b, t, c.num_kv_heads, c.head_dim)
        positions = torch.arange(t, device=x.device) + step  # anchor k's step-s row sits at k + s
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys.append(k)
        values.append(v)
        group = c.num_heads // c.num_kv_heads  # K/V repeated per query head: every SDPA kernel takes that
        scale = 1.0 / math.sqrt(c.head_dim)
        if step == 0:
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.repeat_interleave(group, dim=2).transpose(1, 2),
                v.repeat_interleave(group, dim=2).transpose(1, 2),
                is_causal=True,
                scale=scale,
            )
        else:  # the memory-efficient kernel takes this mask; [B, heads, T * (s + 1), D] keys and values
            all_k = torch.cat(keys, 1).repeat_interleave(group, dim=2).transpose(1, 2)
            all_v = torch.cat(values, 1).repeat_interleave(group, dim=2).transpose(1, 2).to(all_k.dtype)
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2).to(all_k.dtype), all_k, all_v, attn_mask=step_mask(t, step, x.device), scale=scale
            )
        h = x + F.linear(attn.transpose(1, 2).reshape(b, t, -1), w(names["o"]))
        hn = rms_norm(h, w(post_norm), eps)
        gate, up = F.linear(hn, w(names["gate"])), F.linear(hn, w(names["up"]))
        return h + F.linear(F.silu(gate) * up, w(names["down"]))

    def unroll(
        self, target: LlamaModel, input_ids: torch.Tensor, features: torch.Tensor, num_steps: int
    ) -> list[torch.Tensor]:
        """The head's outputs of steps ``0..num_steps-1``, each ``[B, T, H]`` (row ``k``: anchor ``k``).

        ``input_ids [B, T]`` the sequence, ``features [B, T, F]`` the target's features of it.
        Step ``s`` output at anchor ``k`` predicts the token at position ``k + s + 2``.
        """
        c = self.config
        x = F.linear(normalize_features(features, c, self.w), self.w("fc.weight")) if c.version == 3 else features
        keys: list[list[torch.Tensor]] = [[] for _ in range(c.num_layers)]  # per layer, each step's K and V
        values: list[list[torch.Tensor]] = [[] for _ in range(c.num_layers)]
        outs = []
        for step in range(num_steps):
            embed = F.embedding(shift_left(input_ids, step + 1), target.embed_weight)  # t[k + s + 1]
            if c.version == 1:
                x = F.linear(torch.cat([embed.to(x.dtype), x], -1), self.w("fc.weight"))
            x = self._layer(x, embed, step, keys[0], values[0])
            for index in range(1, c.num_layers):
                x = self._extra_layer(index, x, step, keys[index], values[index])
            outs.append(x)
        return outs

    def lm_input(self, target: LlamaModel, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The LM head's input and weight for head outputs ``hidden [N, H]``: ``(norm(hidden) [N, H], W [V', H])``.

        The target's final norm and LM head where `EagleConfig.target_lm_head` (``V' = V``, frozen), else
        the head's own norm and reduced-vocabulary LM head (``V' = draft_vocab_size``, trained).
        """
        if self.config.target_lm_head:
            return target.norm(hidden), target.lm_head_weight
        return rms_norm(hidden, self.w("norm.weight"), self.config.rms_norm_eps), self.w("lm_head.weight")

    def logits(self, target: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of head outputs ``[N, H]``: ``[N, V]`` over the target's LM head, else ``[N, Vd]``."""
        return F.linear(*self.lm_input(target, hidden))
