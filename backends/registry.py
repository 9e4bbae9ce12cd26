"""Choose a backend per device and platform, with an environment override.

``SPECCYCLE_BACKEND=torch|cuda|rocm`` forces one. Otherwise a CUDA device picks ``cuda`` on NVIDIA and
``rocm`` on ROCm builds of torch (``torch.version.hip``), when registered; anything else is ``torch``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .torch import TorchBackend

_FACTORIES: dict[str, Callable[[], TorchBackend]] = {"torch": TorchBackend}


def register_backend(name: str, factory: Callable[[], TorchBackend]) -> None:
    """Make ``name`` selectable; fast backends call this when their module imports."""
    _FACTORIES[name] = factory


def _import_optional() -> None:
    # The fast backends register themselves; they need triton, which a CPU install may lack.
    for module in ("cuda", "rocm"):
        try:
            __import__(f"{__package__}.{module}.ops", fromlist=["_"])
        except ImportError:
            pass


def platform_of(device: torch.device | str | None) -> str:
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        return "cpu"
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def get_backend(device: torch.device | str | None = None, platform: str | None = None) -> TorchBackend:
    """The backend for ``device`` (or a forced ``platform``: ``cpu``, ``cuda``, ``rocm``)."""
    forced = os.environ.get("SPECCYCLE_BACKEND")
    _import_optional()
    if forced:
        if forced not in _FACTORIES:
            raise ValueError(
                f"SPECCYCLE_BACKEND={forced!r} is not available; choose one of {sorted(_FACTORIES)}"
                " (cuda and rocm need triton)"
            )
        return _FACTORIES[forced]()
    plat = platform or platform_of(device)
    if plat in _FACTORIES:
        return _FACTORIES[plat]()
    return TorchBackend()
