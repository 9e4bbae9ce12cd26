"""Ports: the protocols an engine implements so the cycle can run on its models and memory.

The library owns the cycle (which rows to run, where they sit, what to accept); the engine owns the
weights, the KV memory and the scheduling. Every model call of the cycle goes through one shape of
batch, `ForwardBatch`, so an engine implements one attention rule:

    a row of request b attends the slots of b's positions [0, prefix_len) (through b's page table)
    plus the slots listed in its `extra_slots` row (its tree ancestors and itself),

after every row of the batch has written its own K/V to `out_slots`. Prefill and draft extend use
`prefix_len = position + 1` and no extra slots (causal); tree verify and tree drafting use
`prefix_len = L` plus the row's ancestors and itself.

Target and draft KV share one slot index space (the `KVPool`), each in its own tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import attrs
import torch

Pairing = Literal["shifted", "aligned"]
"""How a draft family pairs tokens with positions.

* ``shifted`` (EAGLE): the draft sees token ``t[k + 1]`` with the target's feature ``f[k]`` at
  position ``k``; draft forward ``j`` feeds the depth ``j + 1`` tokens at ``L + j``.
* ``aligned`` (standalone model, layer skip): the draft sees token ``t[k]`` at position ``k``, like
  the target; the root is fed by the draft extend at ``L`` and depth ``d`` tokens at ``L + d``.
"""


@attrs.frozen(eq=False)
class ForwardBatch:
    """One model forward over ``T`` rows drawn from ``bs`` requests.

    Shapes: ``T`` rows, ``bs`` requests, ``M`` extra slots per row (0 for causal extends).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, RoPE positions
    row_request: torch.Tensor  # [T] int64, index of the row's request in this batch, 0..bs-1
    out_slots: torch.Tensor  # [T] int64, KV slot the row writes
    prefix_lens: torch.Tensor  # [T] int64, the row attends its request's positions [0, prefix_len)
    extra_slots: torch.Tensor  # [T, M] int64, further slots the row attends, -1 padded
    page_table: torch.Tensor  # [bs, max_pages] int64, page ids of each request, -1 padded
    page_size: int
    request_ids: tuple[int, ...]  # [bs] engine ids, for drafters that keep per-request state
    logits_rows: torch.Tensor | None = None  # [R] int64 rows whose logits are needed; None: all rows

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


@attrs.frozen(eq=False)
class ModelOutput:
    """What a forward returns.

    Shapes: ``logits [R, V]`` for the rows in ``logits_rows`` (all ``T`` rows when it is None);
    ``hidden [T, F]``: for a target, the features a draft consumes (EAGLE-1: last hidden state;
    EAGLE-3: three layers concatenated); for a draft, its own hidden state fed to its children.
    """

    logits: torch.Tensor  # [R, V]
    hidden: torch.Tensor | None  # [T, F]
    # Optional reductions of ``logits`` a port may compute beside them (inside its CUDA graph) and hand
    # over where the cycle's records live: ``greedy [R]`` int64 ``logits.argmax(-1)`` (lowest index on
    # ties), ``finite [R]`` bool ``isfinite(logits).all(-1)``. The cycle uses them instead of reducing
    # ``logits`` itself; they must be exactly those reductions.
    greedy: torch.Tensor | None = None
    finite: torch.Tensor | None = None
    # A draft's logits over its own reduced vocabulary (EAGLE-3's draft vocabulary): ``logits [R, Vd]`` with
    # column ``j`` the target token ``vocab_map[j]`` (``[Vd]`` int64), every other target token at ``-inf``.
    # Greedy drafting picks its top-K there and maps the ids; None: ``logits`` cover the target vocabulary.
    vocab_map: torch.Tensor | None = None


@runtime_checkable
class TargetModel(Protocol):
    """The model whose output the cycle must reproduce exactly."""

    vocab_size: int

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """Write each row's K/V at ``out_slots``, attend as the module docstring says, return logits."""
        ...


@runtime_checkable
class DraftModel(Protocol):
    """A draft that is run forward, step by step (EAGLE heads, layer skip, a smaller model).

    ``extend`` runs over committed tokens (``shifted``: paired with the target's features of the
    previous position; ``aligned``: the tokens themselves, root included) and its last row gives the
    first level of candidates. ``step`` runs one tree level, fed with each node's parent hidden state.
    """

    kind: Literal["forward"]
    vocab_size: int
    pairing: Pairing

    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> ModelOutput:
        """``target_hidden [T, F]``: the target's features paired with each row (None if unused)."""
        ...

    def step(self, batch: ForwardBatch, parent_hidden: torch.Tensor | None) -> ModelOutput:
        """``parent_hidden [T, Hd]``: the draft hidden state of each row's parent node."""
        ...


@runtime_checkable
class LookupDraft(Protocol):
    """A draft that proposes a whole tree from the token history, without a forward (n-gram lookup)."""

    kind: Literal["lookup"]
    vocab_size: int

    def propose(
        self,
        request_ids: Sequence[int],
        histories: Sequence[Sequence[int]],
        num_steps: int,
        num_nodes: int,
        topk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``tokens [bs, n]`` and ``parents [bs, n]``, ``n <= num_nodes`` (fewer: cheaper verify).

        Node ``i`` is verify row ``i + 1``; ``parents[b, i]`` is a verify row index ``< i + 1`` (0 is
        the root); no node deeper than ``num_steps``; with ``topk == 1`` a chain (``parents[b, i] == i``).
        Rows a draft has no guess for still need a token: repeat a plausible one, the verify rejects it
        at no cost to correctness.
        """
        ...


@runtime_checkable
class BlockDraft(Protocol):
    """A draft that proposes a whole block from one non-causal forward (DFlash), chain only.

    ``extend`` writes the draft's context from the target's features of the committed tokens (rows
    paired like a ``shifted`` draft: position ``p`` with the target's feature ``f[p]``); it produces no
    candidates. ``propose`` runs the block: ``block_size`` rows per request at positions ``L + i``, row
    0 the root, rows ``1..B-1`` the token ``mask_token_id``; every row attends the context ``[0, L)``
    and all rows of its block. Row ``i``'s logits are the draft's guess for the token at ``L + i``.
    """

    kind: Literal["block"]
    vocab_size: int
    block_size: int  # B: verify rows per request, root included (N == B, S == B - 1)
    mask_token_id: int

    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor) -> None:
        """``target_hidden [T, F]``: the target's features at each row's position."""
        ...

    def propose(self, batch: ForwardBatch) -> ModelOutput:
        """Logits ``[R, V]`` of ``batch.logits_rows`` (the masked rows)."""
        ...


@runtime_checkable
class Detokenizer(Protocol):
    """What stop strings need of a tokenizer: the bytes each token id decodes to (statemachine/stops.py)."""

    def token_bytes(self, token_id: int) -> bytes: ...


class KVPoolExhausted(RuntimeError):
    """The pool has too few free pages for a reservation. Engines retract or defer requests."""


@runtime_checkable
class KVPool(Protocol):
    """A paged KV pool: a request's position ``p`` lives at slot ``page_table[p // P] * P + p % P``."""

    page_size: int
    num_free_pages: int

    def pages_held(self, request_id: int) -> int:
        """Pages the request holds now (0 for an unknown request)."""
        ...

    def allocate(self, request_id: int, num_tokens: int) -> None:
        """Grow the request's pages to cover positions ``[0, num_tokens)``; raise KVPoolExhausted if short."""
        ...

    def release(self, request_id: int, keep_tokens: int) -> None:
        """Free the request's pages past those covering ``[0, keep_tokens)``."""
        ...

    def free(self, request_id: int) -> None:
        """Free every page the request holds; a second free of the same request is an error."""
        ...

    def page_table(self, request_ids: Sequence[int]) -> torch.Tensor:
        """``[bs, max_pages]`` int64 page ids, -1 padded."""
        ...

    def target_buffers(self) -> Sequence[torch.Tensor]:
        """The target's KV tensors, each viewed slot-major ``[num_slots, ...]``, for KV moves."""
        ...


@runtime_checkable
class RecurrentStatePool(Protocol):
    """Per-request recurrent (Mamba-style) state. Attention-only models use `NoRecurrentState`."""

    def commit(self, *, request_ids: Sequence[int], last_correct_step_indices: torch.Tensor) -> None:
        """Keep, per request, the verify-step state at ``last_correct_step_indices [bs]`` (in [0, N))."""
        ...

    def free(self, *, request_id: int) -> None: ...


class NoRecurrentState:
    """The recurrent-state pool of an attention-only model: nothing to keep."""

    def commit(self, *, request_ids: Sequence[int], last_correct_step_indices: torch.Tensor) -> None:
        return None

    def free(self, *, request_id: int) -> None:
        return None


@attrs.frozen
class Ports:
    """Everything mutable the cycle touches, handed to `step` as one value."""

    target: TargetModel
    draft: DraftModel | LookupDraft | BlockDraft
    kv_pool: KVPool
    recurrent: RecurrentStatePool = attrs.field(factory=NoRecurrentState)
    detokenizer: Detokenizer | None = None  # needed only by requests with stop strings
