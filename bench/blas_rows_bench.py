"""The 8B shape's GEMMs at a decode's and a verify's row counts: cuBLAS against cuBLASLt.

A 32-node tree verify at the Llama-3-8B shape spends ~6 ms of its ~9 ms cycle in GEMMs of 32 rows, which
`scale_profile` measured ~5% slower than an 8-row decode step's (session 16). The GEMMs are memory-bound at
these row counts, so a GEMM of 32 rows could cost what one of 8 does. This times ``F.linear`` in bfloat16 at
each of the layer's shapes (QKV 4096 -> 6144, O 4096 -> 4096, gate-up 4096 -> 2 x 14336, down 14336 -> 4096,
the LM head 4096 -> 128256) and rows 1..64, and the O and down GEMMs as `kernels.linear_add` runs them for
the folded fast path (``x.addmm_(a, w.t())``: the residual add in cuBLAS's epilogue), with torch's default
BLAS library and with cuBLASLt (``torch.backends.cuda.preferred_blas_library``). Each call is replayed from
a CUDA graph of 20 (median of rounds; the weights are larger than L2, as in a real step). Per shape and
library it also counts the rows of a ``T``-row call whose bits equal the same row computed alone (row
invariance; the engine pads a decode to the verify's rows, so only a fixed row count must agree with
itself) and sums a step's GEMMs (32 layers and the LM head), plain and as the folded path runs them.

    python -m bench.blas_rows_bench --out $OUT
    python -m bench.blas_rows_bench --out $OUT --rows 1,8,32 --libraries default,cublaslt

Writes ``blas_rows_bench-<date>.json`` (device, date, commit) into ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from .common import write_result
from .row_linear_bench import graph_us

SHAPES = {  # name: (out features, in features) of Llama-3-8B's GEMMs
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
ADD_SHAPES = ("o", "down")  # `kernels.linear_add`: ``x.addmm_(a, w.t())``, cuBLAS's beta = 1
LAYERS = 32
CALLS = 20  # calls per graph


def invariant_rows(x: torch.Tensor, w: torch.Tensor) -> int:
    """Rows of ``x @ w.T`` (all rows at once) whose bits equal the row computed alone."""
    full = F.linear(x, w)
    return sum(int(torch.equal(full[r], F.linear(x[r : r + 1], w)[0])) for r in range(x.shape[0]))


def run(rows: list[int], libraries: list[str]) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        name: (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) * shape[1] ** -0.5)
        for name, shape in SHAPES.items()
    }
    inputs = {r: torch.randn((r, 14336), generator=gen, device="cuda", dtype=torch.bfloat16) for r in rows}
    out: dict = {"us": {}, "invariant_rows": {}, "step_ms": {}}
    default = torch.backends.cuda.preferred_blas_library()
    try:
        for library in libraries:
            torch.backends.cuda.preferred_blas_library(default if library == "default" else library)
            us = out["us"][library] = {}
            for name, w in weights.items():
                us[name] = {}
                for r in rows:
                    x = inputs[r][:, : w.shape[1]].contiguous()
                    us[name][r] = round(graph_us(F.linear, x, w, reps=CALLS), 2)
                cells = "  ".join(f"{r}:{us[name][r]:8.1f}" for r in rows)
                print(f"[blas] {library:9s} {name:8s} {cells}", flush=True)
            for name in ADD_SHAPES:  # the residual adds the folded fast path rides on the O and down GEMMs
                w, key = weights[name], f"{name}+add"
                us[key] = {}
                for r in rows:
                    x = inputs[r][:, : w.shape[1]].contiguous()
                    residual = torch.zeros((r, w.shape[0]), device="cuda", dtype=torch.bfloat16)
                    us[key][r] = round(graph_us(residual.addmm_, x, w.t(), reps=CALLS), 2)
                cells = "  ".join(f"{r}:{us[key][r]:8.1f}" for r in rows)
                print(f"[blas] {library:9s} {key:8s} {cells}", flush=True)
                key = f"{name}+add2"  # the same sum as a GEMM and an add kernel (the bits differ: two roundings)
                us[key] = {}
                for r in rows:
                    x = inputs[r][:, : w.shape[1]].contiguous()
                    residual = torch.zeros((r, w.shape[0]), device="cuda", dtype=torch.bfloat16)
                    us[key][r] = round(graph_us(lambda x=x, w=w, res=residual: res.add_(F.linear(x, w)), reps=CALLS), 2)
                cells = "  ".join(f"{r}:{us[key][r]:8.1f}" for r in rows)
                print(f"[blas] {library:9s} {key:8s} {cells}", flush=True)
            big = max(rows)
            out["invariant_rows"][library] = {
                name: f"{invariant_rows(inputs[big][:, : w.shape[1]].contiguous(), w)}/{big}"
                for name, w in weights.items()
            }
            out["step_ms"][library] = {
                r: round((LAYERS * sum(us[n][r] for n in ("qkv", "o", "gate_up", "down")) + us["lm_head"][r]) / 1000, 3)
                for r in rows
            }
            out.setdefault("folded_step_ms", {})[library] = {  # O and down as the folded path runs them
                r: round(
                    (LAYERS * sum(us[n][r] for n in ("qkv", "o+add", "gate_up", "down+add")) + us["lm_head"][r]) / 1000,
                    3,
                )
                for r in rows
            }
            print(f"[blas] {library:9s} folded GEMMs of a step (ms): {out['folded_step_ms'][library]}", flush=True)
            print(f"[blas] {library:9s} GEMMs of a step (ms): {out['step_ms'][library]}", flush=True)
            print(f"[blas] {library:9s} invariant rows: {out['invariant_rows'][library]}", flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    weight_bytes = LAYERS * sum(2 * h * w for n, (h, w) in SHAPES.items() if n != "lm_head") + 2 * 128256 * 4096
    out["weight_gb"] = round(weight_bytes / 1e9, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    parser.add_argument("--rows", default="1,5,8,16,24,32,64")
    parser.add_argument("--libraries", default="default,cublaslt", help="default and/or cublas, cublaslt")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("blas_rows_bench needs a CUDA GPU")
    rows = [int(r) for r in args.rows.split(",")]
    payload = {"rows": rows, "shapes": {k: list(v) for k, v in SHAPES.items()}, "calls_per_graph": CALLS}
    payload.update(run(rows, args.libraries.split(",")))
    path = write_result("blas_rows_bench", payload, device="cuda", directory=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
