"""The device-resident cycle: greedy EAGLE chain cycles, each one CUDA graph, no host sync between them.

Why. On an H100 with SmolLM2-135M a whole cycle's kernels (S - 1 draft levels, the verify, the draft
extend) take 1.0-1.5 ms, and the host plane (`engine.host_control`) spent another 1.5-2.7 ms of host
work between them: the records, the copies, three graph launches and two syncs per cycle, during
which the GPU waits. Speculation lost to autoregressive decoding (0.57-0.68x, 2026-11-24). Here the
cycle runs where its data is: one graph replay per cycle, the host only launches, and it checks
whether every request has finished one cycle behind the GPU (`LOOKAHEAD`), so the GPU never waits for it.

What a replay does is the chain cycle of the transition table, row by row, on static buffers
(``B`` requests, ``S`` draft steps, ``N = S + 1`` verify rows, ``L`` committed tokens, the root at ``L``):

``draft`` (table row ``draft_tree``, ``K = 1``)
    ``S - 1`` EAGLE steps: step ``j`` feeds the depth ``j + 1`` token at ``L + j`` with its parent's
    hidden state, writes its KV at the slot of ``L + j`` and sees the prefix ``[0, L)`` and its
    ancestors' slots; the draft's argmax is depth ``j + 2`` (`transitions.draft_levels`).
``verify``
    the target over ``[root, d1 .. dS]`` at ``L + i``, the chain mask, the rows padded to the same
    row bucket as the autoregressive decode step (``FastOptions.min_target_rows``), so a verify row
    and a decode step compute the same bits (`engine.graphs`, numerics).
``accept``
    ``n = 1 +`` the leading matches of ``d(i+1)`` and the target's argmax at row ``i``; the run is cut
    at the first stop token and at ``max_new_tokens`` (`stops.cut_at_stops`: the stop token is kept);
    a finished request commits nothing more.
``compact`` and ``draft_extend``
    a chain's accepted rows already sit at ``L + d``: nothing moves. The draft runs over all ``N``
    rows (token ``predict[d]`` at ``L + d`` with the target features of row ``d``); rows past the
    accepted run write draft KV at positions ``>= L + n`` that no later forward reads before it has
    written them again, and their outputs are dropped. Row ``n - 1`` gives the next ``d1`` and the
    draft hidden state of the next cycle's first step.

Each replay reads the cycle state ``(L, root, d1, draft hidden, done, output length, cycle)`` from one
of two buffer sets and writes the next state to the other (two graphs, parity), so no graph changes
its own inputs; the committed tokens go to an output log and each cycle's committed count to a
histogram log, both written at indices the state holds.

Where it runs: `engine.Engine.generate` takes it for greedy calls without logprobs or stop strings on the
fast path with a fast EAGLE draft, chain or tree (`FusedCycles.serves`: what the table's `accept_commit` fusion
covers); the prefill and the first draft extend run
through the state machine (`statemachine.step`) and the loop starts from their `Ready` record. On a
CPU (tests) the same cycle runs eagerly. Tested: greedy output equal to the engine's autoregressive
output and the per-cycle accept lengths equal to the state machine's (tests/unit/test_fused_cycle.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import torch

from ..backends.cuda.cycle import (
    EXTEND_FIELDS,
    accept_commit,
    accept_commit_torch,
    cycle_slots,
    cycle_slots_torch,
    flag_to_host,
    verify_rows,
    verify_rows_torch,
)
from ..backends.registry import get_backend
from ..core.config import SpecConfig
from ..core.ports import ModelOutput
from ..core.records import Ready
from ..core.tree import draft_scratch_offsets
from ..statemachine.transitions import draft_levels
from .graphs import GraphPool, RowInputs, batch_inputs, bucket

# Cycles the host launches ahead of the one whose "all done" flag it waits for. One is enough to keep the GPU
# busy (a cycle takes ~1.3 ms on an H100 with SmolLM2, its launch ~20-50 us), and every cycle launched ahead
# runs once more after the last request finished: 2 cost a second idle cycle per generate call.
LOOKAHEAD = 1
MAX_STOPS = 8


@attrs.frozen
class FusedRun:
    """What fused cycles committed: ``outputs[b]`` the whole output of request ``b`` (the tokens it had
    plus the committed ones, cut at stops and the limit), ``accept_lens[b]`` each cycle's committed count,
    ``finish_reasons[b]`` ``"stop"`` or ``"length"``."""

    outputs: tuple[tuple[int, ...], ...]
    accept_lens: tuple[tuple[int, ...], ...]
    finish_reasons: tuple[str, ...]


class _Levels:
    """The ports `transitions.draft_levels` reads, over the draft's row forward run in place (inside the
    cycle's graph): ``draft.step`` and ``kv_pool.page_size``."""

    kind, pairing = "forward", "shifted"

    def __init__(self, draft, kv_bound: int, page_size: int) -> None:
        self.draft, self.kv_pool = self, self
        self._fast, self._bound, self.page_size = draft, kv_bound, page_size

    def step(self, batch, parent_hidden):
        # greedy levels pick their top-K over the head's own vocabulary and map the ids (`ModelOutput.vocab_map`)
        logits, hidden = self._fast._compute(
            batch_inputs(batch, self._bound), parent_hidden, from_target=False, draft_vocab=True
        )
        return ModelOutput(logits=logits, hidden=hidden, vocab_map=self._fast.vocab_map)


class _State:
    """The static buffers of ``B`` requests: two sets of cycle state, the logs, the constants."""

    def __init__(self, batch: int, cfg: SpecConfig, width: int, hidden: int, hidden_dtype, max_out: int,
                 max_cycles: int, min_rows: int, device) -> None:  # fmt: skip
        long = dict(dtype=torch.long, device=device)
        n = cfg.num_draft_tokens
        self.batch = batch
        self.sets = []
        for _ in range(2):
            self.sets.append(
                dict(
                    L=torch.zeros(batch, **long),
                    root=torch.zeros(batch, **long),
                    topk_p=torch.zeros((batch, cfg.topk), dtype=torch.float32, device=device),
                    topk_index=torch.zeros((batch, cfg.topk), **long),
                    dh=torch.zeros((batch, hidden), dtype=hidden_dtype, device=device),
                    done=torch.ones(batch, dtype=torch.bool, device=device),
                    out_len=torch.zeros(batch, **long),
                    cycle=torch.zeros(1, **long),
                    all_done=torch.ones(1, dtype=torch.bool, device=device),
                )
            )
        self.table = torch.full((batch, width), -1, **long)
        # every cycle's "all done" flag, copied to the host by the cycle itself (a node of its graph): the
        # loop reads it once the cycle's event has fired. Done is monotone, so a later cycle's value read
        # in its place says no less than the awaited one's.
        cuda = torch.device(device).type == "cuda"
        self.host_done = torch.zeros(1, dtype=torch.bool, pin_memory=cuda)
        self.host_done_np = self.host_done.numpy()
        # written by a kernel where the GPU reaches the pinned flag (`backends.cuda.cycle.flag_to_host`), else copied
        self.flag_kernel = cuda and flag_to_host(self.sets[0]["all_done"], self.host_done)
        self.out = torch.zeros((batch, max_out + 1), **long)  # the last column: a bin for masked writes
        self.hist = torch.zeros((max_cycles + 1, batch), **long)
        self.max_new = torch.zeros(batch, **long)
        self.stops = torch.full((MAX_STOPS,), -1, **long)
        # constants
        rows = batch * n
        self.rows_b = bucket(max(rows, min_rows)) or rows
        requests = torch.arange(batch, **long)
        width = cfg.accept_width
        self.offs = torch.arange(n, **long)
        self.scratch = draft_scratch_offsets(cfg.num_steps, cfg.topk, 0, torch.device(device))  # [S - 1, K]
        self.ext_request = requests.repeat_interleave(width)
        self.no_extra = torch.empty((batch * width, 0), **long)
        # the slots a cycle looks up: its verify rows' (L + i) and its draft scratch's (L + scratch)
        self.slot_offsets = torch.cat([self.offs, self.scratch.reshape(-1)])
        # the verify forward's row inputs, written by `backends.cuda.cycle.verify_rows` (padding rows: no key, no KV)
        self.verify = dict(
            input_ids=torch.zeros(self.rows_b, **long),
            positions=torch.zeros(self.rows_b, **long),
            row_request=torch.cat([requests.repeat_interleave(n), torch.zeros(self.rows_b - rows, **long)]),
            out_slots=torch.full((self.rows_b,), -1, **long),
            prefix_lens=torch.zeros(self.rows_b, **long),
            extra_slots=torch.full((self.rows_b, n), -1, **long),
        )
        # the draft extend's row inputs and a tree's KV moves, written by `backends.cuda.cycle.accept_commit`
        self.extend = {name: torch.zeros(batch * width, **long) for name in EXTEND_FIELDS}
        self.extend["last"] = torch.zeros(batch, **long)
        self.log = dict(out=self.out, hist=self.hist, max_new=self.max_new, stops=self.stops)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}


class FusedCycles:
    """Greedy EAGLE cycles, chain or tree, over a `fast.FastTarget` and a `fast.FastEagleDraft` (module docstring)."""

    def __init__(self, target, draft, pool, spec: SpecConfig, options) -> None:
        self.backend = get_backend(options.device)
        self.target, self.draft, self.pool, self.spec, self.options = target, draft, pool, spec, options
        self.device = options.device
        self.use_graphs = options.graphs and self.device.type == "cuda"
        self.page_size = pool.page_size
        self.table_width = -(-pool.num_slots // pool.page_size)
        self.max_out = options.max_decode_steps + spec.num_draft_tokens + 1
        self.graph_pool: GraphPool = options.graph_pool
        self._states: dict[int, _State] = {}
        self.replays = 0
        # the bookkeeping between the forwards as the kernels of `backends.cuda.cycle` where they run (False: their
        # torch twins, the cycle as it was before them; benchmarks compare the two)
        self.kernels = True
        # the host's time in the loop (graph launches, the flag's copy and check) and waiting for the GPU;
        # launch_s: the part of host_s spent in `CUDAGraph.replay` itself (the driver's graph launch)
        self.host_s = self.wait_s = self.launch_s = 0.0
        # the whole of `run` (setup, graph captures, the loop, the outputs' copies back): what a generate call
        # spends beside it is the prefill and the first draft extend (benchmarks report the split)
        self.run_s = 0.0

    def serves(self, draft, sampling, stop_token_ids=()) -> bool:
        """Whether a `generate` call can run as these fused cycles: greedy without logprobs or stop strings, at
        most `MAX_STOPS` stop token ids, and the engine's draft is the fast EAGLE draft they were built over
        (`fast.accelerate` builds them for one). What the table's `accept_commit` fusion covers."""
        plain = sampling is None or (sampling.greedy and not sampling.logprobs and not sampling.stop_strings)
        return plain and len(set(stop_token_ids)) <= MAX_STOPS and draft is self.draft

    # ---- one cycle ----------------------------------------------------------------------------
    def _slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        page = table.gather(1, (positions // self.page_size).clamp(max=self.table_width - 1))
        return page * self.page_size + positions % self.page_size

    def _cycle(self, st: _State, parity: int, kv_bound: int) -> None:
        """One cycle: reads state set ``parity``, writes set ``1 - parity`` and the logs."""
        cur, nxt = st.sets[parity], st.sets[1 - parity]
        cfg, backend = self.spec, self.backend
        S, K, N, P = cfg.num_steps, cfg.topk, cfg.num_draft_tokens, self.page_size
        B = st.batch
        L, table, done = cur["L"], st.table, cur["done"]

        # slots: the verify rows' and the draft scratch's, in one lookup (a finished request: -1, it writes
        # no KV and reads no draft slot)
        slots_fn, rows_fn, accept_fn = (
            (cycle_slots, verify_rows, accept_commit)
            if self.kernels
            else (cycle_slots_torch, verify_rows_torch, accept_commit_torch)
        )
        slots = slots_fn(table, L, done, st.slot_offsets, P)  # [B, N + (S - 1) K]
        verify_slots = slots[:, :N]  # row i at the slot of L + i
        draft_slots = slots[:, N:].view(B, S - 1, K)
        # draft: S - 1 forwards over the frontier (`transitions.draft_levels`, greedy: no sync, static shapes)
        levels = _Levels(self.draft, kv_bound, P)
        cands, scores, cand_parents, _ = draft_levels(
            levels, backend, cfg, (), L, table, draft_slots, cur["topk_p"], cur["topk_index"], cur["dh"]
        )
        if K == 1:
            tokens, parents = torch.cat([cur["root"][:, None], cands], 1), None  # [B, N]
        else:  # EAGLE-2 rerank to N rows
            tokens, parents, _ = backend.rerank_tree(cur["root"], cands, scores, cand_parents, N)

        # verify: every row at L + depth, the tree mask's rows as extra slots, padded to the decode step's
        # bucket (the padding rows of `st.verify` attend nothing and write no KV)
        rows_fn(tokens, parents, L, verify_slots, S, st.verify, backend)
        inputs = RowInputs(**st.verify, page_table=table, page_size=P, kv_bound=kv_bound, logits_rows=None)
        logits, features = self.target._compute(inputs, want_hidden=True)
        # the verify's greedy: the vocabulary argmax the decode step takes (`decode_step.vocab_argmax` on CUDA,
        # torch's indices, ties included), one split reduce instead of torch's 16-row reduce
        predict = backend.greedy_predict(logits[: B * N]).view(B, N)

        # accept and commit: the greedy walk, cut at the first stop token and at max_new_tokens; the output
        # log, the next state, the draft extend's rows and a tree's KV moves (`backends.cuda.cycle.accept_commit`)
        walk = self._walk(st, cur, tokens, parents, predict)
        accept_fn(tokens, parents, predict, walk, verify_slots, cur, nxt, st.log, st.extend, backend)
        ext = st.extend
        if K > 1:  # compact: a tree's accepted rows move to [L, L + keep) (a chain's are there already)
            self._move(ext["src"], ext["dst"])
        # draft extend over the accepted path's W rows: token d at L + d with the target features of its row;
        # rows past the run write draft KV that no later forward reads before writing it again
        inputs = RowInputs(
            input_ids=ext["input_ids"], positions=ext["positions"], row_request=st.ext_request,
            out_slots=ext["out_slots"], prefix_lens=ext["prefix_lens"], extra_slots=st.no_extra,
            page_table=table, page_size=P, kv_bound=kv_bound, logits_rows=ext["last"],
        )  # fmt: skip
        logits, out = self.draft._compute(inputs, features.index_select(0, ext["feature_rows"]), from_target=True,
                                          draft_vocab=True)  # fmt: skip
        # the next state's top-K (the draft vocabulary's ids mapped to the target's) and draft hidden state,
        # written in place: no copy launches
        backend.select_topk(logits, K, self.draft.vocab_map, out=(nxt["topk_p"], nxt["topk_index"]))
        torch.index_select(out, 0, ext["last"], out=nxt["dh"])
        if not (st.flag_kernel and flag_to_host(nxt["all_done"], st.host_done)):
            st.host_done.copy_(nxt["all_done"], non_blocking=True)

    def _walk(self, st: _State, cur: dict, tokens: torch.Tensor, parents: torch.Tensor | None,
              predict: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The predictions the greedy walk of a cycle follows (``[B, N]``): the target's, ``predict``. Runs inside
        the cycle's graph, so an override may read only the state's static buffers (``cur``: the cycle's state set)."""
        return predict

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy target KV slot ``src[m]`` to ``dst[m]``, negatives skipped, all reads before any write."""
        buffers = list(self.pool.target_buffers())
        if src.device.type == "cuda":
            from ..backends.cuda import kv

            kv.move_kv(buffers, src, dst)
            return
        ok = (src >= 0) & (dst >= 0)  # eager on a CPU: a boolean index is fine here
        for buf in buffers:
            buf[dst[ok]] = buf[src[ok]]

    # ---- the loop -----------------------------------------------------------------------------
    def _state(self, batch: int) -> _State:
        if batch not in self._states:
            head = self.draft.head
            self._states[batch] = _State(
                batch, self.spec, self.table_width, head.config.hidden_size, head.dtype, self.max_out,
                self.options.max_decode_steps + LOOKAHEAD + 1, self.options.min_target_rows, self.device,
            )  # fmt: skip
        return self._states[batch]

    def _capture(self, st: _State, parity: int, bound: int) -> torch.cuda.CUDAGraph:
        # Warm up and capture with every request done: no KV is written (the slots are -1), nothing is
        # committed, every read stays inside the loaded page table. The state is put back afterwards.
        saved_sets = [{k: v.clone() for k, v in s.items()} for s in st.sets]
        saved_logs = [t.clone() for t in (st.out, st.hist)]
        for s in st.sets:
            s["done"].fill_(True)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            self._cycle(st, parity, bound)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with self.graph_pool.capture(graph), torch.no_grad():
            self._cycle(st, parity, bound)
        for s, values in zip(st.sets, saved_sets):
            for k, v in values.items():
                s[k].copy_(v)
        for t, v in zip((st.out, st.hist), saved_logs):
            t.copy_(v)
        return graph

    def run(self, ready: Ready, max_new_tokens: int, stop_token_ids: Sequence[int]) -> FusedRun:
        """Cycles from the `Ready` record of a prefill and its draft extend until every request finishes.

        The requests' KV pages are grown to cover every position a cycle may write; the caller frees them.
        """
        start = time.perf_counter()
        try:
            return self._run(ready, max_new_tokens, stop_token_ids)
        finally:
            self.run_s += time.perf_counter() - start

    def _run(self, ready: Ready, max_new_tokens: int, stop_token_ids: Sequence[int]) -> FusedRun:
        N = self.spec.num_draft_tokens
        requests = ready.requests
        B = len(requests)
        if B == 0:
            return FusedRun((), (), ())
        stops = sorted(set(stop_token_ids))
        if len(stops) > MAX_STOPS:
            raise ValueError(f"fused cycles take up to {MAX_STOPS} stop token ids, got {len(stops)}")
        if max_new_tokens > self.options.max_decode_steps:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} exceeds the fused cycles' static logs "
                f"(FastOptions.max_decode_steps={self.options.max_decode_steps})"
            )
        ids = [r.request_id for r in requests]
        lens = ready.seq_lens.tolist()
        for rid, length in zip(ids, lens):
            self.pool.allocate(rid, length + max_new_tokens + self.spec.reserve_len() + 1)
        page_table = self.pool.page_table(ids)
        st = self._state(B)
        cur = st.sets[0]
        st.table.fill_(-1)
        st.table[:, : page_table.shape[1]].copy_(page_table)
        cur["L"].copy_(ready.seq_lens)
        cur["root"].copy_(ready.root_tokens)
        cur["topk_p"].copy_(ready.topk_p)
        cur["topk_index"].copy_(ready.topk_index)
        cur["dh"].copy_(ready.draft_hidden)
        cur["done"].zero_()
        cur["all_done"].zero_()
        cur["cycle"].zero_()
        had = [len(r.output) for r in requests]
        cur["out_len"].copy_(torch.tensor(had))
        st.out.zero_()
        for b, r in enumerate(requests):
            if r.output:
                st.out[b, : len(r.output)] = torch.tensor(r.output)
        st.max_new.fill_(max_new_tokens)
        st.stops.fill_(-1)
        if stops:
            st.stops[: len(stops)] = torch.tensor(stops)
        bound = self.table_width * self.page_size
        if not self.use_graphs and self.options.ops.needs_kv_bound:
            bound = max(lens) + max_new_tokens + N + 1
        if self.use_graphs:
            for parity in (0, 1):
                if parity not in st.graphs:
                    st.graphs[parity] = self._capture(st, parity, bound)
        max_cycles = max_new_tokens - min(had) + 1  # a request not done commits at least one token a cycle
        cycles = self._loop(st, bound, max_cycles)
        out = st.out[:, :-1].cpu()
        out_len = st.sets[cycles % 2]["out_len"].cpu().tolist()
        hist = st.hist[:cycles].cpu().T.tolist()
        outputs, accept_lens, reasons = [], [], []
        stop_set = set(stops)
        for b in range(B):
            tokens = tuple(out[b, : out_len[b]].tolist())
            outputs.append(tokens)
            accept_lens.append(tuple(n for n in hist[b] if n > 0))
            reasons.append("stop" if tokens and tokens[-1] in stop_set else "length")
        return FusedRun(tuple(outputs), tuple(accept_lens), tuple(reasons))

    def _loop(self, st: _State, bound: int, max_cycles: int) -> int:
        """Replay until every request is done; returns the number of cycles run."""
        if not self.use_graphs:
            with torch.no_grad():
                for i in range(max_cycles):
                    self._cycle(st, i % 2, bound)
                    if bool(st.sets[(i + 1) % 2]["all_done"]):
                        return i + 1
            return max_cycles
        ring = LOOKAHEAD + 1
        events = [torch.cuda.Event() for _ in range(ring)]
        flag = st.host_done_np  # the pinned flag each cycle's graph copies its "all done" into
        torch.cuda.current_stream(self.device).synchronize()  # no copy in flight (a capture's warm-up wrote True)
        flag[0] = False
        clock = time.perf_counter
        host = wait = launch = 0.0
        try:
            for i in range(max_cycles):
                start = clock()
                st.graphs[i % 2].replay()
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
