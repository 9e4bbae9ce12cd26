"""What programmatic dependent launch (PDL) saves between small kernels in a CUDA graph.

A decode step at SmolLM2's shape is ~220 kernels of a few µs each, replayed from one CUDA graph: much of a small
kernel's time is its launch and the wait for the kernel before it to drain. With PDL (Hopper) a kernel launched
with ``launch_pdl=True`` may be scheduled before the kernel ahead of it has finished, and waits in
``gdc_wait`` (the PTX ``griddepcontrol.wait``) until that kernel's writes are visible. This times chains of tiny
Triton kernels, alone and between cuBLAS GEMMs of SmolLM2's decode shapes, with and without PDL (and with the
kernel ahead signalling its dependents early, ``gdc_launch_dependents``), in CUDA graphs, and checks each chain's
result. (End to end the fast path did not gain from it: docs/fast_engine.md, "Programmatic dependent launch, tried
and removed".)

    python -m bench.pdl_bench --out $OUT

Writes ``pdl_bench-<date>.json`` (device, date, commit) into ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import write_result
from .row_linear_bench import graph_us

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def _step_kernel(x_ptr, y_ptr, n, WAIT: tl.constexpr, SIGNAL: tl.constexpr, BLOCK: tl.constexpr):
    """``y = x + 1`` (``WAIT``: `gdc_wait` first; ``SIGNAL``: let the next kernel launch at once)."""
    if WAIT:
        gdc_wait()
    if SIGNAL:
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=200, help="kernels a chain")
    parser.add_argument("--n", type=int, default=4096, help="elements a kernel adds 1 to")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n, count = args.n, args.kernels
    block = 1024
    grid = (triton.cdiv(n, block),)
    x = torch.zeros(n, device="cuda")
    y = torch.zeros(n, device="cuda")
    a = torch.randn(1, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(960, 576, device="cuda", dtype=torch.bfloat16)
    result: dict = {"kernels": count, "n": n, "us_per_kernel": {}, "checks": {}}

    def chain(pdl: bool, signal: bool, gemm: bool):
        def run():
            x.zero_()
            for _ in range(count // 2):
                if gemm:
                    F.linear(a, w)
                _step_kernel[grid](x, y, n, WAIT=pdl, SIGNAL=signal, BLOCK=block, launch_pdl=pdl)
                _step_kernel[grid](y, x, n, WAIT=pdl, SIGNAL=signal, BLOCK=block, launch_pdl=pdl)

        return run

    for gemm in (False, True):
        for label, pdl, signal in (("plain", False, False), ("pdl", True, False), ("pdl+signal", True, True)):
            key = f"{'gemm+' if gemm else ''}{label}"
            run = chain(pdl, signal, gemm)
            us = graph_us(run, reps=1)
            per = us / (count * (1.5 if gemm else 1))
            result["us_per_kernel"][key] = round(per, 3)
            result["checks"][key] = bool((x == float(count)).all().item())
            print(f"[pdl] {key:20s} {us:9.1f} µs a chain, {per:6.3f} µs a kernel, result ok: {result['checks'][key]}",
                  flush=True)  # fmt: skip
    write_result("pdl_bench", result, "cuda", args.out)


if __name__ == "__main__":
    main()
