"""The ports over a transformers causal LM: `TransformersTarget` (`TargetModel`), `TransformersDraft` (an
``aligned`` `DraftModel`: a smaller assistant model with the target's tokenizer) and `EagleTargetParts` (what an
`engine.drafters.eagle.EagleDraft` reads of its target: embedding, final norm and LM head, layer count).

The KV lives in the library's paged pool (`engine.memory.kv_pool.PagedKVPool`), one cache per model, so the
compaction's KV moves (`KVPool.target_buffers`), the page tables and the scratch slots of a tree work as for the
engine's own target. A forward hands the model a `PoolCache` in place of transformers' ``DynamicCache``: each
attention layer's ``cache.update(k, v, layer)`` writes the batch's rows (keys already rotated) at their
``out_slots`` and returns, per request, the keys and values of its prefix slots and of the extra slots its rows
name; a 4-D float mask (0 where a row may attend, the dtype's lowest value elsewhere) says which, per row, as
`core.ports` states the rule:

    a row of request b attends the slots of b's positions [0, prefix_len) plus the slots of its extra_slots row.

Rows are laid out ``[bs, Tq]`` (request ``b``'s rows in batch order, padded to the longest request) with their
own ``position_ids``, so RoPE and any position-dependent op see the cycle's positions, not the cache's length.

Models whose layers all attend in full (Llama, Qwen2, Mistral without a window, SmolLM2, ...) are served; a model
with sliding-window layers is refused (one mask cannot tell its layers apart), and so is a model whose layers keep
state other than keys and values (recurrent layers never call ``cache.update``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from ...core.ports import ForwardBatch, ModelOutput
from ...engine.errors import ModelLoadError
from ...engine.memory.kv_pool import TARGET_CACHE, PagedKVPool


def text_config(model):
    """The text model's config (a multimodal model's ``text_config``; a causal LM's own)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_full_attention(model, role: str = "target") -> None:
    """Refuse a model with sliding-window or non-attention layers, in one line naming what it has."""
    config = text_config(model)
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        raise ModelLoadError(
            f"the {role} {type(model).__name__} has {', '.join(sorted(kinds - {'full_attention'}))} layers: the "
            "transformers adapter serves models whose layers all attend in full; run it on the engine's own "
            "model (speccycle.engine) instead"
        )
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and getattr(config, "use_sliding_window", True):
        raise ModelLoadError(
            f"the {role} {type(model).__name__} attends through a sliding window of {window} tokens: the "
            "transformers adapter serves models whose layers all attend in full"
        )


def kv_shape(model) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers decoder, from its config."""
    c = text_config(model)
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, kv_heads, head_dim


class BatchLayout:
    """A `ForwardBatch` laid out for a transformers forward, computed once and read by every layer.

    Shapes: ``input_ids``, ``position_ids [bs, Tq]``; ``mask [bs, 1, Tq, Kk]`` (the model's dtype);
    ``key_slots [bs, Kk]`` (``Kk``: the longest prefix of the batch plus the most distinct extra slots of one
    request); ``row_b``, ``row_i [T]``: where each batch row sits in ``[bs, Tq]``.
    """

    def __init__(self, batch: ForwardBatch, dtype: torch.dtype) -> None:
        device = batch.input_ids.device
        bs = int(batch.page_table.shape[0])
        rows = batch.row_request.long()
        onehot = F.one_hot(rows, bs)  # [T, bs]
        self.row_b = rows
        self.row_i = (onehot.cumsum(0) * onehot).sum(1) - 1  # [T] index of the row among its request's rows
        counts = onehot.sum(0)  # [bs]
        tq = int(counts.max()) if rows.numel() else 0
        self.bs, self.tq = bs, tq
        self.input_ids = torch.zeros((bs, tq), dtype=torch.long, device=device)
        self.input_ids[self.row_b, self.row_i] = batch.input_ids
        self.position_ids = torch.zeros((bs, tq), dtype=torch.long, device=device)
        self.position_ids[self.row_b, self.row_i] = batch.positions
        self.out_slots = batch.out_slots

        # prefix keys: positions [0, P) of each request through its page table
        prefix = torch.zeros((bs, tq), dtype=torch.long, device=device)
        prefix[self.row_b, self.row_i] = batch.prefix_lens
        width = int(prefix.max()) if prefix.numel() else 0
        page = batch.page_size
        positions = torch.arange(width, device=device)
        pages = batch.page_table.index_select(1, (positions // page).clamp(max=batch.page_table.shape[1] - 1))
        prefix_slots = (pages * page + positions % page).clamp(min=0)  # [bs, P]; -1 pages masked below
        allow_prefix = positions[None, None, :] < prefix[:, :, None]  # [bs, Tq, P]

        # extra keys: the distinct extra slots of each request's rows
        extra = batch.extra_slots
        if extra.shape[1]:
            distinct = [torch.unique(extra[rows == b][extra[rows == b] >= 0]) for b in range(bs)]
        else:
            distinct = [extra.new_empty(0) for _ in range(bs)]
        most = max((len(d) for d in distinct), default=0)
        extra_slots = torch.zeros((bs, most), dtype=torch.long, device=device)
        row_extra = torch.full((bs, tq, max(extra.shape[1], 1)), -1, dtype=torch.long, device=device)
        if extra.shape[1]:
            row_extra[self.row_b, self.row_i] = extra
        allow_extra = torch.zeros((bs, tq, most), dtype=torch.bool, device=device)
        for b, slots in enumerate(distinct):
            if len(slots):
                extra_slots[b, : len(slots)] = slots
                allow_extra[b, :, : len(slots)] = (row_extra[b, :, :, None] == slots[None, None, :]).any(1)
        self.key_slots = torch.cat([prefix_slots, extra_slots], 1)  # [bs, Kk]
        allow = torch.cat([allow_prefix, allow_extra], 2)  # [bs, Tq, Kk]
        self.mask = torch.zeros(allow.shape, dtype=dtype, device=device).masked_fill_(~allow, torch.finfo(dtype).min)[
            :, None
        ]


class PoolCache(Cache):
    """A transformers `Cache` over one model's layers of the library's pool (module docstring): ``update`` writes
    the batch's rows at their slots, then returns each request's keys and values in `BatchLayout.key_slots`
    order."""

    def __init__(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: BatchLayout) -> None:
        super().__init__(layer_class_to_replicate=DynamicLayer)
        self.kv, self.layout = kv, layout

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """``key_states``, ``value_states [bs, Hkv, Tq, D]`` -> ``[bs, Hkv, Kk, D]`` each."""
        k, v = self.kv[layer_idx]
        lay = self.layout
        k[lay.out_slots] = key_states[lay.row_b, :, lay.row_i].to(k.dtype)
        v[lay.out_slots] = value_states[lay.row_b, :, lay.row_i].to(v.dtype)
        keys = k[lay.key_slots].transpose(1, 2)  # [bs, Hkv, Kk, D]
        values = v[lay.key_slots].transpose(1, 2)
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from position_ids, the mask from the layout: nothing reads a length

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return int(self.layout.key_slots.shape[1]), 0


def _cache_keyword(model) -> str:
    """The keyword a model's forward takes its cache by: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class _PoolForward:
    """One transformers causal LM run over `ForwardBatch`es on its cache of the pool."""

    def __init__(self, model, pool: PagedKVPool, cache_name: str, role: str) -> None:
        check_full_attention(model, role)
        layers, kv_heads, head_dim = kv_shape(model)
        self.model = model.eval()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        if self.device != pool.device:
            raise ValueError(
                f"the {role} runs on {self.device} and the KV pool lives on {pool.device}: build the pool with "
                f"PagedKVPool(..., device={str(self.device)!r})"
            )
        self.vocab_size = int(text_config(model).vocab_size)
        self.num_layers = layers
        self.kv = pool.add_cache(cache_name, layers, kv_heads, head_dim, self.dtype)
        self._cache_kw = _cache_keyword(model)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, feature_layers: Sequence[int] | None = None) -> ModelOutput:
        lay = BatchLayout(batch, self.dtype)
        wanted = batch.logits_rows if batch.logits_rows is not None else torch.arange(batch.num_rows)
        wanted = wanted.to(lay.row_i.device)
        keep = torch.unique(lay.row_i[wanted])  # sorted sequence indices whose logits some row needs
        out = self.model(
            input_ids=lay.input_ids,
            attention_mask=lay.mask,
            position_ids=lay.position_ids,
            use_cache=True,
            logits_to_keep=keep,
            output_hidden_states=feature_layers is not None,
            **{self._cache_kw: PoolCache(self.kv, lay)},
        )
        column = torch.searchsorted(keep, lay.row_i[wanted])
        logits = out.logits[lay.row_b[wanted], column].float()  # [R, V]
        hidden = None
        if feature_layers is not None:
            states = out.hidden_states
            hidden = torch.cat([states[i][lay.row_b, lay.row_i] for i in feature_layers], -1)  # [T, F]
        return ModelOutput(logits=logits, hidden=hidden)


class TransformersTarget:
    """A `TargetModel` over a transformers causal LM (module docstring), its KV the pool's ``cache_name`` cache.

    ``feature_layers``: the residual streams `ModelOutput.hidden` concatenates (index ``i``: the stream entering
    layer ``i``, transformers' ``hidden_states[i]``; an EAGLE-3 head's `EagleConfig.feature_layers`), None for no
    features (a lookup draft or an aligned draft reads none).
    """

    def __init__(
        self,
        model,
        pool: PagedKVPool,
        feature_layers: Sequence[int] | None = None,
        cache_name: str = TARGET_CACHE,
    ) -> None:
        self._run = _PoolForward(model, pool, cache_name, "target")
        self.model = model
        self.vocab_size = self._run.vocab_size
        self.device = self._run.device
        self.dtype = self._run.dtype
        if feature_layers is not None:
            features = tuple(int(i) for i in feature_layers)
            if not features or any(not 0 <= i < self._run.num_layers for i in features):
                raise ValueError(
                    f"feature_layers={features}: each must lie in [0, {self._run.num_layers}) (the residual stream "
                    f"entering that layer; the last layer's output is normed by transformers)"
                )
            feature_layers = features
        self.feature_layers = feature_layers

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """Write each row's K/V at ``out_slots``, attend per core.ports, return logits (and features)."""
        return self._run.run(batch, self.feature_layers)


class TransformersDraft:
    """An ``aligned`` `DraftModel` over a smaller transformers causal LM with the target's tokenizer (an assistant
    model): the draft extend writes the committed tokens and the root, each tree level its nodes, in its own cache
    of the pool."""

    kind = "forward"
    pairing = "aligned"

    def __init__(self, model, pool: PagedKVPool, target_vocab_size: int | None = None, cache_name: str = "draft"):
        self._run = _PoolForward(model, pool, cache_name, "draft")
        self.model = model
        self.vocab_size = self._run.vocab_size if target_vocab_size is None else int(target_vocab_size)
        if target_vocab_size is not None and self._run.vocab_size != self.vocab_size:
            raise ModelLoadError(
                f"the draft model has a vocabulary of {self._run.vocab_size} tokens and the target "
                f"{self.vocab_size}: an assistant must share the target's tokenizer"
            )

    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> ModelOutput:
        return self._run.run(batch)

    def step(self, batch: ForwardBatch, parent_hidden: torch.Tensor | None) -> ModelOutput:
        return self._run.run(batch)


class _EagleTargetConfig:
    """What an EAGLE head checks of its target's config (`eagle_config.check_target`)."""

    def __init__(self, model) -> None:
        c = text_config(model)
        self.hidden_size, self.vocab_size, self.num_layers = c.hidden_size, c.vocab_size, c.num_hidden_layers
        self.architecture = getattr(c, "model_type", "llama")


class EagleTargetParts:
    """What `engine.drafters.eagle.EagleDraft` reads of its target, from a transformers Llama-family causal LM:
    the token embedding (``embed_weight``), the final norm and LM head (``logits``), the config sizes and the
    ``feature_layers`` the target returns (those of `TransformersTarget`)."""

    def __init__(self, target: TransformersTarget) -> None:
        model = target.model
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        if not hasattr(decoder, "norm"):
            raise ModelLoadError(
                f"{type(model).__name__} has no final `norm` on its decoder: an EAGLE head runs on Llama-family "
                "targets; use a lookup draft (ngram) or an assistant model"
            )
        self.config = _EagleTargetConfig(model)
        self.embed_weight = model.get_input_embeddings().weight
        self.dtype = target.dtype
        self.feature_layers = target.feature_layers
        self._norm, self._head = decoder.norm, model.get_output_embeddings()

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head: ``x [T, H]`` -> ``[R, V]`` float32."""
        if rows is not None:
            x = x.index_select(0, rows)
        return self._head(self._norm(x)).float()
