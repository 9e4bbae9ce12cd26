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

Each port declares what it is: a target its ``device``, a draft its ``kind`` (and a forward draft its
``pairing``); `Ports` refuses a port without them (`PortDeclarationError`, naming what to set). A port may
also declare optional capabilities (a draft's graphed levels, a recurrent pool's state lengths, a KV pool's
size), None or absent where it lacks them. The library reads both only through the accessors at the end of
this module (`draft_kind`, `draft_pairing`, `graphed_draft_levels`, `target_device`, ...), never by probing
a port's attributes itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
PAIRINGS: tuple[Pairing, ...] = ("shifted", "aligned")

DraftKind = Literal["forward", "lookup", "block"]
"""What a draft port is: a `DraftModel` (``forward``), a `LookupDraft` (``lookup``) or a `BlockDraft` (``block``)."""
DRAFT_KINDS: tuple[DraftKind, ...] = ("forward", "lookup", "block")


class PortDeclarationError(TypeError):
    """A port lacks a declaration the cycle reads, or declares a value outside its choices; the message names
    the attribute and what to set."""


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
    # The rows are a prefill's: whole prompts (from each request's cached length on), each request's rows
    # consecutive, ``prefix_len = position + 1``, no extra slots. A port may attend them with a prefill kernel
    # (`engine.kernels.attention_prefill`: by default each row keeps the decode's bits, the flash kernel on request
    # rounds otherwise); decodes and verifies never set it.
    prefill: bool = False
    # The dtype of the returned logits: float32 (the model dtype's rounding, widened), or None: the model's own dtype,
    # the same values without the widening copy (a ``[T, V]`` pass over the vocabulary), for a caller that only takes
    # their argmax (a greedy verify). A port may return float32 either way.
    logits_dtype: torch.dtype | None = torch.float32

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
    # A draft's top-K of its logits rows taken inside its forward, ``(probs [R, K] float32, ids [R, K] int64)`` on
    # the port's device: exactly ``select_topk(logits, K, vocab_map)``. The draft extend uses it in place of
    # selecting itself when ``K`` is the cycle's (greedy rows); None: the transition selects.
    topk: tuple[torch.Tensor, torch.Tensor] | None = None


@runtime_checkable
class TargetModel(Protocol):
    """The model whose output the cycle must reproduce exactly.

    ``device``: where its forward runs; the cycle builds its index tensors there and picks the backend for it
    (`target_device`).
    """

    vocab_size: int
    device: torch.device

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        """Write each row's K/V at ``out_slots``, attend as the module docstring says, return logits."""
        ...


@runtime_checkable
class DraftModel(Protocol):
    """A draft that is run forward, step by step (EAGLE heads, layer skip, a smaller model).

    ``extend`` runs over committed tokens (``shifted``: paired with the target's features of the
    previous position; ``aligned``: the tokens themselves, root included) and its last row gives the
    first level of candidates. ``step`` runs one tree level, fed with each node's parent hidden state.

    Optional capabilities (`DraftCapabilities` declares them, None where a draft lacks one):
    ``run_draft_levels`` (`graphed_draft_levels`), ``run_draft_levels_on_host`` (`host_draft_levels`),
    ``extend_hidden`` and ``logits_from_hidden`` (`defers_first_level`).
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


class DraftCapabilities:
    """The optional capabilities of a forward draft, declared: each None unless the draft provides it.

    * ``run_draft_levels(fn, ports, backend, cfg, ids, L, page_table, draft_slots, topk_p, topk_index,
      draft_hidden)``: run the greedy cycle's ``S - 1`` draft levels itself, e.g. as one captured CUDA graph,
      by calling ``fn`` (`statemachine.transitions.draft_levels`) with these arguments or returning exactly
      what it returns. None: the draft transition calls ``fn`` (and ``step``) directly.
    * ``run_draft_levels_on_host(...)``: the same levels for inputs that live on the host (the engine's host
      control plane, `engine.fast.host_control`); None: the draft has no host path.

    * ``extend_hidden(batch, target_hidden) -> [T, Hd]``: ``extend``'s draft KV writes and hidden state, without
      its logits (no LM head: ``batch.logits_rows`` is not read).
    * ``logits_from_hidden(hidden [R, Hd]) -> ModelOutput``: the logits ``extend`` computes for rows whose hidden
      state is ``hidden`` (its ``logits`` and ``vocab_map``; ``hidden`` None), exactly. With ``extend_hidden`` it
      lets the draft extend of a cycle of ``S == 0`` skip the LM head and the top-K (`defers_first_level`).

    A draft subclasses this and defines the methods it has; one that does not subclass it may still define
    them (they are read by name).
    """

    run_draft_levels: Callable[..., tuple[torch.Tensor, ...]] | None = None
    run_draft_levels_on_host: Callable[..., tuple[torch.Tensor, ...]] | None = None
    extend_hidden: Callable[..., torch.Tensor] | None = None
    logits_from_hidden: Callable[[torch.Tensor], ModelOutput] | None = None


class StaticForwards:
    """Forwards an executor may run inside a captured cycle (`statemachine.static`), declared: each None unless
    the port provides it. They run on the batch's own tensors (no copy into buffers of the port's), with no
    host sync and no shape that depends on a tensor's value; ``kv_bound`` bounds every row's ``prefix_lens``.

    * a target's ``forward_static(batch, kv_bound) -> ModelOutput`` (``hidden``: the features a draft reads);
    * a forward draft's ``step_static(batch, parent_hidden, kv_bound)`` and ``extend_static(batch, target_hidden,
      kv_bound)``, their logits over the draft's own vocabulary where it has one (``vocab_map`` set);
    * optionally, a forward draft's ``extend_hidden_static(batch, target_hidden, kv_bound) -> [T, Hd]``: the
      ``extend_hidden`` capability (`DraftCapabilities`) as a static form, for the draft extend of ``S == 0``.

    Read through `static_forwards`; a port without them is served by the eager executor only.
    """

    forward_static: Callable[..., ModelOutput] | None = None
    step_static: Callable[..., ModelOutput] | None = None
    extend_static: Callable[..., ModelOutput] | None = None
    extend_hidden_static: Callable[..., torch.Tensor] | None = None


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


class GrammarMatcher(Protocol):
    """One request's grammar state in a grammar engine (docs: constrained). It moves forward over tokens and
    back over the last ones, so the cycle walks each draft branch on one matcher and rolls it back."""

    def try_consume(self, tokens: Sequence[int]) -> int:
        """Advance over ``tokens`` as far as the grammar allows; the number consumed (the first refused stops it)."""

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` consumed tokens."""

    def fill_mask(self, out: torch.Tensor) -> None:
        """Write the bitmask of the tokens allowed next into ``out`` (``[ceil(V / 32)]`` int32, on the host):
        bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed."""

    def is_stopped(self) -> bool:
        """The grammar is finished (its end token consumed): nothing may follow."""


@runtime_checkable
class GrammarCompiler(Protocol):
    """Compiles a request's grammar against the model's vocabulary (`SamplingParams.constraint`)."""

    def compile(self, kind: str, source: str) -> GrammarMatcher:
        """A fresh matcher for ``kind`` (``json_schema``, ``regex`` or ``grammar``) and its ``source``; raises
        `ValueError` with the engine's reason for a grammar it cannot compile or does not support."""


class KVPoolExhausted(RuntimeError):
    """The pool has too few free pages for a reservation. Engines retract or defer requests."""


@runtime_checkable
class KVPool(Protocol):
    """A paged KV pool: a request's position ``p`` lives at slot ``page_table[p // P] * P + p % P``.

    Optional: ``num_pages``, the pages of the whole pool (`kv_capacity`; without it, the free pages when the
    scheduler starts), ``has_request(request_id) -> bool``, whether the pool knows a request that may
    hold no page (`kv_knows`; without it, no such request), ``shared_pages() -> frozenset[int]``, the
    pages no request may write (a prefix cache's, `kv_shared_pages`; without it, none), and ``prefix_caching``
    with ``attach_prefix`` and ``publish`` (`kv_prefix_caching`; without it, no prefix cache).
    """

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
    """Per-request recurrent (Mamba-style) state. Attention-only models use `NoRecurrentState`.

    Optional, for checked mode (invariant 12): ``state_lens(request_ids) -> list[int]``, the tokens folded
    into each request's committed state (`recurrent_state_lens`), and ``pending_rows(*, request_id) -> int``,
    the speculative rows held since the last commit (`recurrent_pending_rows`).
    """

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


def _declares_target(instance, attribute, target) -> None:
    device_of(target)


def _declares_draft(instance, attribute, draft) -> None:
    pairing_of(draft)  # the kind, and a forward draft's pairing


@attrs.frozen
class Ports:
    """Everything mutable the cycle touches, handed to `step` as one value.

    Refuses (`PortDeclarationError`) a target without its ``device`` and a draft without its ``kind`` (a
    forward draft: without its ``pairing``).
    """

    target: TargetModel = attrs.field(validator=_declares_target)
    draft: DraftModel | LookupDraft | BlockDraft = attrs.field(validator=_declares_draft)
    kv_pool: KVPool
    recurrent: RecurrentStatePool = attrs.field(factory=NoRecurrentState)
    detokenizer: Detokenizer | None = None  # needed only by requests with stop strings
    grammar: GrammarCompiler | None = None  # needed only by constrained requests (docs: constrained)


# ---- capabilities -------------------------------------------------------------------------------------
# The one place that reads a port's declarations. ``ports``: a `Ports`, or any value with the same attributes
# (the fused cycle's draft loop hands `draft_levels` a stand-in of its draft and pool).

_MISSING = object()


def _named(port) -> str:
    return type(port).__name__


def kind_of(draft) -> DraftKind:
    """The ``kind`` a draft port declares: ``forward``, ``lookup`` or ``block``."""
    kind = getattr(draft, "kind", _MISSING)
    if kind not in DRAFT_KINDS:
        declared = "declares no `kind`" if kind is _MISSING else f"declares kind={kind!r}"
        raise PortDeclarationError(
            f"the draft port {_named(draft)} {declared}: set the class attribute kind = 'forward' (a DraftModel, "
            "run forward level by level), 'lookup' (a LookupDraft, proposing from the token history) or 'block' "
            "(a BlockDraft, one forward per block) (speccycle.core.ports)"
        )
    return kind


def pairing_of(draft) -> Pairing:
    """How a draft pairs tokens with positions: a forward draft's declared ``pairing``; ``shifted`` for a lookup
    draft (it keeps no cache) and a block draft (its context pairs like a shifted draft's, `BlockDraft`)."""
    if kind_of(draft) != "forward":
        return "shifted"
    pairing = getattr(draft, "pairing", _MISSING)
    if pairing not in PAIRINGS:
        declared = "declares no `pairing`" if pairing is _MISSING else f"declares pairing={pairing!r}"
        raise PortDeclarationError(
            f"the forward draft port {_named(draft)} {declared}: set pairing = 'shifted' (EAGLE: token t[k + 1] "
            "with the target's feature f[k] at position k) or 'aligned' (a standalone model, layer skip: token "
            "t[k] at position k) (speccycle.core.ports.Pairing)"
        )
    return pairing


def device_of(target) -> torch.device:
    """The ``device`` a target port declares."""
    device = getattr(target, "device", _MISSING)
    if device is _MISSING or device is None:
        declared = "declares no `device`" if device is _MISSING else "declares device=None"
        raise PortDeclarationError(
            f"the target port {_named(target)} {declared}: set device to the torch.device its forward runs on "
            "(e.g. torch.device('cpu')); the cycle builds its index tensors there and picks the backend for it"
        )
    try:
        return torch.device(device)
    except (TypeError, RuntimeError) as error:
        raise PortDeclarationError(
            f"the target port {_named(target)} declares device={device!r}, which is no torch.device: {error}"
        ) from error


def _vocab_size(port, role: str) -> int:
    size = getattr(port, "vocab_size", _MISSING)
    if size is _MISSING:
        raise PortDeclarationError(
            f"the {role} port {_named(port)} declares no `vocab_size`: set it to the number of token ids its "
            "logits cover (a draft: the target's)"
        )
    return size


def draft_kind(ports) -> DraftKind:
    """The draft's declared ``kind`` (`kind_of`)."""
    return kind_of(ports.draft)


def draft_pairing(ports) -> Pairing:
    """The draft's pairing as the cycle reserves and places its rows by (`pairing_of`)."""
    return pairing_of(ports.draft)


def target_device(ports) -> torch.device:
    """The target's declared ``device`` (`device_of`)."""
    return device_of(ports.target)


def target_vocab_size(ports) -> int:
    """The target's declared ``vocab_size`` (as declared: the caller checks its value)."""
    return _vocab_size(ports.target, "target")


def draft_vocab_size(ports) -> int:
    """The draft's declared ``vocab_size`` (as declared: the caller checks its value)."""
    return _vocab_size(ports.draft, "draft")


def graphed_draft_levels(ports) -> Callable[..., tuple[torch.Tensor, ...]] | None:
    """A forward draft's ``run_draft_levels`` (`DraftCapabilities`); None for a draft without one and for
    lookup and block drafts."""
    if kind_of(ports.draft) != "forward":
        return None
    return getattr(ports.draft, "run_draft_levels", None)


def host_draft_levels(draft) -> Callable[..., tuple[torch.Tensor, ...]] | None:
    """A forward draft's ``run_draft_levels_on_host`` (`DraftCapabilities`); None for a draft without one and
    for lookup and block drafts."""
    if kind_of(draft) != "forward":
        return None
    return getattr(draft, "run_draft_levels_on_host", None)


def defers_first_level(ports) -> bool:
    """Whether the draft extend of a cycle of ``S == 0`` may skip the draft's LM head and top-K: a forward draft
    that declares ``extend_hidden`` and ``logits_from_hidden`` (`DraftCapabilities`). The batch's `Ready` record
    then holds the draft's hidden state with its top-K pending, and the table's ``first_level`` row computes the
    top-K from it when the batch moves to a shape that drafts (docs: invariants, 17)."""
    if kind_of(ports.draft) != "forward":
        return False
    draft = ports.draft
    return getattr(draft, "extend_hidden", None) is not None and getattr(draft, "logits_from_hidden", None) is not None


@attrs.frozen
class StaticPorts:
    """The static forwards of a target and a forward draft (`StaticForwards`); a lookup draft runs no forward, so
    ``step`` and ``extend`` are None beside it. ``extend_hidden``: the draft's ``extend_hidden_static``, None where
    it has none (then a deferring draft's cycles of ``S == 0`` run eagerly)."""

    forward: Callable[..., ModelOutput]
    step: Callable[..., ModelOutput] | None
    extend: Callable[..., ModelOutput] | None
    extend_hidden: Callable[..., torch.Tensor] | None = None


def static_forwards(ports) -> StaticPorts | None:
    """The target's ``forward_static`` and the draft's ``step_static`` and ``extend_static`` (`StaticForwards`);
    for a lookup draft the target's alone (its cycles of ``S == 0`` run static); None otherwise, or where a port
    does not declare them."""
    kind = kind_of(ports.draft)
    if kind == "lookup":
        forward = getattr(ports.target, "forward_static", None)
        return None if forward is None else StaticPorts(forward, None, None)
    if kind != "forward":
        return None
    found = (
        getattr(ports.target, "forward_static", None),
        getattr(ports.draft, "step_static", None),
        getattr(ports.draft, "extend_static", None),
    )
    if any(f is None for f in found):
        return None
    return StaticPorts(*found, extend_hidden=getattr(ports.draft, "extend_hidden_static", None))


def recurrent_state_lens(ports, request_ids: Sequence[int]) -> list[int] | None:
    """Tokens in each request's committed recurrent state, where the pool reports them (``state_lens``), else
    None."""
    state_lens = getattr(ports.recurrent, "state_lens", None)
    return None if state_lens is None else state_lens(request_ids)


def recurrent_pending_rows(ports, request_id: int) -> int:
    """Speculative rows the recurrent pool holds for a request since its last commit (``pending_rows``); 0 where
    the pool does not report them."""
    pending_rows = getattr(ports.recurrent, "pending_rows", None)
    return 0 if pending_rows is None else pending_rows(request_id=request_id)


def grammar_engine(ports):
    """The ports' grammar engine (`GrammarCompiler`), or None where they have none."""
    return getattr(ports, "grammar", None)


def kv_capacity(ports) -> int:
    """Pages in the whole KV pool: its ``num_pages``, else the pages free now."""
    pool = ports.kv_pool
    return int(getattr(pool, "num_pages", pool.num_free_pages))


def kv_prefix_caching(ports) -> bool:
    """Whether the KV pool keeps a prefix cache (``prefix_caching``: it then has ``attach_prefix(request_id,
    tokens) -> int`` and ``publish(request_id, tokens, num_tokens)``, `engine.memory.kv_pool.PagedKVPool`); False
    where the pool does not say."""
    return bool(getattr(ports.kv_pool, "prefix_caching", False))


def kv_shared_pages(ports) -> frozenset[int]:
    """Pages the KV pool holds read-only (``shared_pages()``: a prefix cache's pages, shared between requests);
    empty where the pool has no such pages or does not say."""
    shared_pages = getattr(ports.kv_pool, "shared_pages", None)
    return frozenset() if shared_pages is None else shared_pages()


def kv_knows(ports, request_id: int) -> bool:
    """Whether the KV pool knows ``request_id`` (``has_request``: it may hold no page); False where the pool
    does not say."""
    has_request = getattr(ports.kv_pool, "has_request", None)
    return bool(has_request(request_id)) if has_request is not None else False
