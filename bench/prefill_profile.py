"""The prefill's cost by attention kernel: a prefill-only scheduler step per prompt mix, and its GPU time by kernel.

Each prompt mix of the shipped prompts (chat-templated: 44 to 767 tokens) is submitted with ``max_new_tokens=1`` and
run through the continuous-batching `Scheduler` on the fast path, so a step is one admission: the prefill's target
forward and its first tokens. Per mix: the median wall time of the step over
``--repeats`` runs after three warm-ups (graphs captured), and on CUDA one profiled step's GPU time: all of it,
and the attention kernels' share, and the kernels of most GPU time (``top_kernels``: name, ms, calls). Each
``--kernels`` choice (``SPECCYCLE_PREFILL_ATTENTION``: ``exact`` and ``prefill``, `engine.kernels.attention_prefill`'s
two kernels, or ``rows``, the decode's kernel) runs in a process of its own, one after the other on the same
device, and the record holds them side by side. A request of one new token finishes at its prefill, so the step
holds no draft extend: what is timed is the target's prefill.

    python -m bench.prefill_profile --device cuda --dtype bfloat16
    python -m bench.prefill_profile --repeats 1 --mixes "4 short"   # CPU: every choice takes the torch attention
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from .common import sync, write_result

# name -> indices into the 13 shipped prompts (cycled)
MIXES = {
    "4 short": [0, 1, 2, 3],
    "10 short": [0, 1, 2, 3, 4, 6, 7, 8, 10, 11],
    "13 all": list(range(13)),
    "26 all": list(range(26)),
}
KERNELS = ("exact", "prefill", "rows")
TOP_KERNELS = 12


def measure(args) -> dict:
    """One process, one kernel choice: every mix's step times (and GPU time on CUDA)."""
    from speccycle.core import SamplingParams, SpecConfig
    from speccycle.engine.bench import load_prompts
    from speccycle.engine.engine import Engine
    from speccycle.engine.serving.scheduler import Scheduler
    from speccycle.engine.tokenizers.tokenizer import Tokenizer
    from speccycle.engine.weights.weights_gguf import default_model_path

    tokenizer = Tokenizer.from_gguf(default_model_path())
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}]) for p in load_prompts(None)]
    mixes = {name: MIXES[name] for name in args.mixes.split(",")}
    most = max(sum(len(prompts[i % len(prompts)]) for i in idx) for idx in mixes.values())
    spec = SpecConfig(num_steps=4, topk=1, page_size=16)
    engine = Engine.load(
        draft="eagle", spec=spec, device=args.device, dtype=getattr(torch, args.dtype), kv_tokens=2 * most + 4096,
        fast=True,
    )  # fmt: skip
    scheduler = Scheduler.from_engine(engine, speculation="on", max_batch_size=64)
    once = SamplingParams(max_new_tokens=1)

    def step(idx) -> float:
        for i in idx:
            scheduler.submit(prompts[i % len(prompts)], once)
        sync(args.device)
        start = time.perf_counter()
        scheduler.run()
        sync(args.device)
        return time.perf_counter() - start

    out = {}
    for name, idx in mixes.items():
        for _ in range(3):  # graphs captured, allocator warm
            step(idx)
        times = [step(idx) for _ in range(args.repeats)]
        row = {
            "requests": len(idx),
            "rows": sum(len(prompts[i % len(prompts)]) for i in idx),
            "step_ms_median": round(statistics.median(times) * 1e3, 3),
            "step_ms_runs": [round(t * 1e3, 3) for t in times],
        }
        if args.device.startswith("cuda"):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step(idx)
            kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            total = sum(e.self_device_time_total for e in kernels)
            attention = sum(e.self_device_time_total for e in kernels if "attention" in e.key)
            row["gpu_ms"] = round(total / 1e3, 3)
            row["attention_gpu_ms"] = round(attention / 1e3, 3)
            top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:TOP_KERNELS]
            row["top_kernels"] = [[e.key[:100], round(e.self_device_time_total / 1e3, 3), e.count] for e in top]
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kernels", default=",".join(KERNELS), help="of exact, prefill, rows")
    parser.add_argument("--mixes", default=",".join(MIXES), help=f"of {', '.join(MIXES)}")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if unknown := set(args.mixes.split(",")) - set(MIXES):
        raise SystemExit(f"--mixes: unknown {sorted(unknown)}; choose from {', '.join(MIXES)}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: give at least 1")
    if args.child:  # one kernel choice (from the environment): the figures as one JSON line
        print(json.dumps(measure(args)))
        return {}
    kernels = args.kernels.split(",")
    if unknown := set(kernels) - set(KERNELS):
        raise SystemExit(f"--kernels: unknown {sorted(unknown)}; choose from {', '.join(KERNELS)}")
    results = {}
    for kernel in kernels:
        env = dict(os.environ, SPECCYCLE_PREFILL_ATTENTION=kernel)
        command = [sys.executable, "-m", "speccycle.bench.prefill_profile", "--child", "--device", args.device,
                   "--dtype", args.dtype, "--mixes", args.mixes, "--repeats", str(args.repeats)]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"the {kernel} run failed:\n{done.stderr[-3000:]}")
        results[kernel] = json.loads(done.stdout.strip().splitlines()[-1])
        for name, row in results[kernel].items():
            gpu = f", GPU {row['gpu_ms']} ms ({row['attention_gpu_ms']} attention)" if "gpu_ms" in row else ""
            print(f"{kernel:8s} {name:9s} {row['requests']:3d} requests {row['rows']:5d} rows: "
                  f"step {row['step_ms_median']} ms{gpu}")  # fmt: skip
    payload = {
        "config": {"dtype": args.dtype, "repeats": args.repeats, "draft": "eagle", "max_new_tokens": 1},
        "kernels": results,
    }
    print("wrote", write_result("prefill_profile", payload, args.device))
    return payload


if __name__ == "__main__":
    main()
