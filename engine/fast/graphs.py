"""Static buffers and CUDA graphs for model forwards: one graph per row bucket, replayed per batch.

`ForwardGraphs` runs a forward function over a `ForwardBatch` the way a captured CUDA graph needs it:

1. the batch's ``T`` rows are padded to a bucket ``Tb`` (`BUCKETS`, at least ``min_rows``) and copied,
   with one ``torch.cat(..., out=)``, into a packed static int64 buffer; the page table is copied
   into a static ``[max_requests, W]`` buffer (``W`` pages: the whole pool), the fed hidden states
   into a static ``[max_rows, F]`` buffer;
2. the forward runs over views of those buffers: on CUDA a graph captured for the key
   ``(Tb, M, Rb, hidden in?)`` (``Rb``: the bucket of the logits rows, 0 for all rows; a prefill's pad to
   `PREFILL_LOGIT_BUCKETS`, so that `prefill_shapes` meets all its keys) is replayed
   (captured on first use), otherwise (or with ``graphs=False``) the same function runs eagerly on
   the same buffers;
3. the outputs (``logits [R, V]``, ``hidden [T, F]``) are cloned out of the graph's memory.

A batch may live on the host (the host control plane, `engine.fast.host_control`): its rows are packed
into pinned staging buffers and cross in one copy. The fed hidden states may be given as
`HiddenRows`, rows of a tensor already on the device (the target's features, a draft's own
output): the row indices cross with the batch and the rows are gathered on the device. A call may
also ask for a `Reduction` of the logits computed inside the graph (`ForwardGraphs.run`), so that
only a few numbers per row need to leave the device.

A padding row reads token 0 at position 0, writes no KV (``out_slot = -1``) and attends nothing
(``prefix_len = 0``, no extra slot); its output is dropped. The forward function never writes its
inputs, so a replay leaves every input buffer as it found it, positions included (SGLang once
advanced positions inside a captured graph). Inside the captured region there is no host sync, no
data-dependent shape and no branch on a tensor value: the attention kernel reads each row's key
count from ``prefix_lens`` and ``extra_slots`` (see `attention_triton`).

A batch of more rows than the buffers hold (a long prefill) runs as consecutive replays of at most ``max_rows``
rows (`ForwardGraphs._chunked`): each chunk writes its KV before the next attends it. Batches that do not fit
otherwise (more requests, extra slots or pages than the buffers hold) run eagerly on the batch's own tensors.

Graphs are captured into a `GraphPool` that keeps them alive and dies with its owner (an engine), never
into a process-wide pool handle: see `GraphPool` for why (a retired pool asserts in the allocator).

`GreedyDecodeGraphs` captures one autoregressive decode step that also picks the next token: two
graphs per bucket read ``(ids, positions, step)`` from one set of buffers and write the next
``(ids, positions, step)`` to the other, so decoding is one replay per token and no graph ever
changes its own inputs.

Numerics. With ``min_rows`` at least the verify rows of one request (``N``), a decode forward and a
verify forward of one request both run at ``Tb = bucket(N)`` rows: the same GEMM shapes, the same
per-row kernels, hence bitwise-equal logits for the same token at the same position. That is what
keeps greedy speculative output identical to autoregressive output in bfloat16 at batch 1.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Callable

import attrs
import torch

from ...core.ports import ForwardBatch, ModelOutput
from ..kernels import decode_step

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket(rows: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket holding ``rows`` rows; None when none does."""
    i = bisect.bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else None


# A prefill's logits rows (one per request: its last row) pad to one of these, and to at most the prefill's row
# bucket: a few graphs a row bucket, which `serving.Scheduler.warm_up` captures before serving (`prefill_shapes`),
# where a bucket per request count met mid-serving captured a new graph (18-50 ms on an H200) in the middle of
# admissions. The padding rows' logits cost a few microseconds of LM head.
PREFILL_LOGIT_BUCKETS = (8, 32, 128, 256, 512)  # past 128: only where ``max_requests`` allows that many


def logit_bucket(rows: int, logit_rows: int, prefill: bool) -> int | None:
    """The logits-rows bucket of a forward of ``rows`` (bucketed) rows that wants ``logit_rows`` logits rows; None
    when none holds them within its rows (the forward runs eagerly)."""
    if prefill:
        wanted = bucket(max(logit_rows, 1), PREFILL_LOGIT_BUCKETS)
        wanted = None if wanted is None else min(wanted, rows)
    else:
        wanted = bucket(max(logit_rows, 1))
    return wanted if wanted is not None and logit_rows <= wanted <= rows else None


def prefill_shapes(max_rows: int, max_requests: int) -> list[tuple[int, int]]:
    """``(rows, requests)`` of prefills that between them meet every graph key a prefill of up to ``max_requests``
    requests can take at up to ``max_rows`` rows a replay (a longer prefill replays chunks of ``max_rows`` rows):
    every row bucket with each of its logits-rows buckets."""
    shapes = set()
    for rows in BUCKETS:
        if rows > max_rows:
            break
        for top in PREFILL_LOGIT_BUCKETS:
            requests = min(rows, top, max_requests)
            if logit_bucket(rows, requests, prefill=True) is not None:
                shapes.add((rows, requests))
    return sorted(shapes)


@attrs.frozen(eq=False)
class RowInputs:
    """What a row forward reads. Shapes: ``T`` rows, ``M`` extra slots, ``bs`` page-table rows."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    row_request: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64, -1: write no KV
    prefix_lens: torch.Tensor  # [T] int64
    extra_slots: torch.Tensor  # [T, M] int64, -1 padded
    page_table: torch.Tensor  # [bs, W] int64
    page_size: int
    kv_bound: int  # bound on prefix_lens (the torch attention gathers this many positions)
    logits_rows: torch.Tensor | None  # [R] int64 rows whose logits are wanted; None: all rows
    prefill: bool = False  # `ForwardBatch.prefill`: the forward may attend with the prefill kernel
    logits_dtype: torch.dtype | None = torch.float32  # `ForwardBatch.logits_dtype` (None: the model's dtype)


# compute(inputs, hidden_in) -> (logits [R or T, V] float32 (the model's dtype where inputs.logits_dtype is None),
#                              hidden [T, F] or None)
Compute = Callable[[RowInputs, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]
# reduction(logits [R, V]) -> [R, X]: computed inside the graph; hashable (it is part of the graph's key)
Reduction = Callable[[torch.Tensor], torch.Tensor]


@attrs.frozen(eq=False)
class HiddenRows:
    """Fed hidden states given as rows of a tensor on the forward's device: ``source[rows]``.

    Shapes: ``source [S, F]`` (on the device), ``rows [T]`` int64 on the batch's device (a host batch:
    the CPU; the indices then cross with the batch's rows, and the gather runs on the device).
    """

    source: torch.Tensor  # [S, F]
    rows: torch.Tensor  # [T] int64

    def gather(self, dtype: torch.dtype) -> torch.Tensor:
        """``source[rows]`` in ``dtype`` on the source's device (an eager forward's path)."""
        return self.source.index_select(0, self.rows.to(self.source.device)).to(dtype)


def pack_rows(tensors) -> torch.Tensor:
    """Tensors of ``R`` rows (int64 up to 2^53, float32, bool) side by side in one float64 ``[R, X]``: exact.

    One tensor, so one device-to-host copy brings all of them; `unpack_rows` undoes it.
    """
    return torch.cat([t.reshape(t.shape[0], -1).to(torch.float64) for t in tensors], dim=1)


def row_layout(tensors) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """What `unpack_rows` needs to know of the packed tensors: each one's shape past the rows and dtype."""
    return tuple((tuple(t.shape[1:]), t.dtype) for t in tensors)


def unpack_rows(packed: torch.Tensor, layout) -> tuple[torch.Tensor, ...]:
    """The tensors `pack_rows` packed, as laid out by `row_layout`. Shapes: ``packed [R, X]``."""
    out, start = [], 0
    for shape, dtype in layout:
        width = math.prod(shape)
        out.append(packed[:, start : start + width].to(dtype).reshape(packed.shape[0], *shape))
        start += width
    return tuple(out)


class GraphPool:
    """A CUDA graph memory pool and every graph captured into it, owned by whoever captures into it.

    Graphs captured into one pool share its memory: safe here, since they run one at a time on one
    stream and what a graph returns is cloned out of the pool before any other graph runs. An engine
    shares one `GraphPool` among its target, draft and decode graphs (`fast.path.FastOptions.graph_pool`);
    a `ForwardGraphs` or `GreedyDecodeGraphs` built without one gets its own.

    Lifetime: the caching allocator counts the live graphs of a pool (its ``use_count``); when the
    last one is destroyed the pool is retired, and a later capture into the same handle fails with
    ``use_count > 0 INTERNAL ASSERT FAILED``. So a pool handle must never outlive its graphs (a
    module-global handle does, once an engine is dropped and a new one captures). Here the pool
    keeps every graph captured into it, and the handle lives exactly as long as the pool object:
    dropping the last owner frees the graphs and the handle together, and a new owner takes a new
    pool. A capture that fails before any graph lives in the pool takes a fresh handle next time.
    The handle is made on first capture, so building a pool touches no CUDA state.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._handle = None
        self._graphs: list = []

    @property
    def num_graphs(self) -> int:
        """Graphs captured into this pool (kept alive by it)."""
        return len(self._graphs)

    @contextlib.contextmanager
    def capture(self, graph):
        """``torch.cuda.graph(graph, pool=<this pool>)``; the graph is kept once its capture ends well."""
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=self._handle):
                yield graph
        except BaseException:
            if not self._graphs:  # no live graph holds the pool: never capture into this handle again
                self._handle = None
            raise
        self._graphs.append(graph)


class _NoEvent:
    def synchronize(self) -> None:
        pass

    def record(self) -> None:
        pass


def batch_to(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """The batch with its tensors on ``device`` (itself when they are there already)."""
    if batch.input_ids.device.type == torch.device(device).type:
        return batch
    move = {
        name: getattr(batch, name).to(device)
        for name in ("input_ids", "positions", "row_request", "out_slots", "prefix_lens", "extra_slots", "page_table")
    }
    if batch.logits_rows is not None:
        move["logits_rows"] = batch.logits_rows.to(device)
    return attrs.evolve(batch, **move)


def batch_inputs(batch: ForwardBatch, kv_bound: int) -> RowInputs:
    """The batch's own tensors as `RowInputs` (the eager path)."""
    return RowInputs(
        input_ids=batch.input_ids,
        positions=batch.positions,
        row_request=batch.row_request,
        out_slots=batch.out_slots,
        prefix_lens=batch.prefix_lens,
        extra_slots=batch.extra_slots,
        page_table=batch.page_table,
        page_size=batch.page_size,
        kv_bound=kv_bound,
        logits_rows=batch.logits_rows,
        prefill=batch.prefill,
        logits_dtype=batch.logits_dtype,
    )


class ForwardGraphs:
    """Static buffers and per-bucket CUDA graphs around ``compute`` (module docstring).

    ``num_slots`` and ``page_size``: the KV pool's; the static page table holds every page of it.
    ``hidden_in``: width of the hidden states fed with the rows (a draft's target features or parent
    states), None if none. ``graphs``: capture on CUDA (False: the same buffers, eagerly).
    ``needs_kv_bound``: ``compute`` gathers keys up to ``RowInputs.kv_bound`` (the torch attention).
    ``graph_pool``: the `GraphPool` to capture into (shared with other graphs of one owner); None: its own.
    ``summarize``: every forward also returns its rows' argmax and finiteness (`ModelOutput.greedy`, ``finite``).
    """

    def __init__(
        self,
        compute: Compute,
        *,
        device: torch.device | str,
        num_slots: int,
        page_size: int,
        vocab_size: int,
        hidden_in: int | None = None,
        hidden_dtype: torch.dtype = torch.float32,
        max_rows: int = 512,
        max_requests: int = 128,
        max_extra: int = 64,
        min_rows: int = 1,
        graphs: bool = True,
        needs_kv_bound: bool = False,
        graph_pool: GraphPool | None = None,
        summarize: bool = False,
        fused_step: bool | None = None,
    ) -> None:
        self.compute = compute
        self.summarize = summarize
        self.device = torch.device(device)
        # The step's bookkeeping as two Triton kernels around a Triton argmax (`engine.kernels.decode_step`);
        # default: on CUDA when triton imports. The plain-torch twins otherwise (the same integers).
        if fused_step is None:
            fused_step = self.device.type == "cuda" and decode_step.fused_available()
        self.fused_step = fused_step
        self.graph_pool = graph_pool if graph_pool is not None else GraphPool(self.device)
        self.page_size = page_size
        self.table_width = math.ceil(num_slots / page_size)
        self.max_rows = bucket(max_rows) or BUCKETS[-1]
        self.max_requests, self.max_extra = max_requests, max_extra
        self.min_rows = min_rows
        self.use_graphs = graphs and self.device.type == "cuda"
        self.needs_kv_bound = needs_kv_bound
        self.vocab_size = vocab_size
        self.hidden_dtype = hidden_dtype
        rows = self.max_rows
        long = dict(dtype=torch.long, device=self.device)
        # 5 per-row fields, the extra slots, the logits rows and the rows of `HiddenRows`
        self.packed = torch.zeros(rows * (7 + max_extra), **long)
        self.table = torch.full((max_requests, self.table_width), -1, **long)
        self.hidden = torch.zeros((rows, hidden_in), dtype=hidden_dtype, device=self.device) if hidden_in else None
        width = rows * max(max_extra, 1)
        self._zeros = torch.zeros(width, **long)
        self._minus = torch.full((width,), -1, **long)
        self._host: dict | None = None  # staging for batches that live on the host (`_load`)
        self._graphs: dict[tuple, tuple] = {}  # key -> (graph, logits, hidden, summary, reduced)
        self.replays = 0
        self.eager_calls = 0

    # ---- layout ----------------------------------------------------------------------------------
    def _views(self, rows: int, extra: int, logit_rows: int) -> RowInputs:
        """Views of the packed buffer for ``rows`` rows, ``extra`` extra slots, ``logit_rows`` logits rows (0: all)."""
        p = self.packed
        extra_view = p[5 * rows : 5 * rows + rows * extra].view(rows, extra)
        end = 5 * rows + rows * extra
        bound = self.table_width * self.page_size
        return RowInputs(
            input_ids=p[0:rows],
            positions=p[rows : 2 * rows],
            row_request=p[2 * rows : 3 * rows],
            out_slots=p[3 * rows : 4 * rows],
            prefix_lens=p[4 * rows : 5 * rows],
            extra_slots=extra_view,
            page_table=self.table,
            page_size=self.page_size,
            kv_bound=bound,
            logits_rows=p[end : end + logit_rows] if logit_rows else None,
        )

    def fits(self, batch: ForwardBatch, rows: bool = True) -> bool:
        """Whether the batch fits the static buffers (else it runs eagerly on its own tensors); ``rows=False``:
        whether it would but for its number of rows (`run` then replays it in chunks of ``max_rows`` rows)."""
        bs, width = batch.page_table.shape
        return (
            (batch.num_rows <= self.max_rows or not rows)
            and bs <= self.max_requests
            and width <= self.table_width
            and batch.extra_slots.shape[1] <= self.max_extra
            and batch.page_size == self.page_size
        )

    def _load(self, batch: ForwardBatch, rows: int, logit_rows: int, hidden_in) -> None:
        """Copy the batch into the static buffers, padding rows ``T .. rows - 1`` (logits rows to ``logit_rows``).

        ``hidden_in``: a tensor, or `HiddenRows` whose row indices travel in the packed copy.
        """
        t, m = batch.num_rows, batch.extra_slots.shape[1]
        pad = rows - t
        host = batch.input_ids.device.type != self.device.type
        pads = self._host_buffers() if host else {"zeros": self._zeros, "minus": self._minus}
        z, minus = pads["zeros"], pads["minus"]
        parts = [batch.input_ids, z[:pad], batch.positions, z[:pad], batch.row_request, z[:pad]]
        parts += [batch.out_slots, minus[:pad], batch.prefix_lens, z[:pad]]
        if m:
            parts += [batch.extra_slots.reshape(-1), minus[: pad * m]]
        if logit_rows:
            parts += [batch.logits_rows, z[: logit_rows - batch.logits_rows.shape[0]]]
        gather = isinstance(hidden_in, HiddenRows) and self.hidden is not None
        if gather:
            parts.append(hidden_in.rows)
        total = 5 * rows + rows * m + logit_rows + (t if gather else 0)
        bs, width = batch.page_table.shape
        if host:  # one host-to-device copy of the packed rows and one of the page table
            staging = self._host_buffers()
            staging["done"].synchronize()  # the previous copy out of the staging buffers has finished
            torch.cat(parts, out=staging["packed"][:total])
            staging["table"][:bs, :width].copy_(batch.page_table)
            staging["table"][:bs, width:] = -1  # whole rows: a contiguous copy (a strided one stages pageable memory)
            self.packed[:total].copy_(staging["packed"][:total], non_blocking=True)
            self.table[:bs].copy_(staging["table"][:bs], non_blocking=True)
            staging["done"].record()
        else:
            torch.cat(parts, out=self.packed[:total])
            self.table[:bs, :width].copy_(batch.page_table)
        if gather:  # the rows' indices arrived with the batch: gather on the device
            self.hidden[:t].copy_(hidden_in.source.index_select(0, self.packed[total - t : total]))
        elif self.hidden is not None and hidden_in is not None:
            self.hidden[:t].copy_(hidden_in)

    def _host_buffers(self) -> dict:
        """Host twins of the packed and page-table buffers (pinned on CUDA) and the padding rows."""
        if self._host is None:
            pin = self.device.type == "cuda"
            long = dict(dtype=torch.long, pin_memory=pin)
            self._host = {
                "packed": torch.empty(self.packed.shape, **long),
                "table": torch.empty(self.table.shape, **long),
                "zeros": torch.zeros(self._zeros.shape, dtype=torch.long),
                "minus": torch.full(self._minus.shape, -1, dtype=torch.long),
                "done": torch.cuda.Event() if pin else _NoEvent(),
            }
        return self._host

    # ---- running -----------------------------------------------------------------------------------
    def __call__(self, batch: ForwardBatch, hidden_in: torch.Tensor | HiddenRows | None = None) -> ModelOutput:
        return self.run(batch, hidden_in)[0]

    def run(
        self, batch: ForwardBatch, hidden_in: torch.Tensor | HiddenRows | None = None, reduce: Reduction | None = None
    ) -> tuple[ModelOutput, torch.Tensor | None]:
        """The forward, and ``reduce(logits)`` computed with it (inside the graph; None without ``reduce``)."""
        t = batch.num_rows
        rows = bucket(max(t, self.min_rows))
        if t > self.max_rows and self.fits(batch, rows=False):
            return self._chunked(batch, hidden_in, reduce)
        if t == 0 or rows is None or rows > self.max_rows or not self.fits(batch):
            return self._eager(batch, hidden_in, reduce)
        m = batch.extra_slots.shape[1]
        r = t if batch.logits_rows is None else batch.logits_rows.shape[0]
        logit_rows = 0 if batch.logits_rows is None else logit_bucket(rows, r, batch.prefill)
        if logit_rows is None:
            return self._eager(batch, hidden_in, reduce)
        self._load(batch, rows, logit_rows, hidden_in)
        inputs = self._views(rows, m, logit_rows)
        if batch.prefill:
            inputs = attrs.evolve(inputs, prefill=True)
        if not self.use_graphs and self.needs_kv_bound:  # no capture: a tight bound is allowed
            inputs = attrs.evolve(inputs, kv_bound=max(1, int(batch.prefix_lens.max())))
        hidden = None if self.hidden is None or hidden_in is None else self.hidden[:rows]
        if self.use_graphs:
            key = (rows, m, logit_rows, hidden is not None, reduce, batch.prefill)
            if key not in self._graphs:
                self._graphs[key] = self._capture(inputs, hidden, reduce)
            graph, logits, out_hidden, summary, reduced = self._graphs[key]
            graph.replay()
            self.replays += 1
        else:
            with torch.no_grad():
                logits, out_hidden, summary, reduced = self._run(inputs, hidden, reduce)
            self.eager_calls += 1
        out = ModelOutput(
            logits=logits[:r].clone(),
            hidden=None if out_hidden is None else out_hidden[:t].clone(),
            greedy=None if summary is None else summary[0, :r].clone(),
            finite=None if summary is None else summary[1, :r].bool(),
        )
        return out, None if reduced is None else reduced[:r].clone()

    def _chunked(self, batch: ForwardBatch, hidden_in, reduce: Reduction | None):
        """A batch of more than ``max_rows`` rows as consecutive graph replays of ``max_rows`` rows at most (a long
        prefill, chunked): chunk ``c`` runs every layer over its rows and writes their KV before chunk ``c + 1``
        runs, so a row attends its request's earlier rows from the pool whichever chunk wrote them (each row reads
        positions ``[0, prefix_len)`` through the page table). Hidden states come back by row. With ``logits_rows``
        (``R`` rows, a prefill's last row per request) every chunk computes ``R`` logits rows, each clamped into
        the chunk, and a row's logits come from the chunk that holds it: no host sync, one graph shape a chunk."""
        t, step = batch.num_rows, self.max_rows
        wanted = None if batch.logits_rows is None else batch.logits_rows.to(batch.input_ids.device)
        outs = []
        for lo in range(0, t, step):
            hi = min(lo + step, t)
            part = {f: getattr(batch, f)[lo:hi] for f in ("input_ids", "positions", "row_request", "out_slots",
                                                          "prefix_lens", "extra_slots")}  # fmt: skip
            held = None  # which of the batch's logits rows this chunk holds
            if wanted is not None:
                held = (wanted >= lo) & (wanted < hi)
                part["logits_rows"] = (wanted - lo).clamp(0, hi - lo - 1)
            hidden = hidden_in
            if isinstance(hidden_in, HiddenRows):
                hidden = HiddenRows(source=hidden_in.source, rows=hidden_in.rows[lo:hi])
            elif hidden_in is not None:
                hidden = hidden_in[lo:hi]
            outs.append((held, *self.run(attrs.evolve(batch, **part), hidden, reduce)))
        models = [o[1] for o in outs]

        def join(parts):
            if parts[0] is None:
                return None
            if wanted is None:  # every row's logits, chunk by chunk: in order
                return torch.cat(parts)
            out = parts[0]
            for (held, *_), part in zip(outs[1:], parts[1:]):
                held = held.to(part.device).view(-1, *([1] * (part.dim() - 1)))
                out = torch.where(held, part, out)
            return out

        out = ModelOutput(
            logits=join([m.logits for m in models]),
            hidden=None if models[0].hidden is None else torch.cat([m.hidden for m in models]),
            greedy=join([m.greedy for m in models]),
            finite=join([m.finite for m in models]),
        )
        return out, join([o[2] for o in outs])

    def _run(self, inputs: RowInputs, hidden: torch.Tensor | None, reduce: Reduction | None = None):
        """``compute``; with ``summarize`` its logits' ``[argmax; all finite]`` per row (``[2, R]`` int64);
        ``reduce(logits)`` when given."""
        logits, out_hidden = self.compute(inputs, hidden)
        summary = None
        if self.summarize:
            summary = torch.stack([logits.argmax(-1), torch.isfinite(logits).all(-1).long()])
        return logits, out_hidden, summary, None if reduce is None else reduce(logits)

    def _capture(self, inputs: RowInputs, hidden: torch.Tensor | None, reduce: Reduction | None = None):
        # Warm-up (compiles the Triton kernels, initializes cuBLAS): it computes what the replay
        # will, so its KV writes are the ones the replay repeats.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            self._run(inputs, hidden, reduce)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with self.graph_pool.capture(graph), torch.no_grad():
            outputs = self._run(inputs, hidden, reduce)
        return (graph, *outputs)

    def _eager(self, batch: ForwardBatch, hidden_in, reduce: Reduction | None = None):
        batch = batch_to(batch, self.device)
        if isinstance(hidden_in, HiddenRows):
            hidden_in = hidden_in.gather(self.hidden_dtype)
        bound = max(1, int(batch.prefix_lens.max())) if self.needs_kv_bound and batch.num_rows else 1
        with torch.no_grad():
            logits, hidden, summary, reduced = self._run(batch_inputs(batch, bound), hidden_in, reduce)
        self.eager_calls += 1
        out = ModelOutput(
            logits=logits,
            hidden=hidden,
            greedy=None if summary is None else summary[0],
            finite=None if summary is None else summary[1].bool(),
        )
        return out, reduced

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


class GreedyDecodeGraphs:
    """Autoregressive greedy decoding, one captured step per token (module docstring).

    ``compute`` is a target forward (`ForwardGraphs`' contract); it runs over ``Tb`` rows, one per
    request (``Tb = bucket(max(bs, min_rows))``), with causal attention, logits of every row, and the
    step writes ``argmax`` into the history ``[rows, max_steps]`` at column ``step``. ``graph_pool``:
    as for `ForwardGraphs`.
    """

    def __init__(
        self,
        compute: Compute,
        *,
        device: torch.device | str,
        num_slots: int,
        page_size: int,
        max_batch: int = 128,
        max_steps: int = 4096,
        min_rows: int = 1,
        graphs: bool = True,
        needs_kv_bound: bool = False,
        graph_pool: GraphPool | None = None,
        summarize: bool = False,
        fused_step: bool | None = None,
    ) -> None:
        self.compute = compute
        self.summarize = summarize
        self.device = torch.device(device)
        # The step's bookkeeping as two Triton kernels around a Triton argmax (`engine.kernels.decode_step`);
        # default: on CUDA when triton imports. The plain-torch twins otherwise (the same integers).
        if fused_step is None:
            fused_step = self.device.type == "cuda" and decode_step.fused_available()
        self.fused_step = fused_step
        self.graph_pool = graph_pool if graph_pool is not None else GraphPool(self.device)
        self.page_size = page_size
        self.table_width = math.ceil(num_slots / page_size)
        self.max_batch = bucket(max(max_batch, min_rows)) or BUCKETS[-1]
        self.max_steps = max_steps
        self.min_rows = min_rows
        self.use_graphs = graphs and self.device.type == "cuda"
        self.needs_kv_bound = needs_kv_bound
        rows = self.max_batch
        long = dict(dtype=torch.long, device=self.device)
        self.ids = [torch.zeros(rows, **long), torch.zeros(rows, **long)]
        self.positions = [torch.zeros(rows, **long), torch.zeros(rows, **long)]
        self.step = [torch.zeros(1, **long), torch.zeros(1, **long)]
        self.num_valid = torch.zeros(1, **long)
        self.table = torch.full((rows, self.table_width), -1, **long)
        self.history = torch.zeros((rows, max_steps), **long)
        self._no_extra = torch.empty((rows, 0), **long)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def _step(self, rows: int, parity: int, kv_bound: int) -> None:
        """One decode step: reads buffers ``parity``, writes buffers ``1 - parity`` and the history."""
        ids_in, pos_in, step_in = self.ids[parity][:rows], self.positions[parity][:rows], self.step[parity]
        rows_of = decode_step.decode_rows_triton if self.fused_step else decode_step.decode_rows_torch
        request, out_slots, prefix_lens = rows_of(pos_in, self.num_valid, self.table, self.page_size)
        inputs = RowInputs(
            input_ids=ids_in,
            positions=pos_in,
            row_request=request,
            out_slots=out_slots,
            prefix_lens=prefix_lens,
            extra_slots=self._no_extra[:rows],
            page_table=self.table,
            page_size=self.page_size,
            kv_bound=kv_bound,
            logits_rows=None,
        )
        logits, _ = self.compute(inputs, None)
        nxt = decode_step.vocab_argmax(logits) if self.fused_step else logits.argmax(dim=-1)
        advance = decode_step.decode_advance_triton if self.fused_step else decode_step.decode_advance_torch
        advance(nxt, pos_in, step_in, self.num_valid, self.ids[1 - parity][:rows], self.positions[1 - parity][:rows],
                self.step[1 - parity], self.history[:rows])  # fmt: skip

    def decode(
        self,
        page_table: torch.Tensor,
        first_tokens: torch.Tensor,
        start_positions: torch.Tensor,
        num_steps: int,
        stop_token_ids: tuple[int, ...] = (),
        check_every: int = 32,
    ) -> torch.Tensor:
        """Greedy tokens after ``first_tokens``: ``[bs, num_steps]`` int64 on the host.

        Shapes: ``page_table [bs, w]`` (pages covering ``start_positions + num_steps``),
        ``first_tokens, start_positions [bs]``. Token ``i`` of request ``b`` sits at position
        ``start_positions[b] + i``. Stops early once every request has produced a stop token (the
        columns after a request's stop are then whatever the step computed: cut them).
        """
        bs, width = page_table.shape
        rows = bucket(max(bs, self.min_rows))
        if rows is None or rows > self.max_batch or width > self.table_width or num_steps > self.max_steps:
            raise ValueError(
                f"decode of {bs} requests x {num_steps} steps over {width} pages exceeds the static buffers "
                f"(max_batch={self.max_batch}, max_steps={self.max_steps}, pages={self.table_width})"
            )
        if num_steps == 0:
            return torch.zeros((bs, 0), dtype=torch.long)
        self.table[:bs, :width].copy_(page_table)
        for parity in (0, 1):
            self.ids[parity].zero_()
            self.positions[parity].zero_()
        self.ids[0][:bs].copy_(first_tokens)
        self.positions[0][:bs].copy_(start_positions)
        self.step[0].zero_()
        self.num_valid.fill_(bs)
        bound = self.table_width * self.page_size
        if self.use_graphs:
            for parity in (0, 1):
                if (rows, parity) not in self._graphs:
                    self._graphs[(rows, parity)] = self._capture(rows, parity, bound)
        elif self.needs_kv_bound:
            bound = int(start_positions.max()) + num_steps + 1
        stops = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long, device=self.device)
        done_at = num_steps
        with torch.no_grad():
            for i in range(num_steps):
                if self.use_graphs:
                    self._graphs[(rows, i % 2)].replay()
                else:
                    self._step(rows, i % 2, bound)
                if stops.numel() and (i + 1) % check_every == 0 and i + 1 < num_steps:
                    seen = torch.isin(self.history[:bs, : i + 1], stops).any(dim=1)
                    if bool(seen.all()):
                        done_at = i + 1
                        break
        return self.history[:bs, :done_at].cpu()

    def _capture(self, rows: int, parity: int, bound: int) -> torch.cuda.CUDAGraph:
        # Warm up and capture with no valid row: nothing is written to the KV cache; the replay
        # reads num_valid from its buffer. The step's outputs are put back afterwards.
        state = (*self.ids, *self.positions, *self.step, self.history, self.num_valid)
        saved = [t.clone() for t in state]
        self.num_valid.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            self._step(rows, parity, bound)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with self.graph_pool.capture(graph), torch.no_grad():
            self._step(rows, parity, bound)
        for target, value in zip(state, saved):
            target.copy_(value)
        return graph
