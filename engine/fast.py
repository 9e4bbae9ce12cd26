"""The fast forward path: static-buffer row forwards, CUDA graphs, fused kernels, a graph-stepped decode.

`llama_rows_forward` and `eagle_rows_forward` are the forwards of `LlamaModel` and `EagleHead` over
`graphs.RowInputs`, written for capture: no host sync, shapes fixed by the inputs, the fused ops of
`engine.kernels` (RMSNorm with the residual add, RoPE with the KV write, SiLU-and-mul) and the paged
row attention of `engine.attention_triton`; Q/K/V and gate/up are the models' concatenated weights
(``qkv_weight``, ``gate_up_weight``), so each layer runs 4 GEMMs. Per layer: norm, QKV, RoPE + KV
write, attention, O, add + norm, gate-up, SiLU-mul, down: 9 kernels.

The port implementations wrap the reference ones and keep their weights, caches and contracts:

* `FastTarget` (a `LlamaTarget`): ``forward(batch)`` through `graphs.ForwardGraphs`.
* `FastLlamaDraft` (layer skip, smaller model) and `FastEagleDraft`: ``extend`` and ``step`` likewise.
* `FastGreedyDecoder`: the engine's autoregressive baseline, one graph replay per token.

`accelerate(engine)` swaps them into an `Engine`. The plain-torch modules stay the reference; the
fast path is tested equal to them (tests/unit/test_fast_path.py, bench/gpu_check.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..core.ports import ForwardBatch, ModelOutput
from .drafters.eagle import EagleDraft
from .drafters.layerskip import LlamaDraft
from .graphs import BUCKETS, ForwardGraphs, GreedyDecodeGraphs, RowInputs
from .kernels import TorchOps, default_ops
from .kv_pool import LayerKV, PagedKVPool
from .llama import LlamaModel, rope_cos_sin
from .target import LlamaTarget


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
    """`LlamaModel.forward` over `RowInputs`: ``(logits [R, V] float32, hidden [T, F] | None)``.

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
    delta = None
    for i in range(depth):
        layer = model.layers[i]
        if delta is None:
            if i in views:
                views[i].copy_(x)
            y = ops.rms_norm(x, layer.input_norm.weight, eps)
        else:
            x, y = ops.add_rms_norm(x, delta, layer.input_norm.weight, eps, views.get(i))
        qkv = F.linear(y, layer.qkv_weight)  # [T, (H + 2Hkv) D]
        k_cache, v_cache = kv[i]
        q = ops.rope_write_kv(qkv, inputs.positions, rope.cos, rope.sin, inputs.out_slots, k_cache, v_cache,
                              c.num_heads, c.num_kv_heads)  # fmt: skip
        attn = ops.attention(q, k_cache, v_cache, inputs.row_request, inputs.prefix_lens, inputs.extra_slots,
                             inputs.page_table, inputs.page_size, inputs.kv_bound)  # fmt: skip
        o = F.linear(attn.reshape(rows, c.num_heads * c.head_dim), layer.o_weight)
        x, y = ops.add_rms_norm(x, o, layer.post_attention_norm.weight, eps)
        delta = F.linear(ops.silu_mul(F.linear(y, layer.gate_up_weight)), layer.down_weight)
    x, y = ops.add_rms_norm(x, delta, model.norm.weight, eps, views.get(depth))
    if inputs.logits_rows is not None:
        y = y.index_select(0, inputs.logits_rows)
    logits = F.linear(y, model.lm_head_weight).float()
    return logits, features


def eagle_rows_forward(
    draft: EagleDraft,
    ops: type[TorchOps],
    rope: RopeTables,
    inputs: RowInputs,
    hidden_in: torch.Tensor | None,
    *,
    from_target: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`EagleDraft.extend` (``from_target``: ``hidden_in`` are target features) or `.step` over `RowInputs`."""
    head, target = draft.head, draft.target_model
    c = head.config
    rows = inputs.input_ids.shape[0]
    eps = c.rms_norm_eps
    embed = F.embedding(inputs.input_ids, target.embed_weight)
    x = hidden_in.to(head.dtype)
    if c.version == 1:
        x = F.linear(torch.cat([embed, x], -1), head.fc)
        attn_in = ops.rms_norm(x, head.input_norm.weight, eps)
    else:
        if from_target:
            x = F.linear(x, head.fc)  # [T, 3H] -> [T, H]
        attn_in = torch.cat(
            [ops.rms_norm(embed, head.embed_norm.weight, eps), ops.rms_norm(x, head.hidden_norm.weight, eps)], -1
        )
    qkv = F.linear(attn_in, head.qkv)
    k_cache, v_cache = draft.kv
    q = ops.rope_write_kv(qkv, inputs.positions, rope.cos, rope.sin, inputs.out_slots, k_cache, v_cache,
                          c.num_heads, c.num_kv_heads)  # fmt: skip
    attn = ops.attention(q, k_cache, v_cache, inputs.row_request, inputs.prefix_lens, inputs.extra_slots,
                         inputs.page_table, inputs.page_size, inputs.kv_bound)  # fmt: skip
    h, y = ops.add_rms_norm(
        x, F.linear(attn.reshape(rows, c.num_heads * c.head_dim), head.o), head.post_norm.weight, eps
    )
    out = h + F.linear(ops.silu_mul(F.linear(y, head.gate_up)), head.down)  # [T, H]
    picked = out if inputs.logits_rows is None else out.index_select(0, inputs.logits_rows)
    if c.version == 1:
        logits = F.linear(ops.rms_norm(picked, target.norm.weight, target.config.rms_norm_eps), target.lm_head_weight)
        return logits.float(), out
    small = F.linear(ops.rms_norm(picked, head.norm.weight, eps), head.lm_head).float()  # [R, Vd]
    logits = small.new_full((small.shape[0], draft.vocab_size), float("-inf"))
    logits.index_copy_(1, head.draft_to_target, small)
    return logits, out


# ---- options -------------------------------------------------------------------------------------
class FastOptions:
    """How the fast path runs. ``ops``: `kernels.TorchOps` or `kernels.TritonOps` (default per device).

    ``min_target_rows``: the smallest row bucket of target forwards; the engine sets it to the verify
    rows of one request (``N``) so decode and verify share GEMM shapes (see `engine.graphs`).
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
    ) -> None:
        self.device = torch.device(device)
        self.graphs = graphs
        self.ops = ops or default_ops(self.device)
        self.max_rows, self.max_requests, self.max_extra = max_rows, max_requests, max_extra
        self.min_target_rows = min_target_rows
        self.max_decode_steps = max_decode_steps

    def runner(self, compute, pool: PagedKVPool, vocab_size: int, hidden_in=None, hidden_dtype=torch.float32,
               min_rows: int = 1) -> ForwardGraphs:  # fmt: skip
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
        )


def _rope_for(model_or_head, pool: PagedKVPool, head_dim: int, theta: float, dtype, max_position: int) -> RopeTables:
    return RopeTables(max(max_position, pool.num_slots) + 1, head_dim, theta, dtype, pool.device)


# ---- ports ---------------------------------------------------------------------------------------
class FastTarget(LlamaTarget):
    """`LlamaTarget` whose forward runs through static buffers and CUDA graphs."""

    def __init__(self, target: LlamaTarget, pool: PagedKVPool, options: FastOptions) -> None:
        super().__init__(target.model, target.kv)
        self.device = target.device
        self.options = options
        c = target.model.config
        self.rope = _rope_for(target.model, pool, c.head_dim, c.rope_theta, target.model.dtype, c.max_position)
        compute = functools.partial(self._compute, want_hidden=True)
        self.graphs = options.runner(compute, pool, c.vocab_size, min_rows=options.min_target_rows)

    def _compute(self, inputs: RowInputs, hidden_in=None, *, want_hidden: bool = True):
        return llama_rows_forward(self.model, self.options.ops, self.rope, self.kv, inputs, want_hidden=want_hidden)

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        return self.graphs(batch)


class FastLlamaDraft(LlamaDraft):
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
        self.graphs = options.runner(self._compute, pool, c.vocab_size)

    def _compute(self, inputs: RowInputs, hidden_in=None):
        return llama_rows_forward(self.model, self.options.ops, self.rope, self.kv, inputs,
                                  num_layers=self.num_layers, want_hidden=False)  # fmt: skip

    def _forward(self, batch: ForwardBatch) -> ModelOutput:
        return ModelOutput(logits=self.graphs(batch).logits, hidden=None)


class FastEagleDraft(EagleDraft):
    """`EagleDraft` through static buffers and CUDA graphs: one runner for extends, one for steps."""

    def __init__(self, draft: EagleDraft, pool: PagedKVPool, options: FastOptions) -> None:
        self.head, self.target_model, self.vocab_size, self.kv = (
            draft.head,
            draft.target_model,
            draft.vocab_size,
            draft.kv,
        )
        c = self.head.config
        self.options = options
        max_position = self.target_model.config.max_position
        self.rope = _rope_for(self.head, pool, c.head_dim, c.rope_theta, self.head.dtype, max_position)
        features = self.target_model.feature_size()
        extend = functools.partial(self._compute, from_target=True)
        step = functools.partial(self._compute, from_target=False)
        self.extend_graphs = options.runner(extend, pool, self.vocab_size, features, self.head.dtype)
        self.step_graphs = options.runner(step, pool, self.vocab_size, c.hidden_size, self.head.dtype)

    def _compute(self, inputs: RowInputs, hidden_in, *, from_target: bool):
        return eagle_rows_forward(self, self.options.ops, self.rope, inputs, hidden_in, from_target=from_target)

    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> ModelOutput:
        if target_hidden is None:
            raise ValueError("an EAGLE draft extend needs the target's features")
        return self.extend_graphs(batch, target_hidden.to(self.head.dtype))

    def step(self, batch: ForwardBatch, parent_hidden: torch.Tensor | None) -> ModelOutput:
        if parent_hidden is None:
            raise ValueError("an EAGLE draft step needs its parent's hidden state")
        return self.step_graphs(batch, parent_hidden.to(self.head.dtype))


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
        )

    def decode(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        first_request_id: int = 0,
    ) -> list[list[int]]:
        """The output of `greedy.greedy_decode` (each request cut at its first stop token or the limit)."""
        from .greedy import extend_batch

        request_ids = [first_request_id + i for i in range(len(prompts))]
        lengths = [len(p) for p in prompts]
        try:
            for rid, n in zip(request_ids, lengths):
                self.pool.allocate(rid, n + max_new_tokens)
            batch = extend_batch(self.pool, request_ids, prompts, [0] * len(prompts))
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


def accelerate(engine, graphs: bool = True, ops: type[TorchOps] | None = None, **options) -> None:
    """Swap the engine's target, forward draft and autoregressive decoder for the fast ones.

    ``min_target_rows`` defaults to the engine's ``N``, so decode and verify share GEMM shapes.
    """
    options.setdefault("min_target_rows", engine.spec.num_draft_tokens)
    opts = FastOptions(engine.model.device, graphs=graphs, ops=ops, **options)
    engine.target = FastTarget(engine.target, engine.pool, opts)
    if isinstance(engine.draft, EagleDraft):
        engine.draft = FastEagleDraft(engine.draft, engine.pool, opts)
    elif isinstance(engine.draft, LlamaDraft):
        engine.draft = FastLlamaDraft(engine.draft, engine.pool, opts)
    engine.fast_decoder = FastGreedyDecoder(engine.target, engine.pool, opts)
    engine.fast_options = opts
