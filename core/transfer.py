"""Host values onto a device without waiting for the device.

A plain ``torch.tensor(values, device="cuda")`` (or ``.to("cuda")`` of a pageable tensor) copies and then waits
for every kernel queued on the stream: the host stops until the GPU is idle. Where the scheduler overlaps host
work with a cycle on the GPU (docs/serving.md, "One step"), that wait would undo the overlap, so the few host
values a transition or a pool sends to the device go through pinned memory and an asynchronous copy, ordered on
the stream like every kernel after it. The pinned block stays allocated until the copy has run (PyTorch's
caching host allocator records the stream's use of it)."""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (a list of numbers or a host tensor) as a tensor of ``dtype`` on ``device``, not waited for."""
    device = torch.device(device)
    host = values.to(dtype) if torch.is_tensor(values) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
