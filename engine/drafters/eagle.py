"""EAGLE draft heads: one decoder layer over the target's features, ``shifted`` pairing.

* EAGLE-1: ``x = fc([embed(t[p+1]), f[p]])`` (``fc: 2H -> H``), one Llama decoder layer, then the
  target's own final norm and LM head.
* EAGLE-3: the target's features are three layers concatenated (``3H``), projected by ``fc: 3H -> H``;
  the layer's attention reads ``[norm(embed), norm(hidden)]`` (``2H``); the head has its own norm and a
  reduced-vocabulary LM head whose ids map to the target's through ``draft_to_target``.
* EAGLE-3 over the target's LM head (``draft_vocab_size == 0``, `EagleConfig.target_lm_head`): the
  EAGLE-3 layer, with logits from the target's final norm and LM head as in EAGLE-1 (the full
  vocabulary; the file stores no norm, LM head or id map, so its bytes go to the layer's MLP).

In both, a draft step feeds a node's parent's layer output as its hidden state (EAGLE's feature
prediction), so ``hidden`` of the output is the layer output ``[T, H]``.

A head may stack more layers (``num_layers > 1``, `EagleConfig.num_layers`): layers ``1..n-1`` are plain
Llama decoder layers over ``[T, H]`` (`llama.DecoderLayer`, weights ``layers.<i>.*`` under Hugging Face's
names), each with its own layer of the draft cache; ``hidden`` is then the last layer's output.

An EAGLE-3 head may normalize the target's features before ``fc`` (`EagleConfig.feature_norm`): one RMSNorm
over the ``3H`` concatenation (``concat``: vLLM speculators' ``norm_before_fc``, weight ``feature_norm.weight``)
or one per feature layer (``per_layer``: EAGLE-3.1's ``fc_norm``, weights ``feature_norm.<i>.weight``).

Weights live in one safetensors file; its metadata key ``speccycle.eagle`` holds the `EagleConfig`
as JSON (with ``rope_scaling`` when the RoPE base is scaled, `rope.ScaledRopeBase`), and
``speccycle.eagle.lm_head`` says where the logits come from (``own`` or ``target``).
`EagleHead.random` builds one with random weights for tests. ``speccycle.eagle.storage`` (absent in a
plain file) names a compact storage, ``int8-rowwise`` (`eagle_storage`): ``load`` dequantizes it.
`EagleHead.load` also reads a head published by the EAGLE repository, SpecForge, SGLang or vLLM's
``speculators`` (a file or folder with its config.json, `eagle_layouts`), recognized by its keys and config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...core.ports import ForwardBatch, ModelOutput
from ..errors import ModelLoadError
from ..kernels.attention import paged_attention, plan_attention, write_kv
from ..memory.kv_pool import PagedKVPool
from ..models.llama import DecoderLayer, LlamaModel, RMSNorm, apply_rope, rope_cos_sin
from .eagle_config import (  # noqa: F401  (re-exported: the head's config, file names and shapes live there)
    FEATURE_NORMS,
    LM_HEAD_KEY,
    METADATA_KEY,
    EagleConfig,
    _shapes,
    check_target,
    config_from_metadata,
    extra_layer_prefix,
    feature_norm_shapes,
    file_metadata,
    normalize_features,
)
from .eagle_storage import PACK_KEY, STORAGE_KEY, STORAGES, pack_state, unpack_state


def _owned(tensor: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` on ``device`` in ``dtype``, in memory of its own: a fresh, contiguous allocation even where no
    conversion was needed. A CPU GEMM's rounding can depend on where its weight starts (a tensor read from a
    safetensors file sits at the file's offset, not at the allocator's alignment), and a head drafts the same
    bits however its weights were stored."""
    out = tensor.to(device=device, dtype=dtype)
    return out.clone(memory_format=torch.contiguous_format) if out.data_ptr() == tensor.data_ptr() else out.contiguous()


class EagleHead(nn.Module):
    """The head's weights and its decoder layers (`layer`, then `extra_layers`); attention over a paged KV
    cache of one layer each."""

    def __init__(self, config: EagleConfig, weights: dict[str, torch.Tensor], dtype=torch.float32, device="cpu"):
        super().__init__()
        expected = _shapes(config)
        missing = sorted(set(expected) - set(weights))
        wrong = [
            f"{k}: {tuple(weights[k].shape)} != {v}"
            for k, v in expected.items()
            if k in weights and tuple(weights[k].shape) != v
        ]
        if missing or wrong:
            raise ModelLoadError(
                f"EAGLE-{config.version} head weights do not fit its config: missing {missing}, shapes {wrong}"
            )
        self.config, self.dtype = config, dtype
        w = {k: _owned(v, device, torch.long if k == "draft_to_target" else dtype) for k, v in weights.items()}
        self.fc = nn.Parameter(w["fc.weight"], requires_grad=False)
        self.qkv = nn.Parameter(torch.cat([w[f"layer.{n}_proj.weight"] for n in "qkv"]), requires_grad=False)
        self.o = nn.Parameter(w["layer.o_proj.weight"], requires_grad=False)
        self.gate_up = nn.Parameter(
            torch.cat([w["layer.gate_proj.weight"], w["layer.up_proj.weight"]]), requires_grad=False
        )
        self.down = nn.Parameter(w["layer.down_proj.weight"], requires_grad=False)
        eps = config.rms_norm_eps
        self.post_norm = RMSNorm(w["layer.post_attention_layernorm.weight"], eps)
        if config.version == 1:
            self.input_norm = RMSNorm(w["layer.input_layernorm.weight"], eps)
        else:
            self.embed_norm = RMSNorm(w["layer.embed_norm.weight"], eps)
            self.hidden_norm = RMSNorm(w["layer.hidden_norm.weight"], eps)
        self.extra_layers = nn.ModuleList(
            DecoderLayer(config, w, extra_layer_prefix(index)) for index in range(1, config.num_layers)
        )
        self.feature_norms = nn.ParameterDict(
            {
                name.replace(".", "__"): nn.Parameter(w[name], requires_grad=False)
                for name in feature_norm_shapes(config)
            }
        )
        if not config.target_lm_head:
            self.norm = RMSNorm(w["norm.weight"], eps)
            self.lm_head = nn.Parameter(w["lm_head.weight"], requires_grad=False)
            self.register_buffer("draft_to_target", w["draft_to_target"])

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's input projection: ``features [T, 3H]`` through `EagleConfig.feature_norm` and ``fc``
        -> ``[T, H]``."""
        x = normalize_features(features, self.config, lambda name: self.feature_norms[name.replace(".", "__")])
        return F.linear(x, self.fc)

    @classmethod
    def random(cls, config: EagleConfig, seed: int = 0, dtype=torch.float32, device="cpu", target_vocab: int = 0):
        gen = torch.Generator().manual_seed(seed)
        weights = {}
        for name, shape in _shapes(config).items():
            if name == "draft_to_target":
                weights[name] = torch.randperm(target_vocab, generator=gen)[: shape[0]].sort().values
            elif name.endswith("norm.weight"):
                weights[name] = torch.ones(shape)
            else:
                weights[name] = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
        return cls(config, weights, dtype, device)

    def state(self) -> dict[str, torch.Tensor]:
        """The weights under their file names (inverse of the constructor's packing)."""
        c, d = self.config, self.config.head_dim
        q, k, v = self.qkv.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d])
        gate, up = self.gate_up.chunk(2)
        out = {
            "fc.weight": self.fc,
            "layer.q_proj.weight": q,
            "layer.k_proj.weight": k,
            "layer.v_proj.weight": v,
            "layer.o_proj.weight": self.o,
            "layer.post_attention_layernorm.weight": self.post_norm.weight,
            "layer.gate_proj.weight": gate,
            "layer.up_proj.weight": up,
            "layer.down_proj.weight": self.down,
        }
        if c.version == 1:
            out["layer.input_layernorm.weight"] = self.input_norm.weight
        else:
            out["layer.embed_norm.weight"] = self.embed_norm.weight
            out["layer.hidden_norm.weight"] = self.hidden_norm.weight
        for index, extra in enumerate(self.extra_layers, start=1):
            p = extra_layer_prefix(index)
            eq, ek, ev = extra.qkv_weight.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d])
            egate, eup = extra.gate_up_weight.chunk(2)
            out.update(
                {
                    p + "input_layernorm.weight": extra.input_norm.weight,
                    p + "self_attn.q_proj.weight": eq,
                    p + "self_attn.k_proj.weight": ek,
                    p + "self_attn.v_proj.weight": ev,
                    p + "self_attn.o_proj.weight": extra.o_weight,
                    p + "post_attention_layernorm.weight": extra.post_attention_norm.weight,
                    p + "mlp.gate_proj.weight": egate,
                    p + "mlp.up_proj.weight": eup,
                    p + "mlp.down_proj.weight": extra.down_weight,
                }
            )
        out.update({name.replace("__", "."): weight for name, weight in self.feature_norms.items()})
        if not c.target_lm_head:
            out.update(
                {
                    "norm.weight": self.norm.weight,
                    "lm_head.weight": self.lm_head,
                    "draft_to_target": self.draft_to_target,
                }
            )
        return {k: v.detach().contiguous() for k, v in out.items()}

    def save(self, path: str | os.PathLike, storage: str | None = None) -> None:
        """Write the head file; ``storage`` ``"int8-rowwise"``: packed (`eagle_storage`), None: as the weights are."""
        from safetensors.torch import save_file

        if storage is None:
            save_file(self.state(), str(path), metadata=file_metadata(self.config))
            return
        if storage not in STORAGES:
            raise ValueError(f"unknown EAGLE head storage {storage!r}: choose one of {', '.join(STORAGES)} or None")
        tensors, record = pack_state(self.state())
        meta = {**file_metadata(self.config), STORAGE_KEY: storage, PACK_KEY: json.dumps(record)}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(
        cls, path: str | os.PathLike, dtype=torch.float32, device="cpu", target_layers: int | None = None
    ) -> EagleHead:
        """The head saved at ``path`` by `save`, or published in another layout (`eagle_layouts`: a file or a
        folder with its config.json, recognized by its keys and config). ``target_layers``: the target's layer
        count, which resolves the default feature layers of a published head whose config names none (an
        `eagle_layouts.HeadPath` may carry it instead)."""
        from safetensors import safe_open

        from . import eagle_layouts

        target_layers = eagle_layouts.target_layers_of(path, target_layers)
        path = Path(path)
        if not path.exists():
            raise ModelLoadError(f"no EAGLE head at {path}: pass its .safetensors file or its folder")
        if path.is_dir() or path.suffix != ".safetensors":
            config, weights = eagle_layouts.read_published(path, target_layers)
            return cls(config, weights, dtype, device)
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                weights = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"{path} is not a readable safetensors file: {err}") from err
        meta = metadata.get(METADATA_KEY)
        if meta is None:  # no speccycle metadata: a published layout, or nothing this reads (which it says)
            config, weights = eagle_layouts.read_published(path, target_layers, weights)
            return cls(config, weights, dtype, device)
        weights = unpack_state(weights, metadata.get(STORAGE_KEY), path)  # int8 storage -> float32; else as stored
        return cls(config_from_metadata(meta, str(path)), weights, dtype, device)

    def layer(self, x: torch.Tensor, embed: torch.Tensor, batch: ForwardBatch, kv, extra_kv=()) -> torch.Tensor:
        """The decoder layers. Shapes: ``x [T, H]`` (projected feature), ``embed [T, H]`` -> ``[T, H]``.

        ``kv``: the first layer's ``(k, v)`` cache; ``extra_kv``: one ``(k, v)`` per layer of `extra_layers`.
        """
        c, rows = self.config, x.shape[0]
        if len(extra_kv) != len(self.extra_layers):
            raise ValueError(f"the head has {c.num_layers} layers: pass one (k, v) cache per extra layer")
        attn_in = torch.cat([self.embed_norm(embed), self.hidden_norm(x)], -1) if c.version == 3 else self.input_norm(x)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = F.linear(attn_in, self.qkv).split([q_size, kv_size, kv_size], dim=-1)
        cos, sin = rope_cos_sin(batch.positions, c.head_dim, c.rope_theta, self.dtype)
        q = apply_rope(q.view(rows, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(rows, c.num_kv_heads, c.head_dim), cos, sin)
        plan = plan_attention(batch)
        write_kv(plan, kv[0], kv[1], k, v.reshape(rows, c.num_kv_heads, c.head_dim))
        h = x + F.linear(paged_attention(plan, q, kv[0], kv[1]).reshape(rows, q_size), self.o)
        gate, up = F.linear(self.post_norm(h), self.gate_up).chunk(2, dim=-1)
        out = h + F.linear(F.silu(gate) * up, self.down)
        for extra, cache in zip(self.extra_layers, extra_kv):
            out = extra(out, cos, sin, plan, cache)
        return out


class EagleDraft:
    """`DraftModel` over an `EagleHead` and the target's `LlamaModel` (embedding; final norm and LM head
    where `EagleConfig.target_lm_head`: EAGLE-1, and EAGLE-3 with ``draft_vocab_size == 0``).

    The target must be built with ``feature_layers == head.config.feature_layers``.
    """

    kind = "forward"
    pairing = "shifted"

    def __init__(self, head: EagleHead, target_model: LlamaModel, pool: PagedKVPool, cache_name: str = "draft"):
        tc, hc = target_model.config, head.config
        check_target(hc, tc)
        if not hc.target_lm_head and int(head.draft_to_target.max()) >= tc.vocab_size:
            raise ModelLoadError(
                f"the EAGLE-3 head maps to token id {int(head.draft_to_target.max())} (draft_to_target), past the "
                f"target's vocabulary of {tc.vocab_size}: the draft and target vocabularies do not match"
            )
        if target_model.feature_layers is not None and tuple(target_model.feature_layers) != hc.feature_layers:
            raise ValueError(
                f"the target returns features {target_model.feature_layers}, the head reads {hc.feature_layers}"
            )
        self.head, self.target_model = head, target_model
        self.vocab_size = tc.vocab_size
        caches = pool.add_cache(cache_name, hc.num_layers, hc.num_kv_heads, hc.head_dim, head.dtype)
        self.kv, self.extra_kv = caches[0], list(caches[1:])  # the first layer's (k, v); the others'

    def _layers(self, batch: ForwardBatch, x: torch.Tensor) -> torch.Tensor:
        embed = F.embedding(batch.input_ids, self.target_model.embed_weight).to(self.head.dtype)
        if self.head.config.version == 1:
            x = F.linear(torch.cat([embed, x], -1), self.head.fc)
        return self.head.layer(x, embed, batch, self.kv, self.extra_kv)  # [T, H]

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The head's logits of hidden states ``rows [R, H]`` over the target vocabulary, ``[R, V]``."""
        if self.head.config.target_lm_head:
            return self.target_model.logits(rows.to(self.target_model.dtype))  # [R, V]
        small = F.linear(self.head.norm(rows), self.head.lm_head).float()  # [R, Vd]
        logits = small.new_full((small.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.head.draft_to_target] = small
        return logits

    def _run(self, batch: ForwardBatch, x: torch.Tensor) -> ModelOutput:
        out = self._layers(batch, x)
        rows = out if batch.logits_rows is None else out.index_select(0, batch.logits_rows)
        return ModelOutput(logits=self._logits(rows), hidden=out)

    def _extend_input(self, target_hidden: torch.Tensor | None) -> torch.Tensor:
        if target_hidden is None:
            raise ValueError("an EAGLE draft extend needs the target's features")
        x = target_hidden.to(self.head.dtype)
        return self.head.project(x) if self.head.config.version == 3 else x  # EAGLE-3: [T, 3H] -> [T, H]

    @torch.inference_mode()
    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> ModelOutput:
        return self._run(batch, self._extend_input(target_hidden))

    @torch.inference_mode()
    def extend_hidden(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> torch.Tensor:
        """`extend` without its logits: the head's layers (they write the draft KV), their hidden state ``[T, H]``
        (`core.ports.DraftCapabilities`)."""
        return self._layers(batch, self._extend_input(target_hidden))

    @torch.inference_mode()
    def logits_from_hidden(self, hidden: torch.Tensor) -> ModelOutput:
        """The logits `extend` computes for rows of hidden state ``hidden [R, H]``: the head's final norm and LM head
        (or the target's), exactly (`core.ports.DraftCapabilities`)."""
        return ModelOutput(logits=self._logits(hidden.to(self.head.dtype)), hidden=None)

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, parent_hidden: torch.Tensor | None) -> ModelOutput:
        if parent_hidden is None:
            raise ValueError("an EAGLE draft step needs its parent's hidden state")
        return self._run(batch, parent_hidden)
