"""A host control plane: the cycle's records on the CPU, the model data on the GPU.

At batch 1 on a GPU, a speculative cycle's bookkeeping (slots, tree, positions, accept, compact) is
a hundred operations on tensors of a few elements. On the GPU each is a kernel launch (about 10
microseconds of host time) and each ``.tolist()`` or boolean index a sync; measured on an H100 with
SmolLM2 and the ngram draft: 89 launches and 19 syncs per cycle, the cycle 3 to 4 times as long as
the verify forward it exists for (`bench/cycle_profile.py`). The same operations on CPU tensors cost
a few microseconds each and never wait for the GPU.

So the ports here present the cycle with a CPU device: the state machine builds its records and
batches on the CPU and runs the torch backend's reference ops, exactly the code the CPU tests run.
What crosses to the GPU, and back, crosses at the ports:

* `HostTarget.forward` takes a CPU `ForwardBatch`; the fast target copies it into its static buffers
  (one host-to-device copy from pinned memory, `graphs.ForwardGraphs._load`) and replays its graph,
  which also reduces the logits to each row's argmax and finiteness (`ModelOutput.greedy`,
  ``finite``). One device-to-host copy brings those two back. The logits stay on the GPU.
* Hidden states stay on the GPU too. Where a record holds them (`RowOutputs.hidden`,
  `ExtendRows.hidden`, `Ready.draft_hidden`) it holds *row references* instead: ``[T, 2]`` int64,
  ``(generation, row)`` into the last output a port kept (`DeviceRows`). The transitions gather,
  compact and retire them like any per-row field (one mechanism, invariant 9); the port that
  consumes them turns them into `graphs.HiddenRows`, whose indices cross with the batch's rows and
  whose rows are gathered on the GPU. A reference to an output that was since replaced is refused.
* `HostDraft` (a forward draft: EAGLE heads, layer skip, a smaller model): its extend's graph also
  takes the top-K of its last rows (`PackedTopK`), handed to the draft extend row in the port's output
  (`ModelOutput.topk`, on the device: the `Ready` record holds it there, nothing crosses); the ``draft``
  row's ``S - 1`` levels then run as one graph over inputs that cross in one copy, fed that top-K and the
  extend's hidden state on the GPU (`fast.path.GraphedDraftLevels.run_draft_levels_on_host`), and one copy
  back brings the levels' candidates. Target features reach the draft extend, and the draft's hidden
  state its first level, without leaving the GPU. Nothing is kept between the two rows but the record.
* `HostPool.page_table` builds page tables on the CPU (the pool's bookkeeping is Python lists
  anyway); the KV buffers stay on the GPU, and a tree's KV move indexes them with indices that
  cross in one pinned copy.

Syncs per cycle: one with a lookup draft (the verify's copy back), two with a forward draft (the
verify's; the draft's: top-K and candidates). Two is the floor while the records live on the host:
the accept needs the verify's argmax, and the verify batch needs the draft's tree.

Which cycles it serves: greedy requests without logprobs, with a lookup draft (``ngram``) or a fast
forward draft (`fast.path.FastEagleDraft`, `fast.path.FastLlamaDraft`). Sampling and logprobs read the full
logits; those cycles keep the device control plane (`Engine.generate` picks per call, `serves`).
The output is the same either way: the same forwards, the same reductions, the reference ops.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import torch

from ...backends.registry import get_backend
from ...backends.torch import TorchBackend
from ...backends.torch.ops import write_out
from ...core.ports import DraftCapabilities, ForwardBatch, ModelOutput, Ports, host_draft_levels, kind_of, pairing_of
from .graphs import HiddenRows, pack_rows, unpack_rows

HOST = torch.device("cpu")


class HostBackend(TorchBackend):
    """The reference ops on the host records, a few of them written for a few elements on a CPU or for the GPU.

    * ``verify_greedy``: the reference is ~25 tensor ops and an ``S``-round loop (about 300 us on the
      H100 machine's CPU for one 6-row chain); for up to `WALK_LIMIT` verify rows the walk is plain
      Python over lists (the textbook walk: from the root, the lowest-row child whose token the
      target predicted at its parent). Larger batches take the reference.
    * ``slots_for_positions``: the reference (a numpy version was faster until the reference shed its
      ops; measured 14 us against 5-11 us on a CPU, `bench/cycle_overhead.py`).
    * ``move_kv``: a tree's KV move runs on the KV's device: the indices (at most ``bs * (S + 1)``)
      go there in one pinned copy and the device's backend moves every buffer (one Triton launch on CUDA).
    * ``select_topk`` and ``top1_probability``: of logits on the device, the device backend's, brought over.

    Each is tested equal to the torch reference (tests/property/test_host_backend.py,
    tests/unit/test_fast_path.py for the top-K).
    """

    WALK_LIMIT = 512

    def __init__(self, device: torch.device | str = HOST) -> None:
        self.device = torch.device(device)
        self.device_backend = get_backend(self.device)

    def select_topk(self, logits, topk, vocab_map=None, out=None):
        if logits.device.type != "cpu":  # logits on the device: its backend's selection, brought over
            device_map = None if vocab_map is None else vocab_map.to(logits.device)
            probs, ids = self.device_backend.select_topk(logits, topk, device_map)
            return write_out(out, probs.cpu(), ids.cpu())
        return super().select_topk(logits, topk, vocab_map, out)

    def top1_probability(self, logits):
        if logits.device.type != "cpu":  # logits on the device: its backend's probabilities, brought over
            return self.device_backend.top1_probability(logits).cpu()
        return super().top1_probability(logits)

    def verify_greedy(
        self, tokens: torch.Tensor, parents: torch.Tensor, predict: torch.Tensor, accept_width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs, n = tokens.shape
        if bs * n > self.WALK_LIMIT or tokens.device.type != "cpu":
            return super().verify_greedy(tokens, parents, predict, accept_width)
        index, lens = [], []
        for b, (tok, par, pred) in enumerate(zip(tokens.tolist(), parents.tolist(), predict.tolist())):
            children: list[list[int]] = [[] for _ in range(n)]
            for i in range(1, n):
                if par[i] >= 0:
                    children[par[i]].append(i)  # rows ascending: the first match is the lowest row
            path, node = [0], 0
            while len(path) < accept_width:
                node = next((c for c in children[node] if tok[c] == pred[node]), -1)
                if node < 0:
                    break
                path.append(node)
            lens.append(len(path))
            index.append([b * n + p for p in path] + [-1] * (accept_width - len(path)))
        return torch.tensor(index, dtype=torch.long), torch.tensor(lens, dtype=torch.long)

    def move_kv(self, buffers: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        both = torch.stack([src, dst])
        if self.device.type == "cuda":  # from pinned memory the copy does not wait for the GPU
            both = both.pin_memory().to(self.device, non_blocking=True)
        self.device_backend.move_kv(buffers, both[0], both[1])


class DeviceRows:
    """The last per-row output a port kept on the device, named in host records by row references.

    `keep` stores ``[T, F]`` device rows and returns their references, ``[T, 2]`` int64 on the host:
    ``(generation, row)``, the generation unique in the process. `rows` turns references back into
    `graphs.HiddenRows` and refuses references to an output since replaced (a record kept too long).
    """

    _generations = itertools.count(1)

    def __init__(self, what: str) -> None:
        self.what = what
        self.source: torch.Tensor | None = None
        self.generation = 0

    def keep(self, rows: torch.Tensor) -> torch.Tensor:
        self.source, self.generation = rows, next(DeviceRows._generations)
        t = rows.shape[0]
        return torch.stack([torch.full((t,), self.generation, dtype=torch.long), torch.arange(t)], dim=1)

    def rows(self, refs: torch.Tensor) -> HiddenRows:
        if refs.dim() != 2 or refs.shape[1] != 2 or refs.dtype != torch.long:
            raise ValueError(
                f"expected row references [T, 2] int64 to the {self.what} (host control plane), got "
                f"{tuple(refs.shape)} {refs.dtype}: records of the host plane hold references, not hidden states"
            )
        if self.source is None or not bool((refs[:, 0] == self.generation).all()):
            raise ValueError(
                f"row references to an earlier {self.what}: the host control plane keeps only the last one, "
                "so a record's hidden states must be used before the next forward replaces them"
            )
        return HiddenRows(self.source, refs[:, 1].contiguous())


@attrs.frozen
class PackedTopK:
    """A `graphs.Reduction`: each logits row's top-K by the device backend's ``select_topk``, packed
    ``[R, 2K]`` float64 (probabilities, then ids; `graphs.pack_rows`: exact), for one copy back."""

    k: int
    backend: TorchBackend = attrs.field(eq=False, repr=False)  # not part of the key: one device's backend

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return pack_rows(self.backend.select_topk(logits, self.k))

    def unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_rows(packed, (((self.k,), torch.float32), ((self.k,), torch.long)))


class HostTarget:
    """The target port, seen from records on the host (module docstring)."""

    def __init__(self, target, keep_features: bool = False) -> None:
        """``keep_features``: hand over the forward's features as row references (a ``shifted`` draft reads
        them), else none."""
        if getattr(target.graphs, "summarize", False) is not True:
            raise ValueError("a host control plane needs a target whose forward summarizes its logits (fast path)")
        self.inner = target
        self.device = HOST
        self.vocab_size = target.vocab_size
        self.features = DeviceRows("target's features") if keep_features else None

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        out = self.inner.forward(batch)
        summary = torch.stack([out.greedy, out.finite.long()]).to(HOST)  # the verify's one sync
        hidden = None
        if self.features is not None and out.hidden is not None:  # references; the features stay
            hidden = self.features.keep(out.hidden)
        return ModelOutput(logits=out.logits, hidden=hidden, greedy=summary[0], finite=summary[1].bool())

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class HostPool:
    """The KV pool with its page tables on the host; everything else is the pool's own."""

    def __init__(self, pool) -> None:
        self.inner = pool

    def page_table(self, request_ids: Sequence[int]) -> torch.Tensor:
        return self.inner.page_table(request_ids, device=HOST)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class HostDraft(DraftCapabilities):
    """A fast forward draft port, seen from records on the host (module docstring).

    ``extend`` launches the extend's graph, which also takes the top-K of its last rows (`PackedTopK`, at the
    cycle's K), and returns it on the device (`ModelOutput.topk`) with row references for the hidden states
    (`DeviceRows`); no sync. ``run_draft_levels`` (the ``draft`` row's levels) runs the ``S - 1`` levels as
    one graph fed with that top-K and hidden state on the device, its one sync the copy of the candidates
    back. ``step`` (a cycle that drafts level by level, which greedy host cycles do not) works on references
    too, each selection then a copy back of its own.
    """

    kind = "forward"

    def __init__(self, draft, target: HostTarget, pool, backend: HostBackend, spec) -> None:
        if host_draft_levels(draft) is None:
            raise ValueError(
                f"{type(draft).__name__} has no host path: the host control plane runs the fast forward drafts "
                "(engine.fast.path.FastEagleDraft, FastLlamaDraft); accelerate the engine or turn host_control off"
            )
        if draft.pairing == "shifted" and target.features is None:
            raise ValueError("a shifted draft reads the target's features: build HostTarget with keep_features=True")
        self.inner, self.target, self.pool, self.backend, self.spec = draft, target, pool, backend, spec
        self.pairing, self.vocab_size = draft.pairing, draft.vocab_size
        self.hidden = DeviceRows("draft's hidden states")
        self.reduce = PackedTopK(spec.topk, backend.device_backend)
        self.device_ports = Ports(target=target.inner, draft=draft, kv_pool=pool)  # where the levels run

    def extend(self, batch: ForwardBatch, target_hidden: torch.Tensor | None) -> ModelOutput:
        fed = None if self.pairing != "shifted" else self.target.features.rows(_required(target_hidden, "extend"))
        out, top = self.inner.extend_reduced(batch, fed, self.reduce)
        hidden = None if out.hidden is None else self.hidden.keep(out.hidden)
        return ModelOutput(logits=out.logits, hidden=hidden, topk=self.reduce.unpack(top))

    def step(self, batch: ForwardBatch, parent_hidden: torch.Tensor | None) -> ModelOutput:
        fed = None if parent_hidden is None else self.hidden.rows(parent_hidden)
        out = self.inner.step(batch, fed)
        return ModelOutput(logits=out.logits, hidden=None if out.hidden is None else self.hidden.keep(out.hidden))

    def run_draft_levels(self, fn, ports, backend, cfg, ids, L, page_table, draft_slots, topk_p, topk_index,
                         draft_hidden):  # fmt: skip
        # the extend's top-K (`ModelOutput.topk`) is still on the device: the levels read it there
        fed = None if draft_hidden is None else self.hidden.rows(draft_hidden)
        return self.inner.run_draft_levels_on_host(fn, self.device_ports, self.backend.device_backend, cfg, ids, L,
                                                   page_table, draft_slots, topk_p, topk_index, fed)  # fmt: skip

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _required(hidden: torch.Tensor | None, where: str) -> torch.Tensor:
    if hidden is None:
        raise ValueError(f"a shifted draft's {where} needs the target's features (row references on the host plane)")
    return hidden


def serves(draft, sampling) -> bool:
    """Whether a `generate` call may run on the host control plane (module docstring): greedy without
    logprobs, with a lookup draft or a fast forward draft."""
    plain = sampling is None or sampling.plain_greedy
    if draft is None:
        return False
    return plain and (kind_of(draft) == "lookup" or host_draft_levels(draft) is not None)


def host_ports(target, draft, pool, spec, device, detokenizer=None) -> tuple[Ports, HostBackend]:
    """The ports and backend of a host-plane `generate` call (``spec``: the cycle's `SpecConfig`; ``detokenizer``:
    the tokenizer stop strings are matched with)."""
    backend = HostBackend(device)
    forward = kind_of(draft) == "forward"
    host_target = HostTarget(target, keep_features=forward and pairing_of(draft) == "shifted")
    if forward:
        draft = HostDraft(draft, host_target, pool, backend, spec)
    return Ports(target=host_target, draft=draft, kv_pool=HostPool(pool), detokenizer=detokenizer), backend
