"""Does the verify attention's launch slow the GEMMs after it? The 8B shape's attention, O and gate-up, per layer.

In the 32-node tree verify's timelines (bench/results/scale_profile-H100-20261126-54b6fcf, the `tree32-fused` one) the O
GEMM takes 18.1 µs and the gate-up 91.3 a layer, where the same kernels at the same 32 rows take 14.8 and 85.5 in
the padded decode's timeline (`tree32-ar`) and 14.4 and 84.2 alone with cold weights (`blas_rows_bench`); the
QKV and down GEMMs take the same time in both. The verify's attention is the tile kernel's several-row launch
(`attention_tiles`: 128 registers, one wave of 4 programs a multiprocessor); the padded decode's is its one-row
launch. Before the launch change of c6a5d39 and e9dc330 the verify's O took 15.6
(`scale_profile-H100-20261126-155a47a/*-start*`).

This replays, from one CUDA graph, ``LAYERS`` layers of: the tile attention of a 32-row tree verify (one
request, ``--ctx`` keys of prefix, an engine's wide page table; each layer its own KV cache), the O GEMM added
into the residual (``x.addmm_``, as `kernels.linear_add`) and the gate-up GEMM (each layer its own weights), with
the attention launched in several ways (`VARIANTS`, speed only except ``rows1``, whose tiles are a decode's), or
not at all (``none``: the GEMMs after a precomputed attention output), or followed by a one-element kernel
(``spacer``). Under torch.profiler it reports each kernel kind's mean time and the graph's time per layer.

    python -m bench.neighbour_bench --out $OUT
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from .attention_bench import PAGE, rows_case
from .common import write_result
from .row_linear_bench import graph_us

LAYERS = 16
HIDDEN, INTER = 4096, 14336
VARIANTS = {  # name -> (attention launch options or None for no attention, spacer kernel after it)
    "none": (None, False),
    "default": ({}, False),
    "spacer": ({}, True),
    "nodiscard": (dict(discard_states=False), False),
    "r0": (dict(maxnreg=0), False),
    "p17-s3-r0": (dict(programs=17, num_stages=3, maxnreg=0), False),
    "p4": (dict(programs=4), False),
    "rows1": (dict(rows_per_tile=1), False),
}


def kind(name: str) -> str:
    if "attention_tile" in name:
        return "attention"
    if "combine" in name:
        return "combine"
    if "badd" in name or "addmm" in name:
        return "o"
    if name.startswith("nvjet") or "gemm" in name.lower():
        return "gate_up" if "128x" in name else f"gemm:{name[:40]}"
    return f"other:{name[:40]}"


def main() -> None:
    from speccycle.engine.attention_tiles import paged_attention_tiles_triton
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ctx", type=int, default=640)
    ap.add_argument("--rows", default="tree32", help="attention_bench's rows case: tree32 (a verify) or 1 (a decode)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("neighbour_bench needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    cases = [rows_case("llama3-8b", args.rows, args.ctx, "wide", torch.bfloat16, gen) for _ in range(LAYERS)]
    cgen = torch.Generator(device="cuda").manual_seed(0)
    w_o = [torch.randn(HIDDEN, HIDDEN, generator=cgen, device="cuda", dtype=torch.bfloat16) * 0.015
           for _ in range(LAYERS)]  # fmt: skip
    w_gu = [torch.randn(2 * INTER, HIDDEN, generator=cgen, device="cuda", dtype=torch.bfloat16) * 0.015
            for _ in range(LAYERS)]  # fmt: skip
    rows = cases[0]["args"][0].shape[0]
    x = torch.zeros(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    spacer = torch.zeros(1, device="cuda")
    fixed = [paged_attention_tiles_triton(*c["args"], PAGE).reshape(rows, HIDDEN) for c in cases]

    # the launch choices move work, never bits: every variant's output against the default's
    def attend(c, opts):
        return paged_attention_tiles_triton(*c["args"], PAGE, **opts).reshape(rows, HIDDEN)

    same = {
        name: all(torch.equal(attend(c, VARIANTS[name][0]), f) for c, f in zip(cases, fixed))
        for name in ("nodiscard", "r0", "p4") if name in args.variants.split(",")
    }  # fmt: skip
    print(f"[neighbour] same bits as the default launch: {same}", flush=True)
    results = {}
    for name in args.variants.split(","):
        options, with_spacer = VARIANTS[name]

        def layers(options=options, with_spacer=with_spacer):
            for i in range(LAYERS):
                if options is None:
                    attn = fixed[i]
                else:
                    attn = paged_attention_tiles_triton(*cases[i]["args"], PAGE, **options).reshape(rows, HIDDEN)
                if with_spacer:
                    spacer.add_(1.0)
                x.addmm_(attn, w_o[i].t())
                F.linear(x, w_gu[i])

        per_layer = graph_us(layers, reps=1) / LAYERS
        graph = torch.cuda.CUDAGraph()
        layers()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            layers()
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        times: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times.setdefault(kind(e.name), []).append(e.time_range.end - e.time_range.start)
        kinds = {k: round(statistics.mean(v), 2) for k, v in sorted(times.items())}
        results[name] = dict(options=options, spacer=with_spacer, graph_us_per_layer=round(per_layer, 2), kernels=kinds)
        print(f"[neighbour] {name:10s} layer {per_layer:7.2f} µs  " + "  ".join(f"{k} {v}" for k, v in kinds.items()),
              flush=True)  # fmt: skip
        del graph
    payload = dict(ctx=args.ctx, rows_case=args.rows, layers=LAYERS, rows=rows, variants=results, same_bits=same)
    path = write_result("neighbour_bench", payload, device="cuda", directory=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
