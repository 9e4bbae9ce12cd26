"""Where a fused cycle's GPU time goes on the Llama-3-8B shape (random bf16 weights, forced acceptance).

    python -m bench.scale_profile --out $OUT

One engine per config (chain of 4, forced tau 3; 32-node tree, forced tau 4; as `gpu_bench --parts
scale`): a warm-up, then one `generate` under torch.profiler; per cycle the kernel time and the top
kernels, and the same for one autoregressive step at the same row padding (``ar``) and, with the chain, for the
plain decode of one row a step that the overhead factor is measured against (``ar1``, `FastGreedyDecoder`).
Writes ``OUT/scale_profile.json`` (device, commit, date; one fused cycle's time by phase and kernel kind,
`cycle_breakdown`), one text file of top kernels per config and one timeline per config: every kernel of the
profiled call in launch order (start, idle gap before it, duration, name), so a cycle's draft levels, verify,
accept and extend can be read apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from .common import result_record
from .decode_profile import kernel_times
from .forced import force_fused_acceptance
from .gpu_bench import LLAMA3_8B, random_eagle3_head, random_weights_on_device


def kernel_events(prof) -> list[tuple[float, float, str]]:
    """The profiled GPU kernels and copies as ``(start_us, end_us, name)``, in start order."""
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )


def timeline(events: list[tuple[float, float, str]]) -> list[str]:
    """``start_us gap_us dur_us name`` per kernel of `kernel_events` (times from the first kernel)."""
    if not events:
        return []
    t0, prev_end, lines = events[0][0], events[0][0], []
    for start, end, name in events:
        lines.append(f"{start - t0:10.1f} {max(0.0, start - prev_end):7.1f} {end - start:8.1f}  {name[:110]}")
        prev_end = max(prev_end, end)
    return lines


def kernel_kind(name: str) -> str:
    """A kernel's kind in a cycle breakdown: attention, GEMM (cuBLAS), other Triton kernels, small torch ops."""
    if "attention" in name:
        return "attention"
    if name.startswith(("nvjet", "sm90_", "ampere_", "cutlass")) or "gemm" in name.lower() or "splitKreduce" in name:
        return "gemm"
    if name.startswith(("void", "Memcpy", "Memset")):
        return "torch"
    return "triton"


def cycle_breakdown(events: list[tuple[float, float, str]]) -> dict:
    """One fused cycle's GPU time by phase and kind: the median over the profiled cycles but the first and last.

    Phases, cut at kernels every cycle runs once: ``accept+extend`` from `_accept_commit_kernel` (the walk's
    commit, a tree's KV move, the draft extend and its top-K), ``draft levels`` from `_cycle_slots_kernel`
    (the draft steps, a tree's rerank), ``verify`` from `_verify_rows_kernel` (the target forward, its argmax
    and, forced, the walk's predictions) up to the next cycle's `_accept_commit_kernel`. Wall time per phase
    (first kernel's start to the next phase's), with the kernels' own time by kind.
    """
    marks = {"_accept_commit_kernel": "accept+extend", "_cycle_slots_kernel": "draft levels",
             "_verify_rows_kernel": "verify"}  # fmt: skip
    starts = [i for i, e in enumerate(events) if e[2] == "_accept_commit_kernel"]
    cycles = []
    for a, b in zip(starts[1:-2], starts[2:-1]):
        phase, out = None, {}
        for i in range(a, b):
            start, end, name = events[i]
            phase = marks.get(name, phase)
            row = out.setdefault(phase, {"wall_us": 0.0, "kernels": 0})
            row["wall_us"] += events[i + 1][0] - start
            row["kernels"] += 1
            kind = kernel_kind(name)
            row[kind] = row.get(kind, 0.0) + end - start
        out["cycle"] = {"wall_us": events[b][0] - events[a][0], "kernels": b - a}
        cycles.append(out)
    if not cycles:
        return {}
    median = {}
    for phase in cycles[len(cycles) // 2]:
        keys = {k for c in cycles for k in c.get(phase, {})}
        median[phase] = {k: round(statistics.median(c.get(phase, {}).get(k, 0.0) for c in cycles), 1) for k in keys}
    median["cycles"] = len(cycles)
    return median


def main() -> None:
    from speccycle.core import SpecConfig
    from speccycle.engine.drafters.eagle import EagleDraft
    from speccycle.engine.engine import Engine
    from speccycle.engine.fast.path import FastGreedyDecoder, FastOptions
    from speccycle.engine.memory.kv_pool import PagedKVPool
    from speccycle.engine.models.llama import LlamaModel
    from speccycle.engine.weights.weights_gguf import LlamaConfig
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**LLAMA3_8B)
    head = random_eagle3_head(config, "cuda", torch.bfloat16)
    model = LlamaModel(config, random_weights_on_device(config, "cuda", torch.bfloat16), dtype=torch.bfloat16,
                       device="cuda", feature_layers=head.config.feature_layers)  # fmt: skip
    prompt = list(range(1000, 1512))
    rows = []
    for label, spec, tau in (
        ("chain4", SpecConfig(num_steps=4, page_size=16), 3.0),
        ("tree32", SpecConfig(num_steps=5, topk=4, num_draft_tokens=32, page_size=16), 4.0),
    ):
        pool = PagedKVPool(num_pages=80, page_size=16, device="cuda")
        engine = Engine(model, pool, lambda e, pool=pool: EagleDraft(head, model, pool), spec, fast=True)
        force_fused_acceptance(engine, tau)
        plain = None  # the plain 1-row decode the factor is measured against: once, with the chain
        if label == "chain4":
            plain = FastGreedyDecoder(engine.target, engine.pool, FastOptions("cuda", min_target_rows=1))
        for way in ("ar", "fused") if plain is None else ("ar1", "ar", "fused"):

            def run(way=way, engine=engine, plain=plain):
                if way == "ar1":
                    return plain.decode([prompt], args.new_tokens)
                if way == "ar":
                    return engine.generate_autoregressive([prompt], args.new_tokens)
                return engine.generate([prompt], args.new_tokens)

            run()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                out = run()
                torch.cuda.synchronize()
            steps = out[1].verifies if way == "fused" else args.new_tokens
            total, per_name = kernel_times(prof)
            top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:40]
            lines = [f"{t / steps:9.1f} {n / steps:9.2f}  {name[:150]}" for name, (t, n) in top]
            (args.out / f"scale_profile-{label}-{way}.txt").write_text("\n".join(lines) + "\n")
            events = kernel_events(prof)
            (args.out / f"scale_profile-{label}-{way}-timeline.txt").write_text("\n".join(timeline(events)) + "\n")
            row = {"config": label, "way": way, "steps": steps, "gpu_us_per_step": round(total / steps, 1),
                   "kernels_per_step": round(sum(n for _, n in per_name.values()) / steps, 1)}  # fmt: skip
            if way == "fused":
                row["cycle"] = cycle_breakdown(events)
            rows.append(row)
            print(json.dumps(row), flush=True)
            print("\n".join(lines[:12]), flush=True)
        del engine, pool, plain
        torch.cuda.empty_cache()
    record = result_record("scale_profile", {"rows": rows}, "cuda")
    (args.out / "scale_profile.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
