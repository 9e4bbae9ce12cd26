"""The 8B shape's GEMMs at a decode's and a verify's row counts: cuBLAS, cuBLASLt and split-K Triton.

A 32-node tree verify at the Llama-3-8B shape spends ~6 ms of its ~9 ms cycle in GEMMs of 32 rows. The GEMMs
are memory-bound at these row counts, so a GEMM of 32 rows could cost what one of 1 does. Part ``libraries``
times ``F.linear`` in bfloat16 at each of the layer's shapes (QKV 4096 -> 6144, O 4096 -> 4096, gate-up 4096 ->
2 x 14336, down 14336 -> 4096, the LM head 4096 -> 128256) and rows 1..64, and the O and down GEMMs as
`kernels.linear_add` runs them for the folded fast path (``x.addmm_(a, w.t())``: the residual add in cuBLAS's
epilogue), with torch's default BLAS library and with cuBLASLt (``torch.backends.cuda.preferred_blas_library``).
Part ``splitk`` times `engine.splitk_linear.splitk_linear_add` for O and down (its default tile, and with
``--sweep`` the tiles of `SPLITK_SWEEP`). Each graph replay calls a shape once per layer, each layer with its own
copy of the weight (`COPIES`: cold in L2, as in a real step); median of rounds. Per shape it also counts the rows
of a ``T``-row call whose bits equal the same row computed alone (row invariance; the engine pads a decode to the
verify's rows, so only a fixed row count must agree with itself) and sums a step's GEMMs (32 layers and the LM
head), plain and as the folded path runs them.

    python -m bench.blas_rows_bench --out $OUT
    python -m bench.blas_rows_bench --out $OUT --rows 1,5,32 --parts splitk --sweep

Writes ``blas_rows_bench-<date>.json`` (device, date, commit) into ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse

import attrs
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
# split-K tiles swept for O and down (`--parts splitk`): (block_m, block_n, splits, num_stages); block_k 128
SPLITK_SWEEP = [(m, n, s, st) for m in (16, 32) for n in (32, 64, 128) for s in (2, 4, 8) for st in (3, 5)]


def invariant_rows(x: torch.Tensor, w: torch.Tensor, fn=F.linear) -> int:
    """Rows of ``fn(x, w)`` (all rows at once) whose bits equal the row computed alone."""
    full = fn(x, w)
    return sum(int(torch.equal(full[r], fn(x[r : r + 1], w)[0])) for r in range(x.shape[0]))


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


def run_splitk(rows: list[int], weights, inputs, sweep: bool) -> dict:
    """`engine.splitk_linear` for O and down as the folded path would run them (``x += a @ w^T``): the default
    tile per shape and, with ``sweep``, `SPLITK_SWEEP`; row invariance of the default tile."""
    from speccycle.engine.splitk_linear import SplitKConfig, splitk_config, splitk_linear, splitk_linear_add

    out: dict = {"default_config": {}, "us": {}, "invariant_rows": {}}
    for name in ADD_SHAPES:
        ws = weights[name]
        n, k = ws[0].shape
        chosen = splitk_config(n, k, torch.bfloat16)
        out["default_config"][name] = attrs.asdict(chosen)
        configs = {"default": chosen}
        if sweep:
            for m, bn, s, st in SPLITK_SWEEP:
                if k % (s * 128) == 0:
                    configs[f"m{m}-n{bn}-s{s}-st{st}"] = SplitKConfig(block_m=m, block_n=bn, block_k=128, splits=s,
                                                                      num_stages=st)  # fmt: skip
        us = out["us"][name] = {}
        for label, config in configs.items():
            us[label] = {}
            for r in rows:
                x = inputs[r][:, :k].contiguous()
                residual = torch.zeros((r, n), device="cuda", dtype=torch.bfloat16)
                call = lambda w, x=x, res=residual, c=config: splitk_linear_add(res, x, w, config=c)  # noqa: E731
                us[label][r] = round(cold_us(call, ws), 2)
            cells = "  ".join(f"{r}:{us[label][r]:8.1f}" for r in rows)
            print(f"[splitk] {name:5s} {label:18s} {cells}", flush=True)
        big = max(rows)
        fn = lambda a, w, c=chosen: splitk_linear(a, w, config=c)  # noqa: E731
        out["invariant_rows"][name] = f"{invariant_rows(inputs[big][:, :k].contiguous(), ws[0], fn)}/{big}"
        best = {r: min(us, key=lambda lab: us[lab][r]) for r in rows}
        out.setdefault("best", {})[name] = {r: [lab, us[lab][r]] for r, lab in best.items()}
        print(f"[splitk] {name}: best {out['best'][name]}, invariant rows {out['invariant_rows'][name]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    parser.add_argument("--rows", default="1,5,8,16,24,32,64")
    parser.add_argument("--libraries", default="default,cublaslt", help="default and/or cublas, cublaslt")
    parser.add_argument("--parts", default="libraries,splitk", help="libraries (cuBLAS / cuBLASLt), splitk")
    parser.add_argument("--sweep", action="store_true", help="splitk: time every tile of SPLITK_SWEEP too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("blas_rows_bench needs a CUDA GPU")
    rows = [int(r) for r in args.rows.split(",")]
    parts = args.parts.split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = make_weights(gen)
    inputs = {r: torch.randn((r, 14336), generator=gen, device="cuda", dtype=torch.bfloat16) for r in rows}
    payload = {"rows": rows, "shapes": {k: list(v) for k, v in SHAPES.items()}, "copies": COPIES, "parts": parts}
    if "libraries" in parts:
        payload.update(run(rows, args.libraries.split(","), weights, inputs))
    if "splitk" in parts:
        payload["splitk"] = run_splitk(rows, weights, inputs, args.sweep)
    path = write_result("blas_rows_bench", payload, device="cuda", directory=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
