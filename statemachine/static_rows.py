"""The table's rows in their static form: records at stable addresses, no host sync, no value-dependent shape.

A static executor (`statemachine.static`) runs a cycle by selecting the table's rows as `runner.step` does and
calling each row's ``static`` form (`table.Transition.static`), or a declared fusion's (`table.Fusion.static`)
in place of the rows it covers. The forms read their record's tensors and write their results into the
buffers of a `CycleBuffers` (``ctx.into``: the set the next records live in), so the records they return are
views of buffers whose addresses never change: a CUDA graph captured while the forms run replays them.

``B`` requests, ``S`` draft steps, ``K`` top-K, ``N`` verify rows, ``W = S + 1`` the accept width, ``P`` the
page size. A request that finished (``OutputLog.done``) looks up slot -1 everywhere: it writes no KV, reads
no draft scratch and commits nothing; the loop around the executor retires it between cycles.
"""

from __future__ import annotations

import attrs
import torch

from ..backends.cuda import cycle as cycle_ops
from ..core.config import SpecConfig
from ..core.ports import (
    ForwardBatch,
    ModelOutput,
    NoRecurrentState,
    StaticPorts,
    defers_first_level,
    draft_kind,
    draft_pairing,
    static_forwards,
    target_vocab_size,
)
from ..core.records import Compacted, Drafted, DraftTree, ExtendRows, OutputLog, Ready, RowOutputs
from ..core.transfer import to_device
from ..core.tree import draft_scratch_offsets
from . import sampling
from .transitions import CycleError, draft_levels, floor_widths

MAX_STOPS = 8  # stop token ids a static cycle compares each committed token with


@attrs.frozen
class StaticOps:
    """The static cycle's bookkeeping ops: the kernels of `backends.cuda.cycle` where they run, else their torch
    twins (the kernel module chooses per call: `backends.cuda.cycle.use_kernels`)."""

    cycle_slots: object
    verify_rows: object
    accept_commit: object

    @classmethod
    def of(cls, kernels: bool = True) -> StaticOps:
        if kernels:
            return cls(cycle_ops.cycle_slots, cycle_ops.verify_rows, cycle_ops.accept_commit)
        return cls(cycle_ops.cycle_slots_torch, cycle_ops.verify_rows_torch, cycle_ops.accept_commit_torch)


class CycleBuffers:
    """The stable addresses of ``B`` requests' records: two sets of cycle state (a cycle reads set ``p`` and writes
    set ``1 - p``), the output log, the page table, and the verify's and the draft extend's row inputs.

    ``verify_rows``: the verify forward's row count, ``B * N`` padded to the engine's row bucket (its padding rows
    attend nothing and write no KV); ``max_out`` the longest output, ``max_cycles`` the most cycles a run takes.
    """

    FIELDS = ("L", "root", "topk_p", "topk_index", "dh", "done", "out_len", "cycle", "all_done")

    def __init__(self, batch: int, cfg: SpecConfig, table_width: int, hidden: int, hidden_dtype, max_out: int,
                 max_cycles: int, verify_rows: int, device, draft_state: bool = True,
                 topk_pending: bool = False, vocab: int | None = None) -> None:  # fmt: skip
        long = dict(dtype=torch.long, device=device)
        n, width = cfg.num_draft_tokens, cfg.accept_width
        self.batch, self.config, self.device = batch, cfg, torch.device(device)
        # whether the records carry a forward draft's state (top-K, hidden); a lookup draft's carry none
        self.draft_state = draft_state
        # a shape of S == 0 over a draft that defers its top-K (`defers_first_level`): the records carry the draft's
        # hidden state alone, their top-K pending (`Ready.topk_pending`); its cycles never read a top-K
        self.topk_pending = draft_state and topk_pending and not cfg.drafts
        self.whole_run = False  # whether the loaded requests' pages cover their whole budget (`load`)
        # ``vocab`` (the target's): the buffers serve sampled requests beside greedy ones (`SampledBuffers`)
        self.sampling = None if vocab is None else SampledBuffers(batch, cfg, vocab, device)
        self.sets = [
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
            for _ in range(2)
        ]
        self.table = torch.full((batch, table_width), -1, **long)
        self.out = torch.zeros((batch, max_out + 1), **long)  # the last column: a bin for masked writes
        self.hist = torch.zeros((max_cycles + 1, batch), **long)
        self.max_new = torch.zeros(batch, **long)
        self.stops = torch.full((MAX_STOPS,), -1, **long)
        requests = torch.arange(batch, **long)
        rows = batch * n
        # constants, made here and never inside a capture (a tensor a capture makes holds no value until replayed)
        self.chain_parents = torch.arange(-1, n - 1, **long).expand(batch, n).contiguous()
        self.chain_depths = torch.arange(n, **long).expand(batch, n).contiguous()
        scratch = draft_scratch_offsets(cfg.num_steps, cfg.topk, 0, self.device)  # [S - 1, K]
        # the slots a cycle looks up: its verify rows' (L + i) and its draft scratch's (L + scratch)
        self.slot_offsets = torch.cat([torch.arange(n, **long), scratch.reshape(-1)])
        self.no_positions = torch.empty((batch, 0), **long)
        self.ext_request = requests.repeat_interleave(width)
        self.no_extra = torch.empty((batch * width, 0), **long)
        self.verify = dict(
            input_ids=torch.zeros(verify_rows, **long),
            positions=torch.zeros(verify_rows, **long),
            row_request=torch.cat([requests.repeat_interleave(n), torch.zeros(verify_rows - rows, **long)]),
            out_slots=torch.full((verify_rows,), -1, **long),
            prefix_lens=torch.zeros(verify_rows, **long),
            extra_slots=torch.full((verify_rows, n), -1, **long),
        )
        self.extend = {name: torch.zeros(batch * width, **long) for name in cycle_ops.EXTEND_FIELDS}
        self.extend["last"] = torch.zeros(batch, **long)
        # a lookup draft's proposals, written on the host before each cycle (`lookup_proposals`): each request's
        # tree tokens (column 0, the root, unused), parents (row numbers, -1 for the root) and padding flags (1: a
        # placeholder row the walk never accepts), one copy to the device for all three
        self.lookup = torch.zeros((3, batch, n), **long)

    def log(self, parity: int) -> OutputLog:
        s = self.sets[parity]
        return OutputLog(tokens=self.out, lengths=s["out_len"], done=s["done"], all_done=s["all_done"],
                         cycle=s["cycle"], accepted=self.hist, max_new=self.max_new, stops=self.stops,
                         reserved_for_run=self.whole_run)  # fmt: skip

    def ready(self, parity: int, requests) -> Ready:
        """The `Ready` record over set ``parity``."""
        s = self.sets[parity]
        state = (s["topk_p"], s["topk_index"], s["dh"]) if self.draft_state else (None, None, None)
        probs = self.sampling.dq[parity] if self.sampling is not None and self.draft_state else None
        if self.topk_pending:  # no top-K, no q: `first_level` computes both (eagerly) when a shape drafts
            state, probs = (None, None, s["dh"]), None
        return Ready(config=self.config, requests=tuple(requests), seq_lens=s["L"], root_tokens=s["root"],
                     topk_p=state[0], topk_index=state[1], draft_hidden=state[2], draft_probs=probs,
                     log=self.log(parity), topk_pending=self.topk_pending)  # fmt: skip

    def load(self, ready: Ready, page_table: torch.Tensor, max_new_tokens, stop_ids, columns: int | None = None,
             whole_run: bool = False) -> Ready:  # fmt: skip
        """Set 0 from an eager `Ready` record (a prefill's and its draft extend's, or a cycle's): its state, an empty
        log, the pages, each request's remaining budget (``max_new_tokens``, one for all or one a request, less the
        output it has) and the stops. A batch of fewer requests than the buffers hold fills the first rows; the
        rest are padding, finished from the start (slot -1 everywhere: they write and read no KV, commit nothing).
        ``columns``: the log columns the run may write (one cycle's: ``S + 1``; None: all), the rest left as they
        are. ``whole_run``: the requests' pages cover the whole budget (`OutputLog.reserved_for_run`).
        Returns the `Ready` record over set 0."""
        n = len(ready.requests)
        self.whole_run = whole_run
        if n > self.batch:
            raise ValueError(f"a batch of {n} requests does not fit buffers of {self.batch}")
        cur = self.sets[0]
        for name in ("L", "root", "topk_p", "topk_index", "dh", "out_len", "cycle"):
            cur[name].zero_()
        self.table.fill_(-1)
        self.table[:n, : page_table.shape[1]].copy_(page_table)
        cur["L"][:n].copy_(ready.seq_lens)
        cur["root"][:n].copy_(ready.root_tokens)
        if self.draft_state:
            if not self.topk_pending:
                cur["topk_p"][:n].copy_(ready.topk_p)
                cur["topk_index"][:n].copy_(ready.topk_index)
            cur["dh"][:n].copy_(ready.draft_hidden)
        cur["done"].fill_(True)
        cur["done"][:n].zero_()
        cur["all_done"].fill_(n == 0)
        self.out[:, :columns].zero_()
        self.out[:, -1].zero_()
        self.hist[: 1 if columns else None].zero_()
        limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        budgets = [m - len(r.output) for m, r in zip(limits, ready.requests)] + [0] * (self.batch - n)
        self.max_new.copy_(to_device(budgets, self.max_new.device))
        self.stops.fill_(-1)
        if stop_ids:
            self.stops[: len(stop_ids)] = to_device(list(stop_ids), self.stops.device)
        if self.sampling is not None:
            self.sampling.load(ready, self.draft_state)
        return self.ready(0, ready.requests)


class SampledBuffers:
    """What a cycle of `CycleBuffers` needs to serve sampled requests: each request's parameters as tensors (a
    greedy request: temperature 0), its seed and its committed count at load (the draws' counter is that count plus
    the log's length: `statemachine.sampling.stream_keys`), and per set the draft extend's ``q`` of the root's
    children (`Ready.draft_probs`); the draft's ``q`` of every verify row is built in ``draft_probs``."""

    def __init__(self, batch: int, cfg: SpecConfig, vocab: int, device) -> None:
        f32, long = dict(dtype=torch.float32, device=device), dict(dtype=torch.long, device=device)
        self.vocab = vocab
        self.index = torch.arange(batch, **long)
        self.sampled = torch.zeros(batch, dtype=torch.bool, device=device)
        self.temperature, self.top_p, self.min_p = (torch.zeros(batch, **f32) for _ in range(3))
        self.top_k, self.seed, self.base = (torch.zeros(batch, **long) for _ in range(3))
        self.dq = [torch.zeros((batch, vocab), **f32) for _ in range(2)]
        self.draft_probs = torch.zeros((batch, cfg.num_draft_tokens, vocab), **f32)

    def load(self, ready: Ready, draft_state: bool) -> None:
        """Each request's parameters, seed and committed count, and set 0's ``q`` (padding rows: greedy, zeros)."""
        requests, n = ready.requests, len(ready.requests)
        pad = self.index.shape[0] - n
        params = [r.sampling for r in requests]
        if any(not p.greedy and p.seed is None for p in params):
            raise ValueError("a sampled request reached the static executor without a seed: start it from an "
                             "Admitted record (the prefill gives it one)")  # fmt: skip
        host = {
            self.sampled: [not p.greedy for p in params] + [False] * pad,
            self.temperature: [p.temperature for p in params] + [0.0] * pad,
            self.top_k: [p.top_k for p in params] + [0] * pad,
            self.top_p: [p.top_p for p in params] + [1.0] * pad,
            self.min_p: [p.min_p for p in params] + [0.0] * pad,
            self.seed: [p.seed or 0 for p in params] + [0] * pad,
            self.base: [len(r.output) for r in requests] + [0] * pad,
        }
        for tensor, values in host.items():
            tensor.copy_(to_device(values, tensor.device, tensor.dtype))
        self.dq[0].zero_()
        if draft_state and ready.draft_probs is not None:
            self.dq[0][:n].copy_(ready.draft_probs)

    def rows(self, log: OutputLog) -> sampling.SampledRows:
        """Every request of the buffers as `sampling.SampledRows` (``mask``: which sample), its draws keyed by the
        committed count of ``log``'s record."""
        return sampling.SampledRows(index=self.index, temperature=self.temperature, top_k=self.top_k,
                                    top_p=self.top_p, min_p=self.min_p, seed=self.seed,
                                    counter=self.base + log.lengths, mask=self.sampled)  # fmt: skip

    def full_vocab(self, out: ModelOutput) -> ModelOutput:
        """A draft's logits over the target vocabulary: a draft vocabulary's (``vocab_map``) scattered into rows of
        ``-inf``, as the eager draft's forward returns them (sampling draws from ``q`` over the target's)."""
        if out.vocab_map is None:
            return out
        full = out.logits.new_full((out.logits.shape[0], self.vocab), float("-inf"))
        full.index_copy_(1, out.vocab_map, out.logits)
        return attrs.evolve(out, logits=full, vocab_map=None)


@attrs.define
class StaticContext:
    """What a static form reads besides its record and the ports: the buffers, the set its results go to
    (``into``), the attention's bound on ``prefix_lens``, the ops, the static forwards, and ``walk``: the
    predictions the greedy walk follows (None: the target's; benchmarks force acceptance through it)."""

    buffers: CycleBuffers
    into: int
    kv_bound: int
    ops: StaticOps
    forwards: StaticPorts
    walk: object = None
    rows: RowOutputs | None = None  # the last fused verify's row outputs (checked mode reads them)
    walked: torch.Tensor | None = None  # [B, N]: the predictions its walk followed


class _LevelPorts:
    """The ports `transitions.draft_levels` reads, over the draft's static step: ``draft.step`` and
    ``kv_pool.page_size``."""

    kind, pairing = "forward", "shifted"

    def __init__(self, step, kv_bound: int, page_size: int, sampled: SampledBuffers | None = None) -> None:
        self.draft, self.kv_pool = self, self
        self._step, self._bound, self.page_size, self._sampled = step, kv_bound, page_size, sampled

    def step(self, batch: ForwardBatch, parent_hidden) -> ModelOutput:
        out = self._step(batch, parent_hidden, self._bound)
        return out if self._sampled is None else self._sampled.full_vocab(out)


def _batch(rows: dict, table: torch.Tensor, page_size: int, logits_rows=None,
           logits_dtype=torch.float32) -> ForwardBatch:  # fmt: skip
    return ForwardBatch(page_table=table, page_size=page_size, request_ids=(), logits_rows=logits_rows,
                        logits_dtype=logits_dtype, **rows)  # fmt: skip


# ---- coverage ----------------------------------------------------------------------------------------
def static_covers(rec, ports) -> bool:
    """Whether the static forms serve ``rec`` and ``ports``: plain requests, greedy or sampled (`SamplingParams.plain`:
    no logprobs, no history-dependent logits, no grammar (constrained batches run eagerly: their masks come from the
    host), all speculating; a sampled one's `Ready` record carries the draft extend's ``q``) without stop strings,
    all with the same stop ids (at most `MAX_STOPS`: the log holds one list), no recurrent state, ports that declare
    static forwards, and a forward draft paired shifted or a lookup draft (its proposals come from the host's token
    histories before the cycle: `lookup_proposals`; sampled requests only in cycles of ``S == 0``, where it proposes
    nothing). A batch holding a sampled request needs buffers that serve sampling (`CycleBuffers` with ``vocab``)."""
    if static_forwards(ports) is None:
        return False
    if draft_kind(ports) != "lookup" and draft_pairing(ports) != "shifted":
        return False
    if not isinstance(ports.recurrent, NoRecurrentState):  # recurrent state commits per accepted row: eager only
        return False
    if isinstance(rec, Ready) and rec.topk_pending and rec.config.drafts:  # the first_level row runs eagerly first
        return False
    if isinstance(rec, Ready) and rec.retract:  # the retract row runs eagerly first (the draft rows wait for it)
        return False
    deferring = draft_kind(ports) == "forward" and not rec.config.drafts and defers_first_level(ports)
    if deferring and static_forwards(ports).extend_hidden is None:  # its extend of S == 0 has no static form
        return False
    stops = {frozenset(r.sampling.stop_token_ids) for r in rec.requests}
    if len(stops) > 1 or any(len(s) > MAX_STOPS for s in stops):
        return False
    if not all(r.sampling.plain and not r.sampling.stop_strings for r in rec.requests):
        return False
    sampled = any(not r.sampling.greedy for r in rec.requests)
    if sampled and draft_kind(ports) == "lookup" and rec.config.drafts:  # sampled lookup proposals: eager only
        return False
    # sampled requests of a forward draft draw their depth-1 children from the extend's q (`Ready.draft_probs`)
    return not (sampled and isinstance(rec, Ready) and rec.topk_p is not None and rec.draft_probs is None)


# ---- draft -------------------------------------------------------------------------------------------
def draft_tree_static(rec: Ready, ports, backend, ctx: StaticContext) -> Drafted:
    """`transitions.draft_tree` over the buffers: one slot lookup for the verify rows and the draft scratch (-1 for a
    finished request), the ``S - 1`` levels (`transitions.draft_levels`), a tree's rerank to ``N``. Buffers that
    serve sampled requests (`SampledBuffers`) draw every request's children and lay out every tree both ways: a
    sampled request takes its draws and its level-order tree, with padding where its draft ran out of mass, and
    the ``q`` of each verify row; a greedy one its top-K and rerank (`torch.where` per request)."""
    cfg, buf = rec.config, ctx.buffers
    S, K, N, P = cfg.num_steps, cfg.topk, cfg.num_draft_tokens, ports.kv_pool.page_size
    B, L, sampled = buf.batch, rec.seq_lens, buf.sampling
    slots = ctx.ops.cycle_slots(buf.table, L, rec.log.done, buf.slot_offsets, P)  # [B, N + (S - 1) K]
    verify_slots, draft_slots = slots[:, :N], slots[:, N:].view(B, max(S - 1, 0), K)
    if S == 0:  # the root alone: a plain decode step (the draft extend keeps the draft's state current)
        tree = DraftTree(tokens=rec.root_tokens[:, None], parents=buf.chain_parents, depths=buf.chain_depths)
        probs = None if sampled is None or rec.draft_probs is None else rec.draft_probs[:, None]
        return Drafted(config=cfg, requests=rec.requests, seq_lens=L, tree=tree, verify_slots=verify_slots,
                       draft_slots=draft_slots, draft_positions=buf.no_positions, draft_probs=probs,
                       log=rec.log)  # fmt: skip
    levels = _LevelPorts(ctx.forwards.step, ctx.kv_bound, P, sampled)
    rows = probs = None
    if sampled is not None:  # q of every verify row: the root's from the draft extend, the others' drawn here
        rows, probs = sampled.rows(rec.log), sampled.draft_probs
        probs.zero_()
        probs[:, 0].copy_(rec.draft_probs)
    cands, cand_scores, cand_parents, positions = draft_levels(
        levels, backend, cfg, (), L, buf.table, draft_slots, rec.topk_p, rec.topk_index, rec.draft_hidden, rows, probs
    )
    padding = None
    if K == 1:
        tokens = torch.cat([rec.root_tokens[:, None], cands], 1)
        parents, depths, scores = buf.chain_parents, buf.chain_depths, None
    else:  # EAGLE-2 rerank to N rows; the depths stay implicit (the verify's row op derives them)
        tokens, parents, scores = backend.rerank_tree(rec.root_tokens, cands, cand_scores, cand_parents, N)
        depths = None
        if sampled is not None:  # sampled requests: level order, never reranked (`sampling.level_order_tree`)
            level = sampling.level_order_tree(rec.root_tokens, cands, cand_scores, cand_parents, N)
            on = sampled.sampled[:, None]
            tokens, parents, scores = (torch.where(on, s, g) for s, g in zip(level, (tokens, parents, scores)))
    if sampled is not None:  # a draft that ran out of mass left -1: padding rows, never accepted
        padding, tokens = tokens < 0, tokens.clamp(min=0)
    widths = None
    if K == 1 and cfg.draft_floor:  # rows past the draft's confidence: padding the verify skips (`floor_widths`)
        widths, scores = floor_widths(cand_scores, cfg.draft_floor, None if sampled is None else sampled.sampled)
        cut = buf.chain_depths >= widths[:, None]
        padding = cut if padding is None else padding | cut
    tree = DraftTree(tokens=tokens, parents=parents, depths=depths, scores=scores, padding=padding, widths=widths)
    return Drafted(config=cfg, requests=rec.requests, seq_lens=L, tree=tree, verify_slots=verify_slots,
                   draft_slots=draft_slots, draft_positions=positions, draft_probs=probs, log=rec.log)  # fmt: skip


def lookup_proposals(rec: Ready, ports, buffers: CycleBuffers) -> None:
    """The host step of `lookup_tree_static`, run before the cycle (outside a captured graph): the lookup draft's
    proposals from each request's token history, as `transitions.lookup_tree` asks for them (``propose(ids,
    histories, S, N - 1, K)``), written into ``buffers.lookup`` in one copy.

    The draft proposes ``n <= N - 1`` nodes a request (the same ``n`` for the batch; shorter guesses padded by the
    draft itself, as on the eager path); the static verify always runs ``N`` rows, so rows past ``n`` (and every
    row of a padding request past the batch) are placeholders flagged as padding: the walk never accepts them, and
    the cycle commits what the eager row's ``n + 1``-row verify commits. In a cycle of ``S == 0`` there is nothing
    to propose."""
    cfg = rec.config
    if not cfg.drafts:
        return
    B, N, bs = buffers.batch, cfg.num_draft_tokens, len(rec.requests)
    if bs:
        tokens, parents = ports.draft.propose(
            tuple(r.request_id for r in rec.requests), [r.tokens for r in rec.requests], cfg.num_steps, N - 1,
            cfg.topk,
        )  # fmt: skip
    else:
        tokens = parents = torch.zeros((0, 0), dtype=torch.long)
    n = tokens.shape[1] if tokens.dim() == 2 else -1
    if tokens.shape != parents.shape or tokens.shape[0] != bs or not 0 <= n <= N - 1:
        raise CycleError(
            f"the lookup draft proposed tokens {tuple(tokens.shape)} / parents {tuple(parents.shape)}; "
            f"expected the same shape [bs={bs}, n <= N - 1 = {N - 1}]"
        )
    tokens, parents = tokens.cpu(), parents.cpu()
    if tokens.numel() and not (
        int(tokens.min()) >= 0
        and int(tokens.max()) < target_vocab_size(ports)
        and int(parents.min()) >= 0
        and bool((parents <= torch.arange(n)).all())
    ):
        raise CycleError(
            f"the lookup draft proposed token ids outside [0, {target_vocab_size(ports)}) or a parent that does "
            "not precede its node: a draft must share the target's vocabulary and list parents first"
        )
    host = torch.zeros((3, B, N), dtype=torch.long)
    host[1, :, 0] = -1
    # placeholders: a chain's continue the chain, a tree's hang under the root (depth 1)
    host[1, :, 1:] = torch.arange(N - 1) if cfg.is_chain else 0
    host[2, :, 1:] = 1
    host[0, :bs, 1 : n + 1] = tokens
    host[1, :bs, 1 : n + 1] = parents
    host[2, :bs, 1 : n + 1] = 0
    buffers.lookup.copy_(to_device(host, buffers.lookup.device))  # not waited for (`core.transfer`)


def _proposes(rec: Ready) -> bool:
    """Whether a lookup draft proposes in ``rec``'s cycle: in a shape of ``S > 0``."""
    return bool(rec.config.drafts)


@attrs.frozen
class HostStep:
    """A static form's host step (`table.Transition.host`): ``run(record, ports, buffers)``, run on the host before
    the cycle, outside any capture, writes what the form reads into the buffers; ``needed(record)``: whether a
    cycle from ``record`` reads it (False: skipped, and such cycles may follow one another with no host between
    them: `FusedCycles.run`'s whole-run loop, a pipelined launch)."""

    run: object
    needed: object

    @property
    def name(self) -> str:
        return self.run.__name__


LOOKUP_PROPOSALS = HostStep(lookup_proposals, _proposes)


def lookup_tree_static(rec: Ready, ports, backend, ctx: StaticContext) -> Drafted:
    """`transitions.lookup_tree` over the buffers: the verify rows' slots (-1 for a finished request) and the tree
    of the proposals the host step wrote (`lookup_proposals`, declared beside this form in the table): the root,
    then ``N - 1`` rows, those past the draft's proposals padding the walk never accepts. In a cycle of ``S == 0``
    the tree is the root alone: a plain decode step."""
    cfg, buf = rec.config, ctx.buffers
    N = cfg.num_draft_tokens
    slots = ctx.ops.cycle_slots(buf.table, rec.seq_lens, rec.log.done, buf.slot_offsets, ports.kv_pool.page_size)
    empty = buf.no_positions.view(buf.batch, 0, 1).expand(buf.batch, 0, cfg.topk)
    if not cfg.drafts:
        tree = DraftTree(tokens=rec.root_tokens[:, None], parents=buf.chain_parents, depths=buf.chain_depths)
    else:
        tokens = torch.cat([rec.root_tokens[:, None], buf.lookup[0, :, 1:]], 1)
        padding = buf.lookup[2].bool()
        if cfg.is_chain:
            tree = DraftTree(tokens=tokens, parents=buf.chain_parents, depths=buf.chain_depths, padding=padding)
        else:  # the depths stay implicit (the verify's row op derives them)
            tree = DraftTree(tokens=tokens, parents=buf.lookup[1], depths=None, padding=padding)
    return Drafted(config=cfg, requests=rec.requests, seq_lens=rec.seq_lens, tree=tree, verify_slots=slots[:, :N],
                   draft_slots=empty, draft_positions=buf.no_positions, log=rec.log)  # fmt: skip


# ---- verify, accept, compact: the accept_commit fusion ------------------------------------------------
def accept_commit_static(rec: Drafted, ports, backend, ctx: StaticContext) -> Compacted:
    """The verify forward, then `backends.cuda.cycle.accept_commit` in place of the rest of the verify, accept and
    compact rows: the greedy walk, the cut at stops and ``max_new_tokens``, the commit to the log, the next
    ``L`` and root, a tree's KV moves (run here, as compact's ``move_kv``) and the draft extend's rows."""
    cfg, buf = rec.config, ctx.buffers
    S, N, P = cfg.num_steps, cfg.num_draft_tokens, ports.kv_pool.page_size
    B, L, tokens = buf.batch, rec.seq_lens, rec.tree.tokens
    parents = None if cfg.is_chain else rec.tree.parents
    # the verify's row inputs (the tree mask as extra slots), padded to the row bucket of the decode step
    ctx.ops.verify_rows(tokens, parents, L, rec.verify_slots, S, buf.verify, backend, rec.tree.widths)
    # an all-greedy batch's verify reads its logits' argmax only: in the model's dtype, the same values without the
    # float32 copy (at 64 requests of a 5-row chain and SmolLM2's 49,152 tokens a 94 MB pass)
    dtype = torch.float32 if buf.sampling is not None else None
    out = ctx.forwards.forward(_batch(buf.verify, buf.table, P, logits_dtype=dtype), ctx.kv_bound)
    # the vocabulary argmax the decode step takes (ties included): what the verify row commits
    predict = backend.greedy_predict(out.logits[: B * N]).view(B, N)
    walk = predict if ctx.walk is None else ctx.walk(rec, tokens, parents, predict)
    if buf.sampling is not None:
        predict, walk = _sampled_walk(rec, out.logits[: B * N], predict, walk, backend, buf.sampling)
    ctx.rows, ctx.walked = RowOutputs(predict=predict.view(-1), hidden=out.hidden), walk
    log, nxt = rec.log, buf.sets[ctx.into]
    cur = dict(L=L, done=log.done, out_len=log.lengths, cycle=log.cycle)
    logs = dict(out=log.tokens, hist=log.accepted, max_new=log.max_new, stops=log.stops)
    ext = buf.extend
    if rec.tree.padding is not None:  # placeholder rows (a lookup draft's): token -1, which no prediction equals
        tokens = torch.where(rec.tree.padding, -1, tokens)
    ctx.ops.accept_commit(tokens, parents, predict, walk, rec.verify_slots, cur, nxt, logs, ext, backend)
    moves = None
    if parents is not None:  # compact: the accepted rows move to [L, L + keep) (a chain's are there already)
        moves = (ext["src"], ext["dst"])
        _move_padded(ports.kv_pool.target_buffers(), *moves, per_request=cfg.accept_width)
    extend = ExtendRows(input_ids=ext["input_ids"], positions=ext["positions"], row_request=buf.ext_request,
                        hidden=out.hidden.index_select(0, ext["feature_rows"]), out_slots=ext["out_slots"],
                        prefix_lens=ext["prefix_lens"], logits_rows=ext["last"])  # fmt: skip
    return Compacted(config=cfg, requests=rec.requests, seq_lens=nxt["L"], root_tokens=nxt["root"], extend=extend,
                     kv_moves=moves, log=buf.log(ctx.into))  # fmt: skip


def _sampled_walk(rec: Drafted, logits, predict, walk, backend, sampled: SampledBuffers):
    """The sampled requests' verify (`sampling.verify_sampled`, every request of the buffers) as the predictions
    and the walk `accept_commit` takes. Along its accepted path a sampled request predicts the tokens it commits
    (each accepted child's, then the final sample at the path's last row); its walk is those predictions with -2
    at the last row and off the path, so the greedy walk follows exactly its accepted path (each accepted child
    is the first sibling with its token: siblings are distinct draws, padding comes after them) and stops there.
    A greedy request keeps its own predictions and walk. Shapes: ``[B, N]`` each."""
    cfg = rec.config
    B, N = predict.shape
    greedy_index = torch.zeros((B, cfg.accept_width), dtype=torch.long, device=predict.device)
    accept_index, accept_len, merged, _ = sampling.verify_sampled(
        sampled.rows(rec.log), rec.tree, rec.draft_probs, logits, cfg.accept_width, cfg.is_chain, greedy_index,
        torch.ones(B, dtype=torch.long, device=predict.device), predict.reshape(-1), backend,
    )  # fmt: skip
    merged = merged.view(B, N)
    base = sampled.index[:, None] * N
    last = accept_index.gather(1, (accept_len - 1).clamp(min=0)[:, None]) - base  # [B, 1]: the path's last row
    rows = torch.arange(N, device=predict.device)[None, :]
    on = sampled.sampled[:, None]
    # -2 stops the walk: no token equals it, neither a real one nor a placeholder row's -1 (`accept_commit_static`)
    walk = torch.where(on, torch.where((rows == last) | (merged < 0), -2, merged), walk)
    # off its path a sampled request predicts -1: the argmax there instead (the extend's rows past the committed run
    # still feed the draft a token, which nothing reads)
    return torch.where(merged >= 0, merged, predict), walk


def _move_padded(buffers, src: torch.Tensor, dst: torch.Tensor, per_request: int) -> None:
    """Copy KV slot ``src[m]`` to ``dst[m]`` in every buffer, negatives skipped, all reads of a request's moves
    before any of its writes (``per_request`` moves each, in request order: the kernel takes whole requests a call,
    at most `kv.MAX_MOVES` moves; no request's moves touch another's slots)."""
    buffers = list(buffers)
    if src.device.type == "cuda":
        from ..backends.cuda import kv

        step = max(1, kv.MAX_MOVES // per_request) * per_request
        for start in range(0, src.numel(), step):
            kv.move_kv(buffers, src[start : start + step], dst[start : start + step])
        return
    ok = (src >= 0) & (dst >= 0)  # eager on a CPU: a boolean index is fine here
    for buf in buffers:
        buf[dst[ok]] = buf[src[ok]]


# ---- draft extend -----------------------------------------------------------------------------------
def draft_extend_static(rec: Compacted, ports, backend, ctx: StaticContext) -> Ready:
    """`transitions.draft_extend` over the fusion's ``W`` rows a request: token ``d`` at ``L + d`` with its row's
    target features; the top-K and draft hidden state of each request's last committed row, written in place."""
    cfg, buf, ext = rec.config, ctx.buffers, rec.extend
    rows = dict(input_ids=ext.input_ids, positions=ext.positions, row_request=ext.row_request,
                out_slots=ext.out_slots, prefix_lens=ext.prefix_lens, extra_slots=buf.no_extra)  # fmt: skip
    batch = _batch(rows, buf.table, ports.kv_pool.page_size, ext.logits_rows)
    out = ctx.forwards.extend(batch, ext.hidden, ctx.kv_bound)
    nxt, sampled, probs = buf.sets[ctx.into], buf.sampling, None
    if sampled is not None:
        out = sampled.full_vocab(out)
    backend.select_topk(out.logits, cfg.topk, out.vocab_map, out=(nxt["topk_p"], nxt["topk_index"]))
    if cfg.draft_floor:  # a chain cut by confidence: the top token's probability (`transitions.floor_widths`)
        nxt["topk_p"][:, 0].copy_(backend.top1_probability(out.logits))
    if sampled is not None:  # sampled requests draw their depth-1 children from q, without replacement
        probs = sampled.dq[ctx.into]
        drawn = sampling.draw_children(sampled.rows(rec.log), out.logits, 1, nxt["topk_p"], nxt["topk_index"], 0,
                                       backend)  # fmt: skip
        for target, value in zip((nxt["topk_p"], nxt["topk_index"], probs), drawn):
            target.copy_(value)
    torch.index_select(out.hidden, 0, ext.logits_rows, out=nxt["dh"])
    return Ready(config=cfg, requests=rec.requests, seq_lens=rec.seq_lens, root_tokens=rec.root_tokens,
                 topk_p=nxt["topk_p"], topk_index=nxt["topk_index"], draft_hidden=nxt["dh"], draft_probs=probs,
                 log=rec.log)  # fmt: skip


def draft_extend_deferred_static(rec: Compacted, ports, backend, ctx: StaticContext) -> Ready:
    """`transitions.draft_extend_deferred` over the fusion's ``W`` rows a request: the draft's layers alone
    (``extend_hidden_static``: its KV and hidden state, no LM head, no top-K); each request's last committed row's
    hidden state written in place, the top-K pending."""
    cfg, buf, ext = rec.config, ctx.buffers, rec.extend
    rows = dict(input_ids=ext.input_ids, positions=ext.positions, row_request=ext.row_request,
                out_slots=ext.out_slots, prefix_lens=ext.prefix_lens, extra_slots=buf.no_extra)  # fmt: skip
    batch = _batch(rows, buf.table, ports.kv_pool.page_size, ext.logits_rows)
    hidden = ctx.forwards.extend_hidden(batch, ext.hidden, ctx.kv_bound)
    nxt = buf.sets[ctx.into]
    torch.index_select(hidden, 0, ext.logits_rows, out=nxt["dh"])
    return Ready(config=cfg, requests=rec.requests, seq_lens=rec.seq_lens, root_tokens=rec.root_tokens,
                 topk_p=None, topk_index=None, draft_hidden=nxt["dh"], log=rec.log, topk_pending=True)  # fmt: skip


def skip_extend_static(rec: Compacted, ports, backend, ctx: StaticContext) -> Ready:
    """`transitions.skip_extend`: a lookup draft keeps no draft cache, so the next `Ready` record has no draft state."""
    return Ready(config=rec.config, requests=rec.requests, seq_lens=rec.seq_lens, root_tokens=rec.root_tokens,
                 topk_p=None, topk_index=None, draft_hidden=None, log=rec.log)  # fmt: skip
