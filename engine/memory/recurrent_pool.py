"""`RecurrentPool`: per-request recurrent (Mamba-style) state, with the per-row states of a verify.

A recurrent layer folds every token into one state, so it cannot "skip" a rejected draft token the way
attention skips a KV slot: the cycle must keep the state each verify row left, then adopt the one of
the last accepted row. The pool holds, per request and per recurrent layer:

* the **committed** state: every token of ``[0, state_len)`` folded in (the target: ``state_len == L``);
* the **row states** of the speculative rows since the last commit, indexed by the order the rows
  arrived (a verify's rows arrive in row order, so row ``i`` of the ``N``-block is row state ``i``);
* **tracking snapshots**: copies of the state after every ``snapshot_interval``-th token, taken from
  prefills and from the accepted path at commit, for prefix reuse (`restore`).

A forward asks the pool for a `ScanPlan` (`plan`): each row's recurrence parent. A causal row (no
``extra_slots``, a prefill or decode) continues the previous row of its request, the first row the
committed state, and the forward commits the last row. A speculative row (tree verify, draft step)
continues the row at ``position - 1`` among the slots it attends (its tree parent), or the committed
state when it sits at ``state_len``; nothing is committed until `commit` picks a row
(``last_correct_step_indices``: chain ``accept_len - 1``, tree the last accepted row of the block).

    pool = RecurrentPool(num_layers=2, state_shapes={"conv": (64, 3), "ssm": (64, 8)}, max_requests=8, max_rows=16)
    plan = pool.plan(batch)                              # once per forward, shared by the layers
    ... layers read pool.parent_states / pool.row_buffer and write pool.store ...
    pool.commit(request_ids=ids, last_correct_step_indices=lcsi)   # after accept (the cycle's compact)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import attrs
import torch

from ...backends.torch.recurrent import COMMITTED, PREVIOUS
from ...core.ports import ForwardBatch


class RecurrentStateError(ValueError):
    """A forward or a commit does not fit the recurrent state the pool holds."""


@attrs.frozen(eq=False)
class ScanPlan:
    """How the rows of one forward chain their recurrent state; shared by every recurrent layer.

    Shapes: ``T`` rows, ``bs`` requests, ``Z`` snapshot rows. Segment ``b`` is the rows of request
    ``b`` in recurrence order, ``row_order[seg_starts[b]:seg_starts[b + 1]]``.
    """

    speculative: bool  # tree verify / draft step rows (True) or causal extend rows (False)
    request_slots: torch.Tensor  # [bs] int64: pool slot of each request
    row_order: torch.Tensor  # [T] int64
    seg_starts: torch.Tensor  # [bs + 1] int64
    parent_row: torch.Tensor  # [T] int64: the parent's batch row, -1 where the parent is outside the batch
    external: torch.Tensor  # [T] int64: outside parent, a slot (< R) or R + a flat row-state index; -1: none
    parent_src: torch.Tensor  # [T] int64: the scan kernel's form (COMMITTED, PREVIOUS or a row-state index)
    store_index: torch.Tensor  # [T] int64: row-state index the row's state goes to (-1: none)
    final_slot: torch.Tensor  # [bs] int64: slot committed after the segment (-1: none)
    last_row: torch.Tensor  # [bs] int64: the segment's last batch row (-1: no rows)
    snapshot_rows: torch.Tensor  # [Z] int64: causal rows whose state is a tracking snapshot
    snapshot_keys: tuple[tuple[int, int], ...] = ()  # [Z] (request id, tokens folded in)


class RecurrentPool:
    """A `RecurrentStatePool` (core.ports) of ``max_requests`` slots, each ``num_layers`` states.

    ``state_shapes``: every named state of one layer and its shape (a Mamba layer: ``conv`` window and
    ``ssm`` state). ``max_rows``: speculative rows a request may hold between commits (``N`` for a
    target; ``(S - 1) * K`` for a draft). ``snapshot_interval``: keep a tracking snapshot every that
    many tokens (0: none), at most ``max_snapshots`` of them (least recently used dropped first).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        state_shapes: Mapping[str, tuple[int, ...]],
        max_requests: int,
        max_rows: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        snapshot_interval: int = 0,
        max_snapshots: int = 64,
    ) -> None:
        if num_layers < 1 or max_requests < 1 or max_rows < 1:
            raise ValueError(
                f"num_layers={num_layers}, max_requests={max_requests}, max_rows={max_rows} must all be >= 1"
            )
        if snapshot_interval < 0:
            raise ValueError(f"snapshot_interval={snapshot_interval} must be >= 0 (0 keeps no snapshots)")
        self.num_layers, self.max_requests, self.max_rows = num_layers, max_requests, max_rows
        self.state_shapes = {name: tuple(shape) for name, shape in state_shapes.items()}
        self.dtype, self.device = dtype, torch.device(device)
        self.snapshot_interval, self.max_snapshots = snapshot_interval, max_snapshots
        self.states = {  # [layers, R, *shape]
            name: torch.zeros((num_layers, max_requests, *shape), dtype=dtype, device=self.device)
            for name, shape in self.state_shapes.items()
        }
        self.rows = {  # [layers, R, Q, *shape]
            name: torch.zeros((num_layers, max_requests, max_rows, *shape), dtype=dtype, device=self.device)
            for name, shape in self.state_shapes.items()
        }
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self._slot: dict[int, int] = {}
        self._len: dict[int, int] = {}
        self._freed: set[int] = set()
        # Speculative rows since the last commit, per request: (kv slot, position, parent row index or -1).
        self._pending: dict[int, list[tuple[int, int, int]]] = {}
        self._snapshots: OrderedDict[tuple[int, int], dict[str, torch.Tensor]] = OrderedDict()

    # ---- bookkeeping ---------------------------------------------------------------------------
    def state_len(self, *, request_id: int) -> int:
        """Tokens folded into the request's committed state (0 for an unknown request)."""
        return self._len.get(request_id, 0)

    def state_lens(self, request_ids: Sequence[int]) -> list[int]:
        return [self.state_len(request_id=r) for r in request_ids]

    def pending_rows(self, *, request_id: int) -> int:
        """Speculative rows held since the last commit."""
        return len(self._pending.get(request_id, ()))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def _slot_of(self, request_id: int) -> int:
        if request_id in self._slot:
            return self._slot[request_id]
        if not self._free_slots:
            raise RecurrentStateError(
                f"request {request_id}: all {self.max_requests} recurrent state slots are taken; build the pool "
                "with a larger max_requests or finish requests first"
            )
        slot = self._free_slots.pop()
        for name in self.states:
            self.states[name][:, slot].zero_()
        self._slot[request_id], self._len[request_id] = slot, 0
        self._freed.discard(request_id)
        return slot

    def free(self, *, request_id: int) -> None:
        """Give the request's slot back. Unknown requests (refused before prefill) are a no-op; a second
        free of the same request is an error."""
        if request_id in self._slot:
            self._free_slots.append(self._slot.pop(request_id))
            self._len.pop(request_id)
            self._pending.pop(request_id, None)
            self._freed.add(request_id)
        elif request_id in self._freed:
            raise RecurrentStateError(f"request {request_id}: its recurrent state was already freed (double free)")

    # ---- planning a forward --------------------------------------------------------------------
    def plan(self, batch: ForwardBatch) -> ScanPlan:
        """Each row's recurrence parent, checked against the state the pool holds; registers the rows.

        A batch is all causal (no row has extra slots) or all speculative. Raises
        `RecurrentStateError` for rows that do not continue the committed state.
        """
        extra = batch.extra_slots
        has_extra = (extra >= 0).any(dim=1) if extra.shape[1] else torch.zeros_like(batch.positions, dtype=torch.bool)
        speculative = bool(has_extra.any())
        if speculative and not bool(has_extra.all()):
            raise RecurrentStateError(
                "a recurrent model runs causal rows (prefill, decode) and speculative rows (verify, draft "
                "steps) in separate forwards; this batch mixes them"
            )
        rows_of = self._rows_per_request(batch)
        if speculative:
            return self._plan_speculative(batch, rows_of)
        return self._plan_causal(batch, rows_of)

    def _rows_per_request(self, batch: ForwardBatch) -> list[list[int]]:
        order = torch.sort(batch.row_request, stable=True).indices.tolist()
        requests = batch.row_request.tolist()
        rows_of: list[list[int]] = [[] for _ in batch.request_ids]
        for t in order:
            rows_of[requests[t]].append(t)
        return rows_of

    def _finish_plan(self, batch, rows_of, speculative, slots, parent_row, external, parent_src, store, final, snaps):
        device = batch.positions.device
        counts = [len(r) for r in rows_of]
        seg_starts = torch.tensor([0] + counts, dtype=torch.long).cumsum(0)
        as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return ScanPlan(
            speculative=speculative,
            request_slots=as_long(slots),
            row_order=as_long([t for rows in rows_of for t in rows]),
            seg_starts=seg_starts.to(device),
            parent_row=as_long(parent_row),
            external=as_long(external),
            parent_src=as_long(parent_src),
            store_index=as_long(store),
            final_slot=as_long(final),
            last_row=as_long([rows[-1] if rows else -1 for rows in rows_of]),
            snapshot_rows=as_long([row for row, _ in snaps]),
            snapshot_keys=tuple(key for _, key in snaps),
        )

    def _plan_causal(self, batch: ForwardBatch, rows_of: list[list[int]]) -> ScanPlan:
        positions = batch.positions.tolist()
        num_rows = len(positions)
        parent_row, external, parent_src, store = [-1] * num_rows, [-1] * num_rows, [0] * num_rows, [-1] * num_rows
        slots, final, snaps = [], [], []
        for rid, rows in zip(batch.request_ids, rows_of):
            slot = self._slot_of(rid)
            slots.append(slot)
            final.append(slot if rows else -1)
            start = self._len[rid]
            got = [positions[t] for t in rows]
            if got != list(range(start, start + len(rows))):
                raise RecurrentStateError(
                    f"request {rid}: its recurrent state holds {start} tokens, so a causal extend must feed "
                    f"positions {start}, {start + 1}, ... in order; got {got[:8]}"
                )
            self._pending.pop(rid, None)  # a draft's speculative rows are dropped when it extends again
            for i, t in enumerate(rows):
                parent_row[t] = rows[i - 1] if i else -1
                external[t] = -1 if i else slot
                parent_src[t] = PREVIOUS if i else COMMITTED
                length = positions[t] + 1
                if self.snapshot_interval and length % self.snapshot_interval == 0:
                    store[t] = len(snaps)
                    snaps.append((t, (rid, length)))
            self._len[rid] = start + len(rows)
        return self._finish_plan(batch, rows_of, False, slots, parent_row, external, parent_src, store, final, snaps)

    def _plan_speculative(self, batch: ForwardBatch, rows_of: list[list[int]]) -> ScanPlan:
        positions, out_slots = batch.positions.tolist(), batch.out_slots.tolist()
        extra = batch.extra_slots.tolist()
        num_rows, R, Q = len(positions), self.max_requests, self.max_rows
        parent_row, external, parent_src, store = [-1] * num_rows, [-1] * num_rows, [0] * num_rows, [-1] * num_rows
        slots = []
        for rid, rows in zip(batch.request_ids, rows_of):
            slot = self._slot_of(rid)
            slots.append(slot)
            pending = self._pending.setdefault(rid, [])
            if len(pending) + len(rows) > Q:
                raise RecurrentStateError(
                    f"request {rid}: {len(pending) + len(rows)} speculative rows since the last commit exceed "
                    f"max_rows={Q}; build the pool with max_rows >= N (target) or (S - 1) * K (draft)"
                )
            by_slot = {kv_slot: i for i, (kv_slot, _, _) in enumerate(pending)}
            base = len(pending)
            batch_row_of = {}
            for k, t in enumerate(rows):
                pos, index = positions[t], base + k
                if pos == self._len[rid]:
                    parent = -1
                    external[t], parent_src[t] = slot, COMMITTED
                else:
                    found = [by_slot[s] for s in extra[t] if s in by_slot and pending[by_slot[s]][1] == pos - 1]
                    if len(found) != 1:
                        raise RecurrentStateError(
                            f"request {rid}: a speculative row at position {pos} has no parent: its state continues "
                            f"the committed state ({self._len[rid]} tokens) or a row at position {pos - 1} among "
                            f"the slots it attends, and {len(found)} such rows were found"
                        )
                    parent = found[0]
                    if parent in batch_row_of:
                        parent_row[t] = batch_row_of[parent]
                        parent_src[t] = PREVIOUS if k and rows[k - 1] == parent_row[t] else slot * Q + parent
                    else:
                        external[t], parent_src[t] = R + slot * Q + parent, slot * Q + parent
                if out_slots[t] in by_slot:
                    raise RecurrentStateError(f"request {rid}: two speculative rows write KV slot {out_slots[t]}")
                by_slot[out_slots[t]] = index
                batch_row_of[index] = t
                pending.append((out_slots[t], pos, parent))
                store[t] = slot * Q + index
        final = [-1] * len(slots)
        return self._finish_plan(batch, rows_of, True, slots, parent_row, external, parent_src, store, final, [])

    # ---- what the layers read and write --------------------------------------------------------
    def parent_states(self, name: str, layer: int, plan: ScanPlan) -> torch.Tensor:
        """The state each row's outside parent left (committed or an earlier forward's row).

        Shapes: -> ``[T, *shape]``; rows whose parent is in the batch get an arbitrary (finite) state.
        """
        committed = self.states[name][layer]  # [R, *shape]
        rows = self.rows[name][layer].flatten(0, 1)  # [R * Q, *shape]
        ext = plan.external.clamp(min=0)
        R = self.max_requests
        from_rows = rows[(ext - R).clamp(min=0)]
        from_committed = committed[ext.clamp(max=R - 1)]
        pick = (ext >= R).view(-1, *([1] * len(self.state_shapes[name])))
        return torch.where(pick, from_rows, from_committed)

    def row_buffer(self, name: str, layer: int, plan: ScanPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """``(committed [R, *shape], row_states [X, *shape])`` for a kernel that indexes them itself.

        Speculative plans get the pool's row states (``X = R * Q``); causal plans a scratch buffer of
        their snapshot rows (``X = Z``), which `keep_snapshots` files afterwards.
        """
        committed = self.states[name][layer]
        if plan.speculative:
            return committed, self.rows[name][layer].view(-1, *self.state_shapes[name])
        return committed, committed.new_zeros((len(plan.snapshot_keys), *self.state_shapes[name]))

    def store(self, name: str, layer: int, plan: ScanPlan, values: torch.Tensor) -> None:
        """File per-row states computed outside a kernel. Shapes: ``values [T, *shape]``.

        Speculative rows become row states; a causal segment commits its last row; snapshot rows are kept.
        """
        values = values.to(self.dtype)
        if plan.speculative:
            self.rows[name][layer].view(-1, *self.state_shapes[name])[plan.store_index] = values
            return
        done = plan.final_slot >= 0
        self.states[name][layer][plan.final_slot[done]] = values[plan.last_row[done]]
        self.keep_snapshots(name, layer, plan, values[plan.snapshot_rows])

    def keep_snapshots(self, name: str, layer: int, plan: ScanPlan, snapshot_states: torch.Tensor) -> None:
        """File the states of a causal plan's snapshot rows. Shapes: ``snapshot_states [Z, *shape]``."""
        for key, state in zip(plan.snapshot_keys, snapshot_states):
            self._snapshot_entry(key)[name][layer] = state

    def _snapshot_entry(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        if key not in self._snapshots:
            self._snapshots[key] = {
                name: torch.zeros((self.num_layers, *shape), dtype=self.dtype, device=self.device)
                for name, shape in self.state_shapes.items()
            }
            while len(self._snapshots) > self.max_snapshots:
                self._snapshots.popitem(last=False)
        self._snapshots.move_to_end(key)
        return self._snapshots[key]

    # ---- the port ------------------------------------------------------------------------------
    def commit(self, *, request_ids: Sequence[int], last_correct_step_indices: torch.Tensor) -> None:
        """Adopt, per request, the state of speculative row ``last_correct_step_indices[b]`` (in [0, N)).

        Row ``i`` is the ``i``-th speculative row since the last commit: verify row ``i`` of the
        request's ``N``-block. Takes tracking snapshots along the accepted path; drops the other rows.
        """
        indices = last_correct_step_indices.tolist()
        if len(indices) != len(request_ids):
            raise RecurrentStateError(
                f"commit got {len(indices)} last_correct_step_indices for {len(request_ids)} requests"
            )
        slots, picks = [], []
        for rid, index in zip(request_ids, indices):
            pending = self._pending.get(rid, [])
            if not 0 <= index < len(pending):
                raise RecurrentStateError(
                    f"request {rid}: last_correct_step_indices={index} but the request holds {len(pending)} "
                    "verify rows since its last commit (run the verify forward before committing)"
                )
            slot = self._slot[rid]
            slots.append(slot)
            picks.append(index)
            self._track_accepted_path(rid, slot, pending, index)
            self._len[rid] = pending[index][1] + 1
            self._pending[rid] = []
        if not slots:
            return
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        pick_t = torch.tensor(picks, dtype=torch.long, device=self.device)
        for name in self.states:
            self.states[name][:, slot_t] = self.rows[name][:, slot_t, pick_t]

    def _track_accepted_path(self, rid: int, slot: int, pending, index: int) -> None:
        if not self.snapshot_interval:
            return
        while index >= 0:
            _, position, parent = pending[index]
            if (position + 1) % self.snapshot_interval == 0:
                entry = self._snapshot_entry((rid, position + 1))
                for name in self.states:
                    entry[name].copy_(self.rows[name][:, slot, index])
            index = parent

    # ---- prefix reuse --------------------------------------------------------------------------
    def snapshots(self, *, request_id: int) -> list[int]:
        """Lengths at which a tracking snapshot of the request is kept, ascending."""
        return sorted(length for rid, length in self._snapshots if rid == request_id)

    def snapshot_state(self, *, request_id: int, length: int) -> dict[str, torch.Tensor]:
        """The tracking snapshot of ``request_id`` after ``length`` tokens: ``{name: [layers, *shape]}``."""
        key = (request_id, length)
        if key not in self._snapshots:
            have = self.snapshots(request_id=request_id)
            raise RecurrentStateError(f"no snapshot of request {request_id} after {length} tokens; it has {have}")
        return {name: state.clone() for name, state in self._snapshots[key].items()}

    def restore(self, *, request_id: int, from_request_id: int, length: int) -> None:
        """Start ``request_id`` from the snapshot of ``from_request_id`` after ``length`` tokens.

        For prefix reuse: the engine found that both requests share their first ``length`` tokens; the
        new request's next causal extend starts at position ``length``.
        """
        key = (from_request_id, length)
        if key not in self._snapshots:
            have = self.snapshots(request_id=from_request_id)
            raise RecurrentStateError(
                f"no snapshot of request {from_request_id} after {length} tokens; it has snapshots at {have}"
            )
        if self._len.get(request_id, 0) or self._pending.get(request_id):
            raise RecurrentStateError(f"request {request_id} already holds state: restore before its prefill")
        slot = self._slot_of(request_id)
        entry = self._snapshots[key]
        self._snapshots.move_to_end(key)
        for name in self.states:
            self.states[name][:, slot] = entry[name]
        self._len[request_id] = length


class RecurrentPools:
    """The cycle's `RecurrentStatePool` over a target's pool and its draft's pools.

    ``commit`` adopts the target's verify state (a draft re-extends from its own committed state);
    ``free`` frees the request in every pool, so a draft's state does not outlive its request.
    """

    def __init__(self, target: RecurrentPool, *drafts: RecurrentPool) -> None:
        self.target, self.drafts = target, drafts

    def commit(self, *, request_ids: Sequence[int], last_correct_step_indices: torch.Tensor) -> None:
        self.target.commit(request_ids=request_ids, last_correct_step_indices=last_correct_step_indices)

    def free(self, *, request_id: int) -> None:
        for pool in (self.target, *self.drafts):
            pool.free(request_id=request_id)

    def state_lens(self, request_ids: Sequence[int]) -> list[int]:
        return self.target.state_lens(request_ids)

    def pending_rows(self, *, request_id: int) -> int:
        return self.target.pending_rows(request_id=request_id)
