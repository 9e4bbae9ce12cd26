"""Which backend runs where, the ROCm FP8 gate, and the whole cycle on the Triton kernels.

No AMD GPU is at hand: the ROCm backend's choices are tested on CPU with the platform forced
(``get_backend(platform="rocm")``) and its kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from speccycle.backends.registry import get_backend
from speccycle.backends.torch import TorchBackend

triton = pytest.importorskip("triton")

from speccycle.backends.cuda import argmax  # noqa: E402
from speccycle.backends.cuda.launch import interpreted, runs_triton  # noqa: E402
from speccycle.backends.cuda.ops import FP8_DTYPES, CudaBackend  # noqa: E402
from speccycle.backends.rocm.ops import RocmBackend, softmax_max  # noqa: E402

needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreted(), reason="Triton kernels need a GPU or TRITON_INTERPRET=1"
)


# ---- the registry ------------------------------------------------------------------------------------
def test_registry_picks_per_platform(monkeypatch):
    monkeypatch.delenv("SPECCYCLE_BACKEND", raising=False)
    assert type(get_backend("cpu")) is TorchBackend
    assert type(get_backend(platform="cuda")) is CudaBackend
    assert type(get_backend(platform="rocm")) is RocmBackend  # what a ROCm build of torch gets


def test_environment_override_keeps_torch_selectable(monkeypatch):
    monkeypatch.setenv("SPECCYCLE_BACKEND", "torch")
    assert type(get_backend(platform="cuda")) is TorchBackend
    monkeypatch.setenv("SPECCYCLE_BACKEND", "rocm")
    assert type(get_backend("cpu")) is RocmBackend
    monkeypatch.setenv("SPECCYCLE_BACKEND", "tpu")
    with pytest.raises(ValueError, match="SPECCYCLE_BACKEND='tpu' is not available"):
        get_backend("cpu")


def test_rocm_is_chosen_when_torch_is_a_hip_build(monkeypatch):
    monkeypatch.delenv("SPECCYCLE_BACKEND", raising=False)
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    assert type(get_backend("cuda")) is RocmBackend
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert type(get_backend("cuda")) is CudaBackend


# ---- the ROCm FP8 gate ----------------------------------------------------------------------------------
def test_rocm_k1_path_per_dtype():
    rocm = RocmBackend()
    assert FP8_DTYPES, "this torch has no float8 dtypes"
    for dtype in FP8_DTYPES:
        assert rocm.k1_path(dtype) == "softmax_max", dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert rocm.k1_path(dtype) == "argmax", dtype


@needs_kernels
def test_rocm_fp8_logits_take_softmax_max_and_others_the_argmax_kernel(monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 300, generator=gen) * 3).to(device)
    rocm = RocmBackend()
    calls = []
    kernel = argmax.vocab_argmax
    monkeypatch.setattr(argmax, "vocab_argmax", lambda x, *a: calls.append(x.dtype) or kernel(x, *a))
    for dtype in FP8_DTYPES:
        try:
            fp8 = logits.to(dtype)
        except (RuntimeError, TypeError):  # a float8 variant this device cannot cast to (fnuz on some GPUs)
            continue
        probs, ids = rocm.select_topk(fp8, 1)
        want_probs, want_ids = softmax_max(fp8)
        assert torch.equal(ids, want_ids) and torch.equal(probs, want_probs)
        assert ids.shape == (4, 1) and probs.dtype == torch.float32
    assert calls == [], "FP8 logits on ROCm must not reach the argmax kernel"
    bf16 = logits.to(torch.bfloat16)
    probs, ids = rocm.select_topk(bf16, 1)
    assert calls == [torch.bfloat16]
    assert torch.equal(ids, TorchBackend().select_topk(bf16, 1)[1]) and bool((probs == 1).all())
    # K > 1 and the verify's argmax are not gated: the same kernels as on CUDA.
    for got, want in zip(rocm.select_topk(logits, 3), CudaBackend().select_topk(logits, 3)):
        assert torch.equal(got, want)
    fp8 = logits.to(FP8_DTYPES[0])
    assert torch.equal(rocm.greedy_predict(fp8), fp8.float().argmax(-1))


@needs_kernels
def test_cuda_backend_widens_fp8_logits_exactly():
    fp8 = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)).to(FP8_DTYPES[0])
    if torch.cuda.is_available():
        fp8 = fp8.cuda()
    ids = CudaBackend().select_topk(fp8, 1)[1]
    assert torch.equal(ids[:, 0], fp8.float().argmax(-1))


def test_cpu_tensors_without_the_interpreter_use_the_reference():
    if interpreted():
        assert runs_triton(torch.zeros(1))
    else:
        assert not runs_triton(torch.zeros(1))
        logits = torch.randn(2, 10)
        assert torch.equal(CudaBackend().greedy_predict(logits), logits.argmax(-1))


# ---- the whole cycle on the kernels -----------------------------------------------------------------------
def _cycle_machine():
    """`tests/property/test_cycle_machine.py`'s machine (loaded by path: test folders are not packages)."""
    path = Path(__file__).resolve().parents[1] / "property" / "test_cycle_machine.py"
    spec = importlib.util.spec_from_file_location("_cycle_machine_for_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CycleMachine


if interpreted():  # the cycle machine's tensors live on the CPU: its kernels run under TRITON_INTERPRET=1 only

    class KernelCycleMachine(_cycle_machine()):
        """The property machine in checked mode with every cycle op on `CudaBackend`'s kernels (CPU, interpreted)."""

        backend = CudaBackend()

    TestCycleOnKernels = KernelCycleMachine.TestCase
    TestCycleOnKernels.settings = settings(
        max_examples=int(os.environ.get("SPECCYCLE_KERNEL_CYCLE_EXAMPLES", "6")),
        stateful_step_count=6,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def test_fast_path_op_set_and_attention_warps_per_device(monkeypatch):
    """CUDA gets the folded-norm op set (7 kernels a layer), a CPU the torch one; ``CUDA_OPS`` overrides it for
    benchmarks. The rows attention kernel runs 1 warp a program up to head dim 64, 4 above; ``NUM_WARPS``
    overrides it. (Both choices were measured on an H100: docs/decisions.md.)"""
    from speccycle.engine.kernels import attention_triton
    from speccycle.engine.kernels import fused_ops as kernels

    assert kernels.default_ops("cuda") is kernels.FoldedNormOps
    assert kernels.default_ops("cpu") is kernels.TorchOps
    assert kernels.FoldedNormOps.fold_norms and not kernels.TritonCublasOps.fold_norms
    monkeypatch.setattr(kernels, "CUDA_OPS", kernels.TritonCublasOps)
    assert kernels.default_ops("cuda") is kernels.TritonCublasOps
    assert [attention_triton.default_num_warps(d) for d in (32, 64, 128)] == [1, 1, 4]
    monkeypatch.setattr(attention_triton, "NUM_WARPS", 8)
    assert attention_triton.default_num_warps(64) == 8
