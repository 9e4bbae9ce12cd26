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
  ``finite``). One device-to-host copy brings those two back: the cycle's only sync. The logits and
  hidden states stay on the GPU.
* `HostPool.page_table` builds page tables on the CPU (the pool's bookkeeping is Python lists
  anyway); the KV buffers stay on the GPU, and a tree's KV move indexes them with CPU indices.

Which cycles it serves: greedy requests without logprobs, with a lookup draft (``ngram``) or none.
Sampling reads the full logits, and a forward draft's top-K and hidden states feed its own GPU loop;
those cycles keep the device control plane (`Engine.generate` picks per call). The output is the
same either way: the same forwards, the same reductions, the reference ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..backends.registry import get_backend
from ..backends.torch import TorchBackend
from ..core.ports import ForwardBatch, ModelOutput

HOST = torch.device("cpu")


class HostBackend(TorchBackend):
    """The reference ops on the host records, two of them written for a few elements on a CPU.

    * ``verify_greedy``: the reference is ~25 tensor ops and an ``S``-round loop (about 300 us on the
      H100 machine's CPU for one 6-row chain); for up to `WALK_LIMIT` verify rows the walk is plain
      Python over lists (the textbook walk: from the root, the lowest-row child whose token the
      target predicted at its parent). Larger batches take the reference.
    * ``slots_for_positions``: the same arithmetic in numpy.
    * ``move_kv``: a tree's KV move runs on the KV's device: the indices (at most ``bs * (S + 1)``)
      go there once and the device's backend moves every buffer (one Triton launch on CUDA).

    Each is tested equal to the torch reference (tests/property/test_host_backend.py).
    """

    WALK_LIMIT = 512

    def __init__(self, device: torch.device | str = HOST) -> None:
        self.device = torch.device(device)
        self.device_backend = get_backend(self.device)

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

    def slots_for_positions(self, page_table: torch.Tensor, positions: torch.Tensor, page_size: int):
        if page_table.device.type != "cpu" or positions.device.type != "cpu":
            return super().slots_for_positions(page_table, positions, page_size)
        flat = positions.reshape(positions.shape[0], -1).numpy()
        pages = np.take_along_axis(page_table.numpy(), flat // page_size, axis=1)
        if (pages < 0).any():
            raise IndexError("a position lies past the pages its request holds; reserve before assigning slots")
        return torch.from_numpy(pages * page_size + flat % page_size).reshape(positions.shape)

    def move_kv(self, buffers: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        self.device_backend.move_kv(buffers, src.to(self.device), dst.to(self.device))


class HostTarget:
    """The target port, seen from records on the host (module docstring)."""

    def __init__(self, target) -> None:
        if getattr(target.graphs, "summarize", False) is not True:
            raise ValueError("a host control plane needs a target whose forward summarizes its logits (fast path)")
        self.inner = target
        self.device = HOST
        self.vocab_size = target.vocab_size

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        out = self.inner.forward(batch)
        summary = torch.stack([out.greedy, out.finite.long()]).to(HOST)  # the cycle's one sync
        return ModelOutput(logits=out.logits, hidden=None, greedy=summary[0], finite=summary[1].bool())

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


def serves(draft, sampling) -> bool:
    """Whether a `generate` call may run on the host control plane (module docstring)."""
    lookup = draft is not None and getattr(draft, "kind", "forward") == "lookup"
    plain = sampling is None or (sampling.greedy and not sampling.logprobs)
    return lookup and plain
