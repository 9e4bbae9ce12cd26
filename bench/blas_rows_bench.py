"""The 8B shape's GEMMs at a decode's and a verify's row counts: cuBLAS and cuBLASLt.

A 32-node tree verify at the Llama-3-8B shape spends ~6 ms of its ~9 ms cycle in GEMMs of 32 rows. The GEMMs are
memory-bound at these row counts, so a GEMM of 32 rows could cost what one of 1 does. It times ``F.linear`` in
bfloat16 at each of the layer's shapes (QKV 4096 -> 6144, O 4096 -> 4096, gate-up 4096 -> 2 x 14336, down 14336 ->
4096, the LM head 4096 -> 128256) and rows 1..64, and the O and down GEMMs as `kernels.linear_add` runs them for
the folded fast path (``x.addmm_(a, w.t())``: the residual add in cuBLAS's epilogue), with torch's default BLAS
library and with cuBLASLt (``torch.backends.cuda.preferred_blas_library``). Each graph replay calls a shape once
per layer, each layer with its own copy of the weight (`COPIES`: cold in L2, as in a real step); median of rounds.
Per shape it also counts the rows of a ``T``-row call whose bits equal the same row computed alone (row invariance;
the engine pads a decode to the verify's rows, so only a fixed row count must agree with itself) and sums a step's
GEMMs (32 layers and the LM head), plain and as the folded path runs them.

    python -m bench.blas_rows_bench --out $OUT
    python -m bench.blas_rows_bench --out $OUT --rows 1,5,32 --libraries cublaslt

A split-K Triton kernel for O and down (``engine/splitk_linear.py``, the ``splitk`` part of this benchmark) was
measured here against both libraries, lost (blas_rows_bench-H100-cold-20261126-095903.json) and was removed.

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
# Each timed graph calls a shape once per layer, every layer with its own copy of the weight, so no call finds
# its weight in L2 (the O weight, 32 MB, fits the H100's 50 MB L2: the figures of 02ba531 replayed one copy 20
# times, warm, and put O at 8.2-8.8 µs at 32 rows against the 14.8-18.1 of a real verify's timeline).
COPIES = {name: (1 if name == "lm_head" else LAYERS) for name in SHAPES}


def invariant_rows(x: torch.Tensor, w: torch.Tensor) -> int:
    """Rows of ``F.linear(x, w)`` (all rows at once) whose bits equal the row computed alone."""
    full = F.linear(x, w)
    return sum(int(torch.equal(full[r], F.linear(x[r : r + 1], w)[0])) for r in range(x.shape[0]))


def cold_us(call, weights: list[torch.Tensor]) -> float:
    """GPU time of one ``call(w)`` (µs), each graph replay calling it once per weight copy."""
    return graph_us(lambda: [call(w) for w in weights], reps=1) / len(weights)


def make_weights(gen) -> dict[str, list[torch.Tensor]]:
    return {
        name: [torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) * shape[1] ** -0.5
               for _ in range(COPIES[name])]
        for name, shape in SHAPES.items()
    }  # fmt: skip


def run(rows: list[int], libraries: list[str], weights, inputs) -> dict:
    out: dict = {"us": {}, "invariant_rows": {}, "step_ms": {}}
    default = torch.backends.cuda.preferred_blas_library()
    try:
        for library in libraries:
            torch.backends.cuda.preferred_blas_library(default if library == "default" else library)
            us = out["us"][library] = {}
            for name, ws in weights.items():
                us[name] = {}
                for r in rows:
                    x = inputs[r][:, : ws[0].shape[1]].contiguous()
                    us[name][r] = round(cold_us(lambda w, x=x: F.linear(x, w), ws), 2)
                cells = "  ".join(f"{r}:{us[name][r]:8.1f}" for r in rows)
                print(f"[blas] {library:9s} {name:8s} {cells}", flush=True)
            for name in ADD_SHAPES:  # the residual adds the folded fast path rides on the O and down GEMMs
                ws, key = weights[name], f"{name}+add"
                us[key] = {}
                for r in rows:
                    x = inputs[r][:, : ws[0].shape[1]].contiguous()
                    residual = torch.zeros((r, ws[0].shape[0]), device="cuda", dtype=torch.bfloat16)
                    us[key][r] = round(cold_us(lambda w, x=x, res=residual: res.addmm_(x, w.t()), ws), 2)
                cells = "  ".join(f"{r}:{us[key][r]:8.1f}" for r in rows)
                print(f"[blas] {library:9s} {key:8s} {cells}", flush=True)
            big = max(rows)
            out["invariant_rows"][library] = {
                name: f"{invariant_rows(inputs[big][:, : ws[0].shape[1]].contiguous(), ws[0])}/{big}"
                for name, ws in weights.items()
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
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = make_weights(gen)
    inputs = {r: torch.randn((r, 14336), generator=gen, device="cuda", dtype=torch.bfloat16) for r in rows}
    payload = {"rows": rows, "shapes": {k: list(v) for k, v in SHAPES.items()}, "copies": COPIES}
    payload.update(run(rows, args.libraries.split(","), weights, inputs))
    path = write_result("blas_rows_bench", payload, device="cuda", directory=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
