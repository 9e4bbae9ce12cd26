"""Where a speculative cycle's host time goes on the fast path: the device and host control planes side by side.

    python -m bench.cycle_profile --out $OUT --prompts spec_bench_dev.jsonl \
        --configs ngram:S5,layerskip:S4,eagle:S4,eagle:S5K4N24

For each config (`gpu_bench.parse_config`; ``eagle`` loads ``--eagle-head`` or the shipped head) one
engine runs the same prompt greedily on each control plane (`Engine.host_control` off, then on: the
plane a call actually took is recorded from `Engine._cycle_ports`), median of 3 calls, against the
fast autoregressive decoder. Per plane, one more call under torch.profiler counts the CUDA runtime
calls per cycle: syncs (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``),
copies (``cudaMemcpyAsync``), kernel launches and graph launches. Writes
``OUT/cycle_profile-<config>.txt`` (the summary, cProfile of the host plane by internal and
cumulative time, the torch.profiler table of each plane) and ``OUT/cycle_profile.json``; prints a
summary line per config.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import Counter
from pathlib import Path

import torch

from .gpu_bench import eagle_head_path, parse_config

# CUDA runtime / driver calls counted per cycle, by the kind of host cost they are
CALL_KINDS = {
    "sync": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
    "copy": ("cudaMemcpyAsync", "cudaMemcpy"),
    "kernel_launch": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"),
    "graph_launch": ("cudaGraphLaunch",),
}


def call_counts(profile, cycles: int) -> dict[str, float]:
    """Per cycle: how many CUDA runtime calls of each `CALL_KINDS` kind the profiled call made."""
    counts: Counter[str] = Counter()
    for event in profile.key_averages():
        for kind, names in CALL_KINDS.items():
            if event.key in names:
                counts[kind] += event.count
    return {kind: round(counts[kind] / max(cycles, 1), 2) for kind in CALL_KINDS}


def random_head(device: str, dtype: torch.dtype):
    """A random EAGLE-3 head for the default target (`gpu_bench.random_eagle3_head`): it drafts badly, but
    its cycle runs every forward and copy a trained head's does."""
    from speccycle.engine.engine import load_model

    from .gpu_bench import random_eagle3_head

    config, _, _ = load_model(None, dtype)
    return random_eagle3_head(config, device, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--configs", default="ngram:S5,layerskip:S4,eagle:S4,eagle:S5K4N24")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--fast", type=int, default=1)
    parser.add_argument("--layerskip-layers", type=int, default=8)
    parser.add_argument(
        "--eagle-head",
        default=None,
        help="EAGLE head .safetensors (default: the shipped head); 'random': a random EAGLE-3 head (cycle costs only)",
    )
    args = parser.parse_args()
    from speccycle.engine.engine import Engine

    dtype = getattr(torch, args.dtype)
    prompts = [json.loads(line) for line in args.prompts.open()]
    text = prompts[0].get("text") or prompts[0]["turns"][0]
    args.out.mkdir(parents=True, exist_ok=True)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = []
    for config in args.configs.split(","):
        draft, spec = parse_config(config)
        kwargs = {"layerskip_layers": args.layerskip_layers} if draft == "layerskip" else {}
        if draft == "eagle":
            head = random_head(args.device, dtype) if args.eagle_head == "random" else eagle_head_path(args.eagle_head)
            if head is None:
                print(json.dumps({"config": config, "skipped": "no --eagle-head and no shipped head"}), flush=True)
                continue
            kwargs["eagle_head"] = head
        engine = Engine.load(draft=draft, spec=spec, device=args.device, dtype=dtype, kv_tokens=4096,
                             fast=bool(args.fast), **kwargs)  # fmt: skip
        ids = engine.chat_prompt(text)
        pick = engine._cycle_ports
        planes_taken: list[str] = []

        def cycle_ports(sampling, pick=pick, planes_taken=planes_taken):
            ports, backend = pick(sampling)
            planes_taken.append("host" if type(backend).__name__ == "HostBackend" else "device")
            return ports, backend

        engine._cycle_ports = cycle_ports
        host = engine.host_control
        modes = [False, True] if args.fast else [False]  # on a CPU the host plane runs too (its 'device' the CPU)
        for mode in modes:  # warm-up: every graph bucket this prompt needs is captured, on each plane
            engine.host_control = mode
            for _ in range(2):
                engine.generate([ids], args.new_tokens)
        engine.generate_autoregressive([ids], 32)
        sync()
        start = time.perf_counter()
        ar = engine.generate_autoregressive([ids], args.new_tokens)
        sync()
        ar_s = time.perf_counter() - start
        both, tables = {}, {}
        for mode in modes:  # the device control plane, then the host one
            engine.host_control = mode
            planes_taken.clear()
            times = []
            for _ in range(3):
                sync()
                start = time.perf_counter()
                res, stats = engine.generate([ids], args.new_tokens)
                sync()
                times.append(time.perf_counter() - start)
            spec_s = sorted(times)[1]
            activities = [torch.profiler.ProfilerActivity.CPU]
            if args.device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as tp:
                _, profiled = engine.generate([ids], args.new_tokens)
            name = "host" if mode else "device"
            tables[name] = tp.key_averages().table(sort_by="cpu_time_total", row_limit=60)
            both[name] = {
                "plane_taken": sorted(set(planes_taken)),
                "spec_tok_s": round(len(res[0].output) / spec_s, 1),
                "spec_us_per_cycle": round(spec_s / max(stats.verifies, 1) * 1e6, 1),
                "tau": round(stats.tau, 3),
                "speedup_vs_ar": round((len(res[0].output) / spec_s) / (len(ar[0]) / ar_s), 3),
                "identical": list(res[0].output) == list(ar[0]),
                "calls_per_cycle": call_counts(tp, profiled.verifies),  # batch 1: one verify per cycle
            }
        engine.host_control = host
        host_serves = "host" in both and both["host"]["plane_taken"] == ["host"]
        prof = cProfile.Profile()
        prof.enable()
        engine.generate([ids], args.new_tokens)
        prof.disable()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(60)
        st.sort_stats("cumulative").print_stats(60)
        summary = {
            "config": config, "verifies": stats.verifies,
            "ar_tok_s": round(len(ar[0]) / ar_s, 1), "ar_us_per_token": round(ar_s / max(len(ar[0]), 1) * 1e6, 1),
            "control_plane": both, "cprofile": "host" if host and host_serves else "device",
        }  # fmt: skip
        rows.append(summary)
        print(json.dumps(summary), flush=True)
        body = json.dumps(summary) + "\n\n" + buf.getvalue()
        body += "".join(f"\n---- torch.profiler, {plane} control plane\n{table}" for plane, table in tables.items())
        (args.out / f"cycle_profile-{config.replace(':', '-')}.txt").write_text(body)
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result = {
        "benchmark": "cycle_profile",
        "device": device,
        "config": {"dtype": args.dtype, "batch": 1, "new_tokens": args.new_tokens, "fast": bool(args.fast),
                   "prompt": f"first prompt of {args.prompts.name}", "layerskip_layers": args.layerskip_layers},
        "rows": rows,
    }  # fmt: skip
    (args.out / "cycle_profile.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
