"""Where "the same bits" is a claim a test can make, and the check it makes instead where it is not.

A kernel that computes each row with the same sequence of operations whatever the other rows of its launch
(a verify's rows in one tile against each row as a decode alone, a tile size, a program count) gives the same
bits on a GPU: a tensor-core product's per-row sum does not depend on how many rows the tile holds. Under
``TRITON_INTERPRET=1`` a ``tl.dot`` is numpy's matrix product, whose summation order depends on the CPU
(its BLAS kernels for AVX2, AVX-512 or AMX) and on the operand shapes (one row goes to a matrix-vector
kernel, several to a matrix-matrix one): the same kernel can then differ in the last bit of a float32 sum
between an Intel and an AMD CPU. So:

- on a GPU (or anywhere the kernel's products do not go through the interpreter): bitwise, every dtype;
- under the interpreter: float32 within a few units in the last place; bfloat16 (float32 sums rounded to
  bfloat16 at the output) bitwise, which held on both an AMD EPYC and an Intel Xeon host CPU.

`assert_same_bits` states this once for the kernel tests.
"""

from __future__ import annotations

import os

import torch

# float32 sums of the same products in another order: a few units in the last place of the result
INTERPRETER_RTOL = 1e-6
INTERPRETER_ATOL = 1e-6


def interpreted(device: torch.device | str | None = None) -> bool:
    """Whether Triton kernels run through the interpreter here: ``TRITON_INTERPRET=1`` and no GPU tensors."""
    on_gpu = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    return os.environ.get("TRITON_INTERPRET") == "1" and not on_gpu


def bitwise_claim(dtype: torch.dtype, device: torch.device | str | None = None) -> bool:
    """Whether two launches of one kernel that reduce the same values in differently shaped products must agree
    bit for bit here (module docstring): always on a GPU; under the interpreter for bfloat16 only."""
    return not interpreted(device) or dtype == torch.bfloat16


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: object = "",
                     device: torch.device | str | None = None) -> None:  # fmt: skip
    """``got`` equals ``want`` bit for bit where `bitwise_claim` holds, else within the interpreter's float32
    tolerance (a few units in the last place); ``what`` names the case in the failure."""
    if bitwise_claim(dtype, device):
        if not torch.equal(got, want):
            diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "shapes differ"
            raise AssertionError(f"not bitwise equal ({what}): max |difference| {diff}")
        return
    torch.testing.assert_close(got, want, rtol=INTERPRETER_RTOL, atol=INTERPRETER_ATOL, msg=lambda m: f"{what}: {m}")
