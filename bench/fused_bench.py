"""Fused EAGLE cycles (`engine.fast.fused_cycle`) against the host control plane and autoregressive decoding.

SmolLM2-135M (``$SPECCYCLE_DEFAULT_MODEL`` or the embedded GGUF), the shipped EAGLE-3 head, bfloat16,
batch 1, greedy, on the fast path. For each ``--configs`` entry (chains ``S4,S5``, trees ``S6K4N32``;
page size 16) one engine runs every prompt three ways, interleaved prompt by prompt so that clocks
and temperatures hit each alike: the fast autoregressive decode, speculative with fused cycles, and
speculative with the host control plane (the engine's previous GPU path). Per way: tokens/s over all
prompts, the median per-prompt tokens/s, tau, and identical_to_ar (output == autoregressive).

    python -m bench.fused_bench --out $OUT --prompts spec_bench_dev.jsonl --per-category 2 --max-new-tokens 256
    python -m bench.fused_bench --out $OUT --prompts spec_bench_dev.jsonl --per-category 0 --max-new-tokens 128 \\
        --ways ar,fused            # every prompt: the bf16 losslessness of the fused cycles
    python -m bench.fused_bench ... --ways ar,fused,ngram:S5,layerskip:S4   # against the other drafters
    python -m bench.fused_bench ... --ways ar,fused,fused-torch   # the cycle's bookkeeping kernels vs torch ops

Other drafters (``--ways`` entries ``draft:S..`` beyond ``ar,fused,host``) run on their own fast engines,
interleaved with the rest. ``fused_host_us_per_cycle``: the host's work per fused cycle (launch, the
done flag's copy, its check); ``fused_launch_us_per_cycle``: the part spent in the graph launch itself.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from collections import defaultdict

import torch

from .common import write_result
from .gpu_bench import eagle_head_path, free, parse_config, pick, say, timed


def main() -> None:
    from speccycle.engine.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--per-category", type=int, default=2, help="0: every prompt")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--configs", default="S4,S5,S6")
    ap.add_argument("--ways", default="ar,fused,host")
    ap.add_argument("--eagle-head", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--variants",
        default="",
        help="comma list of engine variants, each '+'-joined settings: w<n> (attention warps), frontier-torch "
        "(`CudaBackend.advance_frontier` as torch ops), an op set "
        "(triton-cublas, triton-cublas-folded, triton: `kernels.fused_ops.CUDA_OPS`), "
        "head=PATH (this EAGLE head instead of --eagle-head's); "
        "one engine each, every way run on each, "
        "interleaved; labels get '@<variant>' (e.g. --variants triton-cublas,triton-cublas-folded)",
    )
    args = ap.parse_args()
    from speccycle.backends.cuda.ops import CudaBackend
    from speccycle.engine.kernels import attention_triton
    from speccycle.engine.kernels import fused_ops as kernels

    op_sets = {ops.name: ops for ops in (kernels.TritonCublasOps, kernels.FoldedNormOps, kernels.TritonOps)}

    def settings(variant):
        """``(warps or None, op set or None, fused frontier, head path or None)`` of a variant string."""
        warps, ops, frontier, head_file = None, None, True, None
        for part in [p for p in (variant or "").split("+") if p]:
            if part.startswith("w") and part[1:].isdigit():
                warps = int(part[1:])
            elif part in op_sets:
                ops = op_sets[part]
            elif part == "frontier-torch":
                frontier = False
            elif part.startswith("head="):
                head_file = eagle_head_path(part[len("head=") :])
            else:
                raise SystemExit(
                    f"--variants: unknown setting {part!r} (w<n>, frontier-torch, head=PATH or one of "
                    f"{sorted(op_sets)})"
                )
        return warps, ops, frontier, head_file

    prompts = [json.loads(line) for line in open(args.prompts)]
    for p in prompts:
        p.setdefault("text", p.get("prompt") or p["turns"][0])
    if args.per_category:
        prompts = pick(prompts, args.per_category)
    ways = args.ways.split(",")
    head = eagle_head_path(args.eagle_head)
    # ways other than ar / fused / host: other drafters, "ngram:S5", "layerskip:S4" (gpu_bench's config
    # syntax), each on its own fast engine built once and reused for every --configs entry
    others = [w for w in ways if w not in ("ar", "fused", "fused-torch", "host")]
    other_engines = {}

    def other_engine(way):
        if way not in other_engines:
            draft, spec = parse_config(way if ":" in way else f"{way}:S4")
            other_engines[way] = Engine.load(draft=draft, spec=spec, device="cuda", dtype=torch.bfloat16,
                                             kv_tokens=4096, fast=True)  # fmt: skip
        return other_engines[way]

    variants = [v for v in args.variants.split(",") if v] or [None]  # None: the defaults, labels unsuffixed
    default_warps = attention_triton.NUM_WARPS

    def apply(variant):  # graphs capture the launches they first see: each engine keeps its own settings
        warps, ops, frontier, _ = settings(variant)
        attention_triton.NUM_WARPS = warps or default_warps
        kernels.CUDA_OPS = ops
        CudaBackend.fused_frontier = frontier

    labels = [(f"{way}@{w}" if w else way, way, w) for w in variants for way in ways]
    rows = []
    for text in args.configs.split(","):
        spec = parse_config(f"eagle:{text}")[1]
        engines = {}
        for w in variants:
            apply(w)
            engine = Engine.load(draft="eagle", spec=spec, device="cuda", dtype=torch.bfloat16, kv_tokens=4096,
                                 fast=True, eagle_head=settings(w)[3] or head)  # fmt: skip
            fused = engine.fused_cycles
            # "fused-torch": the same fused cycles with the bookkeeping in torch ops (`FusedCycles.kernels`)
            fused_torch = copy.copy(fused)
            fused_torch._states, fused_torch.kernels, fused_torch.replays = {}, False, 0
            engines[w] = (engine, fused, fused_torch)
        ids = [engine.chat_prompt(p["text"]) for p in prompts]

        def run(label, x, n, engines=engines):
            _, way, w = next(item for item in labels if item[0] == label)
            engine, fused, fused_torch = engines[w]
            apply(w)
            if way == "ar":
                return engine.generate_autoregressive([x], n)[0], None
            if way in others:  # another drafter on its own fast engine (host control plane)
                results, stats = other_engine(way).generate([x], n)
                return list(results[0].output), stats
            engine.fused_cycles = {"fused": fused, "fused-torch": fused_torch}.get(way)
            results, stats = engine.generate([x], n)
            return list(results[0].output), stats

        names = [label for label, _, _ in labels]
        for x in ids[:3]:  # warm-up: prefill buckets, graphs
            for way in names:
                run(way, x, 8)
        for x in ids:  # every prompt's prefill once (its shapes compile on first use)
            for way in names:
                run(way, x, 2)
        for way in names:  # and one full-length run each, so that clocks are up before the first timed prompt
            run(way, ids[0], args.max_new_tokens)
        per = {
            way: dict(tokens=0, seconds=0.0, tps=[], verifies=0, committed=0, outputs=[], run_s=0.0) for way in names
        }
        cats = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        for i, x in enumerate(ids):
            for way in names:
                _, plain, w = next(item for item in labels if item[0] == way)
                cycles = engines[w][1] if plain == "fused" else None
                before = cycles.run_s if cycles is not None else 0.0
                (out, stats), seconds = timed(lambda way=way, x=x: run(way, x, args.max_new_tokens))
                r = per[way]
                if cycles is not None:  # the part of the call inside `FusedCycles.run`
                    r["run_s"] += cycles.run_s - before
                r["tokens"] += len(out)
                r["seconds"] += seconds
                r["tps"].append(len(out) / seconds)
                r["outputs"].append(out)
                if stats is not None:
                    r["verifies"] += stats.verifies
                    r["committed"] += stats.committed
                    c = cats[way][prompts[i]["category"]]
                    c[0] += stats.committed
                    c[1] += stats.verifies
            if (i + 1) % 20 == 0:
                say(f"[{text}] {i + 1}/{len(ids)}")
        row = {
            "config": text,
            "S": spec.num_steps,
            "K": spec.topk,
            "N": spec.num_draft_tokens,
            "P": spec.page_size,
            "prompts": len(ids),
            "new_tokens": args.max_new_tokens,
        }
        for label, way, w in labels:
            r = per[label]
            base = per.get(f"ar@{w}" if w else "ar")
            entry = {
                "tokens_per_s": round(r["tokens"] / r["seconds"], 1),
                "median_prompt_tokens_per_s": round(statistics.median(r["tps"]), 1),
            }
            if r["run_s"]:  # per prompt: the prefill and first draft extend (outside the cycles) and the cycles' run
                entry["outside_cycles_ms_per_prompt"] = round((r["seconds"] - r["run_s"]) / len(ids) * 1e3, 2)
                entry["cycles_run_ms_per_prompt"] = round(r["run_s"] / len(ids) * 1e3, 2)
            if r["verifies"]:
                entry["tau"] = round(r["committed"] / r["verifies"], 3)
                entry["tau_by_category"] = {k: round(v[0] / v[1], 3) for k, v in sorted(cats[way].items())}
            if base is not None and way != "ar":
                entry["identical_to_ar"] = sum(a == b for a, b in zip(base["outputs"], r["outputs"]))
                entry["speedup_vs_ar"] = round(entry["tokens_per_s"] / (base["tokens"] / base["seconds"]), 3)
                entry["median_speedup_vs_ar"] = round(
                    statistics.median(s / a for s, a in zip(r["tps"], base["tps"])), 3
                )
            row[label] = entry
        if len(variants) > 1 and "ar" in ways:  # the AR decodes of every variant, outputs compared
            first = per[f"ar@{variants[0]}"]["outputs"]
            row["ar_identical_across_variants"] = sum(
                all(per[f"ar@{w}"]["outputs"][i] == out for w in variants) for i, out in enumerate(first)
            )
        fused = engines[variants[0]][1]
        if fused is not None:  # the host's work per cycle in the fused loop (launch, flag copy and check)
            row["fused_replays"] = fused.replays
            row["fused_host_us_per_cycle"] = round(fused.host_s / max(fused.replays, 1) * 1e6, 1)
            row["fused_wait_us_per_cycle"] = round(fused.wait_s / max(fused.replays, 1) * 1e6, 1)
            row["fused_launch_us_per_cycle"] = round(fused.launch_s / max(fused.replays, 1) * 1e6, 1)
        rows.append(row)
        say("[fused_bench]", json.dumps(row))
        del engine, fused, engines
        free()
    attention_triton.NUM_WARPS, kernels.CUDA_OPS = default_warps, None
    payload = {
        "benchmark": "fused_bench",
        "config": {
            "dtype": "bfloat16",
            "batch": 1,
            "draft": "eagle (shipped head)",
            "ways": ways,
            "variants": variants,
            "prompts_file": args.prompts,
            "per_category": args.per_category,
        },  # fmt: skip
        "rows": rows,
    }
    path = write_result(f"fused_bench{args.tag}", payload, device="cuda", directory=args.out)
    say("wrote", path)


if __name__ == "__main__":
    main()
