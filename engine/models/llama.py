"""A Llama-family decoder in plain torch, run over a `ForwardBatch` and a paged KV cache.

It follows Hugging Face `LlamaForCausalLM` op for op (RMSNorm in float32, RoPE with `rotate_half`,
grouped-query attention, SwiGLU MLP, tied or untied LM head), so float32 greedy decoding matches
`transformers` token for token. Attention is the rule of core.ports (see `engine/kernels/attention.py`): every row
writes its K/V at ``out_slots`` first, then attends its request's prefix plus its extra slots.

Features. ``feature_layers`` picks what `ModelOutput.hidden` holds: index ``i`` is the residual stream
entering decoder layer ``i`` (``0`` the embeddings, ``n`` the output of the last layer run, before the
final norm), the indexing of Hugging Face's ``hidden_states`` tuple and of SGLang's
``layers_to_capture``. EAGLE-3 takes three, e.g. ``(2, n // 2, n - 3)``; the default is ``(n,)``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...core.ports import ForwardBatch, ModelOutput
from ..errors import ForwardBatchError, ModelLoadError
from ..kernels.attention import AttentionPlan, paged_attention, plan_attention, write_kv
from ..weights.weights_gguf import LlamaConfig, check_weights, expected_shapes
from .rope import rope_inv_freq


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 like Hugging Face's `LlamaRMSNorm`."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's RoPE tables at explicit positions, scaled as ``theta`` says (`rope.ScaledRopeBase`; a plain
    float: the default frequencies). Shapes: ``[T]`` -> cos, sin ``[T, D]``."""
    inv_freq = rope_inv_freq(head_dim, theta, positions.device)  # [D / 2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D / 2]
    angles = torch.cat([freqs, freqs], dim=-1)  # [T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves ``(x[i], x[i + D/2])``. Shapes: ``x [T, H, D]``, ``cos, sin [T, D]`` -> ``[T, H, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# Above this many rows (a prefill) MKL's GEMM beats the packed weight: at 1024 rows all the linears of a
# SmolLM2-135M forward took 1.67 s through F.linear, 1.78 s packed; at 256 rows 0.48 s and 0.44 s.
PACKED_MAX_ROWS = 512


def _packs_on_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`PackedLinear` runs oneDNN: float32 on a CPU, 2-D, 1 to `PACKED_MAX_ROWS` rows, no autograd."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and x.dim() == 2
        and 0 < x.shape[0] <= PACKED_MAX_ROWS
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear:
    """``F.linear(x, weight)`` (no bias); on a CPU in float32 through a oneDNN copy of ``weight`` packed once.

    Why: a CPU forward of SmolLM2-135M is memory-bound, so a verify of ``n`` rows should cost about one decode row.
    ``F.linear`` runs MKL's GEMV at 1 row but packs ``W`` for a GEMM from 2 rows on: all the linears of a forward
    took 1.9x (2 rows) to 2.1x (16 rows) the 1-row call; through the packed weight 0.65x, 0.66x, 0.77x, 0.93x, 1.32x
    at 1, 2, 4, 8, 16 rows (2 threads, docs/engine.md, bench/results/cpu_linear*-20261122-*.json). Row ``r`` of the
    result is bitwise the same whatever the number of rows (up to `PACKED_MAX_ROWS`), so a verify row equals the
    decode row of the same input. Elsewhere (a prefill of more rows, GPU, other dtypes, autograd) it is
    ``F.linear``. The packed copy (one per weight, as much memory again) is remade when the weight is replaced,
    moved or changed in place. One instance per module: ``self.linear(x, self.o_weight)``.

    ``skinny=True`` (the engine's layers and LM head) lets 1 row run MKL's GEMV and 2 to `SKINNY_MAX_ROWS`
    rows MKL's ``W @ x.T`` instead, each where that is measured faster on this machine (`skinny_pays`, once
    per weight shape and row count): on one 2-core machine the skinny GEMM took ~1 packed 1-row call at 2
    and 4 rows, on another (AVX-512/AMX, 2026-11-24) 2-3x the packed call, while there the GEMV took 0.45-0.7x
    the packed 1-row call. Such rows are not bitwise the packed rows, like the attention of a verify row
    (docs/engine.md). The default keeps every row bitwise row-count-invariant.
    """

    def __init__(self, skinny: bool = False) -> None:
        self._packed: dict[int, tuple[weakref.ref, int, int | None, torch.Tensor]] = {}
        self.skinny = skinny

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # x: [T, in], weight: [out, in] -> [T, out]
        if not _packs_on_cpu(x, weight):
            return F.linear(x, weight)
        packed = self._packed_weight(weight)
        if self.skinny and x.shape[0] <= SKINNY_MAX_ROWS and skinny_pays(x, weight, packed):
            return _unpacked_linear(x, weight)
        return _packed_linear(x, packed)

    def _packed_weight(self, weight: torch.Tensor) -> torch.Tensor:
        version = None if weight.is_inference() else weight._version
        entry = self._packed.get(id(weight))
        if entry is None or entry[0]() is not weight or entry[1] != weight.data_ptr() or entry[2] != version:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            entry = (weakref.ref(weight), weight.data_ptr(), version, packed)
            self._packed[id(weight)] = entry
        return entry[3]


def _packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


def _unpacked_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """MKL without the packed copy: 1 row its GEMV (``F.linear``), 2 to `SKINNY_MAX_ROWS` rows the skinny GEMM."""
    return F.linear(x, weight) if x.shape[0] == 1 else _skinny_linear(x, weight)


# With ``skinny``, 2 to 4 rows run MKL's GEMM with the rows as columns (``W @ x.T``, 3 rows padded to 4): it
# streams the weight once, and all the linears of a SmolLM2-135M forward took ~25 ms at 2 and 4 rows, as
# the packed 1-row call, against ~26, 27.5 and 30.7 ms packed at 2, 3, 4 rows (2 threads, indicative,
# docs/engine.md). Those rows are not bitwise the 1-row call's.
SKINNY_MAX_ROWS = 4


# Whether the skinny GEMM beats the packed call, per (out, in, rows, threads): measured once in the process.
_SKINNY_PAYS: dict[tuple[int, int, int, int], bool] = {}
SKINNY_MARGIN = 0.9  # skinny only when it takes under 90% of the packed call: near a tie, keep the invariant rows
SKINNY_REPS = 5


def skinny_pays(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Time `_unpacked_linear` against the packed call for this weight shape and row count (``SKINNY_REPS``
    calls each after one warm-up, the minimum of each) the first time the shape is seen; remembered for the
    process. The two give the same values up to rounding, so the choice is speed only."""
    key = (weight.shape[0], weight.shape[1], x.shape[0], torch.get_num_threads())
    pays = _SKINNY_PAYS.get(key)
    if pays is None:
        best = {}
        for name, call in (
            ("skinny", lambda: _unpacked_linear(x, weight)),
            ("packed", lambda: _packed_linear(x, packed)),
        ):
            call()
            times = []
            for _ in range(SKINNY_REPS):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            best[name] = min(times)
        pays = _SKINNY_PAYS[key] = best["skinny"] < SKINNY_MARGIN * best["packed"]
    return pays


def _skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as ``(weight @ x.T).T`` over 2 or 4 columns. Shapes: ``x [n, in]`` -> ``[n, out]``."""
    n = x.shape[0]
    columns = x if n % 2 == 0 else torch.cat([x, x[-1:]])  # [2 or 4, in]
    return torch.mm(weight, columns.t()).t()[:n].contiguous()


def set_projections(layer: nn.Module, weights: dict[str, torch.Tensor], prefix: str) -> None:
    """The layer's matmul weights: Q/K/V concatenated (``qkv_weight [(H + 2Hkv) D, hidden]``), ``o_weight``,
    gate/up concatenated (``gate_up_weight [2I, hidden]``), ``down_weight``."""
    qkv = [weights[prefix + f"self_attn.{name}_proj.weight"] for name in ("q", "k", "v")]
    layer.qkv_weight = nn.Parameter(torch.cat(qkv, dim=0), requires_grad=False)
    layer.o_weight = nn.Parameter(weights[prefix + "self_attn.o_proj.weight"], requires_grad=False)
    gate_up = [weights[prefix + f"mlp.{name}_proj.weight"] for name in ("gate", "up")]
    layer.gate_up_weight = nn.Parameter(torch.cat(gate_up, dim=0), requires_grad=False)
    layer.down_weight = nn.Parameter(weights[prefix + "mlp.down_proj.weight"], requires_grad=False)


class DecoderLayer(nn.Module):
    """One pre-norm block: ``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``.

    Q, K and V share one matmul, gate and up another (fewer, larger matmuls).
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.input_norm = RMSNorm(weights[prefix + "input_layernorm.weight"], c.rms_norm_eps)
        self.post_attention_norm = RMSNorm(weights[prefix + "post_attention_layernorm.weight"], c.rms_norm_eps)
        set_projections(self, weights, prefix)
        self.linear = PackedLinear(skinny=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        # x: [T, hidden]
        num_rows = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.linear(self.input_norm(x), self.qkv_weight)  # [T, (H + 2Hkv) D]
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(num_rows, self.num_heads, self.head_dim), cos, sin)  # [T, H, D]
        k = apply_rope(k.view(num_rows, self.num_kv_heads, self.head_dim), cos, sin)  # [T, Hkv, D]
        v = v.reshape(num_rows, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        k_cache, v_cache = kv
        write_kv(plan, k_cache, v_cache, k, v)
        attn = paged_attention(plan, q, k_cache, v_cache)  # [T, H, D]
        h = x + self.linear(attn.reshape(num_rows, q_size), self.o_weight)
        gate, up = self.linear(self.post_attention_norm(h), self.gate_up_weight).chunk(2, dim=-1)  # [T, I] each
        return h + self.linear(F.silu(gate) * up, self.down_weight)


class LlamaModel(nn.Module):
    """A Llama decoder over paged KV. Weights use Hugging Face names (see `weights_gguf.expected_shapes`).

    ``feature_layers``: residual-stream indices concatenated into `ModelOutput.hidden` (module
    docstring); None gives the final-norm input of the last layer run. Other architectures subclass
    it (`gemma3.Gemma3Model`); `engine.models.catalog.build_model` picks the class from ``config.architecture``.
    """

    architectures: tuple[str, ...] = ("llama",)

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        feature_layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if config.architecture not in self.architectures:
            raise ModelLoadError(
                f"{type(self).__name__} runs {', '.join(self.architectures)} models, not {config.architecture!r}: "
                f"speccycle.engine.models.catalog.build_model(config, weights, ...) picks the class that runs it"
            )
        check_weights(config, weights, f"{type(self).__name__} weights")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.feature_layers = None if feature_layers is None else tuple(int(i) for i in feature_layers)
        if self.feature_layers is not None:
            bad = [i for i in self.feature_layers if not 0 <= i <= config.num_layers]
            if bad or not self.feature_layers:
                raise ModelLoadError(
                    f"feature_layers={self.feature_layers}: each index must lie in [0, {config.num_layers}] "
                    f"(the residual stream entering that layer; {config.num_layers} is the final-norm input)"
                )
        w = {name: tensor.to(device=self.device, dtype=dtype) for name, tensor in weights.items()}
        self.embed_weight = nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)  # [V, hidden]
        self.layers = nn.ModuleList(self._make_layer(config, w, i) for i in range(config.num_layers))
        self.norm = self._make_norm(w["model.norm.weight"], config.rms_norm_eps)
        head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
        self.lm_head_weight = nn.Parameter(head, requires_grad=False)  # [V, hidden]
        self.head_linear = PackedLinear(skinny=True)

    def _make_layer(self, config: LlamaConfig, weights: dict[str, torch.Tensor], index: int) -> nn.Module:
        return DecoderLayer(config, weights, f"model.layers.{index}.")

    def _make_norm(self, weight: torch.Tensor, eps: float) -> nn.Module:
        return RMSNorm(weight, eps)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def feature_size(self) -> int:
        """Width ``F`` of `ModelOutput.hidden`."""
        return self.config.hidden_size * (1 if self.feature_layers is None else len(self.feature_layers))

    @torch.no_grad()  # not inference_mode: a draft-head trainer feeds these features into autograd
    def forward(
        self,
        batch: ForwardBatch,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        num_layers: int | None = None,
    ) -> ModelOutput:
        """Run the first ``num_layers`` layers (all by default), the final norm and the LM head.

        ``kv``: per layer ``(k, v)``, each ``[num_slots, Hkv, D]``; a layer-skip draft passes its own
        cache of ``num_layers`` layers. Returns ``logits [R, V]`` float32 for ``batch.logits_rows``
        (all ``T`` rows when None) and ``hidden [T, F]`` (see ``feature_layers``).
        """
        depth, capture = self._layers_to_run(kv, num_layers)
        plan = plan_attention(batch)
        cos, sin = rope_cos_sin(batch.positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        x = F.embedding(batch.input_ids, self.embed_weight)  # [T, hidden]
        features: dict[int, torch.Tensor] = {}
        for i in range(depth):
            if i in capture:
                features[i] = x
            x = self.layers[i](x, cos, sin, plan, kv[i])
        features[depth] = x
        return ModelOutput(
            logits=self.logits(x, batch.logits_rows), hidden=torch.cat([features[i] for i in capture], -1)
        )

    def _layers_to_run(
        self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], num_layers: int | None
    ) -> tuple[int, tuple[int, ...]]:
        """``(depth, capture)``: how many layers a forward runs and which residual streams it returns."""
        depth = self.config.num_layers if num_layers is None else num_layers
        if not 1 <= depth <= self.config.num_layers:
            raise ForwardBatchError(f"num_layers={num_layers} must lie in [1, {self.config.num_layers}]")
        if len(kv) < depth:
            raise ForwardBatchError(f"kv has {len(kv)} layers; running {depth} layers needs as many (k, v) pairs")
        capture = (depth,) if self.feature_layers is None else self.feature_layers
        if max(capture) > depth:
            raise ForwardBatchError(f"feature_layers={capture} reach past the {depth} layers run")
        return depth, capture

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head on the chosen rows. Shapes: ``x [T, hidden]``, ``rows [R]`` -> ``[R, V]`` float32."""
        if rows is not None:
            x = x.index_select(0, rows)
        return self.head_linear(self.norm(x), self.lm_head_weight).float()


def random_llama_weights(config: LlamaConfig, seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Random float32 weights of the right names and shapes, for tests (norm weights near 1)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        noise = torch.randn(shape, generator=generator) * scale
        weights[name] = 1.0 + noise if name.endswith("norm.weight") else noise
    return weights
