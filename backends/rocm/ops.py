"""The ROCm backend: the CUDA backend's Triton kernels, with one gate for FP8 draft logits.

Triton compiles the same kernels for AMD GPUs, so `RocmBackend` inherits every op of `CudaBackend`
(all of them are plain loads, stores, reductions and a CTA barrier; nothing NVIDIA-specific; each
compiles for ``gfx942``, see `speccycle.backends.cuda.compile_specs`). One choice differs: the
``K == 1`` draft step.

**The FP8 gate.** On CUDA the chain draft takes the argmax of the logits and skips the full-vocabulary
softmax. On ROCm, when the logits are FP8 (``float8_e4m3fn``, ``float8_e4m3fnuz``, ``float8_e5m2``,
``float8_e5m2fnuz``), `select_topk` keeps softmax + max: in SGLang the argmax fast path and softmax +
max picked different tokens there, and a DeepSeek-V3.2 + MTP model's GSM8K accuracy on MI35x fell
from 0.975 to 0.035 (96% invalid output) until the fast path was reverted (SGLang PRs 26235, 26358;
re-landed for CUDA only). The cause was never pinned down; the suspects were a downstream read of the
``K == 1`` probability that needs the real value (the gated path returns it, not ones) and a ROCm
argmax that returned an index past an unaligned vocabulary tail (our kernel masks the tail and is
tested on unaligned vocabularies). Until that is measured on AMD hardware, FP8 logits take the path
that was measured correct; every other dtype takes the argmax kernel (exact, ties to the lowest
index). The verify's `greedy_predict` is not gated: it defines the target's greedy token, and the
kernel widens FP8 to float32 (exactly) before its argmax.

No AMD GPU is at hand: the tests force the platform (``get_backend(platform="rocm")``) and run these
choices on CPU under ``TRITON_INTERPRET=1``. HIP graphs are the engine's: on ROCm builds of torch,
``torch.cuda.CUDAGraph`` records HIP graphs (not run here either).
"""

from __future__ import annotations

import torch

from ..cuda.ops import FP8_DTYPES, CudaBackend
from ..registry import register_backend
from ..torch.ops import write_out


class RocmBackend(CudaBackend):
    """`CudaBackend` with the ROCm FP8 gate on the ``K == 1`` draft step (see the module docstring)."""

    name = "rocm"

    def k1_path(self, dtype: torch.dtype) -> str:
        """How ``select_topk(logits, 1)`` picks: ``"softmax_max"`` for FP8 logits, ``"argmax"`` otherwise."""
        return "softmax_max" if dtype in FP8_DTYPES else "argmax"

    def select_topk(self, logits, topk, vocab_map=None, out=None):
        """Top-``K`` draft candidates; ``K == 1`` with FP8 logits is softmax + max (the probability is real).

        Shapes: ``logits [R, V]`` -> ``probs [R, K]`` float32, ``ids [R, K]`` int64 (``vocab_map`` and ``out``:
        `TorchBackend.select_topk`).
        """
        if topk == 1 and self.k1_path(logits.dtype) == "softmax_max":
            probs, ids = softmax_max(logits)
            return write_out(out, probs, ids if vocab_map is None else vocab_map[ids])
        return super().select_topk(logits, topk, vocab_map, out)


def softmax_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated ``K == 1`` pick: ``softmax(logits.float()).max(-1)``. Shapes: ``[R, V]`` -> ``[R, 1]``, ``[R, 1]``."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.max(dim=-1, keepdim=True)
    return top.values, top.indices


register_backend("rocm", RocmBackend)
