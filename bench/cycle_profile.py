"""Where a speculative cycle's host time goes on the fast path: cProfile and torch.profiler over `generate`.

    python -m bench.cycle_profile --out $OUT --prompts spec_bench_dev.jsonl --configs ngram:S5,layerskip:S4

Writes ``OUT/cycle_profile-<config>.txt`` (cProfile by internal and cumulative time, the torch.profiler
table of CPU-side ops: launches and syncs per cycle) and prints a summary line per config.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from .gpu_bench import parse_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--configs", default="ngram:S5,layerskip:S4")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--fast", type=int, default=1)
    args = parser.parse_args()
    from speccycle.engine.engine import Engine

    dtype = getattr(torch, args.dtype)
    prompts = [json.loads(line) for line in args.prompts.open()]
    text = prompts[0].get("text") or prompts[0]["turns"][0]
    args.out.mkdir(parents=True, exist_ok=True)
    for config in args.configs.split(","):
        draft, spec = parse_config(config)
        kwargs = {"layerskip_layers": 8} if draft == "layerskip" else {}
        engine = Engine.load(draft=draft, spec=spec, device=args.device, dtype=dtype, kv_tokens=4096,
                             fast=bool(args.fast), **kwargs)  # fmt: skip
        ids = engine.chat_prompt(text)
        for _ in range(2):  # warm-up: every graph bucket this prompt needs is captured
            engine.generate([ids], args.new_tokens)
        engine.generate_autoregressive([ids], 32)
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        ar = engine.generate_autoregressive([ids], args.new_tokens)
        sync()
        ar_s = time.perf_counter() - start
        host = engine.host_control
        both = {}
        for mode in ([False, True] if host else [False]):  # the device control plane, then the host one
            engine.host_control = mode
            engine.generate([ids], args.new_tokens)
            times = []
            for _ in range(3):
                sync()
                start = time.perf_counter()
                res, stats = engine.generate([ids], args.new_tokens)
                sync()
                times.append(time.perf_counter() - start)
            spec_s = sorted(times)[1]
            both["host" if mode else "device"] = {
                "spec_tok_s": round(len(res[0].output) / spec_s, 1),
                "spec_us_per_cycle": round(spec_s / max(stats.verifies, 1) * 1e6, 1),
                "identical": list(res[0].output) == list(ar[0]),
            }
        engine.host_control = host
        prof = cProfile.Profile()
        prof.enable()
        engine.generate([ids], args.new_tokens)
        prof.disable()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(60)
        st.sort_stats("cumulative").print_stats(60)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as tp:
            engine.generate([ids], args.new_tokens)
        table = tp.key_averages().table(sort_by="cpu_time_total", row_limit=60)
        summary = {
            "config": config, "verifies": stats.verifies, "tau": round(stats.tau, 3),
            "ar_tok_s": round(len(ar[0]) / ar_s, 1), "ar_us_per_token": round(ar_s / max(len(ar[0]), 1) * 1e6, 1),
            "control_plane": both, "profiled": "host" if host else "device",
        }  # fmt: skip
        print(json.dumps(summary), flush=True)
        name = config.replace(":", "-")
        (args.out / f"cycle_profile-{name}.txt").write_text(json.dumps(summary) + "\n\n" + buf.getvalue() + "\n" + table)
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
