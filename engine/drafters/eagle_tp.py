"""EAGLE drafts over a tensor-parallel target: the head replicated on every rank, or sharded like the target.

Both read the target's vocabulary-parallel embedding (one ``all_reduce``) and, for EAGLE-1 and an
EAGLE-3 head without its own LM head (``draft_vocab_size == 0``), its vocabulary-parallel LM head
(one ``all_gather``), so their logits are the full ``[R, V]`` on every rank.

* `TPEagleDraft` (replicated): every rank runs the whole head layer on the same inputs. No
  communication inside the layer; the ranks agree because the same kernels on the same inputs give the
  same bits. EAGLE-1 logits go through the target's gathered head, so every rank gets the same logits
  even if its layer drifted; EAGLE-3's replicated small head has no such collective, and a drifting
  rank proposes another tree: checked mode compares every forward's inputs across ranks and names it
  before the verify.
* `ShardedEagleDraft`: the head layer is split like a target layer (Q/K/V and gate/up by column, o and
  down by row, two ``all_reduce``), and the draft cache holds this rank's KV heads. EAGLE-3's small
  draft LM head stays replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core.ports import ForwardBatch
from ..errors import ModelLoadError
from ..kernels.attention import paged_attention, plan_attention, write_kv
from ..memory.kv_pool import PagedKVPool
from ..models.llama import apply_rope, rope_cos_sin
from ..tp.tp_model import TPLlamaModel, plan_shard
from ..weights.weights_gguf import LlamaConfig
from .eagle import EagleDraft, EagleHead


class TPEagleDraft(EagleDraft):
    """`DraftModel`: an `EagleHead` replicated on every rank, over a `TPLlamaModel` target."""

    def __init__(self, head: EagleHead, target_model: TPLlamaModel, pool: PagedKVPool, cache_name: str = "draft"):
        super().__init__(head, target_model, pool, cache_name)

    def _layer(self, x: torch.Tensor, embed: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.head.layer(x, embed, batch, self.kv, self.extra_kv)

    def _layers(self, batch: ForwardBatch, x: torch.Tensor) -> torch.Tensor:
        embed = self.target_model.embed(batch.input_ids)  # [T, H] on every rank
        if self.head.config.version == 1:
            x = F.linear(torch.cat([embed, x], -1), self.head.fc)
        return self._layer(x, embed, batch)  # [T, H]

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        if self.head.config.target_lm_head:  # EAGLE-1, or EAGLE-3 without its own LM head
            return self.target_model.logits(rows)  # the target's norm and head: [R, V], gathered
        small = F.linear(self.head.norm(rows), self.head.lm_head).float()  # [R, Vd], replicated
        logits = small.new_full((small.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.head.draft_to_target] = small
        return logits


class ShardedEagleDraft(TPEagleDraft):
    """`DraftModel`: the head's decoder layer split over the target's tensor-parallel group."""

    def __init__(self, head: EagleHead, target_model: TPLlamaModel, pool: PagedKVPool, cache_name: str = "draft"):
        c, tp = head.config, target_model.tp
        if c.num_layers != 1:
            raise ModelLoadError(
                f"the sharded EAGLE draft splits a one-layer head; this head has {c.num_layers} layers: "
                "replicate it instead (TPEagleDraft: run without --eagle-sharded)"
            )
        shape = LlamaConfig(
            architecture="eagle",
            vocab_size=target_model.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=1,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rope_theta=c.rope_theta,
            rms_norm_eps=c.rms_norm_eps,
            max_position=1,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_ids=(),
        )
        self.plan = plan_shard(shape, tp.rank, tp.world_size)
        local = self.plan.local_config(shape)
        self.tp, self.num_heads, self.num_kv_heads = tp, local.num_heads, local.num_kv_heads
        # The parent's checks, with the draft cache sized for this rank's KV heads.
        super().__init__(head, target_model, _LocalHeads(pool, local.num_kv_heads), cache_name)
        d, device = c.head_dim, head.fc.device
        (q_lo, q_hi), (kv_lo, kv_hi), (i_lo, i_hi) = self.plan.q_heads, self.plan.kv_heads, self.plan.intermediate
        w = head.state()
        q, k, v = w["layer.q_proj.weight"], w["layer.k_proj.weight"], w["layer.v_proj.weight"]
        self.qkv = torch.cat([q[q_lo * d : q_hi * d], k[kv_lo * d : kv_hi * d], v[kv_lo * d : kv_hi * d]]).to(device)
        self.o = w["layer.o_proj.weight"][:, q_lo * d : q_hi * d].contiguous().to(device)
        gate, up = w["layer.gate_proj.weight"], w["layer.up_proj.weight"]
        self.gate_up = torch.cat([gate[i_lo:i_hi], up[i_lo:i_hi]]).to(device)
        self.down = w["layer.down_proj.weight"][:, i_lo:i_hi].contiguous().to(device)

    def _layer(self, x: torch.Tensor, embed: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        head, c, rows = self.head, self.head.config, x.shape[0]
        if c.version == 3:
            attn_in = torch.cat([head.embed_norm(embed), head.hidden_norm(x)], -1)
        else:
            attn_in = head.input_norm(x)
        q_size, kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        q, k, v = F.linear(attn_in, self.qkv).split([q_size, kv_size, kv_size], dim=-1)
        cos, sin = rope_cos_sin(batch.positions, c.head_dim, c.rope_theta, head.dtype)
        q = apply_rope(q.view(rows, self.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(rows, self.num_kv_heads, c.head_dim), cos, sin)
        plan = plan_attention(batch)
        write_kv(plan, self.kv[0], self.kv[1], k, v.reshape(rows, self.num_kv_heads, c.head_dim))
        attn = paged_attention(plan, q, self.kv[0], self.kv[1]).reshape(rows, q_size)
        h = x + self.tp.all_reduce(F.linear(attn, self.o))
        gate, up = F.linear(head.post_norm(h), self.gate_up).chunk(2, dim=-1)
        return h + self.tp.all_reduce(F.linear(F.silu(gate) * up, self.down))


class _LocalHeads:
    """The pool as `EagleDraft.__init__` sees it: ``add_cache`` gets this rank's KV-head count."""

    def __init__(self, pool: PagedKVPool, num_kv_heads: int) -> None:
        self.pool, self.num_kv_heads = pool, num_kv_heads

    def add_cache(self, name: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype=torch.float32):
        return self.pool.add_cache(name, num_layers, self.num_kv_heads, head_dim, dtype)
