"""Everything that moves a batch through the speculative cycle lives in this table.

One row per transition: the record type it reads, the event, the guard that enables it, the record
type it returns, the backend ops it calls, and the function that runs it. Read it top to bottom; the
docs' state diagram and transition table are rendered from it (`speccycle.statemachine.render`).
For each record type and event, the guards of its rows are exclusive, so at most one row applies.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ..core.records import Accepted, Admitted, Compacted, Drafted, Ready, Verified
from . import block as blk
from . import static_rows as sr
from . import transitions as t

Guard = Callable[[object, object], bool]


def always(record, ports) -> bool:
    return True


@attrs.frozen
class Transition:
    source: type
    event: str
    target: type
    run: Callable = attrs.field(repr=False)
    ops: tuple[str, ...] = ()
    guard: Guard = always
    doc: str = ""
    # the row's static form (`statemachine.static_rows`): the same work over records at stable addresses, with no
    # host sync and no value-dependent shape, for the static and graphed executors; None: eager only
    static: Callable | None = attrs.field(default=None, repr=False)
    # the static form's host step (`static_rows.HostStep`): it reads the record's requests (host values a captured
    # form cannot read) and writes what the form reads into the `static_rows.CycleBuffers`; the static executor runs
    # it before the cycle, outside any capture (`StaticExecutor.prepare`), so only a row that starts a cycle (source
    # `Ready`) may have one. None: the form needs nothing from the host
    host: sr.HostStep | None = attrs.field(default=None, repr=False)
    # where a constrained request's grammar enters the row: the host steps of `statemachine.grammar` that compute
    # its token masks, cut its run or move its matcher, or the record field the row reads its masks from; the
    # masks reach the logits through the backend op ``apply_token_mask``
    grammar: tuple[str, ...] = ()

    @property
    def guard_name(self) -> str:
        return "" if self.guard is always else self.guard.__name__


# The backend ops of one draft level (its slots, top-K, the top token's probability under draft_floor, a grammar's
# mask, sampling's processing and draws): the draft extend runs the first level, the draft row the rest.
DRAFT_LEVEL_OPS = (
    "slots_for_positions",
    "select_topk",
    "top1_probability",
    "apply_token_mask",
    "process_logits",
    "uniforms_from_keys",
    "sample_without_replacement",
)

TABLE: tuple[Transition, ...] = (
    Transition(
        Admitted,
        "prefill",
        Compacted,
        t.prefill,
        ops=(
            "slots_for_positions",
            "greedy_predict",
            "apply_token_mask",
            "process_logits",
            "uniforms_from_keys",
            "sample_without_replacement",
        ),
        grammar=("compile_request", "next_masks", "cut", "advance"),
        doc="Target extend over the prompts, first token (argmax or sampled from p), draft-extend rows shifted by one.",
    ),
    Transition(
        Compacted,
        "retire",
        Compacted,
        t.retire,
        guard=t.any_finished,
        doc="Finished requests leave the batch; every page they held is freed once.",
    ),
    Transition(
        Compacted,
        "extend",
        Ready,
        t.draft_extend,
        guard=t.extend_ready,
        ops=DRAFT_LEVEL_OPS,
        grammar=("draft_masks",),
        doc="Draft extend over the committed tokens: draft KV and the depth-1 top-K (sampled: K draws from q; "
        "a chain under draft_floor: its top token's probability).",
        static=sr.draft_extend_static,
    ),
    Transition(
        Compacted,
        "extend",
        Ready,
        t.draft_extend_deferred,
        guard=t.extend_deferred,
        ops=("slots_for_positions",),
        doc="A cycle of S == 0: the draft's layers over the committed tokens (its KV and hidden state), no LM head "
        "and no top-K; the Ready record's top-K is pending (first_level computes it when a shape drafts again).",
        static=sr.draft_extend_deferred_static,
    ),
    Transition(
        Compacted,
        "extend",
        Ready,
        t.skip_extend,
        guard=t.lookup_ready,
        doc="A lookup draft keeps no draft cache.",
        static=sr.skip_extend_static,
    ),
    Transition(
        Compacted,
        "extend",
        Ready,
        blk.block_extend,
        guard=t.block_ready,
        ops=("slots_for_positions",),
        doc="A block draft (DFlash) writes its context from the target's features of the committed tokens.",
    ),
    Transition(
        Ready,
        "retire",
        Ready,
        t.retire_ready,
        guard=t.any_finished,
        doc="Requests that finished in a static cycle (it commits and extends in one replay), or were cancelled "
        "between cycles, leave the batch; every page they held is freed once.",
    ),
    Transition(
        Ready,
        "retract",
        Ready,
        t.retract,
        guard=t.retracting,
        doc="Requests an engine short of KV pages takes out (Ready.retract) leave the batch unfinished, their "
        "committed output kept; every page they held is freed once. Queued again, a readmission recomputes their KV.",
    ),
    Transition(
        Ready,
        "first_level",
        Ready,
        t.first_level,
        guard=t.first_level_due,
        ops=tuple(op for op in DRAFT_LEVEL_OPS if op != "slots_for_positions"),  # a level's top-K, no forward
        grammar=("draft_masks",),
        doc="A batch whose top-K a cycle of S == 0 deferred, moved to a shape that drafts: the draft's logits from "
        "its hidden state (the extend's, exactly), then the depth-1 top-K as the extend takes it.",
    ),
    Transition(
        Ready,
        "draft",
        Drafted,
        t.draft_tree,
        guard=t.forward_draft_live,
        ops=(*DRAFT_LEVEL_OPS, "advance_frontier", "rerank_tree"),
        grammar=("FrontierMasks", "row_masks"),
        doc="Reserve the cycle's slots; S - 1 draft forwards at L + depth - 1; rerank to N - 1 "
        "(sampled: children drawn from q, level order, no rerank; speculate=False: no draft rows, width 1; "
        "a chain under draft_floor: a greedy request's rows cut where its draft's confidence runs out).",
        static=sr.draft_tree_static,
    ),
    Transition(
        Ready,
        "draft",
        Drafted,
        t.lookup_tree,
        guard=t.lookup_draft_live,
        ops=("slots_for_positions",),
        grammar=("row_masks",),
        doc="Reserve the cycle's slots; the lookup draft proposes up to N - 1 nodes (fewer: a cheaper verify; "
        "the static form verifies N rows, those past the proposals padding).",
        static=sr.lookup_tree_static,
        host=sr.LOOKUP_PROPOSALS,
    ),
    Transition(
        Ready,
        "draft",
        Drafted,
        blk.draft_block,
        guard=t.block_draft_live,
        ops=("slots_for_positions", "greedy_predict"),
        doc="Reserve the cycle's slots; one non-causal draft forward over [root, mask x (B - 1)] at L + i.",
    ),
    Transition(
        Drafted,
        "verify",
        Verified,
        t.verify,
        guard=t.not_block_draft,
        ops=(
            "tree_mask",
            "greedy_predict",
            "apply_token_mask",
            "verify_greedy",
            "verify_greedy_chain",
            "process_logits",
            "uniforms_from_keys",
            "verify_chain_sampling",
            "verify_tree_sampling",
        ),
        grammar=("Drafted.token_masks",),
        doc="One target forward over [root, drafts] at L + depth with the tree mask (the rows within each "
        "request's width); each row's logits changed by its own path (penalties, bias, bad words); greedy walk "
        "(sampled: lossless rejection sampling, chain or tree).",
    ),
    Transition(
        Drafted,
        "verify",
        Verified,
        blk.verify_block,
        guard=t.block_draft,
        ops=("greedy_predict", "verify_block"),
        doc="One target forward over the block as a chain; correct_len = cumprod(cand[1:] == target[:-1]).sum().",
    ),
    Transition(
        Verified,
        "accept",
        Accepted,
        t.accept,
        ops=("gather_accepted", "fill_bonus"),
        grammar=("cut",),
        doc="Gather the accepted path, cut it at stops, read the bonus at stride S + 1.",
    ),
    Transition(
        Accepted,
        "compact",
        Compacted,
        t.compact,
        ops=("plan_kv_move", "move_kv", "last_correct_step_indices"),
        grammar=("advance",),
        doc="Move the accepted path's KV to [L, L + accept_len); commit; pick recurrent state.",
    ),
)

STATES: tuple[type, ...] = (Admitted, Ready, Drafted, Verified, Accepted, Compacted)


@attrs.frozen
class Fusion:
    """One op of a backend that does the work of several rows of the table (or of some of their ops).

    ``rows`` are the table rows whose work it does, in cycle order; ``replaces_ops`` the ops of those rows
    it takes over (a row's forward, and any op not named, still runs as the row says); ``module`` the kernel
    module that holds the op beside its torch twin (``<op>`` and ``<op>_torch``). A property test holds the
    op and its twin equal to the rows on random batches (tests/property/test_fusions.py); an executor may
    run a fusion in place of its rows only for the records and ports ``doc`` says it covers.
    """

    op: str
    rows: tuple[Transition, ...]
    replaces_ops: tuple[str, ...]
    module: str
    doc: str = ""
    # the fusion's static form: the covered rows' forwards, then the op, from the first row's source record to the
    # last row's result (`statemachine.static_rows`); ``covers(record, ports)``: the records and ports it serves
    static: Callable | None = attrs.field(default=None, repr=False)
    covers: Guard = attrs.field(default=always, repr=False)


def _row(run: Callable) -> Transition:
    (row,) = (r for r in TABLE if r.run is run)
    return row


FUSIONS: tuple[Fusion, ...] = (
    Fusion(
        "accept_commit",
        rows=(_row(t.verify), _row(t.accept), _row(t.compact)),
        replaces_ops=("verify_greedy", "verify_greedy_chain", "gather_accepted", "fill_bonus", "plan_kv_move"),
        module="speccycle.backends.cuda.cycle",
        doc="After the verify forward: the greedy walk, the cut at stop tokens and max_new_tokens, the bonus, "
        "the commit to an output log, a tree's KV moves (planned; move_kv runs them), the draft extend's rows, "
        "and the done flags (the requests finish from them when the log is read back). Greedy or sampled "
        "requests (a sampled request's verify runs first, as the row's sampling ops, and the walk follows its "
        "accepted path) with one stop list and no stop strings, logprobs, grammar or history-dependent logits, "
        "every request speculating, no recurrent state, a forward draft paired shifted or a lookup draft (its "
        "proposals from the draft row's host step; sampled requests only in cycles of S == 0).",
        static=sr.accept_commit_static,
        covers=sr.static_covers,
    ),
)


def fusions_of(row: Transition) -> tuple[Fusion, ...]:
    """The fusions that do (some of) ``row``'s work."""
    return tuple(f for f in FUSIONS if row in f.rows)
