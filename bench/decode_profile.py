"""Where the GPU time of a decode step and of a speculative cycle goes: kernel time against wall time.

    python -m bench.decode_profile --out $OUT --prompts spec_bench_dev.jsonl --configs none:S5,ngram:S5,eagle:S4

For each config (`gpu_bench.parse_config`; ``none:<spec>`` is the fast autoregressive decoder of an
engine built with that spec, whose decode graphs pad to the spec's ``N`` rows) one engine decodes the
first prompt greedily, once to warm up (graphs captured), then once under torch.profiler with CUDA
activity. Per step (autoregressive) or per cycle (speculative) it reports the wall time, the summed
kernel time on the GPU (``gpu_busy_us``; what the GPU could not do faster without faster kernels),
and the rest (``gpu_idle_us``: launch latency, host work the GPU waits for). The top kernels by total
time, with calls per step, go to ``OUT/decode_profile-<config>.txt``; ``OUT/decode_profile.json`` holds
the summary rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from .gpu_bench import eagle_head_path, parse_config


def kernel_times(prof) -> tuple[float, dict[str, tuple[float, int]]]:
    """Summed device time (us) of the GPU kernels and memcpys in ``prof``, and per kernel name (us, calls)."""
    per_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.device_time if hasattr(event, "device_time") else event.cuda_time
        total += us
        per_name[event.name][0] += us
        per_name[event.name][1] += 1
    return total, {name: (t, n) for name, (t, n) in per_name.items()}


def decode_once(engine, ids: list[int], new_tokens: int, autoregressive: bool) -> tuple[int, int]:
    """One greedy generation; returns (tokens, steps): decode steps, or verify cycles."""
    if autoregressive:
        out = engine.generate_autoregressive([ids], new_tokens)[0]
        return len(out), len(out)
    results, stats = engine.generate([ids], new_tokens)
    return len(results[0].output), stats.verifies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--configs", default="none:S5,ngram:S5,eagle:S4")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eagle-head", default=None, help="EAGLE head .safetensors (default: the shipped head)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    from speccycle.engine.engine import Engine
    from torch.profiler import ProfilerActivity, profile

    dtype = getattr(torch, args.dtype)
    first = json.loads(args.prompts.open().readline())
    text = first.get("text") or first["turns"][0]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in args.configs.split(","):
        draft, spec = parse_config(config.replace("none:", "ngram:"))
        autoregressive = config.startswith("none:")
        kwargs = {}
        if draft == "eagle" and not autoregressive:
            kwargs["eagle_head"] = eagle_head_path(args.eagle_head)
        engine = Engine.load(draft=draft, spec=spec, device="cuda", dtype=dtype, kv_tokens=4096, fast=True, **kwargs)
        ids = engine.chat_prompt(text)

        run = functools.partial(decode_once, engine, ids, args.new_tokens, autoregressive)
        run()
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens, steps = run()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        busy_us, per_name = kernel_times(prof)
        row = {
            "config": config,
            "autoregressive": autoregressive,
            "tokens": tokens,
            "steps": steps,
            "tok_s": round(tokens / wall_us * 1e6, 1),
            "wall_us_per_step": round(wall_us / steps, 1),
            "gpu_busy_us_per_step": round(busy_us / steps, 1),
            "gpu_idle_us_per_step": round((wall_us - busy_us) / steps, 1),
            "kernels_per_step": round(sum(n for _, n in per_name.values()) / steps, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[: args.top]
        lines = [json.dumps(row), "", f"{'us/step':>9} {'calls/step':>10}  kernel"]
        lines += [f"{t / steps:9.1f} {n / steps:10.2f}  {name[:150]}" for name, (t, n) in top]
        (args.out / f"decode_profile-{config.replace(':', '-')}.txt").write_text("\n".join(lines) + "\n")
        del engine, run
        torch.cuda.empty_cache()
    result = {
        "benchmark": "decode_profile",
        "device": torch.cuda.get_device_name(),
        "config": {"dtype": args.dtype, "batch": 1, "new_tokens": args.new_tokens, "prompt": "first prompt"},
        "rows": rows,
    }
    (args.out / "decode_profile.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
