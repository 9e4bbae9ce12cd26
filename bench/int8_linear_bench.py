"""An 8B-shaped EAGLE-3 head's GEMMs in bfloat16 (cuBLAS / cuBLASLt) and in weight-only int8
(`engine.kernels.int8_linear`).

The head drafts at a decode's few rows (1 for a chain, the tree's frontier of K for a tree, a verify's accepted
rows for an extend), so its GEMMs read weights: int8 halves the bytes. Per shape (`SHAPES`: the head's ``fc``
12288 -> 4096, QKV 8192 -> 6144, O, gate-up, down, and a 32,000-token draft LM head) and row count this times
``F.linear`` in bfloat16 with torch's default BLAS library and with cuBLASLt (the fast path's, `fast.path.blas_scope`),
and `int8_linear.int8_linear_triton` with its default tile (`int8_config`) and, with ``--sweep``, the tiles of
`SWEEP`. Weights are cold: each graph replay calls a shape once per copy of its weight, the copies together
larger than L2 (`COPY_BYTES`). It sums a draft level (QKV, O, gate-up, down, LM head) per library and checks the
kernel against `int8_linear_torch`.

    python -m bench.int8_linear_bench --out $OUT
    python -m bench.int8_linear_bench --out $OUT --rows 1,4 --sweep

Writes ``int8_linear_bench-<date>.json`` (device, date, commit) into ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse

import attrs
import torch
import torch.nn.functional as F

from .common import write_result
from .row_linear_bench import graph_us

SHAPES = {  # name: (out features, in features) of an EAGLE-3 head on Llama-3-8B (hidden 4096, draft vocab 32,000)
    "fc": (4096, 3 * 4096),
    "qkv": (6144, 2 * 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (32000, 4096),
}
LEVEL = ("qkv", "o", "gate_up", "down", "lm_head")  # a draft step's GEMMs (the fc runs on extends only)
COPY_BYTES = 256 << 20  # bfloat16 bytes of a shape's copies together: past the H100's 50 MB L2 several times
# (block_n, block_k, splits, num_warps, num_stages) swept with ``--sweep``
SWEEP = [(n, k, s, w, st) for n in (32, 64, 128) for k in (128, 256, 512) for s in (1, 2, 4) for w in (4, 8)
         for st in (3, 5)]  # fmt: skip


def cold_us(call, weights: list) -> float:
    return graph_us(lambda: [call(w) for w in weights], reps=1) / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,5,16,32")
    parser.add_argument("--sweep", action="store_true", help="time every tile of SWEEP too")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from speccycle.engine.kernels.int8_linear import Int8Config, Int8Rowwise, int8_config, int8_linear_torch
    from speccycle.engine.kernels.int8_linear import int8_linear_triton as int8_linear

    rows = [int(r) for r in args.rows.split(",")]
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    gen = torch.Generator(device="cuda").manual_seed(0)
    result: dict = {"shapes": shapes, "rows": rows, "us": {}, "default_config": {}, "check": {}}
    default = torch.backends.cuda.preferred_blas_library()
    for name, (n, k) in shapes.items():
        copies = max(2, COPY_BYTES // (2 * n * k))
        dense = [
            torch.randn((n, k), generator=gen, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)
        ]
        packed = [Int8Rowwise.from_weight(w) for w in dense]
        us = result["us"][name] = {"cublas": {}, "cublaslt": {}, "int8": {}}
        result["default_config"][name] = {}
        for r in rows:
            x = torch.randn((r, k), generator=gen, device="cuda", dtype=torch.bfloat16)
            for library, key in ((default, "cublas"), ("cublaslt", "cublaslt")):
                torch.backends.cuda.preferred_blas_library(library)
                us[key][r] = round(cold_us(lambda w, x=x: F.linear(x, w), dense), 2)
            torch.backends.cuda.preferred_blas_library(default)
            config = int8_config(r, n, k)
            result["default_config"][name][r] = attrs.asdict(config)
            us["int8"][r] = round(cold_us(lambda w, x=x: int8_linear(x, w), packed), 2)
            ref = int8_linear_torch(x, packed[0]).float()
            err = (int8_linear(x, packed[0]).float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            result["check"].setdefault(name, {})[r] = err
            if args.sweep:
                for bn, bk, s, w, st in SWEEP:
                    if k % (s * bk) or bn > n:
                        continue
                    c = Int8Config(block_m=16 if r <= 16 else 32, block_n=bn, block_k=bk, splits=s, num_warps=w,
                                   num_stages=st)  # fmt: skip
                    label = f"n{bn}-k{bk}-s{s}-w{w}-st{st}"
                    try:
                        t = round(cold_us(lambda wt, x=x, c=c: int8_linear(x, wt, config=c), packed), 2)
                    except Exception as exc:  # out of shared memory or registers: skip the tile
                        print(f"[int8] {name} {label}: {type(exc).__name__}", flush=True)
                        continue
                    us.setdefault("sweep", {}).setdefault(label, {})[r] = t
            best = ""
            if args.sweep and "sweep" in us:
                lab = min(us["sweep"], key=lambda lab: us["sweep"][lab].get(r, 1e9))
                us.setdefault("best", {})[r] = [lab, us["sweep"][lab][r]]
                best = f" best {lab} {us['sweep'][lab][r]:.1f}"
            gbs = n * k / (us["int8"][r] * 1e3)
            print(f"[int8] {name:8s} rows {r:3d}: cublas {us['cublas'][r]:7.1f} cublaslt {us['cublaslt'][r]:7.1f} "
                  f"int8 {us['int8'][r]:7.1f} ({gbs:6.0f} GB/s, rel err {err:.1e}){best}", flush=True)  # fmt: skip
        del dense, packed
        torch.cuda.empty_cache()
    level = result["level_us"] = {}
    for key in ("cublas", "cublaslt", "int8"):
        if all(name in shapes for name in LEVEL):
            level[key] = {r: round(sum(result["us"][name][key][r] for name in LEVEL), 1) for r in rows}
    print(f"[int8] a draft level's GEMMs (µs): {level}", flush=True)
    write_result("int8_linear_bench", result, "cuda", args.out)


if __name__ == "__main__":
    main()
