"""The records of the cycle: one frozen attrs class per state, changed only through `attrs.evolve`.

A batch moves through

    Admitted -> Compacted -> Ready -> Drafted -> Verified -> Accepted -> Compacted -> ...

(prefill commits the prompt, so its result is a `Compacted` record like any cycle's). Tensor fields
carry their shape in a comment and compare by identity (``eq=False`` on the class); ``bs`` requests,
``N`` verify rows each, ``S + 1`` the accept width, ``T`` ragged rows, ``F`` target features,
``Hd`` draft hidden size.

An executor that runs the cycle over buffers at stable addresses (`statemachine.static`) commits to an
`OutputLog` on the device instead of each `Request.output` (a host copy a cycle); its records carry the
log, and the requests' outputs are materialized from it when they retire.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch

from .config import SamplingParams, SpecConfig

# "cancelled": the caller gave the request up (`Scheduler.cancel`); its output so far is kept
FinishReason = Literal["eos", "stop", "length", "error", "cancelled"]


@attrs.frozen(eq=False)
class GrammarState:
    """A constrained request's grammar: its engine's matcher and how many output tokens it stands after.

    The matcher is the grammar engine's own object (`core.ports.GrammarMatcher`), owned by this request: the
    draft and the verify advance it along a branch and roll it back; only the compact row moves it for good,
    and then evolves ``consumed`` to the new output length (invariant 16: ``consumed == len(output)`` at every
    `Compacted` and `Ready` record, and the matcher stands exactly after the committed tokens).
    """

    matcher: object = attrs.field(repr=False)
    consumed: int = 0


@attrs.frozen
class Request:
    """One request's host-side bookkeeping. ``output`` holds every committed token, the root included."""

    request_id: int
    prompt: tuple[int, ...]
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    output: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: tuple[float, ...] = ()  # log p of each output token, when sampling.logprobs (docs: sampling)
    grammar: GrammarState | None = attrs.field(default=None, eq=False)  # set at prefill when sampling.constraint
    # per output token, its sampling.top_logprobs most likely tokens as (token id, log p), most likely first
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt + self.output


@attrs.frozen(eq=False)
class RowOutputs:
    """Everything the verify forward produces per verify row.

    Flat over the batch (``[bs * N, ...]``) after verify, ``[bs, S + 1, ...]`` after the accepted path
    is gathered. A new per-row output is a new field here: compaction walks `attrs.fields`, so it is
    compacted with the rest (SGLang's tree compaction once forgot routed-experts outputs).
    """

    predict: torch.Tensor  # [bs * N] int64: the token each row's target output commits next
    hidden: torch.Tensor | None = None  # [bs * N, F]: target features for the draft extend
    logprobs: torch.Tensor | None = None  # [bs * N] float32: log p(predict) under the target
    top_logprobs: torch.Tensor | None = None  # [bs * N, n] float32: the n largest log p of the row, descending
    top_ids: torch.Tensor | None = None  # [bs * N, n] int64: their tokens


@attrs.frozen(eq=False)
class ExtendRows:
    """Rows the draft extend must run, ragged over requests (``T`` rows in all).

    The draft cache covers positions ``[0, L + offset)``, offset 1 for ``aligned`` drafts (the root).
    """

    input_ids: torch.Tensor  # [T] int64: the token the draft sees at each position
    positions: torch.Tensor  # [T] int64
    row_request: torch.Tensor  # [T] int64: index of the row's request in the batch
    hidden: torch.Tensor | None  # [T, F]: target features paired with each row (shifted drafts)
    # Set by a fusion that writes the extend's inputs itself (static shapes, `statemachine.static`): ``W``
    # rows a request, rows past its committed run write draft KV no later forward reads before writing it
    # again. None: the extend row computes them (``prefix_lens = positions + 1``, the request's last row).
    out_slots: torch.Tensor | None = None  # [T] int64
    prefix_lens: torch.Tensor | None = None  # [T] int64
    logits_rows: torch.Tensor | None = None  # [bs] int64: each request's last committed row
    # the rows of prompts (a prefill's draft extend): the draft's forward is a prefill (`ForwardBatch.prefill`)
    prefill: bool = False


@attrs.frozen(eq=False)
class OutputLog:
    """A batch's committed tokens on its device, for executors that commit without a host copy.

    Every record of one run shares ``tokens``, ``accepted``, ``max_new`` and ``stops``; the others are the
    record's own (a cycle reads one set and writes the next). Request ``b``'s output is its `Request.output`
    (the record's requests are the host's view as of the log's start) followed by ``tokens[b, :lengths[b]]``.
    ``O`` the most tokens a log takes, ``C`` the most cycles, ``X`` stop ids.
    """

    tokens: torch.Tensor  # [bs, O + 1] int64; column O takes the masked writes
    lengths: torch.Tensor  # [bs] int64
    done: torch.Tensor  # [bs] bool: finished (a stop token, max_new_tokens); commits nothing more
    all_done: torch.Tensor  # [1] bool
    cycle: torch.Tensor  # [1] int64: cycles run since the log began
    accepted: torch.Tensor  # [C + 1, bs] int64: tokens cycle c committed (0 once done)
    max_new: torch.Tensor  # [bs] int64: log length at which a request finishes (its remaining max_new_tokens)
    stops: torch.Tensor  # [X] int64: stop token ids, -1 padded
    reserved_for_run: bool = False  # the requests' pages cover their whole budget (else one cycle's reservation)


@attrs.frozen(eq=False)
class Admitted:
    """Requests whose prompts are not yet in the cache.

    ``cached``: per request, how many of its leading tokens' KV its pages already hold (a prefix cache hit,
    `PagedKVPool.attach_prefix`); the prefill computes only the rest. Empty: none for any request.
    """

    config: SpecConfig
    requests: tuple[Request, ...]
    cached: tuple[int, ...] = ()


@attrs.frozen(eq=False)
class Compacted:
    """The cycle's (or the prefill's) tokens are committed; finished requests still in the batch.

    ``root_tokens`` are the last committed tokens: their KV is not in the target cache yet.
    """

    config: SpecConfig
    requests: tuple[Request, ...]
    seq_lens: torch.Tensor  # [bs] int64: L, committed tokens in the target cache
    root_tokens: torch.Tensor  # [bs] int64
    extend: ExtendRows
    kv_moves: tuple[torch.Tensor, torch.Tensor] | None = None  # ([M] src, [M] dst) slots, M <= bs * (S+1)
    accept_len: torch.Tensor | None = None  # [bs] int64: tokens committed by the last cycle
    last_correct_step_indices: torch.Tensor | None = None  # [bs] int64 in [0, N)
    retired: tuple[Request, ...] = ()  # requests that left the batch at this boundary
    log: OutputLog | None = None  # the device's commit (static executors); None: Request.output holds it


@attrs.frozen(eq=False)
class Ready:
    """Ready to draft. ``topk_*`` and ``draft_hidden`` are the draft extend's first tree level (``topk_pending``:
    the top-K is deferred until a shape that drafts needs it)."""

    config: SpecConfig
    requests: tuple[Request, ...]
    seq_lens: torch.Tensor  # [bs] int64
    root_tokens: torch.Tensor  # [bs] int64
    topk_p: torch.Tensor | None  # [bs, K] float32: draft probabilities of the depth-1 candidates
    topk_index: torch.Tensor | None  # [bs, K] int64: their tokens
    draft_hidden: torch.Tensor | None  # [bs, Hd]: the draft hidden state their forward is fed with
    retired: tuple[Request, ...] = ()
    # [bs, V] float32: the processed draft distribution sampled requests drew their depth-1 candidates
    # from (zero rows for greedy requests); None when every request is greedy. ``topk_index`` is -1
    # where a sampled draft ran out of mass before K candidates.
    draft_probs: torch.Tensor | None = None
    log: OutputLog | None = None
    # The draft extend of a cycle of ``S == 0`` ran the draft's layers alone (a draft that can, `core.ports.defers_
    # first_level`): ``draft_hidden`` is current, the depth-1 top-K not computed (``topk_*`` and ``draft_probs``
    # None). The table's ``first_level`` row computes it from ``draft_hidden`` once the batch moves to a shape of
    # ``S >= 1`` (invariant 17).
    topk_pending: bool = False
    # Ids of requests an engine takes out of the batch at this boundary (KV pressure), their committed output kept:
    # the table's ``retract`` row frees their pages and moves them to ``retired`` unfinished (``finish_reason``
    # None); the engine queues them again, and a readmission recomputes their KV.
    retract: tuple[int, ...] = ()


@attrs.frozen(eq=False)
class DraftTree:
    """The verify rows of every request: row 0 is the root, parents precede children."""

    tokens: torch.Tensor  # [bs, N] int64
    parents: torch.Tensor  # [bs, N] int64: row index of the parent, -1 for the root
    depths: torch.Tensor | None  # [bs, N] int64: 0 for the root; None: not materialized (a static verify derives them)
    scores: torch.Tensor | None = None  # [bs, N] float32: cumulative draft probability (root 1)
    # [bs, N] bool: placeholder rows the verify never accepts: a sampled draft had no token for them (it ran out of
    # mass), a lookup draft proposed fewer, or they lie past the request's width. None: no such row.
    padding: torch.Tensor | None = None
    # [bs] int64: rows ``[0, width)`` of each request are verified; the rest are padding the verify forward
    # skips (``SamplingParams(speculate=False)``: width 1, the root alone; a chain under ``SpecConfig.draft_floor``:
    # the rows its draft's confidence reaches). None: every request verifies N rows.
    widths: torch.Tensor | None = None


@attrs.frozen(eq=False)
class Drafted:
    """A tree per request, with the slots its verify rows will write."""

    config: SpecConfig
    requests: tuple[Request, ...]
    seq_lens: torch.Tensor  # [bs] int64
    tree: DraftTree
    verify_slots: torch.Tensor  # [bs, N] int64: slot of verify row i is the slot of position L + i
    draft_slots: torch.Tensor  # [bs, S - 1, K] int64: draft scratch slots (empty for lookup drafts)
    draft_positions: torch.Tensor  # [bs, S - 1] int64: position each draft forward ran at
    # [bs, N, V] float32: q of each row, the processed draft distribution its children were drawn
    # from (sampled requests; zero rows elsewhere). None: every request greedy, or a lookup draft,
    # whose proposals the sampling verify treats as point masses.
    draft_probs: torch.Tensor | None = None
    log: OutputLog | None = None
    # [bs, N, W] int32: the grammar's token bitmask of every verify row (``W = ceil(V / 32)``): row d's is the
    # matcher's state after the path to node d; all ones for unconstrained requests. None: no constrained request.
    token_masks: torch.Tensor | None = None


@attrs.frozen(eq=False)
class Verified:
    """The target has scored every verify row; ``accept_index`` walks the accepted path."""

    config: SpecConfig
    requests: tuple[Request, ...]
    seq_lens: torch.Tensor  # [bs] int64
    tree: DraftTree
    verify_slots: torch.Tensor  # [bs, N] int64
    rows: RowOutputs  # flat [bs * N, ...]
    accept_index: torch.Tensor  # [bs, S + 1] int64: flat row indices, -1 padded
    accept_len: torch.Tensor  # [bs] int64: correct_drafts + 1, in [1, min(S + 1, N)]


@attrs.frozen(eq=False)
class Accepted:
    """The accepted path gathered to the front, the bonus filled, the run cut at stops."""

    config: SpecConfig
    requests: tuple[Request, ...]
    seq_lens: torch.Tensor  # [bs] int64
    tree: DraftTree
    verify_slots: torch.Tensor  # [bs, N] int64
    accept_index: torch.Tensor  # [bs, S + 1] int64
    accept_len: torch.Tensor  # [bs] int64: after the cut at stops
    accepted_rows: RowOutputs  # [bs, S + 1, ...]: row d is accept_index[b, d]'s output
    bonus: torch.Tensor  # [bs] int64: accepted_rows.predict read at stride S + 1
    finish_reasons: tuple[FinishReason | None, ...]  # [bs]


CycleRecord = Admitted | Compacted | Ready | Drafted | Verified | Accepted


def batch_size(record: CycleRecord) -> int:
    return len(record.requests)
