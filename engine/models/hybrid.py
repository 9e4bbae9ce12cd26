"""A hybrid attention + Mamba decoder (Jamba / Nemotron-H style) and its ports.

Layers alternate between Llama attention blocks (paged KV, the attention rule of core.ports) and
Mamba blocks (`mamba.MambaMixer`, recurrent state in a `RecurrentPool`); every block is pre-norm with
a SwiGLU MLP. Weights use Llama's Hugging Face names, with ``model.layers.{i}.mamba.*`` in place of
``self_attn.*`` for Mamba layers.

    config = HybridConfig(llama=tiny_llama_config, layer_types=("attention", "mamba", "attention", "mamba"))
    target = HybridTarget.from_weights(config, random_hybrid_weights(config), kv_pool)
    draft = HybridSkipDraft(target.model, kv_pool, num_layers=2)
    ports = Ports(target=target, draft=draft, kv_pool=kv_pool, recurrent=RecurrentPools(target.states, draft.states))

`hybrid_greedy` is the model's own autoregressive greedy decoding, the output the cycle must equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ...core.ports import ForwardBatch, ModelOutput
from ..errors import ForwardBatchError, ModelLoadError
from ..greedy import greedy_decode
from ..kernels.attention import plan_attention
from ..memory.kv_pool import TARGET_CACHE, PagedKVPool
from ..memory.recurrent_pool import RecurrentPool
from ..weights.weights_gguf import LlamaConfig, expected_shapes
from .llama import DecoderLayer, RMSNorm, rope_cos_sin
from .mamba import MambaConfig, MambaMixer, random_mamba_weights, scan_for

LAYER_TYPES = ("attention", "mamba")


@attrs.frozen
class HybridConfig:
    """A `LlamaConfig` (sizes of attention, MLP, vocabulary) plus a type per layer and Mamba sizes."""

    llama: LlamaConfig
    layer_types: tuple[str, ...] = attrs.field(converter=tuple)
    d_inner: int | None = None  # None: 2 * hidden_size
    d_state: int = 8
    d_conv: int = 4
    dt_rank: int = 8

    def __attrs_post_init__(self) -> None:
        if len(self.layer_types) != self.llama.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.llama.num_layers} layers: "
                "give one per layer"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unknown layer types {bad}: each layer is one of {LAYER_TYPES}")

    @property
    def mamba(self) -> MambaConfig:
        h = self.llama.hidden_size
        return MambaConfig(h, self.d_inner or 2 * h, self.d_state, self.d_conv, self.dt_rank)

    def count(self, kind: str, num_layers: int | None = None) -> int:
        """Layers of ``kind`` among the first ``num_layers`` (all by default)."""
        return sum(t == kind for t in self.layer_types[: self.llama.num_layers if num_layers is None else num_layers])


def hybrid_weight_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `HybridModel` needs, by name, with its shape."""
    shapes = expected_shapes(config.llama)
    for i, kind in enumerate(config.layer_types):
        if kind == "mamba":
            prefix = f"model.layers.{i}."
            for name in [n for n in shapes if n.startswith(prefix + "self_attn.")]:
                del shapes[name]
            shapes.update({prefix + "mamba." + n: s for n, s in config.mamba.weight_shapes().items()})
    return shapes


def random_hybrid_weights(config: HybridConfig, seed: int = 0, scale: float = 0.1) -> dict[str, torch.Tensor]:
    """Random float32 weights for tests (norms near 1, Mamba ranges as `random_mamba_weights`)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in hybrid_weight_shapes(config).items():
        if ".mamba." in name:
            continue
        noise = torch.randn(shape, generator=generator) * scale
        weights[name] = 1.0 + noise if name.endswith("norm.weight") else noise
    weights["model.embed_tokens.weight"] = torch.randn(weights["model.embed_tokens.weight"].shape, generator=generator)
    for i, kind in enumerate(config.layer_types):
        if kind == "mamba":
            mixer = random_mamba_weights(config.mamba, generator, scale)
            weights.update({f"model.layers.{i}.mamba.{n}": w for n, w in mixer.items()})
    return weights


class MambaBlock(nn.Module):
    """``h = x + mamba(norm(x))``, ``out = h + mlp(norm(h))``."""

    def __init__(self, config: HybridConfig, weights: dict[str, torch.Tensor], prefix: str, state_layer: int) -> None:
        super().__init__()
        eps = config.llama.rms_norm_eps
        self.input_norm = RMSNorm(weights[prefix + "input_layernorm.weight"], eps)
        self.post_norm = RMSNorm(weights[prefix + "post_attention_layernorm.weight"], eps)
        self.mixer = MambaMixer(config.mamba, weights, prefix + "mamba.", state_layer)
        gate_up = [weights[prefix + f"mlp.{name}_proj.weight"] for name in ("gate", "up")]
        self.gate_up = nn.Parameter(torch.cat(gate_up, dim=0), requires_grad=False)
        self.down = nn.Parameter(weights[prefix + "mlp.down_proj.weight"], requires_grad=False)

    def forward(self, x: torch.Tensor, pool: RecurrentPool, plan, scan) -> torch.Tensor:
        h = x + self.mixer(self.input_norm(x), pool, plan, scan)
        gate, up = F.linear(self.post_norm(h), self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


class HybridModel(nn.Module):
    """The hybrid decoder. ``feature_layers`` as in `LlamaModel` (residual streams into ``hidden``)."""

    def __init__(
        self,
        config: HybridConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        feature_layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        for name, shape in hybrid_weight_shapes(config).items():
            if name not in weights or tuple(weights[name].shape) != shape:
                got = tuple(weights[name].shape) if name in weights else "missing"
                raise ModelLoadError(f"hybrid weights: tensor {name} is {got}, the config implies {shape}")
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.feature_layers = None if feature_layers is None else tuple(int(i) for i in feature_layers)
        c = config.llama
        w = {name: tensor.to(device=self.device, dtype=dtype) for name, tensor in weights.items()}
        self.embed_weight = nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)
        self.layers = nn.ModuleList()
        self.kv_index: list[int] = []  # per layer: its (k, v) in the attention cache, -1 for Mamba layers
        for i, kind in enumerate(config.layer_types):
            prefix = f"model.layers.{i}."
            if kind == "attention":
                self.kv_index.append(config.count("attention", i))
                self.layers.append(DecoderLayer(c, w, prefix))
            else:
                self.kv_index.append(-1)
                self.layers.append(MambaBlock(config, w, prefix, config.count("mamba", i)))
        self.norm = RMSNorm(w["model.norm.weight"], c.rms_norm_eps)
        head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head_weight = nn.Parameter(head, requires_grad=False)
        self.scan = scan_for(self.device)

    @property
    def vocab_size(self) -> int:
        return self.config.llama.vocab_size

    def recurrent_pool(self, num_layers: int | None = None, **kwargs) -> RecurrentPool:
        """A `RecurrentPool` for the Mamba layers among the first ``num_layers``; ``kwargs`` as the pool's."""
        count = self.config.count("mamba", num_layers)
        if count == 0:
            raise ValueError("these layers have no Mamba layer: they need no recurrent pool")
        return RecurrentPool(
            num_layers=count, state_shapes=self.config.mamba.state_shapes(), device=self.device, **kwargs
        )

    @torch.no_grad()
    def forward(
        self,
        batch: ForwardBatch,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        states: RecurrentPool | None,
        num_layers: int | None = None,
    ) -> ModelOutput:
        """Run the first ``num_layers`` layers (all by default), the final norm and the LM head.

        ``kv``: ``(k, v)`` of each attention layer run; ``states``: the pool of the Mamba layers run.
        Returns ``logits [R, V]`` float32 and ``hidden [T, F]`` like `LlamaModel.forward`.
        """
        c = self.config
        depth = c.llama.num_layers if num_layers is None else num_layers
        if not 1 <= depth <= c.llama.num_layers:
            raise ForwardBatchError(f"num_layers={num_layers} must lie in [1, {c.llama.num_layers}]")
        if len(kv) < c.count("attention", depth):
            raise ForwardBatchError(f"kv has {len(kv)} layers; these layers need {c.count('attention', depth)}")
        mamba_layers = c.count("mamba", depth)
        if mamba_layers and (states is None or states.num_layers < mamba_layers):
            raise ForwardBatchError(f"these layers have {mamba_layers} Mamba layers: pass a RecurrentPool of as many")
        capture = (depth,) if self.feature_layers is None else self.feature_layers
        if max(capture) > depth:
            raise ForwardBatchError(f"feature_layers={capture} reach past the {depth} layers run")
        attention_plan = plan_attention(batch) if c.count("attention", depth) else None
        scan_plan = states.plan(batch) if mamba_layers else None
        cos, sin = rope_cos_sin(batch.positions, c.llama.head_dim, c.llama.rope_theta, self.dtype)
        x = F.embedding(batch.input_ids, self.embed_weight)  # [T, hidden]
        features: dict[int, torch.Tensor] = {}
        for i in range(depth):
            if i in capture:
                features[i] = x
            layer = self.layers[i]
            if self.kv_index[i] >= 0:
                x = layer(x, cos, sin, attention_plan, kv[self.kv_index[i]])
            else:
                x = layer(x, states, scan_plan, self.scan)
        features[depth] = x
        rows = x if batch.logits_rows is None else x.index_select(0, batch.logits_rows)
        logits = F.linear(self.norm(rows), self.lm_head_weight).float()
        return ModelOutput(logits=logits, hidden=torch.cat([features[i] for i in capture], -1))


class HybridTarget:
    """A `TargetModel` (core.ports) over a `HybridModel`, the pool's KV cache and a `RecurrentPool`.

    Hand ``target.states`` (or `RecurrentPools` over it and a draft's) to `Ports.recurrent`: the cycle's
    compact commits the verify state the accepted path left.
    """

    def __init__(self, model: HybridModel, kv, states: RecurrentPool) -> None:
        self.model, self.kv, self.states = model, list(kv), states
        self.vocab_size = model.vocab_size
        self.device = model.device

    @classmethod
    def from_weights(
        cls,
        config: HybridConfig,
        weights: dict[str, torch.Tensor],
        kv_pool: PagedKVPool,
        *,
        dtype: torch.dtype = torch.float32,
        feature_layers: Sequence[int] | None = None,
        max_requests: int = 64,
        max_rows: int = 64,
        snapshot_interval: int = 0,
        cache_name: str = TARGET_CACHE,
    ) -> HybridTarget:
        """Build the model on the pool's device, its KV cache in ``kv_pool`` and its recurrent pool.

        ``max_rows`` must cover the verify rows ``N``.
        """
        model = HybridModel(config, weights, dtype=dtype, device=kv_pool.device, feature_layers=feature_layers)
        c = config.llama
        kv = kv_pool.add_cache(cache_name, config.count("attention"), c.num_kv_heads, c.head_dim, dtype)
        states = model.recurrent_pool(max_requests=max_requests, max_rows=max_rows, snapshot_interval=snapshot_interval)
        return cls(model, kv, states)

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        return self.model.forward(batch, self.kv, self.states)


class HybridSkipDraft:
    """Layer skip on a hybrid model: the first ``num_layers`` layers, an ``aligned`` `DraftModel`.

    Its attention layers keep their own KV cache in the shared pool; its Mamba layers their own
    `RecurrentPool` (``states``), whose speculative rows are the draft's tree steps (``max_rows``
    must cover ``(S - 1) * K``). A draft extend continues its committed state and drops the rows of
    the previous cycle's steps, so the draft needs no commit; give ``states`` to `RecurrentPools` so
    finished requests free it.
    """

    kind = "forward"
    pairing = "aligned"

    def __init__(
        self,
        model: HybridModel,
        kv_pool: PagedKVPool,
        num_layers: int,
        *,
        max_requests: int = 64,
        max_rows: int = 64,
        cache_name: str = "draft",
    ) -> None:
        c = model.config
        if not 1 <= num_layers <= c.llama.num_layers:
            raise ValueError(f"a draft of {num_layers} layers is out of range: the model has {c.llama.num_layers}")
        self.model, self.num_layers = model, num_layers
        self.vocab_size = model.vocab_size
        self.kv = kv_pool.add_cache(
            cache_name, c.count("attention", num_layers), c.llama.num_kv_heads, c.llama.head_dim, model.dtype
        )
        self.states = (
            model.recurrent_pool(num_layers, max_requests=max_requests, max_rows=max_rows)
            if c.count("mamba", num_layers)
            else None
        )

    def _forward(self, batch: ForwardBatch) -> ModelOutput:
        out = self.model.forward(batch, self.kv, self.states, num_layers=self.num_layers)
        return ModelOutput(logits=out.logits, hidden=None)

    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> ModelOutput:
        return self._forward(batch)

    def step(self, batch: ForwardBatch, parent_hidden: torch.Tensor | None) -> ModelOutput:
        return self._forward(batch)


def hybrid_greedy(
    target: HybridTarget,
    kv_pool: PagedKVPool,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    first_request_id: int = 0,
) -> list[list[int]]:
    """Plain greedy decoding, one token per forward (`greedy.greedy_decode`), freeing the recurrent state."""
    try:
        return greedy_decode(target, kv_pool, prompts, max_new_tokens, stop_token_ids, first_request_id)
    finally:
        for i in range(len(prompts)):
            target.states.free(request_id=first_request_id + i)
