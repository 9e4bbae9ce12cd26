"""When the cycle's Triton kernels can run, and how many programs to aim a launch at.

Triton decides at ``@triton.jit`` time whether a kernel is compiled for a GPU or interpreted on the
CPU (``TRITON_INTERPRET=1`` set before triton is imported): `interpreted` reads that decision from a
kernel object. `runs_triton` is true for CUDA tensors, and for CPU tensors under the interpreter
(how CI tests every kernel); the backend falls back to the torch reference otherwise.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _probe_kernel(ptr):
    tl.store(ptr, 0)


def interpreted() -> bool:
    """True when this process runs Triton kernels in the interpreter (``TRITON_INTERPRET=1``)."""
    return type(_probe_kernel).__name__ == "InterpretedFunction"


def runs_triton(*tensors: torch.Tensor) -> bool:
    """Every tensor on one CUDA device, or every tensor on the CPU under the interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return False
    (device,) = devices
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def target_programs(device: torch.device) -> int:
    """Programs that fill the device a few times over; the interpreter runs each program in Python: few."""
    if device.type != "cuda":
        return 4
    return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Under the interpreter every program, and every reduction inside one, costs milliseconds of Python:
# kernels over many short rows take this many rows per program there.
ROWS_PER_PROGRAM = 256


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))
