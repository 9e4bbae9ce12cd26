"""CPU float32 linear layers at SmolLM2-135M's weight shapes: which call makes a few rows cost about one.

A decode step runs every weight once with 1 row, a speculative verify with 2-16 rows. On a CPU the
model is memory-bound (float32 SmolLM2-135M streams ~540 MB per forward), so ideally ``n`` rows cost
what 1 row costs. This script times, for each projection shape of the model and ``n`` in ``--rows``,
several ways to compute ``x @ W.T`` (``W [out, in]`` as stored):

* ``linear``: ``F.linear(x, W)`` (what the engine ran before; MKL GEMV at 1 row, packing GEMM above);
* ``w_xt``: ``(W @ x.T).T``; ``x_wt``: ``x @ Wt`` with ``Wt = W.t().contiguous()`` kept beside ``W``;
* ``addmm``: ``torch.addmm(0, x, W.t())``, ``addmm_wt``: the same on ``Wt``;
* ``onednn``: oneDNN's prepacked weight (``torch.ops.mkldnn._reorder_linear_weight`` once, then
  ``_linear_pointwise``; ``onednn_m1``: packed for 1 row); ``mkl_pack``: MKL's packed GEMM
  (``torch.ops.mkl._mkl_reorder_linear_weight`` for the exact row count, then ``_mkl_linear``), the
  two paths Inductor's CPU freezing uses;
* ``gemv``: one ``torch.mv`` per row; ``gemv_tiled``: the rows of ``W`` cut into tiles of
  ``--tile-mb`` and, per tile, one ``torch.mv`` per row (the tile stays in cache for rows 2..n).

Each weight is held in enough distinct copies (``--cold-mb`` in all, 30 for the per-layer shapes, as
in the model) and every timed call takes the next copy, so weights come from memory as in a forward,
not from the cache. Repeats interleave variants and row counts (drifting load hits them alike); the
statistic is the median. The record also says, per variant and ``n``, whether row ``r`` of the
``n``-row call equals the 1-row call on row ``r`` bitwise (``row_invariant``: verify rows then equal
decode rows exactly) and the largest difference from ``F.linear``.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.cpu_linear --threads 2 --write   # idle machine only

Without ``--write`` nothing is stored: on a shared machine the timings are indicative only.

``--model`` times whole target forwards instead (the engine's SmolLM2-135M, float32): ``n`` causal
rows after a ``--context``-token prompt, over a one-row forward, with the engine's linears
(`engine.llama.PackedLinear`) and with plain ``F.linear``, interleaved; medians. These ratios are the
row costs `bench/ngram_tau.py` weighs verifies with.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.cpu_linear --threads 2 --model --write
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .common import write_result

# name -> (out_features, in_features), SmolLM2-135M (30 layers, hidden 576, 9/3 heads of 64, MLP 1536)
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}
NUM_LAYERS = 30
CLOCK = [time.perf_counter]  # --clock thread: time.thread_time, this thread's CPU time (1 thread only)


def _tiles(weight: torch.Tensor, tile_mb: float) -> list[tuple[int, torch.Tensor]]:
    """Row tiles of ``weight`` of at most ``tile_mb`` MB each: ``(first row, tile)``."""
    rows = max(1, int(tile_mb * 2**20 // (weight.shape[1] * weight.element_size())))
    return [(start, weight[start : start + rows]) for start in range(0, weight.shape[0], rows)]


def _gemv_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], weight.shape[0])
    for r in range(x.shape[0]):
        torch.mv(weight, x[r], out=out[r])
    return out


def _gemv_tiled(x: torch.Tensor, tiles: list[tuple[int, torch.Tensor]], out_features: int) -> torch.Tensor:
    out = x.new_empty(x.shape[0], out_features)
    for start, tile in tiles:
        for r in range(x.shape[0]):
            torch.mv(tile, x[r], out=out[r, start : start + tile.shape[0]])
    return out


def variants(tile_mb: float) -> dict[str, tuple[Callable, Callable]]:
    """name -> (prepare(W, n) -> prepared, call(x, prepared) -> y). ``prepare`` may ignore ``n``."""
    mkldnn, mkl = torch.ops.mkldnn, torch.ops.mkl
    return {
        "linear": (lambda w, n: w, lambda x, w: F.linear(x, w)),
        "w_xt": (lambda w, n: w, lambda x, w: (w @ x.T).T),
        "x_wt": (lambda w, n: w.t().contiguous(), lambda x, wt: x @ wt),
        "addmm": (
            lambda w, n: (w, w.new_zeros(w.shape[0])),
            lambda x, p: torch.addmm(p[1], x, p[0].t()),
        ),
        "addmm_wt": (
            lambda w, n: (w.t().contiguous(), w.new_zeros(w.shape[0])),
            lambda x, p: torch.addmm(p[1], x, p[0]),
        ),
        "onednn": (
            lambda w, n: mkldnn._reorder_linear_weight(w),
            lambda x, p: mkldnn._linear_pointwise(x, p, None, "none", [], ""),
        ),
        "onednn_m1": (
            lambda w, n: mkldnn._reorder_linear_weight(w, 1),
            lambda x, p: mkldnn._linear_pointwise(x, p, None, "none", [], ""),
        ),
        "mkl_pack": (
            lambda w, n: (mkl._mkl_reorder_linear_weight(w, n), w, n),
            lambda x, p: mkl._mkl_linear(x, p[0], p[1], None, p[2]),
        ),
        "gemv": (lambda w, n: w, _gemv_rows),
        "gemv_tiled": (
            lambda w, n: (_tiles(w, tile_mb), w.shape[0]),
            lambda x, p: _gemv_tiled(x, p[0], p[1]),
        ),
    }


PER_ROW_COUNT = {"mkl_pack"}  # prepared per row count (MKL packs for one M)


def copies_for(shape: tuple[int, int], cold_mb: float) -> int:
    if shape == SHAPES["head"]:
        return 2
    size_mb = shape[0] * shape[1] * 4 / 2**20
    return max(NUM_LAYERS, math.ceil(cold_mb / size_mb))


@torch.no_grad()
def check_rows(call, prepared_for: Callable[[int], object], weight: torch.Tensor, rows: list[int], seed: int) -> dict:
    """Per ``n``: is row ``r`` of the ``n``-row call bitwise the 1-row call on it; max |diff| from F.linear."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    one = prepared_for(1)
    for n in rows:
        x = torch.randn(n, weight.shape[1], generator=gen)
        y = call(x, prepared_for(n))
        singles = torch.cat([call(x[r : r + 1], one) for r in range(n)])
        ref = F.linear(x, weight)
        out[str(n)] = {
            "row_invariant": bool(torch.equal(y, singles)),
            "max_diff_vs_1row": float((y - singles).abs().max()),
            "max_diff_vs_linear": float((y - ref).abs().max()),
        }
    return out


@torch.no_grad()
def bench_shape(name: str, names: list[str], rows: list[int], reps: int, tile_mb: float, cold_mb: float) -> dict:
    out_f, in_f = SHAPES[name]
    table = variants(tile_mb)
    copies = copies_for(SHAPES[name], cold_mb)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_f, in_f, generator=gen) * 0.05 for _ in range(copies)]
    prepared: dict[tuple[str, int], list] = {}
    checks = {}
    for v in names:
        prepare, call = table[v]
        keys = rows if v in PER_ROW_COUNT else [0]
        for n in keys:
            prepared[(v, n)] = [prepare(w, n) for w in weights]
        one_key = (lambda n, v=v: prepared[(v, n)][0]) if v in PER_ROW_COUNT else (lambda n, v=v: prepared[(v, 0)][0])
        checks[v] = check_rows(call, one_key, weights[0], rows, seed=1)
    xs = {n: torch.randn(n, in_f, generator=gen) for n in rows}
    times: dict[tuple[str, int], list[float]] = {(v, n): [] for v in names for n in rows}
    order = [(v, n) for v in names for n in rows]
    for rep in range(reps):
        for v, n in order if rep % 2 == 0 else reversed(order):
            call = table[v][1]
            packs = prepared[(v, n if v in PER_ROW_COUNT else 0)]
            x = xs[n]
            tick = CLOCK[0]()
            for p in packs:  # every copy once: each call finds its weight cold, as in a forward
                call(x, p)
            times[(v, n)].append((CLOCK[0]() - tick) / len(packs))
    base = statistics.median(times[("linear", 1)]) if "linear" in names else None
    result = {"shape": [out_f, in_f], "copies": copies, "variants": {}}
    for v in names:
        entry = {"median_us": {}, "vs_linear_1row": {}, "vs_own_1row": {}, "rows": checks[v]}
        own1 = statistics.median(times[(v, rows[0])])
        for n in rows:
            med = statistics.median(times[(v, n)])
            entry["median_us"][str(n)] = round(med * 1e6, 1)
            entry["vs_own_1row"][str(n)] = round(med / own1, 3)
            if base:
                entry["vs_linear_1row"][str(n)] = round(med / base, 3)
        result["variants"][v] = entry
    return result


@torch.no_grad()
def bench_model(rows: list[int], reps: int, context: int) -> dict:
    """Median seconds of a target forward of ``n`` rows after ``context`` tokens, packed vs F.linear."""
    from speccycle.engine import llama
    from speccycle.engine.engine import Engine
    from speccycle.engine.greedy import extend_batch

    engine = Engine.load(draft="ngram", device="cpu", dtype=torch.float32)
    pool, target = engine.pool, engine.target
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (context,), generator=gen).tolist()
    rid = 10**9
    target.forward(extend_batch(pool, [rid], [prompt], [0]))
    packs = llama._packs_on_cpu
    modes = {"packed": packs, "f_linear": lambda x, w: False}
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in rows}
    try:
        for rep in range(reps):
            order = [(m, n) for m in modes for n in rows]
            for mode, n in order if rep % 2 == 0 else reversed(order):
                llama._packs_on_cpu = modes[mode]
                batch = extend_batch(pool, [rid], [prompt[:n]], [context], last_logits_only=False)
                tick = CLOCK[0]()
                target.forward(batch)
                times[(mode, n)].append(CLOCK[0]() - tick)
    finally:
        llama._packs_on_cpu = packs
        pool.free(rid)
    out = {"context_tokens": context, "reps": reps, "modes": {}}
    base = statistics.median(times[("f_linear", 1)])
    for mode in modes:
        own = statistics.median(times[(mode, 1)])
        out["modes"][mode] = {
            "median_ms": {str(n): round(statistics.median(times[(mode, n)]) * 1e3, 2) for n in rows},
            "ratio": {str(n): round(statistics.median(times[(mode, n)]) / own, 3) for n in rows},
            "vs_f_linear_1row": {str(n): round(statistics.median(times[(mode, n)]) / base, 3) for n in rows},
            "min_ms": {str(n): round(min(times[(mode, n)]) * 1e3, 2) for n in rows},
            "min_ratio": {str(n): round(min(times[(mode, n)]) / min(times[(mode, 1)]), 3) for n in rows},
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--variants", default=",".join(variants(1.0)))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--tile-mb", type=float, default=0.5, help="gemv_tiled: MB of W per tile")
    parser.add_argument("--cold-mb", type=float, default=96.0, help="MB of weight copies per shape (> the L3)")
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: count this thread's CPU time, not wall time (with --threads 1 on a shared machine: time "
        "spent descheduled is left out, memory contention is not)",
    )
    parser.add_argument("--model", action="store_true", help="time whole forwards (packed vs F.linear) instead")
    parser.add_argument("--context", type=int, default=900, help="--model: prompt tokens before the rows")
    parser.add_argument("--write", action="store_true", help="store the record in bench/results (idle machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "thread":
        if args.threads != 1:
            raise ValueError("--clock thread counts one thread's CPU time: use it with --threads 1")
        CLOCK[0] = time.thread_time
    rows = [int(n) for n in args.rows.split(",")]
    if rows[0] != 1:
        raise ValueError("--rows must start with 1 (every ratio is against the 1-row call)")
    if args.model:
        result = {"clock": args.clock, **bench_model(rows, args.reps, args.context)}
        for mode, entry in result["modes"].items():
            cells = "  ".join(f"{n}:{entry['median_ms'][n]:>7.1f} {entry['ratio'][n]:.2f}" for n in entry["ratio"])
            print(f"{mode:<9} forward median ms, ratio to own 1 row: {cells}", flush=True)
            cells = "  ".join(f"{n}:{entry['min_ms'][n]:>7.1f} {entry['min_ratio'][n]:.2f}" for n in entry["ratio"])
            print(f"{mode:<9} forward min ms, ratio to own 1 row:    {cells}", flush=True)
        if args.write:
            print(f"wrote {write_result('cpu_linear_model', {'threads': args.threads, **result})}")
        return
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in variants(1.0)]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}: choose from {', '.join(variants(1.0))}")
    record = {"threads": args.threads, "clock": args.clock, "rows": rows, "reps": args.reps, "tile_mb": args.tile_mb}
    record["shapes"] = {}
    for name in args.shapes.split(","):
        result = bench_shape(name, names, rows, args.reps, args.tile_mb, args.cold_mb)
        record["shapes"][name] = result
        print(f"{name} {result['shape']} ({result['copies']} copies): median us, ratio to F.linear 1 row, row_inv")
        for v, e in result["variants"].items():
            cells = "  ".join(
                f"{n}:{e['median_us'][n]:>8.0f} {e['vs_linear_1row'].get(n, float('nan')):.2f}"
                f"{'' if e['rows'][n]['row_invariant'] else '*'}"
                for n in map(str, rows)
            )
            print(f"  {v:<11} {cells}", flush=True)
    # the whole forward's linears: per-layer shapes x 30 + head, per variant and n, against F.linear at 1 row
    if all(s in record["shapes"] for s in SHAPES) and "linear" in names:
        total = {}
        for v in names:
            per_n = {}
            for n in map(str, rows):
                us = sum(
                    record["shapes"][s]["variants"][v]["median_us"][n] * (1 if s == "head" else NUM_LAYERS)
                    for s in SHAPES
                )
                per_n[n] = round(us / 1e3, 2)
            total[v] = per_n
        base = total["linear"]["1"]
        record["forward_linears_ms"] = total
        print("all linears of one forward (ms; ratio to F.linear at 1 row):")
        for v, per_n in total.items():
            print(f"  {v:<11} " + "  ".join(f"{n}:{ms:>7.1f} {ms / base:.2f}" for n, ms in per_n.items()))
    record["note"] = "* in the printout: row r of the n-row call differs from the 1-row call (not row-invariant)"
    if args.write:
        print(f"wrote {write_result('cpu_linear', record)}")


if __name__ == "__main__":
    main()
