"""Programmatic dependent launch (PDL) for the fast path's small Triton kernels (CUDA, Hopper and later).

Why: a decode step is a few hundred kernels replayed from one CUDA graph, many of them a few µs long, and part of
each is its launch and the wait for the kernel ahead of it to drain. A kernel launched with PDL may be scheduled
while the kernel ahead of it is still running; it must then wait (PTX ``griddepcontrol.wait``) before it touches
memory, which returns once that kernel has completed and its writes are visible. On an H100, in a CUDA graph
(bench/pdl_bench.py, bench/results/pdl_bench-H100-*): a chain of tiny kernels 1.16 -> 0.81 µs a kernel; between
cuBLAS GEMMs of SmolLM2's decode shapes 1.89 -> 1.49 µs a launch.

**The rule that keeps it correct.** Every kernel launched with PDL begins with `pdl_start`: the wait, before any
load or store, then the signal that lets the kernel after it be scheduled (``griddepcontrol.launch_dependents``).
The wait covers the kernel ahead completely (its loads too, so a write here cannot race a read there), and since
each PDL kernel completes only after its own wait has returned, every earlier kernel has completed too. A kernel
launched without PDL (cuBLAS, torch, the other Triton kernels) waits for the kernel ahead as always. So the order
of memory effects is the stream's; what PDL moves earlier is only a launch and the arithmetic before the wait (here:
none). The signal's early launch cannot deadlock: the dependent is scheduled only once every program of the kernel
ahead has signalled, that is, is already running.

`pdl_options` turns it on for CUDA tensors on a device of compute capability 9.0 or more when the installed
Triton has the instructions, off for CPU tensors (the interpreter), ROCm and older GPUs, and everywhere with
``SPECCYCLE_PDL=0``.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without triton
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - a triton without grid dependency control: never launched with PDL
    gdc_wait = gdc_launch_dependents = None

ENV = "SPECCYCLE_PDL"
# ``SPECCYCLE_PDL`` -> the kernels' ``PDL``: 0 off; 1 wait (the next kernel is scheduled once this one's programs have
# exited, before its completion is signalled); 2 wait and signal at once (the next kernel is scheduled as soon as every
# program of this one is running)
LEVELS = {"0": 0, "wait": 1, "1": 2}


def pdl_level() -> int:
    """``SPECCYCLE_PDL`` (unset: ``1``) as the kernels' ``PDL`` level (`LEVELS`); refused with the choices otherwise."""
    value = os.environ.get(ENV, "1")
    if value not in LEVELS:
        raise ValueError(f"{ENV}={value!r}: choose 1 (programmatic dependent launch where the GPU has it, with the "
                         "early signal), wait (without it) or 0 (off)")  # fmt: skip
    return LEVELS[value]


def pdl_wanted() -> bool:
    return pdl_level() > 0


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_options(like: torch.Tensor) -> dict:
    """The launch keywords of a kernel with a ``PDL`` constexpr whose tensors live where ``like`` does: ``PDL`` and
    Triton's ``launch_pdl`` both true where PDL runs (see the module docstring), ``PDL`` false elsewhere."""
    level = pdl_level()
    if not level or gdc_wait is None or not like.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return {"PDL": 0}
    index = like.device.index if like.device.index is not None else torch.cuda.current_device()
    return {"PDL": level, "launch_pdl": True} if _device_has_pdl(index) else {"PDL": 0}


if triton is not None and gdc_wait is not None:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """A PDL-launched kernel's first statement: wait for the kernel ahead, then (level 2) let the next one be
        scheduled."""
        if PDL >= 1:
            gdc_wait()
        if PDL >= 2:
            gdc_launch_dependents()

elif triton is not None:  # pragma: no cover - pdl_options never sets PDL here

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        pass
