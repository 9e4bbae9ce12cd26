"""The fast forward path: static-buffer row forwards, CUDA graphs, fused kernels, a graph-stepped decode.

`llama_rows_forward` and `eagle_rows_forward` are the forwards of `LlamaModel` and `EagleHead` over
`graphs.RowInputs`, written for capture: no host sync, shapes fixed by the inputs, the fused ops of
`engine.kernels.fused_ops` (RMSNorm with the residual add, RoPE with the KV write, SiLU-and-mul) and the paged
row attention of `engine.kernels.attention_triton`; Q/K/V and gate/up are the models' concatenated weights
(``qkv_weight``, ``gate_up_weight``), so each layer runs 4 GEMMs. With `kernels.fused_ops.TorchOps` (and above
`linear_triton.MAX_ROWS` rows) a layer is norm, QKV, RoPE + KV write, attention, O, add + norm,
gate-up, SiLU-mul, down: 9 kernels. With `kernels.fused_ops.TritonOps` the norms, RoPE + KV write and SiLU-mul
fuse into the row-invariant GEMMs of `engine.kernels.linear_triton` (a row's bits never depend on the row
count, so a verify row computes the decode step's logits): (add +) norm + QKV + RoPE + KV write,
attention, O, add + norm + gate-up + SiLU-mul, down: 5 kernels.

The port implementations wrap the reference ones and keep their weights, caches and contracts:

* `FastTarget` (a `LlamaTarget`): ``forward(batch)`` through `graphs.ForwardGraphs`.
* `FastLlamaDraft` (layer skip, smaller model) and `FastEagleDraft`: ``extend`` and ``step`` likewise.
* `FastGreedyDecoder`: the engine's autoregressive baseline, one graph replay per token.

`accelerate(engine)` swaps them into an `Engine`. The plain-torch modules stay the reference; the
fast path is tested equal to them (tests/unit/test_fast_path.py, bench/gpu_check.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F

from ...core.ports import DraftCapabilities, ForwardBatch, ModelOutput, StaticForwards, kind_of
from ..drafters.eagle import EagleDraft
from ..drafters.eagle_config import normalize_features
from ..drafters.layerskip import LlamaDraft
from ..kernels.fused_ops import TorchOps, default_ops
from ..kernels.int8_linear import Int8Rowwise, int8_linear, int8_linear_add
from ..memory.kv_pool import LayerKV, PagedKVPool
from ..models.llama import LlamaModel, rope_cos_sin
from ..models.target import LlamaTarget
from .fused_cycle import FusedCycles
from .graphs import (
    BUCKETS,
    ForwardGraphs,
    GraphPool,
    GreedyDecodeGraphs,
    HiddenRows,
    RowInputs,
    _NoEvent,
    batch_inputs,
    bucket,
    pack_rows,
    row_layout,
    unpack_rows,
)


class RopeTables:
    """``cos, sin [max_position, D]`` in the model dtype, by `llama.rope_cos_sin` (bitwise the same values)."""

    def __init__(self, max_position: int, head_dim: int, theta: float, dtype: torch.dtype, device) -> None:
        positions = torch.arange(max_position, device=device)
        self.cos, self.sin = rope_cos_sin(positions, head_dim, theta, dtype)


def _feature_views(features: torch.Tensor | None, capture: Sequence[int], hidden: int) -> dict[int, torch.Tensor]:
    if features is None:
        return {}
    return {layer: features[:, j * hidden : (j + 1) * hidden] for j, layer in enumerate(capture)}


def llama_rows_forward(
    model: LlamaModel,
    ops: type[TorchOps],
    rope: RopeTables,
    kv: Sequence[LayerKV],
    inputs: RowInputs,
    hidden_in: torch.Tensor | None = None,
    *,
    num_layers: int | None = None,
    want_hidden: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`LlamaModel.forward` over `RowInputs`: ``(logits [R, V], hidden [T, F] | None)``, the logits float32 (the
    model dtype's rounding, widened) or, where ``inputs.logits_dtype`` is None, in the model's dtype.

    ``num_layers``: run the first layers only (layer skip). ``hidden`` holds the model's feature layers
    (`LlamaModel.feature_layers`; default the final-norm input) when ``want_hidden``.
    """
    c = model.config
    depth = c.num_layers if num_layers is None else num_layers
    capture = (depth,) if model.feature_layers is None else model.feature_layers
    rows = inputs.input_ids.shape[0]
    hidden_size, eps = c.hidden_size, c.rms_norm_eps
    features = None
    if want_hidden:
        features = torch.empty((rows, hidden_size * len(capture)), dtype=model.dtype, device=inputs.input_ids.device)
    views = _feature_views(features, capture, hidden_size)

    x = F.embedding(inputs.input_ids, model.embed_weight)  # [T, hidden]
    if ops.fold_norms:
        return _folded_layers(model, ops, rope, kv, inputs, x, depth, views, eps), features
    attend = _attend(ops, inputs)
    delta = None  # the previous layer's MLP output, added to x by the next norm
    for i in range(depth):
        layer = model.layers[i]
        k_cache, v_cache = kv[i]
        # (x + delta), RMSNorm, the QKV GEMM, RoPE and the KV write: one kernel with TritonOps
        # (`engine.kernels.linear_triton`)
        x, q = ops.norm_qkv_rope(x, delta, layer.input_norm.weight, eps, layer.qkv_weight, views.get(i),
                                 inputs.positions, rope.cos, rope.sin, inputs.out_slots, k_cache, v_cache,
                                 c.num_heads, c.num_kv_heads)  # fmt: skip
        attn = attend(q, k_cache, v_cache, inputs.row_request, inputs.prefix_lens, inputs.extra_slots,
                      inputs.page_table, inputs.page_size, inputs.kv_bound)  # fmt: skip
        o = ops.linear(attn.reshape(rows, c.num_heads * c.head_dim), layer.o_weight)
        # (x + o), RMSNorm, gate-up GEMM and SiLU-mul: one kernel with TritonOps
        x, act = ops.norm_gate_up_silu(x, o, layer.post_attention_norm.weight, eps, layer.gate_up_weight)
        delta = ops.linear(act, layer.down_weight)
    x, y = ops.add_rms_norm(x, delta, model.norm.weight, eps, views.get(depth))
    if inputs.logits_rows is not None:
        y = y.index_select(0, inputs.logits_rows)
    # the dtype's rounding, stored as float32 unless the caller takes the model's dtype (`RowInputs.logits_dtype`)
    logits = ops.linear(y, model.lm_head_weight, inputs.logits_dtype)
    return logits, features


def _fold_gain(weight: torch.Tensor, gain: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight * gain`` per input column, in float32, rounded to ``dtype`` once: an RMSNorm's gain folded into
    the GEMM after it."""
    return (weight.float() * gain.float()[None, :]).to(dtype).contiguous()


def fold_norm_weights(model: LlamaModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's QKV and gate-up weights with its norm's gain folded in (``W * g`` per input column, rounded
    to the model dtype once), kept on the model for `FoldedNormOps` (made on first use, outside any graph)."""
    folded = getattr(model, "folded_norm_weights", None)
    if folded is None:
        folded = [
            (_fold_gain(layer.qkv_weight, layer.input_norm.weight, model.dtype),
             _fold_gain(layer.gate_up_weight, layer.post_attention_norm.weight, model.dtype))
            for layer in model.layers
        ]  # fmt: skip
        model.folded_norm_weights = folded
    return folded


def _folded_layers(model, ops, rope, kv, inputs, x, depth, views, eps) -> torch.Tensor:
    """The layers with the norms folded (`kernels.fused_ops.FoldedNormOps`): per layer the QKV GEMM reads the residual
    stream itself (the gain in its weight), the RoPE kernel applies the row's RMS factor, the O GEMM adds
    into the residual (cuBLAS's ``beta = 1``), the gate-up GEMM reads it, the SiLU-mul kernel applies the
    factor, the down GEMM adds: 7 kernels a layer instead of 9, no norm kernel. Returns the logits."""
    c = model.config
    rows = x.shape[0]
    attend = _attend(ops, inputs)
    folded = getattr(model, "folded_norm_weights", None)
    if folded is None:
        raise RuntimeError(
            "FoldedNormOps: call fast.path.fold_norm_weights(model) before the first forward (outside a graph)"
        )
    for i in range(depth):
        layer = model.layers[i]
        k_cache, v_cache = kv[i]
        qkv_weight, gate_up_weight = folded[i]
        qkv = ops.linear(x, qkv_weight)
        # the RoPE kernel reads x for the folded norm's factor and, at a feature layer, copies it out: the
        # residual stream entering layer i (EAGLE-3's features), no copy launch of its own
        q = ops.rope_write_kv(qkv, inputs.positions, rope.cos, rope.sin, inputs.out_slots, k_cache, v_cache,
                              c.num_heads, c.num_kv_heads, x, eps, views.get(i))  # fmt: skip
        attn = attend(q, k_cache, v_cache, inputs.row_request, inputs.prefix_lens, inputs.extra_slots,
                      inputs.page_table, inputs.page_size, inputs.kv_bound)  # fmt: skip
        x = ops.linear_add(x, attn.reshape(rows, c.num_heads * c.head_dim), layer.o_weight)
        act = ops.silu_mul(ops.linear(x, gate_up_weight), x, eps)
        x = ops.linear_add(x, act, layer.down_weight)
    if depth in views:
        views[depth].copy_(x)
    y = ops.rms_norm(x, model.norm.weight, eps)
    if inputs.logits_rows is not None:
        y = y.index_select(0, inputs.logits_rows)
    return ops.linear(y, model.lm_head_weight, inputs.logits_dtype)


def eagle_rows_forward(
    draft: EagleDraft,
    ops: type[TorchOps],
    rope: RopeTables,
    inputs: RowInputs,
    hidden_in: torch.Tensor | None,
    *,
    from_target: bool,
    draft_vocab: bool = False,
    logits: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`EagleDraft.extend` (``from_target``: ``hidden_in`` are target features) or `.step` over `RowInputs`.

    ``draft_vocab``: a head with its own LM head returns its logits over the draft vocabulary (``[R, Vd]``,
    column ``j`` the target token ``head.draft_to_target[j]``; `ModelOutput.vocab_map`) instead of scattering
    them into a ``-inf`` row of the target vocabulary (two launches and a 16x wider top-K).
    ``logits``: False runs the head's layers alone (`EagleDraft.extend_hidden`): the logits returned are empty
    (``[0, 0]``), no final norm, no LM head (`eagle_head_logits` computes them later from the hidden state).
    """
    head = draft.head
    c = head.config
    if c.version != 1 and ops.fold_norms:
        out = _folded_eagle3_layer(draft, ops, rope, inputs, hidden_in.to(head.dtype), from_target=from_target)
    else:
        out = _eagle_layer(draft, ops, rope, inputs, hidden_in.to(head.dtype), from_target=from_target)
    for layer, cache in zip(head.extra_layers, draft.extra_kv):
        out = _eagle_extra_layer(layer, cache, c, ops, rope, inputs, out)
    if not logits:
        return out.new_empty((0, 0), dtype=torch.float32), out
    picked = out if inputs.logits_rows is None else out.index_select(0, inputs.logits_rows)
    return eagle_head_logits(draft, ops, picked, draft_vocab), out


def eagle_head_logits(draft: EagleDraft, ops: type[TorchOps], picked: torch.Tensor, draft_vocab: bool) -> torch.Tensor:
    """The head's logits of hidden states ``picked [R, H]`` as `eagle_rows_forward` computes them: the final norm
    and the LM head (the head's, over the draft vocabulary where ``draft_vocab``; else the target's), float32."""
    head, target = draft.head, draft.target_model
    c = head.config
    eps = c.rms_norm_eps
    if c.target_lm_head:  # EAGLE-1, or EAGLE-3 over the target's norm and LM head: [R, V]
        target_eps = target.config.rms_norm_eps
        _, logits = ops.norm_linear(picked, None, target.norm.weight, target_eps, target.lm_head_weight,
                                    out_dtype=torch.float32)  # fmt: skip
        return logits
    lm_head = draft.gemms.lm_head
    q = _int8_for(lm_head, picked.shape[0])
    if q is not None:
        small = int8_linear(ops.rms_norm(picked, head.norm.weight, eps), q, torch.float32)  # [R, Vd]
    else:
        _, small = ops.norm_linear(picked, None, head.norm.weight, eps, _dense(lm_head), out_dtype=torch.float32)
    if draft_vocab:
        return small
    logits = small.new_full((small.shape[0], draft.vocab_size), float("-inf"))
    logits.index_copy_(1, head.draft_to_target, small)
    return logits


def _eagle_layer(draft, ops, rope, inputs: RowInputs, x: torch.Tensor, *, from_target: bool) -> torch.Tensor:
    """The head's layer, norms as kernels: its output hidden state ``[T, H]``."""
    head, target = draft.head, draft.target_model
    c = head.config
    rows, eps = inputs.input_ids.shape[0], c.rms_norm_eps
    embed = F.embedding(inputs.input_ids, target.embed_weight)
    if c.version == 1:
        x = ops.linear(torch.cat([embed, x], -1), head.fc)
        attn_in, norm_weight = x, head.input_norm.weight  # normed in the QKV kernel
    else:
        if from_target:
            x = ops.linear(_fc_input(head, x), head.fc)  # [T, 3H] -> [T, H]
        attn_in = torch.cat(
            [ops.rms_norm(embed, head.embed_norm.weight, eps), ops.rms_norm(x, head.hidden_norm.weight, eps)], -1
        )
        norm_weight = None
    k_cache, v_cache = draft.kv
    _, q = ops.norm_qkv_rope(attn_in, None, norm_weight, eps, head.qkv, None, inputs.positions, rope.cos, rope.sin,
                             inputs.out_slots, k_cache, v_cache, c.num_heads, c.num_kv_heads)  # fmt: skip
    attn = _attend(ops, inputs)(q, k_cache, v_cache, inputs.row_request, inputs.prefix_lens, inputs.extra_slots,
                                inputs.page_table, inputs.page_size, inputs.kv_bound)  # fmt: skip
    o = ops.linear(attn.reshape(rows, c.num_heads * c.head_dim), head.o)
    h, act = ops.norm_gate_up_silu(x, o, head.post_norm.weight, eps, head.gate_up)
    return h + ops.linear(act, head.down)  # [T, H]


def _attend(ops, inputs: RowInputs):
    """The attention of ``inputs``' rows: the prefill kernel for a prompt's rows (`RowInputs.prefill`: the target's
    prefill, and the draft extend over its prompt), the decode's kernel otherwise."""
    return ops.prefill_attention if inputs.prefill else ops.attention


def _eagle_extra_layer(layer, cache: LayerKV, c, ops, rope, inputs: RowInputs, x: torch.Tensor) -> torch.Tensor:
    """A deeper head's layer ``i >= 1`` (`EagleConfig.num_layers`): a Llama decoder layer over ``[T, H]``, as
    `llama_rows_forward` runs one (the norms unfolded, whatever the ops fold)."""
    rows, eps = x.shape[0], c.rms_norm_eps
    k_cache, v_cache = cache
    x, q = ops.norm_qkv_rope(x, None, layer.input_norm.weight, eps, layer.qkv_weight, None, inputs.positions,
                             rope.cos, rope.sin, inputs.out_slots, k_cache, v_cache, c.num_heads,
                             c.num_kv_heads)  # fmt: skip
    attn = _attend(ops, inputs)(q, k_cache, v_cache, inputs.row_request, inputs.prefix_lens, inputs.extra_slots,
                                inputs.page_table, inputs.page_size, inputs.kv_bound)  # fmt: skip
    o = ops.linear(attn.reshape(rows, c.num_heads * c.head_dim), layer.o_weight)
    h, act = ops.norm_gate_up_silu(x, o, layer.post_attention_norm.weight, eps, layer.gate_up_weight)
    return h + ops.linear(act, layer.down_weight)  # [T, H]


def fold_head_weights(head) -> torch.Tensor:
    """An EAGLE-3 head's gate-up weight with its post-attention norm's gain folded in (`fold_norm_weights`'s
    rule), kept on the head for `FoldedNormOps` (made on first use, outside any graph)."""
    folded = getattr(head, "folded_gate_up", None)
    if folded is None:
        folded = head.folded_gate_up = _fold_gain(head.gate_up, head.post_norm.weight, head.dtype)
    return folded


def _fc_input(head, features: torch.Tensor) -> torch.Tensor:
    """The target features as ``fc`` reads them: through a published head's feature norms (EAGLE-3.1's per-layer
    ``fc_norm``, speculators' ``norm_before_fc``: `EagleConfig.feature_norm`), unchanged without one."""
    if head.config.feature_norm is None:
        return features
    return normalize_features(features, head.config, lambda name: head.feature_norms[name.replace(".", "__")])


def _folded_eagle3_layer(draft, ops, rope, inputs: RowInputs, x: torch.Tensor, *, from_target: bool) -> torch.Tensor:
    """The EAGLE-3 head's layer with `FoldedNormOps`: one kernel for the embedding, the two input norms and
    their concatenation (`kernels.fused_ops.eagle_input_triton`, which also copies the residual stream), the O and
    down GEMMs adding into that copy in place, the post-attention norm folded into the gate-up GEMM (its
    row factor applied by the SiLU-mul kernel): 9 kernels up to the final norm instead of 14. Its GEMMs read
    ``draft.gemms`` (`HeadGemms`: the head's weights, or their int8 forms)."""
    head, target, w = draft.head, draft.target_model, draft.gemms
    c = head.config
    rows, eps = inputs.input_ids.shape[0], c.rms_norm_eps
    if from_target:
        x = _linear(ops, _fc_input(head, x), w.fc)  # [T, 3H] -> [T, H]
    attn_in, residual = ops.eagle_input(inputs.input_ids, target.embed_weight, x, head.embed_norm.weight,
                                        head.hidden_norm.weight, eps)  # fmt: skip
    k_cache, v_cache = draft.kv
    q = ops.rope_write_kv(_linear(ops, attn_in, w.qkv), inputs.positions, rope.cos, rope.sin, inputs.out_slots,
                          k_cache, v_cache, c.num_heads, c.num_kv_heads)  # fmt: skip
    attn = _attend(ops, inputs)(q, k_cache, v_cache, inputs.row_request, inputs.prefix_lens, inputs.extra_slots,
                                inputs.page_table, inputs.page_size, inputs.kv_bound)  # fmt: skip
    residual = _linear_add(ops, residual, attn.reshape(rows, c.num_heads * c.head_dim), w.o)
    act = ops.silu_mul(_linear(ops, residual, w.gate_up), residual, eps)
    return _linear_add(ops, residual, act, w.down)  # [T, H]


def _int8_for(weight, rows: int) -> Int8Rowwise | None:
    """The int8 form to multiply ``rows`` rows by, or None: the weight's dense tensor (`DraftWeight`)."""
    return weight.int8 if isinstance(weight, DraftWeight) and rows <= INT8_MAX_ROWS else None


def _dense(weight) -> torch.Tensor:
    return weight.dense if isinstance(weight, DraftWeight) else weight


def _linear(ops, x: torch.Tensor, weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    q = _int8_for(weight, x.shape[0])
    return int8_linear(x, q, out_dtype) if q is not None else ops.linear(x, _dense(weight), out_dtype)


def _linear_add(ops, x: torch.Tensor, a: torch.Tensor, weight) -> torch.Tensor:
    q = _int8_for(weight, a.shape[0])
    return int8_linear_add(x, a, q) if q is not None else ops.linear_add(x, a, _dense(weight))


# ---- a draft head's GEMM weights -------------------------------------------------------------------
# What an EAGLE head's GEMMs read on the fast path (`FastOptions.draft_weights`, ``SPECCYCLE_DRAFT_WEIGHTS``): ``int8``
# (`engine.kernels.int8_linear`: the head's weights in `drafters.eagle_storage`'s int8-rowwise form, half the bytes),
# ``dtype`` (the head's own) or ``auto`` (the default: int8 on CUDA for a bfloat16 or float16 EAGLE-3 head under an op
# set that folds it, such as `kernels.fused_ops.FoldedNormOps`, CUDA's default; the head's dtype elsewhere, float32
# heads included). The draft only proposes, so each keeps the output the target's.
DRAFT_WEIGHTS = ("auto", "int8", "dtype")
# Rows up to which a draft GEMM reads the int8 form: a draft step's (1 a chain, K a tree's level, per request) and an
# extend's. Above, the head's own weights through cuBLAS: `int8_linear`'s 64-row tiles lost to it (an 8B-shaped head's
# draft level at 48 / 64 / 128 rows 322 / 319 / 513 µs against 207 / 204 / 225, H200, bench/results/
# int8_linear_bench-H200-45124da-manyrows-*), while at 32 it still won (196 against 285, H100,
# int8_linear_bench-H100-274181b-default-*).
INT8_MAX_ROWS = 32


@attrs.frozen(eq=False)
class DraftWeight:
    """A head's GEMM weight twice: its `int8_linear.Int8Rowwise` form (read up to `INT8_MAX_ROWS` rows) and the head's
    own tensor (``dense``, not a copy: read above)."""

    int8: Int8Rowwise
    dense: torch.Tensor


def draft_weights_choice(asked: str | None = None) -> str:
    """``asked`` (`FastOptions`' ``draft_weights``), else ``SPECCYCLE_DRAFT_WEIGHTS``, else ``auto``; refused with the
    choices unless one of `DRAFT_WEIGHTS`."""
    choice = asked or os.environ.get("SPECCYCLE_DRAFT_WEIGHTS") or "auto"
    if choice not in DRAFT_WEIGHTS:
        source = "draft_weights" if asked else "SPECCYCLE_DRAFT_WEIGHTS"
        raise ValueError(f"{source}={choice!r}: choose one of {', '.join(DRAFT_WEIGHTS)}, or leave it unset")
    return choice


def int8_form(head, name: str, weight: torch.Tensor) -> Int8Rowwise:
    """The int8 form of the head's GEMM weight ``name`` (``weight``), made once per head: engines accelerated over one
    head share it (an 8B-shaped head's forms are 0.42 GB). Made again when the weight is another tensor or was
    changed in place since (its version counter)."""
    try:
        version = weight._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        version = None
    key = (weight.data_ptr(), version, tuple(weight.shape), weight.dtype, weight.device)
    cache = head.__dict__.setdefault("int8_forms", {})
    held = cache.get(name)
    if held is None or held[0] != key:
        held = cache[name] = (key, Int8Rowwise.from_weight(weight))
    return held[1]


@attrs.frozen(eq=False)
class HeadGemms:
    """The weights an EAGLE head's fast forward multiplies by: the head's tensors, or (``int8``) `DraftWeight`s (their
    `int8_linear.Int8Rowwise` forms beside them). ``gate_up`` is the folded one (`fold_head_weights`) where the ops
    fold the head; ``lm_head`` is None for a head over the target's LM head (the target's weight, never quantized). A
    deeper head's layers past the first keep the head's dtype (`_eagle_extra_layer`). ``kind``: ``int8`` or
    ``dtype``."""

    kind: str
    fc: object
    qkv: object
    o: object
    gate_up: object
    down: object
    lm_head: object

    @classmethod
    def of(cls, head, ops: type[TorchOps], draft_weights: str, device: torch.device) -> HeadGemms:
        c = head.config
        draft_weights = draft_weights_choice(draft_weights)
        folds = ops.fold_norms and c.version != 1
        if draft_weights == "auto":  # the fast path's half-precision heads on CUDA (a float32 head: a parity run)
            half = head.dtype in (torch.bfloat16, torch.float16)
            draft_weights = "int8" if folds and half and torch.device(device).type == "cuda" else "dtype"
        if draft_weights == "int8" and not folds:
            raise ValueError(
                f"draft_weights='int8' runs the folded EAGLE-3 layer (an op set with fold_norms, such as "
                f"kernels.fused_ops.FoldedNormOps, CUDA's default); this head is EAGLE-{c.version} under "
                f"{ops.__name__}: pass draft_weights='dtype' (or SPECCYCLE_DRAFT_WEIGHTS=dtype)"
            )
        gate_up = fold_head_weights(head) if folds else head.gate_up
        weights = dict(fc=head.fc, qkv=head.qkv, o=head.o, gate_up=gate_up, down=head.down,
                       lm_head=None if c.target_lm_head else head.lm_head)  # fmt: skip
        if draft_weights == "int8":
            weights = {n: None if w is None else DraftWeight(int8_form(head, n, w), w) for n, w in weights.items()}
        return cls(draft_weights, **weights)

    @property
    def int8_bytes(self) -> int:
        """Bytes of the int8 forms (held beside the head's own weights; 0 for ``dtype``)."""
        return sum(w.int8.nbytes for w in attrs.astuple(self, recurse=False)[1:] if isinstance(w, DraftWeight))


# ---- options -------------------------------------------------------------------------------------
class FastOptions:
    """How the fast path runs. ``ops``: `kernels.fused_ops.TorchOps` or `kernels.fused_ops.TritonOps` (default per
    device).

    ``min_target_rows``: the smallest row bucket of target forwards; the engine sets it to the verify
    rows of one request (``N``) so decode and verify share GEMM shapes (see `engine.fast.graphs`).
    ``graph_pool``: the CUDA graph memory pool of the engine these options accelerate (`accelerate`
    makes one set of options per engine): its target, draft and decode graphs are captured into it,
    and it keeps them alive until the engine and its options are dropped (`graphs.GraphPool`).
    ``draft_weights``: what an EAGLE head's GEMMs read, ``int8`` (`engine.kernels.int8_linear`, half the bytes),
    ``dtype`` (the head's own weights) or ``auto`` (int8 on CUDA for a half-precision EAGLE-3 head, folded ops);
    None: `draft_weights_choice` (``SPECCYCLE_DRAFT_WEIGHTS``, else auto). The output is the target's either
    way; int8 may move acceptance (measured in docs/fast_engine.md).
    """

    def __init__(
        self,
        device,
        graphs: bool = True,
        ops: type[TorchOps] | None = None,
        max_rows: int = 512,
        max_requests: int = 128,
        max_extra: int = 64,
        min_target_rows: int = 1,
        max_decode_steps: int = 4096,
        draft_weights: str | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.graphs = graphs
        self.ops = ops or default_ops(self.device)
        self.max_rows, self.max_requests, self.max_extra = max_rows, max_requests, max_extra
        self.min_target_rows = min_target_rows
        self.max_decode_steps = max_decode_steps
        self.graph_pool = GraphPool(self.device)
        # the library of the fast path's GEMMs (`blas_scope`), CUDA only
        blas = blas_choice()  # refused before anything is swapped, on any device
        self.blas = blas if self.device.type == "cuda" else None
        # an EAGLE head's GEMM weights (`HeadGemms`): None takes the environment's or auto
        self.draft_weights = draft_weights_choice(draft_weights)

    def runner(self, compute, pool: PagedKVPool, vocab_size: int, hidden_in=None, hidden_dtype=torch.float32,
               min_rows: int = 1, summarize: bool = False) -> ForwardGraphs:  # fmt: skip
        return ForwardGraphs(
            compute,
            device=self.device,
            num_slots=pool.num_slots,
            page_size=pool.page_size,
            vocab_size=vocab_size,
            hidden_in=hidden_in,
            hidden_dtype=hidden_dtype,
            max_rows=self.max_rows,
            max_requests=self.max_requests,
            max_extra=self.max_extra,
            min_rows=min_rows,
            graphs=self.graphs,
            needs_kv_bound=self.ops.needs_kv_bound,
            graph_pool=self.graph_pool,
            summarize=summarize,
        )


def _rope_for(model_or_head, pool: PagedKVPool, head_dim: int, theta: float, dtype, max_position: int) -> RopeTables:
    return RopeTables(max(max_position, pool.num_slots) + 1, head_dim, theta, dtype, pool.device)


# ---- the draft loop ---------------------------------------------------------------------------------------


class GraphedDraftLevels(DraftCapabilities):
    """Runs the cycle's greedy draft loop (`statemachine.transitions.draft_levels`) as one CUDA graph.

    One graph per key ``(bs bucket, S, K, N, fed hidden?)``: the loop's inputs (``L``, page table,
    draft slots, the first level's top-K and hidden state) are copied into static buffers padded to
    the bucket (a padding request has ``L = 0`` and draft slots ``-1``: it writes no KV), the whole
    loop of ``S - 1`` draft forwards, top-K and EAGLE-2 rescoring replays at once, and its outputs are
    cloned out. While the loop is captured the draft's ``step`` runs its forward directly on the
    loop's tensors. Without CUDA (or with ``graphs=False``) the same code runs eagerly over the same
    padded buffers (what the CPU tests check).

    The static inputs are views of one int64 buffer (``topk_p`` a float32 view of it), so inputs that
    live on the host cross in one copy: `run_draft_levels_on_host` (the host control plane) fills
    its pinned twin, copies it over once, gathers the fed hidden states on the device, replays a
    second graph of the same loop that also packs its outputs into one tensor (`graphs.pack_rows`),
    and brings that back in one device-to-host copy.
    """

    def _init_levels(self, pool: PagedKVPool, options: FastOptions, hidden_width: int | None) -> None:
        self._levels: dict[tuple, dict] = {}
        self._in_levels = False
        self._levels_width = math.ceil(pool.num_slots / pool.page_size)
        self._levels_page_size = pool.page_size
        self._levels_hidden = hidden_width
        self.level_runs = 0  # loops run over the static buffers (replayed or eager)

    def _direct(self, batch: ForwardBatch, hidden: torch.Tensor | None, graphs: ForwardGraphs) -> ModelOutput:
        """The forward on the batch's own tensors (inside the loop's capture: no buffers, no clone)."""
        bound = self._levels_width * self._levels_page_size
        logits, out_hidden = graphs.compute(batch_inputs(batch, bound), hidden)
        return ModelOutput(logits=logits, hidden=out_hidden)

    def _levels_entry(self, L, page_table, cfg, hidden_dtype: torch.dtype | None) -> dict | None:
        """The static buffers of this loop's key; None when the batch does not fit them (or capture failed)."""
        bs, width = L.shape[0], page_table.shape[1]
        rows = bucket(bs)
        if rows is None or rows > self.options.max_requests or width > self._levels_width:
            return None
        # draft_floor too: a chain's depth scores are [bs, S] under a floor, [bs, 1] without (`draft_levels`)
        key = (rows, cfg.num_steps, cfg.topk, cfg.num_draft_tokens, cfg.draft_floor, hidden_dtype is not None)
        entry = self._levels.get(key)
        if entry is None:
            entry = self._levels[key] = self._level_buffers(rows, cfg, hidden_dtype, self.options.device)
        return None if entry.get("failed") else entry

    def run_draft_levels(self, fn, ports, backend, cfg, ids, L, page_table, draft_slots, topk_p, topk_index,
                         draft_hidden):  # fmt: skip
        bs, width = L.shape[0], page_table.shape[1]
        entry = self._levels_entry(L, page_table, cfg, None if draft_hidden is None else draft_hidden.dtype)
        if entry is None:
            return fn(ports, backend, cfg, ids, L, page_table, draft_slots, topk_p, topk_index, draft_hidden)
        b = entry["inputs"]
        b["L"][:bs].copy_(L)
        b["table"][:bs, :width].copy_(page_table)
        b["slots"][:bs].copy_(draft_slots)
        b["topk_p"][:bs].copy_(topk_p)
        b["topk_index"][:bs].copy_(topk_index)
        if draft_hidden is not None:
            b["hidden"][:bs].copy_(draft_hidden)
        if entry["bs"] != bs:  # padding requests: L 0, no slot; untouched while bs stays the same
            b["L"][bs:].zero_()
            b["slots"][bs:].fill_(-1)
            b["topk_p"][bs:].fill_(1.0)
            b["topk_index"][bs:].zero_()
            entry["bs"] = bs
        outputs = self._replay_levels(entry, fn, ports, backend, cfg, ids, L.device, pack=False)
        if outputs is None:  # not captured: run it on the batch's own tensors
            return fn(ports, backend, cfg, ids, L, page_table, draft_slots, topk_p, topk_index, draft_hidden)
        return tuple(out[:bs].clone() for out in outputs)

    def run_draft_levels_on_host(self, fn, ports, backend, cfg, ids, L, page_table, draft_slots, topk_p, topk_index,
                                 draft_hidden: HiddenRows | None, first_level: torch.Tensor | None = None):  # fmt: skip
        """`run_draft_levels` for inputs on the host; returns the loop's outputs on the host.

        ``ports`` and ``backend``: the device's (the loop runs there). ``draft_hidden``: the rows of the
        draft's output on the device that feed the first level (`graphs.HiddenRows`, rows on the host).
        ``first_level``: the first level's top-K still on the device, ``[bs, 2K]`` packed (probabilities,
        then ids; `graphs.pack_rows`), in place of ``topk_p`` and ``topk_index``; or ``topk_p`` and ``topk_index``
        themselves on the device (a draft extend's `ModelOutput.topk`).
        One host-to-device copy of the inputs, one graph, one device-to-host copy of the outputs.
        """
        bs, width, k = L.shape[0], page_table.shape[1], cfg.topk
        device = self.options.device
        on_device = first_level is None and topk_p.device.type != "cpu"  # the extend's top-K, left where it is
        hidden_dtype = None if draft_hidden is None else draft_hidden.source.dtype
        entry = self._levels_entry(L, page_table, cfg, hidden_dtype)
        if entry is None:  # too big for the static buffers: the loop on the device, eagerly
            if first_level is not None:
                topk_p, topk_index = first_level[:, :k].float(), first_level[:, k:].long()
            move = [t.to(device) for t in (L, page_table, draft_slots, topk_p, topk_index)]
            hidden = None if draft_hidden is None else draft_hidden.gather(draft_hidden.source.dtype)
            with torch.no_grad():
                outputs = fn(ports, backend, cfg, ids, *move, hidden)
            return unpack_rows(pack_rows(outputs).cpu(), row_layout(outputs))
        b = entry["inputs"]
        stage = self._level_staging(entry)
        stage["done"].synchronize()  # the previous copy out of the staging buffer has finished
        s = stage["views"]
        s["L"][:bs] = L
        s["L"][bs:] = 0  # padding requests: L 0, no slot
        s["slots"][:bs] = draft_slots
        s["slots"][bs:] = -1
        if first_level is None and not on_device:
            s["topk_p"][:bs] = topk_p
            s["topk_index"][:bs] = topk_index
        s["topk_p"][bs:] = 1.0
        s["topk_index"][bs:] = 0
        if draft_hidden is not None:
            s["hidden_rows"][:bs] = draft_hidden.rows
        s["table"][:bs, :width] = page_table
        s["table"][:bs, width:] = -1
        end = entry["table_offset"] + bs * self._levels_width  # everything up to the last live table row
        entry["packed"][:end].copy_(stage["packed"][:end], non_blocking=True)
        stage["done"].record()
        entry["bs"] = bs  # the copy rewrote the padding rows
        if first_level is not None:  # after the copy, on the device
            b["topk_p"][:bs].copy_(first_level[:, :k])
            b["topk_index"][:bs].copy_(first_level[:, k:])
        elif on_device:
            b["topk_p"][:bs].copy_(topk_p)
            b["topk_index"][:bs].copy_(topk_index)
        if draft_hidden is not None:
            b["hidden"][:bs].copy_(draft_hidden.source.index_select(0, b["hidden_rows"][:bs]))
        packed = self._replay_levels(entry, fn, ports, backend, cfg, ids, device, pack=True)
        if packed is None:  # not captured: on the device, eagerly
            return self.run_draft_levels_on_host(fn, ports, backend, cfg, ids, L, page_table, draft_slots, topk_p,
                                                 topk_index, draft_hidden, first_level)  # fmt: skip
        return unpack_rows(packed[:bs].cpu(), entry["layout"])  # the loop's one sync

    def _replay_levels(self, entry, fn, ports, backend, cfg, ids, device, pack: bool):
        """Run the loop over the entry's static buffers (replay its graph; eager without CUDA graphs).

        ``pack``: return the outputs packed into one float64 tensor (`graphs.pack_rows`), else as they come.
        None when the capture failed (the entry is marked, and the caller runs the loop on its own tensors).
        """
        b, rows = entry["inputs"], entry["inputs"]["L"].shape[0]
        static = (ports, backend, cfg, tuple(ids) + (-1,) * (rows - len(ids)), b["L"], b["table"], b["slots"],
                  b["topk_p"], b["topk_index"], b.get("hidden"))  # fmt: skip

        def loop(*args):
            outputs = fn(*args)
            entry["layout"] = row_layout(outputs)
            return pack_rows(outputs) if pack else outputs

        name = "packed_graph" if pack else "graph"
        if not (self.options.graphs and torch.device(device).type == "cuda"):  # the same buffers, eagerly
            self._in_levels = True
            try:
                with torch.no_grad():
                    outputs = loop(*static)
            finally:
                self._in_levels = False
            self.level_runs += 1
            return outputs
        if name not in entry:
            try:
                entry[name], entry[name + "_outputs"] = self._capture_levels(loop, static, device)
            except RuntimeError as err:  # a backend op that syncs cannot be captured: stay eager
                entry["failed"] = True
                warnings.warn(f"draft loop not captured ({err}); running it eagerly", stacklevel=3)
                return None
        entry[name].replay()
        self.level_runs += 1
        return entry[name + "_outputs"]

    def _level_buffers(self, rows, cfg, hidden_dtype, device) -> dict:
        """Static inputs as views of one int64 buffer (`_level_views`); the fed hidden state beside it."""
        layout = self._level_layout(rows, cfg)
        packed = torch.zeros(layout["total"], dtype=torch.long, device=device)
        inputs = self._level_views(packed, layout)
        inputs["table"].fill_(-1)
        inputs["slots"].fill_(-1)
        inputs["topk_p"].fill_(1.0)
        if hidden_dtype is not None:
            inputs["hidden"] = torch.zeros((rows, self._levels_hidden), dtype=hidden_dtype, device=device)
        return {"inputs": inputs, "packed": packed, "layout_in": layout, "table_offset": layout["table"][0], "bs": rows}

    def _level_layout(self, rows, cfg) -> dict:
        """Offsets (int64 elements) of each static input in the packed buffer; the table last."""
        k, steps = cfg.topk, cfg.num_steps
        sizes = {"L": rows, "slots": rows * (steps - 1) * k, "topk_index": rows * k, "topk_p": -(-rows * k // 2),
                 "hidden_rows": rows, "table": rows * self._levels_width}  # fmt: skip
        layout, start = {"rows": rows, "k": k, "steps": steps}, 0
        for name, size in sizes.items():
            layout[name] = (start, size)
            start += size
        layout["total"] = start
        return layout

    def _level_views(self, packed: torch.Tensor, layout: dict) -> dict:
        rows, k, steps = layout["rows"], layout["k"], layout["steps"]

        def part(name):
            start, size = layout[name]
            return packed[start : start + size]

        return {
            "L": part("L"),
            "slots": part("slots").view(rows, steps - 1, k),
            "topk_index": part("topk_index").view(rows, k),
            "topk_p": part("topk_p").view(torch.float32)[: rows * k].view(rows, k),
            "hidden_rows": part("hidden_rows"),
            "table": part("table").view(rows, self._levels_width),
        }

    def _level_staging(self, entry) -> dict:
        """The host twin of the entry's packed inputs (pinned on CUDA), made on first use."""
        if "staging" not in entry:
            pin = entry["packed"].device.type == "cuda"
            packed = torch.empty(entry["packed"].shape, dtype=torch.long, pin_memory=pin)
            entry["staging"] = {
                "packed": packed,
                "views": self._level_views(packed, entry["layout_in"]),
                "done": torch.cuda.Event() if pin else _NoEvent(),
            }
        return entry["staging"]

    def _capture_levels(self, fn, static, device):
        self._in_levels = True
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), torch.no_grad():
                fn(*static)  # warm-up: the same draft KV writes the replay repeats
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with self.options.graph_pool.capture(graph), torch.no_grad():
                outputs = fn(*static)
        finally:
            self._in_levels = False
        return graph, outputs


# ---- ports ---------------------------------------------------------------------------------------
class FastTarget(StaticForwards, LlamaTarget):
    """`LlamaTarget` whose forward runs through static buffers and CUDA graphs; ``forward_static`` runs it on the
    batch's own tensors, inside a cycle an executor captures (`core.ports.StaticForwards`)."""

    def __init__(self, target: LlamaTarget, pool: PagedKVPool, options: FastOptions) -> None:
        super().__init__(target.model, target.kv)
        self.device = target.device
        self.options = options
        c = target.model.config
        self.rope = _rope_for(target.model, pool, c.head_dim, c.rope_theta, target.model.dtype, c.max_position)
        if options.ops.fold_norms:
            fold_norm_weights(target.model)
        compute = functools.partial(self._compute, want_hidden=True)
        # summarize: every forward also hands over its rows' argmax and finiteness (inside the graph),
        # so the cycle never reduces the logits itself (`core.ports.ModelOutput`).
        self.graphs = options.runner(compute, pool, c.vocab_size, min_rows=options.min_target_rows, summarize=True)

    def _compute(self, inputs: RowInputs, hidden_in=None, *, want_hidden: bool = True):
        with blas_scope(self.options.blas):
            return llama_rows_forward(self.model, self.options.ops, self.rope, self.kv, inputs,
                                      want_hidden=want_hidden)  # fmt: skip

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        return self.graphs(batch)

    def forward_static(self, batch: ForwardBatch, kv_bound: int) -> ModelOutput:
        logits, hidden = self._compute(batch_inputs(batch, kv_bound), want_hidden=True)
        return ModelOutput(logits=logits, hidden=hidden)


class FastLlamaDraft(GraphedDraftLevels, LlamaDraft):
    """`LlamaDraft` (layer skip or a smaller model) through static buffers and CUDA graphs."""

    def __init__(self, draft: LlamaDraft, pool: PagedKVPool, options: FastOptions) -> None:
        self.model, self.num_layers, self.vocab_size, self.kv = (
            draft.model,
            draft.num_layers,
            draft.vocab_size,
            draft.kv,
        )
        c = self.model.config
        self.options = options
        self.rope = _rope_for(self.model, pool, c.head_dim, c.rope_theta, self.model.dtype, c.max_position)
        if options.ops.fold_norms:
            fold_norm_weights(self.model)
        self.graphs = options.runner(self._compute, pool, c.vocab_size)
        self._init_levels(pool, options, None)

    def _compute(self, inputs: RowInputs, hidden_in=None):
        with blas_scope(self.options.blas):
            return llama_rows_forward(self.model, self.options.ops, self.rope, self.kv, inputs,
                                      num_layers=self.num_layers, want_hidden=False)  # fmt: skip

    def _forward(self, batch: ForwardBatch) -> ModelOutput:
        if self._in_levels:
            return ModelOutput(logits=self._direct(batch, None, self.graphs).logits, hidden=None)
        return ModelOutput(logits=self.graphs(batch).logits, hidden=None)

    def extend_reduced(self, batch: ForwardBatch, target_hidden, reduce) -> tuple[ModelOutput, torch.Tensor | None]:
        """`extend`, and ``reduce(logits)`` computed inside its graph (`graphs.ForwardGraphs.run`)."""
        out, reduced = self.graphs.run(batch, None, reduce)
        return ModelOutput(logits=out.logits, hidden=None), reduced


class FastEagleDraft(StaticForwards, GraphedDraftLevels, EagleDraft):
    """`EagleDraft` through static buffers and CUDA graphs: one runner for extends, one for steps; ``step_static``
    and ``extend_static`` run on the batch's own tensors, logits over the head's vocabulary
    (`core.ports.StaticForwards`)."""

    def __init__(self, draft: EagleDraft, pool: PagedKVPool, options: FastOptions) -> None:
        self.head, self.target_model, self.vocab_size, self.kv, self.extra_kv = (
            draft.head,
            draft.target_model,
            draft.vocab_size,
            draft.kv,
            draft.extra_kv,
        )
        c = self.head.config
        self.options = options
        self.gemms = HeadGemms.of(self.head, options.ops, options.draft_weights, options.device)  # folds where ops do
        max_position = self.target_model.config.max_position
        self.rope = _rope_for(self.head, pool, c.head_dim, c.rope_theta, self.head.dtype, max_position)
        features = self.target_model.feature_size()
        extend = functools.partial(self._compute, from_target=True)
        layers = functools.partial(self._compute, from_target=True, logits=False)
        step = functools.partial(self._compute, from_target=False)
        self.extend_graphs = options.runner(extend, pool, self.vocab_size, features, self.head.dtype)
        # the extend of a cycle of S == 0: the head's layers alone (`extend_hidden`), graphs of their own
        self.extend_hidden_graphs = options.runner(layers, pool, self.vocab_size, features, self.head.dtype)
        self.step_graphs = options.runner(step, pool, self.vocab_size, c.hidden_size, self.head.dtype)
        self._init_levels(pool, options, c.hidden_size)

    def _compute(self, inputs: RowInputs, hidden_in, *, from_target: bool, draft_vocab: bool = False,
                 logits: bool = True):  # fmt: skip
        with blas_scope(self.options.blas):
            return eagle_rows_forward(self, self.options.ops, self.rope, inputs, hidden_in, from_target=from_target,
                                      draft_vocab=draft_vocab, logits=logits)  # fmt: skip

    @property
    def vocab_map(self) -> torch.Tensor | None:
        """The draft-to-target id map of ``_compute(..., draft_vocab=True)``'s logits; None: the head's logits
        cover the target vocabulary (EAGLE-1, or EAGLE-3 over the target's LM head)."""
        return None if self.head.config.target_lm_head else self.head.draft_to_target

    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor | HiddenRows | None) -> ModelOutput:
        return self.extend_reduced(batch, target_hidden, None)[0]

    def extend_reduced(self, batch: ForwardBatch, target_hidden, reduce) -> tuple[ModelOutput, torch.Tensor | None]:
        """`extend`, and ``reduce(logits)`` computed inside its graph (`graphs.ForwardGraphs.run`).

        ``target_hidden``: the features, or `graphs.HiddenRows` of them (gathered on the device).
        """
        if target_hidden is None:
            raise ValueError("an EAGLE draft extend needs the target's features")
        return self.extend_graphs.run(batch, self._fed(target_hidden), reduce)

    def extend_hidden(self, batch: ForwardBatch, target_hidden: torch.Tensor | HiddenRows | None) -> torch.Tensor:
        """`extend` without its logits: the head's layers (they write the draft KV), their hidden state ``[T, H]``
        (`core.ports.DraftCapabilities`), through graphs of their own."""
        if target_hidden is None:
            raise ValueError("an EAGLE draft extend needs the target's features")
        batch = attrs.evolve(batch, logits_rows=None)  # no logits rows to pick (a chunked run joins none)
        return self.extend_hidden_graphs.run(batch, self._fed(target_hidden))[0].hidden

    def logits_from_hidden(self, hidden: torch.Tensor) -> ModelOutput:
        """The logits `extend` computes for rows of hidden state ``hidden [R, H]`` (the head's final norm and LM head
        over the target vocabulary, `eagle_head_logits`), eagerly: a batch moving to a shape that drafts. The rows
        are padded to the bucket `extend`'s graphs take its logits rows at: the GEMMs run at the same shape, so each
        row's logits are the same bits."""
        rows = hidden.shape[0]
        padded = bucket(max(rows, 1)) or rows
        x = hidden.to(self.head.dtype)
        if padded > rows:
            x = torch.cat([x, x.new_zeros((padded - rows, x.shape[1]))])
        with torch.no_grad(), blas_scope(self.options.blas):
            logits = eagle_head_logits(self, self.options.ops, x, draft_vocab=False)
        return ModelOutput(logits=logits[:rows], hidden=None)

    def extend_hidden_static(self, batch: ForwardBatch, target_hidden: torch.Tensor, kv_bound: int) -> torch.Tensor:
        """`extend_hidden` on the batch's own tensors, inside a captured cycle (`core.ports.StaticForwards`)."""
        _, out = self._compute(batch_inputs(batch, kv_bound), target_hidden, from_target=True, logits=False)
        return out

    def step(self, batch: ForwardBatch, parent_hidden: torch.Tensor | HiddenRows | None) -> ModelOutput:
        if parent_hidden is None:
            raise ValueError("an EAGLE draft step needs its parent's hidden state")
        if self._in_levels:
            return self._direct(batch, parent_hidden.to(self.head.dtype), self.step_graphs)
        return self.step_graphs(batch, self._fed(parent_hidden))

    def step_static(self, batch: ForwardBatch, parent_hidden: torch.Tensor, kv_bound: int) -> ModelOutput:
        return self._static(batch, parent_hidden, kv_bound, from_target=False)

    def extend_static(self, batch: ForwardBatch, target_hidden: torch.Tensor, kv_bound: int) -> ModelOutput:
        return self._static(batch, target_hidden, kv_bound, from_target=True)

    def _static(self, batch: ForwardBatch, hidden: torch.Tensor, kv_bound: int, *, from_target: bool) -> ModelOutput:
        inputs = batch_inputs(batch, kv_bound)
        logits, out = self._compute(inputs, hidden, from_target=from_target, draft_vocab=True)
        return ModelOutput(logits=logits, hidden=out, vocab_map=self.vocab_map)

    def _fed(self, hidden: torch.Tensor | HiddenRows) -> torch.Tensor | HiddenRows:
        return hidden if isinstance(hidden, HiddenRows) else hidden.to(self.head.dtype)


class FastGreedyDecoder:
    """Autoregressive greedy decoding: a (graph or eager) prefill, then one graph replay per token."""

    def __init__(self, target: FastTarget, pool: PagedKVPool, options: FastOptions) -> None:
        self.target, self.pool, self.options = target, pool, options
        compute = functools.partial(target._compute, want_hidden=False)
        self.loop = GreedyDecodeGraphs(
            compute,
            device=options.device,
            num_slots=pool.num_slots,
            page_size=pool.page_size,
            max_batch=min(options.max_requests, BUCKETS[-1]),
            max_steps=options.max_decode_steps,
            min_rows=options.min_target_rows,
            graphs=options.graphs,
            needs_kv_bound=options.ops.needs_kv_bound,
            graph_pool=options.graph_pool,
        )

    def decode(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        first_request_id: int = 0,
    ) -> list[list[int]]:
        """The output of `greedy.greedy_decode` (each request cut at its first stop token or the limit)."""
        from ..greedy import extend_batch

        request_ids = [first_request_id + i for i in range(len(prompts))]
        lengths = [len(p) for p in prompts]
        try:
            for rid, n in zip(request_ids, lengths):
                self.pool.allocate(rid, n + max_new_tokens)
            batch = extend_batch(self.pool, request_ids, prompts, [0] * len(prompts), prefill=True)
            first = self.target.forward(batch).logits.argmax(dim=-1)  # [bs]
            device = self.pool.device
            rest = self.loop.decode(
                self.pool.page_table(request_ids),
                first,
                torch.tensor(lengths, dtype=torch.long, device=device),
                max_new_tokens - 1,
                tuple(stop_token_ids),
            )
            first_list = first.tolist()
        finally:
            for rid in request_ids:
                if self.pool.has_request(rid):
                    self.pool.free(rid)
        stops = set(stop_token_ids)
        outputs = []
        for b in range(len(prompts)):
            out = []
            for token in [first_list[b], *rest[b].tolist()]:
                out.append(token)
                if token in stops or len(out) >= max_new_tokens:
                    break
            outputs.append(out)
        return outputs


BLAS_LIBRARIES = ("cublaslt", "cublas", "torch")
# The fast path's GEMMs on CUDA: cuBLASLt. On an H100 at the 8B shape it runs a 32-row verify's O and down projections
# as one kernel each (no split-K reduce) and the 32-node tree's cycle ~2% faster than torch's default (cuBLAS), the
# chain, the plain decode and SmolLM2 the same (a98c48f, process-wide: overhead factor 1.456 / 1.452 -> 1.438 /
# 1.432, bench/results/gpu_bench-H100-scale-20261126-a98c48f-blas-*; 84ba1d3, scoped: 1.451 -> 1.427 / 1.432, the
# cycle 8,664 / 8,657 -> 8,476 / 8,499 µs, gpu_bench-H100-scale-20261126-eefbb4f-blas-*,
# scale_profile-H100-20261126-eefbb4f/blas-*); with it the bfloat16 fast path's speculative output is the autoregressive
# output on all 240 dev prompts (ngram S5, EAGLE S5, S6 K4 N24, S7 K6 N32; gpu_bench-H100-lossless-46a9139-*).
DEFAULT_BLAS = "cublaslt"


def blas_choice() -> str:
    """``SPECCYCLE_BLAS``: the BLAS library of the fast path's GEMMs on CUDA, `DEFAULT_BLAS` when unset; ``torch``
    leaves torch's process-wide preference alone. An unknown name is refused with the choices."""
    blas = os.environ.get("SPECCYCLE_BLAS") or DEFAULT_BLAS
    if blas not in BLAS_LIBRARIES:
        raise ValueError(f"SPECCYCLE_BLAS={blas!r}: choose one of {', '.join(BLAS_LIBRARIES)}, or unset it")
    return blas


@contextlib.contextmanager
def blas_scope(blas: str | None):
    """torch's preferred BLAS library set to ``blas`` for the forwards inside (every fast-path forward, eager or
    captured: decode, verify and draft all take the same library, so their rows keep agreeing), and put back
    after: the host engine's own GEMMs keep torch's setting. ``None`` or ``torch``: nothing is changed. A graph
    keeps the kernels it was captured with."""
    if blas in (None, "torch"):
        yield
        return
    backends = torch.backends.cuda
    before = backends.preferred_blas_library()
    want = getattr(torch._C._BlasBackend, "Cublaslt" if blas == "cublaslt" else "Cublas")
    if before == want:
        yield
        return
    backends.preferred_blas_library(want)
    try:
        yield
    finally:
        backends.preferred_blas_library(before)


def accelerate(
    engine,
    graphs: bool = True,
    ops: type[TorchOps] | None = None,
    host_control: bool | None = None,
    fused: bool = True,
    **options,
) -> None:
    """Swap the engine's target, forward draft and autoregressive decoder for the fast ones.

    ``min_target_rows`` defaults to the engine's ``N``, so decode and verify share GEMM shapes.
    ``host_control``: run the cycles it serves with their records on the host (`engine.fast.host_control`);
    None: on a GPU. ``fused``: greedy EAGLE and n-gram cycles (chain or tree) run as one graph each
    (`engine.fast.fused_cycle`; an n-gram draft's proposals are made on the host before each cycle).
    """
    architecture = engine.model.config.architecture
    if architecture != "llama":
        raise ValueError(
            f"the fast path (fast=True) runs Llama-architecture models; {architecture} needs QK-norm, four norms per "
            f"layer, GeGLU, sliding-window attention and per-layer RoPE bases, which its kernels lack: use fast=False"
        )
    options.setdefault("min_target_rows", engine.spec.num_draft_tokens)
    opts = FastOptions(engine.model.device, graphs=graphs, ops=ops, **options)
    engine.target = FastTarget(engine.target, engine.pool, opts)
    if isinstance(engine.draft, EagleDraft):
        engine.draft = FastEagleDraft(engine.draft, engine.pool, opts)
    elif isinstance(engine.draft, LlamaDraft):
        engine.draft = FastLlamaDraft(engine.draft, engine.pool, opts)
    engine.fast_decoder = FastGreedyDecoder(engine.target, engine.pool, opts)
    lookup = engine.draft is not None and kind_of(engine.draft) == "lookup"
    if fused and (isinstance(engine.draft, FastEagleDraft) or lookup):
        engine.fused_cycles = FusedCycles(engine.target, engine.draft, engine.pool, engine.spec, opts)
    engine.fast_options = opts
    engine.host_control = opts.device.type == "cuda" if host_control is None else bool(host_control)
