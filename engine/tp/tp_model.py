"""Tensor parallelism for the Llama runner: one rank's shard of a `LlamaModel`, over `torch.distributed`.

Every rank holds a slice of each weight and runs the same forward on the same rows:

* attention: Q, K, V column-parallel by whole KV-head groups (a rank keeps the query heads that read
  its KV heads, and the pool of that rank holds only those KV heads), ``o_proj`` row-parallel, its
  partial sums summed by one ``all_reduce``;
* MLP: ``gate``/``up`` column-parallel over the intermediate size, ``down`` row-parallel, one
  ``all_reduce``;
* embedding and LM head vocabulary-parallel: a rank embeds the ids of its vocabulary range (zeros
  elsewhere, summed by ``all_reduce``) and computes the logits of its range, which ``all_gather``
  assembles, so every rank returns the full ``[R, V]`` logits;
* norms replicated.

After each ``all_reduce`` every rank holds the same residual stream, bit for bit (a collective
reduces each element once and hands the sum to all ranks), and after the logits ``all_gather`` the
same logits, so each rank's copy of the cycle takes the same decisions: the rank-consistency choice
of `speccycle.engine.tp.engine` (see docs/tensor_parallel.md).

Uneven shapes are allowed: SmolLM2 (9 query heads, 3 KV heads) at TP=2 splits 2:1 KV heads; more ranks
than KV heads replicate each KV head over ``world_size / Hkv`` ranks; the vocabulary pads the last
shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from ...core.ports import ForwardBatch, ModelOutput
from ..errors import ForwardBatchError, ModelLoadError
from ..kernels.attention import AttentionPlan, paged_attention, plan_attention, write_kv
from ..memory.kv_pool import LayerKV
from ..models.llama import RMSNorm, apply_rope, rope_cos_sin
from ..weights.weights_gguf import LlamaConfig
from .tp_group import TPGroup, batch_digest, check_same_on_ranks


# ---- the partition -------------------------------------------------------------------------------
def _split(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``index`` when ``total`` items split into ``parts`` near-equal runs (first ones larger)."""
    base, extra = divmod(total, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


@attrs.frozen
class ShardPlan:
    """What rank ``rank`` of ``world_size`` holds: ``[lo, hi)`` ranges in the full model's index space."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # real rows; the shard is padded to vocab_per_rank rows
    vocab_per_rank: int

    def local_config(self, config: LlamaConfig) -> LlamaConfig:
        """The shape this rank runs: its heads, KV heads and intermediate size; hidden and vocabulary in full."""
        return attrs.evolve(
            config,
            num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
        )


def plan_shard(config: LlamaConfig, rank: int, world_size: int) -> ShardPlan:
    """Partition ``config`` over ``world_size`` ranks (module docstring). Raises ValueError when it cannot."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    group = heads // kv_heads
    if world_size <= kv_heads:
        kv = _split(kv_heads, world_size, rank)
        q = (kv[0] * group, kv[1] * group)
    else:
        replicas = world_size // kv_heads
        if world_size % kv_heads or group % replicas:
            raise ValueError(
                f"cannot split {heads} query / {kv_heads} KV heads over {world_size} ranks: with more ranks than "
                f"KV heads, world_size must be a multiple of {kv_heads} and each KV head's {group} query heads "
                f"divisible by world_size / {kv_heads}; use at most {kv_heads} ranks"
            )
        head = rank // replicas
        per_rank = group // replicas
        kv = (head, head + 1)
        q = (head * group + (rank % replicas) * per_rank, head * group + (rank % replicas + 1) * per_rank)
    if config.intermediate_size < world_size or config.vocab_size < world_size:
        raise ValueError(
            f"intermediate_size={config.intermediate_size} and vocab_size={config.vocab_size} must each be at "
            f"least world_size={world_size}"
        )
    per_rank_vocab = -(-config.vocab_size // world_size)
    vocab = (min(rank * per_rank_vocab, config.vocab_size), min((rank + 1) * per_rank_vocab, config.vocab_size))
    return ShardPlan(rank, world_size, q, kv, _split(config.intermediate_size, world_size, rank), vocab, per_rank_vocab)


# ---- the model -----------------------------------------------------------------------------------
class _WeightReader:
    """Reads full tensors by name (checking their shapes) and keeps a slice on the device, in ``dtype``.

    ``weights`` may be a lazy mapping: each tensor is read once and dropped after slicing.
    """

    def __init__(self, config: LlamaConfig, weights: Mapping[str, torch.Tensor], device, dtype) -> None:
        from ..weights.weights_gguf import expected_shapes

        self.shapes, self.weights, self.device, self.dtype = expected_shapes(config), weights, device, dtype

    def rows(self, name: str, lo: int, hi: int, pad_to: int | None = None) -> torch.Tensor:
        full = self._read(name)
        part = full[lo:hi].to(device=self.device, dtype=self.dtype)
        if pad_to is not None and part.shape[0] < pad_to:
            part = torch.cat([part, part.new_zeros((pad_to - part.shape[0], *part.shape[1:]))])
        return part.contiguous()

    def cols(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self._read(name)[:, lo:hi].to(device=self.device, dtype=self.dtype).contiguous()

    def full(self, name: str) -> torch.Tensor:
        return self._read(name).to(device=self.device, dtype=self.dtype).contiguous()

    def _read(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise ModelLoadError(f"tensor-parallel shard: tensor {name} is missing")
        tensor = self.weights[name]
        if tuple(tensor.shape) != self.shapes[name]:
            raise ModelLoadError(
                f"tensor-parallel shard: tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{self.shapes[name]}"
            )
        return tensor


class TPDecoderLayer(nn.Module):
    """One pre-norm block on this rank's heads and intermediate slice; two ``all_reduce`` per call."""

    def __init__(self, plan: ShardPlan, config: LlamaConfig, read: _WeightReader, prefix: str, tp: TPGroup) -> None:
        super().__init__()
        d = config.head_dim
        (q_lo, q_hi), (kv_lo, kv_hi), (i_lo, i_hi) = plan.q_heads, plan.kv_heads, plan.intermediate
        self.tp, self.num_heads, self.num_kv_heads, self.head_dim = tp, q_hi - q_lo, kv_hi - kv_lo, d
        self.input_norm = RMSNorm(read.full(prefix + "input_layernorm.weight"), config.rms_norm_eps)
        self.post_attention_norm = RMSNorm(read.full(prefix + "post_attention_layernorm.weight"), config.rms_norm_eps)
        attn = prefix + "self_attn."
        qkv = [
            read.rows(attn + "q_proj.weight", q_lo * d, q_hi * d),
            read.rows(attn + "k_proj.weight", kv_lo * d, kv_hi * d),
            read.rows(attn + "v_proj.weight", kv_lo * d, kv_hi * d),
        ]
        self.qkv_weight = nn.Parameter(torch.cat(qkv), requires_grad=False)  # [(h + 2 hkv) D, hidden]
        self.o_weight = nn.Parameter(read.cols(attn + "o_proj.weight", q_lo * d, q_hi * d), requires_grad=False)
        gate_up = [read.rows(prefix + f"mlp.{n}_proj.weight", i_lo, i_hi) for n in ("gate", "up")]
        self.gate_up_weight = nn.Parameter(torch.cat(gate_up), requires_grad=False)  # [2 i, hidden]
        self.down_weight = nn.Parameter(read.cols(prefix + "mlp.down_proj.weight", i_lo, i_hi), requires_grad=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan, kv: LayerKV
    ) -> torch.Tensor:
        # x: [T, hidden], the same on every rank
        rows = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(self.input_norm(x), self.qkv_weight).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(rows, self.num_heads, self.head_dim), cos, sin)  # [T, h, D]
        k = apply_rope(k.view(rows, self.num_kv_heads, self.head_dim), cos, sin)  # [T, hkv, D]
        write_kv(plan, kv[0], kv[1], k, v.reshape(rows, self.num_kv_heads, self.head_dim))
        attn = paged_attention(plan, q, kv[0], kv[1])  # [T, h, D]
        h = x + self.tp.all_reduce(F.linear(attn.reshape(rows, q_size), self.o_weight))
        gate, up = F.linear(self.post_attention_norm(h), self.gate_up_weight).chunk(2, dim=-1)  # [T, i] each
        return h + self.tp.all_reduce(F.linear(F.silu(gate) * up, self.down_weight))


class TPLlamaModel(nn.Module):
    """This rank's shard of a `LlamaModel`, with the same ``forward(batch, kv, num_layers)`` and ``logits``.

    ``config`` is the rank's local shape (`ShardPlan.local_config`: its heads, KV heads, intermediate
    slice), so a pool cache built from it (``config.num_kv_heads``) holds this rank's KV heads only and
    `Engine`, `LlamaTarget` and the layer-skip `LlamaDraft` work unchanged; ``full_config`` is the
    whole model. ``weights`` are the full model's (Hugging Face names), possibly a lazy mapping.
    """

    def __init__(
        self,
        config: LlamaConfig,
        weights: Mapping[str, torch.Tensor],
        tp: TPGroup,
        dtype: torch.dtype = torch.float32,
        feature_layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if config.architecture != "llama":
            raise ModelLoadError(
                f"tensor parallelism shards Llama-architecture models; {config.architecture!r} runs unsharded "
                f"(Engine.load)"
            )
        self.full_config, self.tp, self.dtype, self.device = config, tp, dtype, tp.device
        self.shard = plan_shard(config, tp.rank, tp.world_size)
        self.config = self.shard.local_config(config)
        self.feature_layers = None if feature_layers is None else tuple(int(i) for i in feature_layers)
        if self.feature_layers is not None and (
            not self.feature_layers or any(not 0 <= i <= config.num_layers for i in self.feature_layers)
        ):
            raise ModelLoadError(
                f"feature_layers={self.feature_layers}: each index must lie in [0, {config.num_layers}] (the residual "
                f"stream entering that layer)"
            )
        self.check_inputs = False  # checked mode: every forward first compares its inputs across ranks
        read = _WeightReader(config, weights, self.device, dtype)
        v_lo, v_hi = self.shard.vocab
        pad = self.shard.vocab_per_rank
        self.embed_shard = nn.Parameter(read.rows("model.embed_tokens.weight", v_lo, v_hi, pad), requires_grad=False)
        self.layers = nn.ModuleList(
            TPDecoderLayer(self.shard, config, read, f"model.layers.{i}.", tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(read.full("model.norm.weight"), config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head_shard = self.embed_shard  # [V / world, hidden], padded
        else:
            self.lm_head_shard = nn.Parameter(read.rows("lm_head.weight", v_lo, v_hi, pad), requires_grad=False)

    @property
    def vocab_size(self) -> int:
        return self.full_config.vocab_size

    def feature_size(self) -> int:
        """Width ``F`` of `ModelOutput.hidden` (the full hidden size: the residual stream is replicated)."""
        return self.config.hidden_size * (1 if self.feature_layers is None else len(self.feature_layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: ``[T]`` -> ``[T, hidden]`` on every rank (one ``all_reduce``, exact)."""
        v_lo, v_hi = self.shard.vocab
        mine = (input_ids >= v_lo) & (input_ids < v_hi)
        local = F.embedding(torch.where(mine, input_ids - v_lo, 0), self.embed_shard)
        return self.tp.all_reduce(local * mine[:, None].to(local.dtype))

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv: Sequence[LayerKV], num_layers: int | None = None) -> ModelOutput:
        """As `LlamaModel.forward`; ``kv`` holds this rank's KV heads. Returns full logits on every rank."""
        depth = self.config.num_layers if num_layers is None else num_layers
        if not 1 <= depth <= self.config.num_layers:
            raise ForwardBatchError(f"num_layers={num_layers} must lie in [1, {self.config.num_layers}]")
        if len(kv) < depth:
            raise ForwardBatchError(f"kv has {len(kv)} layers; running {depth} layers needs as many (k, v) pairs")
        capture = (depth,) if self.feature_layers is None else self.feature_layers
        if max(capture) > depth:
            raise ForwardBatchError(f"feature_layers={capture} reach past the {depth} layers run")
        if self.check_inputs:
            check_same_on_ranks(self.tp, batch_digest(batch), f"the inputs of a {depth}-layer forward")

        plan = plan_attention(batch)
        cos, sin = rope_cos_sin(batch.positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        x = self.embed(batch.input_ids)  # [T, hidden]
        features: dict[int, torch.Tensor] = {}
        for i in range(depth):
            if i in capture:
                features[i] = x
            x = self.layers[i](x, cos, sin, plan, kv[i])
        features[depth] = x
        return ModelOutput(
            logits=self.logits(x, batch.logits_rows), hidden=torch.cat([features[i] for i in capture], -1)
        )

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm, this rank's vocabulary slice, ``all_gather``. ``x [T, hidden]`` -> ``[R, V]`` float32."""
        if rows is not None:
            x = x.index_select(0, rows)
        local = F.linear(self.norm(x), self.lm_head_shard)  # [R, V / world] in the model dtype
        gathered = self.tp.all_gather(local)  # [world, R, V / world]
        full = gathered.permute(1, 0, 2).reshape(local.shape[0], -1)
        return full[:, : self.vocab_size].float()


class TPTarget:
    """The `TargetModel` port over a `TPLlamaModel` and this rank's slice of the pool's target cache."""

    def __init__(self, model: TPLlamaModel, kv: Sequence[LayerKV]) -> None:
        if len(kv) != model.config.num_layers:
            raise ValueError(f"the target cache has {len(kv)} layers and the model {model.config.num_layers}")
        self.model, self.kv = model, list(kv)
        self.vocab_size = model.vocab_size
        self.device = model.device

    @property
    def config(self) -> LlamaConfig:
        return self.model.config

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        return self.model.forward(batch, self.kv)
