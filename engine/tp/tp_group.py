"""The tensor-parallel group: its collectives, their timing, and the cross-rank agreement check.

`TPGroup` wraps a `torch.distributed` process group with the two collectives the sharded model uses
(``all_reduce``, ``all_gather``), an optional `CommTimer`, and nothing at world size 1.
`check_same_on_ranks` is checked mode's comparison: one ``all_gather`` of a 63-bit digest per check.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence

import attrs
import numpy as np
import torch
import torch.distributed as dist

from ...core.ports import ForwardBatch

# all_gather_single replaces all_gather_into_tensor in newer torch; the GPU machine runs an older one.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RankDivergenceError(RuntimeError):
    """Tensor-parallel ranks disagree (committed tokens, or the inputs of a forward)."""


class CommTimer:
    """Time spent in collectives, per kind. CUDA: events around each call (read at `collect`); CPU: wall.

    A collective's time includes waiting for the slowest rank to arrive, not only the transfer.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()

    @contextlib.contextmanager
    def time(self, kind: str) -> Iterator[None]:
        self.calls[kind] += 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((kind, start, end))
        else:
            began = time.perf_counter()
            yield
            self.seconds[kind] += time.perf_counter() - began

    def collect(self) -> dict[str, dict[str, float]]:
        """``{kind: {"calls": n, "seconds": s}}`` so far (synchronizes the device once)."""
        if self._pending:
            torch.cuda.synchronize()
            for kind, start, end in self._pending:
                self.seconds[kind] += start.elapsed_time(end) / 1e3
            self._pending.clear()
        return {kind: {"calls": self.calls[kind], "seconds": self.seconds[kind]} for kind in sorted(self.calls)}

    def reset(self) -> None:
        self.collect()
        self.seconds.clear()
        self.calls.clear()


@attrs.define(eq=False)
class TPGroup:
    """This rank's place in a tensor-parallel group and the collectives the model uses.

    ``group`` is a `torch.distributed` process group (None: the default group); with ``world_size == 1``
    every collective is the identity and nothing is communicated.
    """

    rank: int = 0
    world_size: int = 1
    group: object | None = None
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"), converter=torch.device)
    timer: CommTimer | None = None

    @classmethod
    def from_process_group(cls, group=None, device: str | torch.device = "cpu") -> TPGroup:
        """The group of an initialized `torch.distributed` (``group`` None: the default group)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call speccycle.engine.tp.engine.init_tp() first")
        return cls(dist.get_rank(group), dist.get_world_size(group), group, device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.world_size == 1:
            return x
        with self._timed("all_reduce"):
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked by rank. Shapes: ``[*S]`` (same on all ranks) -> ``[world_size, *S]``."""
        if self.world_size == 1:
            return x[None]
        if x.dim() == 0:
            raise ValueError("all_gather needs a tensor of at least one dimension; reshape a scalar to [1]")
        x = x.contiguous()
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))  # rank r's x at rows [r * n, (r + 1) * n)
        with self._timed("all_gather"):
            _all_gather_flat(out, x, group=self.group)
        return out.view(self.world_size, *x.shape)

    def _timed(self, kind: str):
        return self.timer.time(kind) if self.timer is not None else contextlib.nullcontext()


def check_same_on_ranks(group: TPGroup, digest: int, what: str) -> None:
    """Raise `RankDivergenceError` on every rank unless every rank passed the same ``digest``.

    One ``all_gather`` of one int64; every rank must call it at the same point. The reference is the
    digest most ranks hold (rank 0's on a tie); the error names the ranks that differ from it.
    """
    if group.world_size == 1:
        return
    mine = torch.tensor([digest], dtype=torch.int64, device=group.device)
    digests = group.all_gather(mine).view(-1).tolist()
    if len(set(digests)) == 1:
        return
    counts = Counter(digests)
    reference = max(counts, key=lambda d: (counts[d], d == digests[0]))
    reference_rank = digests.index(reference)
    diverging = [r for r, d in enumerate(digests) if d != reference]
    raise RankDivergenceError(
        f"tensor-parallel ranks disagree on {what}: rank {', '.join(map(str, diverging))} differs from rank "
        f"{reference_rank} (digests {digests}; the majority is the reference, rank 0 on a tie). Each rank must "
        f"run the same cycle on the same logits; look for rank-local randomness, a draft that is not "
        f"deterministic, or a perturbed rank"
    )


def digest(values: Sequence[int] | torch.Tensor | np.ndarray) -> int:
    """A 63-bit digest of a sequence of integers (blake2b), equal on every rank for equal input."""
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.int64).numpy()
    data = np.ascontiguousarray(np.asarray(values, dtype=np.int64)).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def batch_digest(batch: ForwardBatch) -> int:
    """A digest of what a forward reads: ids, positions, slots, prefix lengths, extra slots, page table."""
    parts = [batch.input_ids, batch.positions, batch.out_slots, batch.prefix_lens, batch.extra_slots.reshape(-1)]
    parts += [batch.page_table.reshape(-1), torch.tensor(batch.extra_slots.shape + batch.page_table.shape)]
    if batch.logits_rows is not None:
        parts.append(batch.logits_rows)
    return digest(torch.cat([p.detach().to("cpu", torch.int64).reshape(-1) for p in parts]))
