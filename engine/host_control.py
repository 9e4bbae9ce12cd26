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

import torch

from ..backends.registry import get_backend
from ..backends.torch import TorchBackend
from ..core.ports import ForwardBatch, ModelOutput

HOST = torch.device("cpu")


class HostBackend(TorchBackend):
    """The torch reference ops on the host records; a tree's KV move runs on the KV's device.

    The move's indices (at most ``bs * (S + 1)``) go to the device once, and the device's backend
    moves every buffer (one Triton launch on CUDA, instead of two indexing kernels per buffer).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.device_backend = get_backend(self.device)

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
