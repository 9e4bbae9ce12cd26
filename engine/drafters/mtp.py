"""Multi-token-prediction drafts (DeepSeek-V3 MTP): modules fed by the target's last hidden state.

Module ``k`` (``k = 1..m``) combines the representation of depth ``k - 1`` with the embedding of the
next token and runs one decoder layer (its own KV cache), then its own norm and the target's LM head:

    h^k = layer_k(eh_proj_k([hnorm_k(h^{k-1}); enorm_k(embed(token))]))       h^0: the target's hidden state

It is a ``shifted`` draft: at position ``p`` module 1 pairs the target's feature ``f[p]`` with token
``t[p + 1]`` (predicting ``t[p + 2]``), and module ``k > 1`` pairs ``h^{k-1}`` of position ``p - 1``
with ``t[p + 1]``: DeepSeek-V3's ``(h^{k-1}_i, t_{i+k})`` with every module's positions relabelled to
the token it is fed. So the extend fills every module's cache over the committed tokens, module 1
gives the depth-1 candidates, and draft step ``j`` (depth ``j + 2``, position ``L + j``) runs module
``min(j + 2, m)``, fed with its parent's representation; past ``m`` the last module is reused, as
engines do with a model's single MTP layer. A module attends its committed context and the draft
positions it computed itself in this cycle. Chain only (``topk == 1``).
"""

from __future__ import annotations

from collections import OrderedDict

import attrs
import torch
import torch.nn.functional as F

from ...core.ports import ForwardBatch, ModelOutput
from ..errors import ModelLoadError
from ..kernels.attention import plan_attention
from ..memory.kv_pool import PagedKVPool
from ..models.llama import DecoderLayer, LlamaModel, RMSNorm, rope_cos_sin
from ..weights.weights_gguf import expected_shapes


def mtp_weight_shapes(target_config, num_modules: int) -> dict[str, tuple[int, ...]]:
    """Module ``k``'s tensors under ``layers.{k}.``: a target-shaped decoder layer plus the MTP parts."""
    h = target_config.hidden_size
    layer = {n[len("model.layers.0.") :]: s for n, s in expected_shapes(target_config).items() if ".layers.0." in n}
    shapes = {}
    for k in range(num_modules):
        p = f"layers.{k}."
        shapes.update({p + n: s for n, s in layer.items()})
        shapes[p + "enorm.weight"] = shapes[p + "hnorm.weight"] = shapes[p + "shared_head.norm.weight"] = (h,)
        shapes[p + "eh_proj.weight"] = (h, 2 * h)
    return shapes


class MtpDraft:
    """A `DraftModel` (core.ports) of ``num_modules`` MTP modules over the target's `LlamaModel`.

    The target must return its last hidden state (``feature_layers`` None). ``max_requests``: how many
    requests' last representations the draft keeps between cycles (least recently extended dropped).
    """

    kind = "forward"
    pairing = "shifted"

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        target_model: LlamaModel,
        kv_pool: PagedKVPool,
        num_modules: int = 1,
        dtype: torch.dtype = torch.float32,
        cache_name: str = "draft",
        max_requests: int = 4096,
    ) -> None:
        c = target_model.config
        if c.architecture != "llama":
            raise ValueError(f"MTP drafts run over Llama-architecture targets, not {c.architecture!r}")
        if num_modules < 1:
            raise ValueError(f"num_modules={num_modules}: an MTP draft has at least one module")
        if target_model.feature_layers not in (None, (c.num_layers,)):
            raise ValueError(
                f"MTP modules read the target's last hidden state; the target returns {target_model.feature_layers}"
            )
        wrong = [
            n for n, s in mtp_weight_shapes(c, num_modules).items() if n not in weights or tuple(weights[n].shape) != s
        ]
        if wrong:
            raise ModelLoadError(f"MTP weights do not fit {num_modules} target-shaped modules: {wrong[:5]}")
        self.target_model, self.num_modules, self.dtype = target_model, num_modules, dtype
        self.vocab_size = c.vocab_size
        w = {k: v.to(device=target_model.device, dtype=dtype) for k, v in weights.items()}
        eps = c.rms_norm_eps
        self.layers = [DecoderLayer(c, w, f"layers.{k}.") for k in range(num_modules)]
        self.enorm = [RMSNorm(w[f"layers.{k}.enorm.weight"], eps) for k in range(num_modules)]
        self.hnorm = [RMSNorm(w[f"layers.{k}.hnorm.weight"], eps) for k in range(num_modules)]
        self.eh_proj = [w[f"layers.{k}.eh_proj.weight"] for k in range(num_modules)]
        self.head_norm = [RMSNorm(w[f"layers.{k}.shared_head.norm.weight"], eps) for k in range(num_modules)]
        self.kv = kv_pool.add_cache(cache_name, num_modules, c.num_kv_heads, c.head_dim, dtype)
        self.max_requests = max_requests
        # Per request: modules 1..m-1's outputs at its last extend row, fed to modules 2..m next extend.
        self._carry: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._steps = 0  # draft steps run since the last extend
        self._written: list[torch.Tensor] = []  # per module: slots its steps wrote this cycle

    @classmethod
    def random(cls, target_model: LlamaModel, kv_pool: PagedKVPool, num_modules: int = 1, seed: int = 0, **kwargs):
        gen = torch.Generator().manual_seed(seed)
        weights = {}
        for name, shape in mtp_weight_shapes(target_model.config, num_modules).items():
            if name.endswith("norm.weight"):
                weights[name] = torch.ones(shape)
            else:
                weights[name] = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
        return cls(weights, target_model, kv_pool, num_modules=num_modules, **kwargs)

    def _module(self, k: int, batch: ForwardBatch, hidden: torch.Tensor, plan) -> torch.Tensor:
        """Module ``k`` (0-based) on ``hidden [T, H]`` paired with ``batch.input_ids``. Returns ``[T, H]``."""
        c = self.target_model.config
        embed = F.embedding(batch.input_ids, self.target_model.embed_weight)
        x = F.linear(torch.cat([self.hnorm[k](hidden), self.enorm[k](embed)], dim=-1), self.eh_proj[k])
        cos, sin = rope_cos_sin(batch.positions, c.head_dim, c.rope_theta, self.dtype)
        return self.layers[k](x, cos, sin, plan, self.kv[k])

    def _logits(self, k: int, out: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        picked = out if rows is None else out.index_select(0, rows)
        return F.linear(self.head_norm[k](picked), self.target_model.lm_head_weight).float()

    @torch.inference_mode()
    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> ModelOutput:
        if target_hidden is None:
            raise ValueError("an MTP draft extend needs the target's last hidden state")
        plan = plan_attention(batch)
        request = batch.row_request
        first = torch.ones_like(request, dtype=torch.bool)
        first[1:] = request[1:] != request[:-1]  # the first extend row of each request (rows are request-major)
        carried = torch.stack([self._carried(rid, target_hidden) for rid in batch.request_ids])  # [bs, m - 1, H]
        outputs = [self._module(0, batch, target_hidden.to(self.dtype), plan)]
        for k in range(1, self.num_modules):
            previous = torch.roll(outputs[-1], 1, dims=0)  # h^{k-1} of position p - 1 ...
            previous = torch.where(first[:, None], carried[request, k - 1], previous)  # ... or the last cycle's
            outputs.append(self._module(k, batch, previous, plan))
        last = torch.zeros(len(batch.request_ids), dtype=torch.long, device=request.device)
        last.scatter_reduce_(0, request, torch.arange(len(request), device=request.device), reduce="amax")
        if self.num_modules > 1:
            kept = torch.stack(outputs[:-1], dim=1)[last]  # [bs, m - 1, H]
            for i, rid in enumerate(batch.request_ids):
                self._carry[rid] = kept[i]
                self._carry.move_to_end(rid)
            while len(self._carry) > self.max_requests:
                self._carry.popitem(last=False)
        self._steps, self._written = 0, [request.new_empty(0) for _ in range(self.num_modules)]
        return ModelOutput(logits=self._logits(0, outputs[0], batch.logits_rows), hidden=outputs[0])

    def _carried(self, request_id: int, like: torch.Tensor) -> torch.Tensor:
        """Modules 1..m-1's outputs at the request's previous position; zeros before its first token."""
        shape = (self.num_modules - 1, like.shape[-1])
        if request_id in self._carry:
            return self._carry[request_id]
        return torch.zeros(shape, dtype=self.dtype, device=like.device)

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, parent_hidden: torch.Tensor | None) -> ModelOutput:
        if parent_hidden is None:
            raise ValueError("an MTP draft step needs its parent's representation")
        if batch.num_rows != len(batch.request_ids):
            raise ValueError(
                f"MTP drafts are chain-only: a step got {batch.num_rows} rows for {len(batch.request_ids)} "
                "requests; use topk (K)=1"
            )
        k = min(self._steps + 1, self.num_modules - 1)
        self._steps += 1
        own = batch.out_slots[:, None]
        seen = torch.isin(batch.extra_slots, self._written[k]) | (batch.extra_slots == own)
        plan = plan_attention(attrs.evolve(batch, extra_slots=torch.where(seen, batch.extra_slots, -1)))
        out = self._module(k, batch, parent_hidden.to(self.dtype), plan)
        self._written[k] = torch.cat([self._written[k], batch.out_slots])
        return ModelOutput(logits=self._logits(k, out, batch.logits_rows), hidden=out)
