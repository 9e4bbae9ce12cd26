"""Plain-torch reference ops: correct on CPU and on any GPU."""

from .ops import TorchBackend

__all__ = ["TorchBackend"]
