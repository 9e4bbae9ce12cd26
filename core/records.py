"""The records of the cycle: one frozen attrs class per state, changed only through `attrs.evolve`.

A batch moves through

    Admitted -> Compacted -> Ready -> Drafted -> Verified -> Accepted -> Compacted -> ...

(prefill commits the prompt, so its result is a `Compacted` record like any cycle's). Tensor fields
carry their shape in a comment and compare by identity (``eq=False`` on the class); ``bs`` requests,
``N`` verify rows each, ``S + 1`` the accept width, ``T`` ragged rows, ``F`` target features,
``Hd`` draft hidden size.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch

from .config import SamplingParams, SpecConfig

FinishReason = Literal["eos", "stop", "length", "error"]


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


@attrs.frozen(eq=False)
class ExtendRows:
    """Rows the draft extend must run, ragged over requests (``T`` rows in all).

    The draft cache covers positions ``[0, L + offset)``, offset 1 for ``aligned`` drafts (the root).
    """

    input_ids: torch.Tensor  # [T] int64: the token the draft sees at each position
    positions: torch.Tensor  # [T] int64
    row_request: torch.Tensor  # [T] int64: index of the row's request in the batch
    hidden: torch.Tensor | None  # [T, F]: target features paired with each row (shifted drafts)


@attrs.frozen(eq=False)
class Admitted:
    """Requests whose prompts are not yet in the cache."""

    config: SpecConfig
    requests: tuple[Request, ...]


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


@attrs.frozen(eq=False)
class Ready:
    """Ready to draft. ``topk_*`` and ``draft_hidden`` are the draft extend's first tree level."""

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


@attrs.frozen(eq=False)
class DraftTree:
    """The verify rows of every request: row 0 is the root, parents precede children."""

    tokens: torch.Tensor  # [bs, N] int64
    parents: torch.Tensor  # [bs, N] int64: row index of the parent, -1 for the root
    depths: torch.Tensor  # [bs, N] int64: 0 for the root
    scores: torch.Tensor | None = None  # [bs, N] float32: cumulative draft probability (root 1)
    # [bs, N] bool: rows a sampled draft had no token for (it ran out of mass); their token is a
    # placeholder the verify never accepts. None: no such row.
    padding: torch.Tensor | None = None


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
