"""The graphed executor: the table's cycle captured as one CUDA graph per batch size and parity, replayed with no
host sync between cycles.

Why. On an H100 with SmolLM2-135M a whole cycle's kernels (S - 1 draft levels, the verify, the draft
extend) take 1.0-1.5 ms, and the host plane (`engine.fast.host_control`) spent another 1.5-2.7 ms of host
work between them: the records, the copies, three graph launches and two syncs per cycle, during
which the GPU waits. Speculation lost to autoregressive decoding (0.57-0.68x, 2026-11-24). Here the
cycle runs where its data is: one graph replay per cycle, the host only launches, and it checks
whether every request has finished one cycle behind the GPU (`LOOKAHEAD`), so the GPU never waits for it.

What a replay runs is `statemachine.static.StaticExecutor.cycle`: the table's rows chosen as `runner.step`
chooses them (``draft`` by `draft_tree`'s static form, then the ``accept_commit`` fusion in place of the
verify, accept and compact rows, then ``extend`` by `draft_extend`'s), over the `CycleBuffers` of the batch
size, captured once per parity: a replay reads set ``p`` and writes set ``1 - p``, so no graph changes its own
inputs. The capture keeps the boundaries it crossed: `FusedCycles.steps` are the rows it captured (a test
holds them equal to the table's rows), and in checked mode every boundary is validated after each replay
(`StaticExecutor.check`; the records' tensors then hold that replay's values).

Where it runs: `engine.Engine.generate` takes it for greedy calls, and plainly sampled ones with a fast EAGLE
draft (temperature, top-k, top-p, min-p), without logprobs or stop strings and with one stop list, on the fast
path with a fast EAGLE draft or an n-gram draft, chain or tree (`FusedCycles.serves`: what the table's
`accept_commit` fusion covers), checked or not; the prefill and the first draft extend run through
`statemachine.step`, the loop (`FusedCycles.run`) starts from their `Ready` record, and the requests retire
through the table's ``retire`` row from the record `statemachine.static.materialize` makes of the log. The
scheduler runs one cycle at a time (`FusedCycles.step`): its batch changes between cycles, so each step loads
the batch into the buffers of its power-of-two bucket (padding rows finished from the start) and reads the
commits back; the requests that finished leave through the table's ``Ready --retire--> Ready`` row. A lookup
draft's proposals come from the draft row's host step (`statemachine.static.StaticExecutor.prepare`: the
requests' token histories are on the host), run before each cycle outside its graph, so its cycles run one
`step` at a time, in `run` too. The scheduler's batches may hold sampled requests (temperature, top-k, top-p,
min-p) beside greedy ones: a batch with a sampled request runs on buffers and graphs of its own that draw, lay
out and verify per request (`static_rows.SampledBuffers`, docs/sampling.md), and an all-greedy batch on the
greedy ones, which do none of that work. On a CPU (tests) the same executor runs eagerly. A request whose logits
turn non-finite inside a captured cycle is not errored there (the eager verify errors it): the cycle commits the
argmax of its rows.
Tested: tests/unit/test_fused_cycle.py (the engine's autoregressive output, the table's accept lengths),
tests/property/test_static_executor.py (random configs in checked mode against the eager table).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import torch

from ...backends.cuda.cycle import flag_to_host
from ...backends.registry import get_backend
from ...core.config import SpecConfig
from ...core.ports import Ports, defers_first_level, draft_kind
from ...core.records import Compacted, ExtendRows, Ready, Request
from ...statemachine.batching import select_ready
from ...statemachine.static import (
    Boundary,
    LogCopy,
    StaticExecutor,
    accepted_counts,
    copy_log,
    materialize,
    materialize_ready,
    snapshot_state,
)
from ...statemachine.static_rows import MAX_STOPS, CycleBuffers
from ...statemachine.transitions import reserve
from .graphs import GraphPool, bucket

# Cycles the host launches ahead of the one whose "all done" flag it waits for. One is enough to keep the GPU
# busy (a cycle takes ~1.3 ms on an H100 with SmolLM2, its launch ~20-50 us), and every cycle launched ahead
# runs once more after the last request finished: 2 cost a second idle cycle per generate call.
LOOKAHEAD = 1


@attrs.frozen
class FusedRun:
    """What fused cycles committed: ``final`` the eager `Compacted` record of the run's end (each request's whole
    output and finish reason, `statemachine.static.materialize`), ``accept_lens[b]`` each cycle's committed count
    of request ``b``, ``cycles`` the cycles run."""

    final: Compacted
    accept_lens: tuple[tuple[int, ...], ...]
    cycles: int


class _Batch:
    """A batch size's buffers (`CycleBuffers`), its two graphs and the boundaries each captured, and the pinned
    "all done" flag the cycle copies to the host."""

    def __init__(self, buffers: CycleBuffers, device, ports: Ports) -> None:
        self.buffers, self.batch, self.ports = buffers, buffers.batch, ports
        self.loads = 0  # how often a batch was loaded into the buffers (a pipelined cycle goes on only from its own)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.captured: dict[int, tuple[Boundary, ...]] = {}
        # every cycle's "all done" flag, copied to the host by the cycle itself (a node of its graph): the
        # loop reads it once the cycle's event has fired. Done is monotone, so a later cycle's value read
        # in its place says no less than the awaited one's.
        cuda = torch.device(device).type == "cuda"
        self.host_done = torch.zeros(1, dtype=torch.bool, pin_memory=cuda)
        self.host_done_np = self.host_done.numpy()
        # written by a kernel where the GPU reaches the pinned flag (`backends.cuda.cycle.flag_to_host`), else copied
        self.flag_kernel = cuda and flag_to_host(buffers.sets[0]["all_done"], self.host_done)


class CycleTimer:
    """What a launched cycle cost the device and the host: CUDA events recorded on the stream around its replay
    (the GPU's time for the cycle alone: the start fires once the work before it on the stream is done), and the
    seconds `FusedCycles.collect` waited for its commits. The adaptive controller compares shapes by these
    (`engine.serving.adaptive`): the device's time of a replay is steady where a step's wall time is not."""

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.waited = 0.0  # seconds the host waited for the commits (set by `FusedCycles.collect`)

    @property
    def gpu_seconds(self) -> float:
        """The replay's time on the device (once `FusedCycles.collect` has waited for the commits)."""
        return self.start.elapsed_time(self.end) / 1e3


@attrs.frozen(eq=False)
class Launched:
    """A cycle `FusedCycles.launch` put on the device: its source record, ports, batch buffers, stop ids and the
    boundaries of the cycle it replayed (`FusedCycles.collect` reads it back)."""

    ready: Ready
    ports: Ports
    batch: _Batch
    stops: list[int]
    boundaries: tuple[Boundary, ...]
    copy: LogCopy  # the commits on their way to the host
    state: Ready  # the cycle's resulting state, cloned off the buffers right after it (`static.snapshot_state`)
    loads: int  # the buffers' load count when the batch was loaded (`_Batch.loads`)
    captured: bool = False  # whether launching it captured a graph (its time is not a cycle's)
    parity: int = 0  # the buffer set the cycle read (it wrote ``1 - parity``)
    cycles: int = 1  # cycles run on the batch since it was loaded, this one included (`FusedCycles.launch_next`)
    timer: CycleTimer | None = None  # a replay's device time and the wait for its commits (None: eager, or untimed)

    @property
    def buffers(self) -> CycleBuffers:
        return self.batch.buffers


class FusedCycles:
    """The graphed executor of greedy EAGLE or n-gram cycles, chain or tree, over a `fast.path.FastTarget` and a
    `fast.path.FastEagleDraft` or a lookup draft (module docstring)."""

    def __init__(self, target, draft, pool, spec: SpecConfig, options) -> None:
        self.backend = get_backend(options.device)
        self.target, self.draft, self.pool, self.spec, self.options = target, draft, pool, spec, options
        self.ports = Ports(target=target, draft=draft, kv_pool=pool)
        self.device = options.device
        self.use_graphs = options.graphs and self.device.type == "cuda"
        self.page_size = pool.page_size
        self.table_width = -(-pool.num_slots // pool.page_size)
        self.graph_pool: GraphPool = options.graph_pool
        self._batches: dict[int, _Batch] = {}
        self.replays = 0
        self.captured = False  # whether the last `step` captured its graph (its time is not a cycle's)
        # the bookkeeping between the forwards as the kernels of `backends.cuda.cycle` where they run (False: their
        # torch twins; benchmarks compare the two)
        self.kernels = True
        # the steps (table rows and fusions) of the last cycle run or captured: `statemachine.static.expand` of them
        # is what the table's rows for the config must be
        self.steps: tuple = ()
        # the host's time in the loop (graph launches, the flag's copy and check) and waiting for the GPU;
        # launch_s: the part of host_s spent in `CUDAGraph.replay` itself (the driver's graph launch)
        self.host_s = self.wait_s = self.launch_s = 0.0
        # the whole of `run` (setup, graph captures, the loop, the outputs' copies back): what a generate call
        # spends beside it is the prefill and the first draft extend (benchmarks report the split)
        self.run_s = 0.0

    def serves(self, draft, sampling, stop_token_ids=()) -> bool:
        """Whether a `generate` call can run as these fused cycles: greedy, or sampled from the raw logits after
        temperature, min-p, top-k and top-p (`SamplingParams.plain`; with a forward draft: a lookup draft's cycles
        serve sampled requests only where it proposes nothing), without logprobs or stop strings, at most
        `MAX_STOPS` stop token ids, and the engine's draft is the one they were built over (`fast.path.accelerate`
        builds them for one). What the table's `accept_commit` fusion covers."""
        if sampling is not None and not (sampling.plain and not sampling.stop_strings):
            return False
        if sampling is not None and not sampling.greedy and draft_kind(self.ports) != "forward":
            return False
        return len(set(stop_token_ids)) <= MAX_STOPS and draft is self.draft

    def covers(self, ready: Ready, ports: Ports | None = None) -> bool:
        """Whether `step` serves a `Ready` batch over ``ports`` (None: these cycles' own, the fast EAGLE draft): a
        shape of the built config's family (any ``S`` and ``N``, the same ``K`` and page size: the draft state's
        width; `batching.reshape` moves a batch between shapes), and what the table's fusion covers
        (`static_rows.static_covers`: greedy or plainly sampled, one stop list, no stop strings or logprobs; a forward
        draft paired shifted or a lookup draft: n-gram (greedy), or the scheduler's no-draft `ZeroDraft`). A step's
        log holds one cycle, so any ``max_new_tokens`` fits."""
        ports = self.ports if ports is None else ports
        if ports.target is not self.target or ports.kv_pool is not self.pool:
            return False
        cfg = ready.config
        if not ready.requests or cfg.topk != self.spec.topk or cfg.page_size != self.spec.page_size:
            return False
        own = draft_kind(ports) == "forward" and ports.draft is self.draft
        if own and ready.draft_hidden is None:
            return False  # extended by another draft (speculation off)
        if own and ready.topk_p is None and not (ready.topk_pending and not cfg.drafts):
            return False  # no top-K to draft from (a deferred one: the first_level row computes it first)
        return self.executor(ports).covers(ready)

    def executor(self, ports: Ports | None = None) -> StaticExecutor:
        """The static executor over ``ports`` (None: these cycles' own), with this object's kernel choice and walk."""
        forced = type(self)._walk is not FusedCycles._walk  # a benchmark's override (`bench.forced`)
        ports = self.ports if ports is None else ports
        return StaticExecutor(ports, self.backend, kernels=self.kernels, walk=self._walk if forced else None)

    # ---- one cycle ----------------------------------------------------------------------------
    def _cycle(self, bt: _Batch, parity: int, kv_bound: int, requests) -> tuple[Boundary, ...]:
        """One cycle: the static executor from the `Ready` record over set ``parity`` to set ``1 - parity``, then
        the next set's "all done" flag to the host."""
        ready = bt.buffers.ready(parity, requests)
        _, boundaries = self.executor(bt.ports).cycle(ready, bt.buffers, 1 - parity, kv_bound)
        nxt = bt.buffers.sets[1 - parity]
        if not (bt.flag_kernel and flag_to_host(nxt["all_done"], bt.host_done)):
            bt.host_done.copy_(nxt["all_done"], non_blocking=True)
        return boundaries

    def _walk(self, drafted, tokens: torch.Tensor, parents: torch.Tensor | None, predict: torch.Tensor):
        """The predictions the greedy walk of a cycle follows (``[B, N]``): the target's, ``predict``. Runs inside
        the cycle's graph, so an override may read only the record's tensors (``drafted.log.cycle``: the cycle)."""
        return predict

    # ---- the loop -----------------------------------------------------------------------------
    def _batch(self, batch: int, cfg: SpecConfig | None = None, ports: Ports | None = None,
               sampled: bool = False) -> _Batch:  # fmt: skip
        """The buffers and graphs of ``batch`` requests in shape ``cfg`` over ``ports`` (None: the built config and
        these cycles' own ports); ``sampled``: buffers (and graphs) that serve sampled requests beside greedy ones,
        kept apart from the greedy ones so an all-greedy batch runs no sampling work."""
        cfg, ports = cfg or self.spec, ports or self.ports
        # whether the records carry a forward draft's state (top-K, hidden): not a lookup draft's (n-gram, `ZeroDraft`)
        state = ports.draft is self.draft and draft_kind(ports) == "forward"
        key = (batch, cfg, ports.draft is self.draft, defers_first_level(ports), sampled)
        if key not in self._batches:
            hidden, dtype = (self.draft.head.config.hidden_size, self.draft.head.dtype) if state else (0, torch.float32)
            rows = batch * cfg.num_draft_tokens
            buffers = CycleBuffers(
                batch, cfg, self.table_width, hidden, dtype,
                self.options.max_decode_steps + cfg.num_draft_tokens + 1, self.options.max_decode_steps + LOOKAHEAD + 1,
                bucket(max(rows, self.options.min_target_rows)) or rows, self.device, draft_state=state,
                topk_pending=key[3], vocab=self.target.vocab_size if sampled else None,
            )  # fmt: skip
            self._batches[key] = _Batch(buffers, self.device, ports)
        return self._batches[key]

    def _capture(self, bt: _Batch, parity: int, bound: int, requests) -> torch.cuda.CUDAGraph:
        # Warm up and capture with every request done: no KV is written (the slots are -1), nothing is
        # committed, every read stays inside the loaded page table. The state is put back afterwards.
        buffers = bt.buffers
        saved_sets = [{k: v.clone() for k, v in s.items()} for s in buffers.sets]
        logs = (buffers.out, buffers.hist) + (tuple(buffers.sampling.dq) if buffers.sampling is not None else ())
        saved_logs = [t.clone() for t in logs]  # with a sampled batch's draft q, which the cycle writes too
        for s in buffers.sets:
            s["done"].fill_(True)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            self._cycle(bt, parity, bound, requests)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with self.graph_pool.capture(graph), torch.no_grad():
            bt.captured[parity] = self._cycle(bt, parity, bound, requests)
        for s, values in zip(buffers.sets, saved_sets):
            for k, v in values.items():
                s[k].copy_(v)
        for t, v in zip(logs, saved_logs):
            t.copy_(v)
        return graph

    def run(self, ready: Ready, max_new_tokens: int, stop_token_ids: Sequence[int], checked: bool = False) -> FusedRun:
        """Cycles from the `Ready` record of a prefill and its draft extend until every request finishes.

        The requests' KV pages are grown to cover every position a cycle may write; the table's ``retire`` row
        frees them (the caller steps the returned record). ``checked``: every boundary of every cycle is validated
        after it ran (`StaticExecutor.check`; slow).
        """
        if ready.requests and self.executor().host_steps(ready):  # a lookup draft proposes on the host each cycle
            return self._run_stepped(ready, checked)  # (`step` adds its time to run_s)
        start = time.perf_counter()
        try:
            return self._run(ready, max_new_tokens, stop_token_ids, checked)
        finally:
            self.run_s += time.perf_counter() - start

    def _run(self, ready: Ready, max_new_tokens: int, stop_token_ids: Sequence[int], checked: bool) -> FusedRun:
        N = self.spec.num_draft_tokens
        requests = ready.requests
        B = len(requests)
        stops = sorted(set(stop_token_ids))
        if B == 0:
            return FusedRun(materialize(ready, stops), (), 0)
        if len(stops) > MAX_STOPS:
            raise ValueError(f"fused cycles take up to {MAX_STOPS} stop token ids, got {len(stops)}")
        if max_new_tokens > self.options.max_decode_steps:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} exceeds the fused cycles' static logs "
                f"(FastOptions.max_decode_steps={self.options.max_decode_steps})"
            )
        ids = [r.request_id for r in requests]
        lens = ready.seq_lens.tolist()
        for r, length in zip(requests, lens):  # the run's pages at once: L grows by the remaining budget at most
            self.pool.allocate(r.request_id, length + max_new_tokens - len(r.output) + self.spec.reserve_len() + 1)
        bt = self._batch(B, sampled=_sampled(requests))
        bt.buffers.load(ready, self.pool.page_table(ids), max_new_tokens, stops, whole_run=True)
        bt.loads += 1
        bound = self.table_width * self.page_size
        if not self.use_graphs and self.options.ops.needs_kv_bound:
            bound = max(lens) + max_new_tokens + N + 1
        if self.use_graphs:
            for parity in (0, 1):
                if parity not in bt.graphs:
                    bt.graphs[parity] = self._capture(bt, parity, bound, requests)
            self.steps = tuple(b.step for b in bt.captured[0])
        had = [len(r.output) for r in requests]
        max_cycles = max_new_tokens - min(had) + 1  # a request not done commits at least one token a cycle
        executor = self.executor() if checked else None
        cycles = self._loop(bt, bound, max_cycles, requests, executor)
        final = bt.buffers.ready(cycles % 2, requests)
        return FusedRun(materialize(final, stops), tuple(accepted_counts(final, cycles)), cycles)

    def _run_stepped(self, ready: Ready, checked: bool) -> FusedRun:
        """`run` for a cycle whose first row has a host step (a lookup draft's proposals, `StaticExecutor.prepare`):
        one `step` a cycle, the host step and one copy back between them. A request that finished leaves the batch
        the next cycle loads, keeping its pages: the returned record holds every request, and the caller's
        ``retire`` row frees them. Each request's budget and stops are its own `SamplingParams`' (as `step` reads
        them)."""
        order = [r.request_id for r in ready.requests]
        rows: dict[int, tuple] = {}  # request id -> (request, L, root) once finished
        counts: dict[int, list[int]] = {rid: [] for rid in order}
        cycles = 0
        while ready.requests:
            ready, committed = self.step(ready, checked)
            cycles += 1
            for r, n in zip(ready.requests, committed):
                counts[r.request_id].append(n)
            live = [b for b, r in enumerate(ready.requests) if r.finish_reason is None]
            L, root = ready.seq_lens.tolist(), ready.root_tokens.tolist()
            for b, r in enumerate(ready.requests):
                if r.finish_reason is not None:
                    rows[r.request_id] = (r, L[b], root[b])
            ready = select_ready(ready, live)
        device = ready.seq_lens.device
        final = [rows[rid] for rid in order]
        empty = torch.zeros(0, dtype=torch.long, device=device)
        record = Compacted(
            config=ready.config,
            requests=tuple(r for r, _, _ in final),
            seq_lens=torch.tensor([x for _, x, _ in final], dtype=torch.long, device=device),
            root_tokens=torch.tensor([x for _, _, x in final], dtype=torch.long, device=device),
            extend=ExtendRows(input_ids=empty, positions=empty, row_request=empty, hidden=None),
        )
        return FusedRun(record, tuple(tuple(counts[rid]) for rid in order), cycles)

    def step(self, ready: Ready, checked: bool = False, ports: Ports | None = None) -> tuple[Ready, list[int]]:
        """One cycle of an eager `Ready` batch whose composition changes between cycles (the scheduler's), in the
        record's shape (``ready.config``), over ``ports`` (None: these cycles' own; `covers` says which serve):
        `launch` then `collect`. Returns the next eager `Ready` record, its finished requests still in it (the
        table's Ready ``retire`` row takes them), and each request's committed count. ``checked``: every boundary
        of the cycle is validated after it ran."""
        return self.collect(self.launch(ready, ports), checked)

    def launch(self, ready: Ready, ports: Ports | None = None, timed: bool = False) -> Launched:
        """The cycle of ``ready`` put on the GPU, not waited for: the pages grow by one cycle's reservation
        (`transitions.reserve`: all or nothing, `KVPoolExhausted` leaves the pool as it was); the batch is loaded
        into the buffers of its bucket; one replay of the captured cycle (eagerly on a CPU: it has run when this
        returns). Until `collect`, the host is free for other work (the scheduler admits the next requests); work
        it puts on the device runs after the cycle (one stream). ``timed``: a replay between the events of a
        `CycleTimer` (`Launched.timer`; its `launch_next` cycles too), for an adaptive controller."""
        start = time.perf_counter()
        try:
            return self._launch(ready, ports or self.ports, timed)
        finally:
            self.run_s += time.perf_counter() - start

    def _launch(self, ready: Ready, ports: Ports, timed: bool = False) -> Launched:
        requests, cfg = ready.requests, ready.config
        ids = [r.request_id for r in requests]
        lens = [len(r.tokens) - 1 for r in requests]  # L: prompt + output - the root (invariant 8), no copy back
        stops = sorted(set(requests[0].sampling.stop_token_ids))
        if len(stops) > MAX_STOPS:
            raise ValueError(f"a fused cycle takes up to {MAX_STOPS} stop token ids, got {len(stops)}")
        reserve(self.pool, ids, [length + cfg.reserve_len() for length in lens])
        limits = [r.sampling.max_new_tokens for r in requests]
        bucket_size = 1 << (len(requests) - 1).bit_length()  # a power of two: one graph a bucket (two: `_batch`)
        bt = self._batch(bucket_size, cfg, ports, _sampled(requests))
        bt.buffers.load(ready, self.pool.page_table(ids), limits, stops, columns=cfg.accept_width)
        bt.loads += 1
        # the first row's host step (a lookup draft's proposals), before the cycle and outside its graph
        self.executor(ports).prepare(bt.buffers.ready(0, requests), bt.buffers)
        bound = self.table_width * self.page_size
        if not self.use_graphs and self.options.ops.needs_kv_bound:
            bound = max(lens) + cfg.reserve_len() + 1
        with torch.no_grad():
            self.captured = self.use_graphs and 0 not in bt.graphs  # this step captures its graph (timed apart)
            timer = None
            if self.use_graphs:
                if 0 not in bt.graphs:
                    bt.graphs[0] = self._capture(bt, 0, bound, requests)
                timer = _replay(bt.graphs[0], timed)
                self.replays += 1
                boundaries = bt.captured[0]
            else:
                boundaries = self._cycle(bt, 0, bound, requests)
            # the commits start home now (the host's work queued after the cycle does not delay them), and the
            # state is cloned: whoever loads these buffers next cannot change what `collect` reads
            after = bt.buffers.ready(1, requests)
            copy, state = copy_log(after, cfg.accept_width), snapshot_state(after)
        self.steps = tuple(b.step for b in boundaries)
        return Launched(ready, ports, bt, stops, boundaries, copy, state, bt.loads, self.captured, timer=timer)

    def launch_next(self, launched: Launched, live: Sequence[Request]) -> Launched:
        """The batch's next cycle on the device's own state, launched before the last one is collected: no reload,
        no wait. It reads the set the cycle in flight writes (graph of the other parity) and appends to the same
        log, so the host collects cycle ``n`` while the GPU runs ``n + 1``.

        ``live``: the loaded requests the host has not seen finish (as of the last `collect`). Their pages grow to
        cover the next cycle wherever the one in flight leaves them: ``L`` as the host knows it, plus the commits
        of the cycle in flight (``accept_width`` at most), plus a cycle's reservation (`transitions.reserve`: all
        or nothing). The buffers' page table is refreshed behind the cycle in flight; a request the host retired
        meanwhile reads and writes no KV: its table row is empty (its slots are negative, skipped by the KV
        writes and masked by the attention), and it is done on the device when it finished there. A request that
        finishes in the cycle in flight is done in the next one: it commits nothing. Only the batch's own buffers
        are gone on from (`can_continue`: nobody loaded them since)."""
        start = time.perf_counter()
        try:
            return self._launch_next(launched, live)
        finally:
            self.run_s += time.perf_counter() - start

    def can_continue(self, launched: Launched) -> bool:
        """Whether `launch_next` fits the launched batch's log and history buffers once more, and the cycle needs
        nothing from the host before it (no host step: a lookup draft proposes from the commits `collect` reads)."""
        cfg, buffers = launched.ready.config, launched.buffers
        if launched.loads != launched.batch.loads:  # another batch was loaded into these buffers meanwhile
            return False
        if self.executor(launched.ports).host_steps(launched.ready):  # the host proposes from the last commits
            return False
        width = (launched.cycles + 2) * cfg.accept_width  # the next cycle's, and the slack of the one after
        return width <= buffers.out.shape[1] and launched.cycles + 2 < buffers.hist.shape[0]

    def _launch_next(self, launched: Launched, live: Sequence[Request]) -> Launched:
        cfg, bt, requests = launched.ready.config, launched.batch, launched.ready.requests
        if not self.can_continue(launched):
            raise ValueError(f"the batch's log holds no further cycle after {launched.cycles}: reload it (`launch`)")
        parity = 1 - launched.parity  # the set the cycle in flight writes: this one reads it
        grow = cfg.accept_width + cfg.reserve_len()
        reserve(self.pool, [r.request_id for r in live], [len(r.tokens) - 1 + grow for r in live])
        table = self.pool.page_table([r.request_id for r in requests])  # retired requests: empty rows
        bt.buffers.table[: len(requests)].fill_(-1)
        bt.buffers.table[: len(requests), : table.shape[1]].copy_(table)
        bound = self.table_width * self.page_size
        if not self.use_graphs and self.options.ops.needs_kv_bound:
            bound = max(len(r.tokens) for r in live) + grow + 1 if live else 1
        with torch.no_grad():
            self.captured = self.use_graphs and parity not in bt.graphs
            timer = None
            if self.use_graphs:
                if parity not in bt.graphs:
                    bt.graphs[parity] = self._capture(bt, parity, bound, requests)
                timer = _replay(bt.graphs[parity], launched.timer is not None)
                self.replays += 1
                boundaries = bt.captured[parity]
            else:
                boundaries = self._cycle(bt, parity, bound, requests)
            cycles = launched.cycles + 1
            after = bt.buffers.ready(1 - parity, requests)
            copy, state = copy_log(after, cycles * cfg.accept_width), snapshot_state(after)
        self.steps = tuple(b.step for b in boundaries)
        return attrs.evolve(launched, boundaries=boundaries, copy=copy, state=state, captured=self.captured,
                            parity=parity, cycles=cycles, timer=timer)  # fmt: skip

    def collect(self, launched: Launched, checked: bool = False) -> tuple[Ready, list[int]]:
        """A launched cycle's result: its commits read back in one copy (waits for the GPU), as `step` returns
        them: the loaded requests with every token committed since the load, and each one's count since the load.
        ``checked``: every boundary of the cycle is validated after it ran."""
        start = time.perf_counter()
        try:
            requests, cfg = launched.ready.requests, launched.ready.config
            if checked:
                self.executor(launched.ports).check([_with_requests(b, requests) for b in launched.boundaries])
            width = launched.cycles * cfg.accept_width
            if launched.timer is not None and launched.copy.event is not None:  # the wait, timed apart
                waiting = time.perf_counter()
                launched.copy.event.synchronize()
                launched.timer.waited = time.perf_counter() - waiting
            ready = materialize_ready(launched.state, launched.stops, width=width, copy=launched.copy)
            return ready, [len(new.output) - len(old.output) for new, old in zip(ready.requests, requests)]
        finally:
            self.run_s += time.perf_counter() - start

    def _loop(self, bt: _Batch, bound: int, max_cycles: int, requests, executor: StaticExecutor | None) -> int:
        """Replay until every request is done; returns the number of cycles run. ``executor``: check every
        boundary of every cycle after it ran (checked mode: each cycle waits for the GPU)."""
        sets = bt.buffers.sets
        if not self.use_graphs or executor is not None:
            with torch.no_grad():
                for i in range(max_cycles):
                    if self.use_graphs:
                        bt.graphs[i % 2].replay()
                        self.replays += 1
                        boundaries = bt.captured[i % 2]
                    else:
                        boundaries = self._cycle(bt, i % 2, bound, requests)
                        self.steps = tuple(b.step for b in boundaries)
                    if executor is not None:
                        executor.check([_with_requests(b, requests) for b in boundaries])
                    if bool(sets[(i + 1) % 2]["all_done"]):
                        return i + 1
            return max_cycles
        ring = LOOKAHEAD + 1
        events = [torch.cuda.Event() for _ in range(ring)]
        flag = bt.host_done_np  # the pinned flag each cycle's graph copies its "all done" into
        torch.cuda.current_stream(self.device).synchronize()  # no copy in flight (a capture's warm-up wrote True)
        flag[0] = False
        clock = time.perf_counter
        host = wait = launch = 0.0
        try:
            for i in range(max_cycles):
                start = clock()
                bt.graphs[i % 2].replay()
                launched = clock()
                events[i % ring].record()
                end = clock()
                launch += launched - start
                host += end - start
                if i >= LOOKAHEAD:
                    events[(i - LOOKAHEAD) % ring].synchronize()
                    start = clock()
                    wait += start - end
                    if flag[0]:  # every request done by cycle i - LOOKAHEAD or later: the rest commit nothing
                        return i + 1
                    host += clock() - start
            return max_cycles
        finally:
            self.replays += i + 1 if max_cycles else 0
            self.host_s, self.wait_s, self.launch_s = self.host_s + host, self.wait_s + wait, self.launch_s + launch
            torch.cuda.current_stream(self.device).synchronize()


def _replay(graph: torch.cuda.CUDAGraph, timed: bool) -> CycleTimer | None:
    """One replay of a captured cycle, ``timed``: between the events of its `CycleTimer`."""
    if not timed:
        graph.replay()
        return None
    timer = CycleTimer()
    timer.start.record()
    graph.replay()
    timer.end.record()
    return timer


def _sampled(requests) -> bool:
    """Whether a batch holds a sampled request (it runs on buffers and graphs that serve sampling)."""
    return any(not r.sampling.greedy for r in requests)


def _with_requests(boundary: Boundary, requests) -> Boundary:
    """A captured boundary with this run's requests (a capture keeps the requests of the run it was made in)."""
    source = attrs.evolve(boundary.source, requests=tuple(requests))
    result = attrs.evolve(boundary.result, requests=tuple(requests))
    return attrs.evolve(boundary, source=source, result=result)
