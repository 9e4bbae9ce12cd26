"""Where a scheduler step's time goes on the GPU: host time per step, and the GPU's idle gaps.

One closed loop of ``--clients`` clients (the prompts cycled, ``--max-new-tokens`` each) runs through the
continuous-batching `Scheduler` on the fast path, once untimed, then again with ``torch.profiler`` recording
``--steps`` steps after ``--skip`` (the loop at its steady load). Reported per step, medians and means:

* ``wall_ms``: the step's wall time; ``prefill_ms`` and ``cycle_ms``: the scheduler's own split
  (`SchedulerStats.prefill_seconds`, ``cycle_seconds``);
* ``gpu_busy_ms``: the union of the GPU's kernel and copy intervals inside the recorded window, per step;
  ``gpu_idle_share``: the window's time with nothing running on the GPU, over the window. What the host does
  while the GPU waits for it (the records, admission, loading the next cycle) shows up there.

Run it at two commits on one warm machine for a before/after (`SPECCYCLE_COMMIT` names the measured one):

    python -m speccycle.bench.overlap_profile --clients 64 --mode spec --steps 120
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.engine import Engine
from speccycle.engine.serving.scheduler import Scheduler
from speccycle.engine.tokenizers.tokenizer import Tokenizer
from speccycle.engine.weights.weights_gguf import default_model_path

from .common import write_result


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (microseconds in, milliseconds out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1000.0


def closed_loop(engine: Engine, mode: str, prompts, clients: int, new_tokens: int, per_client: int, window=None):
    """Run the loop; ``window`` (skip, steps, on_start, on_stop) brackets the recorded steps. Returns per-step
    (wall, prefill, cycle) seconds of the recorded steps, the tokens and the seconds of the whole loop."""
    speculation = {"ar": "off", "spec": "on", "adaptive": "adaptive"}[mode]
    scheduler = Scheduler.from_engine(engine, speculation=speculation, max_batch_size=clients)
    params = SamplingParams(max_new_tokens=new_tokens)
    total = clients * per_client
    ids = [scheduler.submit(prompts[i % len(prompts)], params) for i in range(clients)]
    steps, start = [], time.perf_counter()
    n = 0
    while not scheduler.idle:
        if window is not None and n == window[0]:
            window[2]()
        s = scheduler.stats
        before = (time.perf_counter(), s.prefill_seconds, s.cycle_seconds)
        for _ in scheduler.step():
            if len(ids) < total:
                ids.append(scheduler.submit(prompts[len(ids) % len(prompts)], params))
        if window is not None and window[0] <= n < window[0] + window[1]:
            steps.append((time.perf_counter() - before[0], s.prefill_seconds - before[1], s.cycle_seconds - before[2]))
        n += 1
        if window is not None and n == window[0] + window[1]:
            window[3]()
    torch.cuda.synchronize()
    tokens = sum(len(scheduler.finished[i].output) for i in ids)
    return steps, tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--mode", default="spec", choices=["ar", "spec", "adaptive"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--skip", type=int, default=40, help="steps before the recorded window")
    parser.add_argument("--steps", type=int, default=120, help="steps recorded")
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("overlap_profile measures a GPU's idle gaps: run it on a machine with CUDA")
    tokenizer = Tokenizer.from_gguf(default_model_path())
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}]) for p in load_prompts(None)]
    spec = SpecConfig(num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens, page_size=16)
    engine = Engine.load(draft="eagle", spec=spec, device="cuda", dtype=torch.bfloat16, kv_tokens=80000, fast=True)
    closed_loop(engine, args.mode, prompts, args.clients, args.max_new_tokens, args.requests_per_client)  # warm
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    )
    marks = {}

    def on_start():
        torch.cuda.synchronize()
        profiler.start()
        marks["start"] = time.perf_counter()

    def on_stop():
        torch.cuda.synchronize()
        marks["stop"] = time.perf_counter()
        profiler.stop()

    window = (args.skip, args.steps, on_start, on_stop)
    steps, tokens, seconds = closed_loop(
        engine, args.mode, prompts, args.clients, args.max_new_tokens, args.requests_per_client, window
    )
    intervals = [
        (e.time_range.start, e.time_range.end)
        for e in profiler.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    window_ms = (marks["stop"] - marks["start"]) * 1000.0
    busy = busy_ms(intervals)
    recorded = len(steps)
    walls, prefills, cycles = ([s[i] * 1000.0 for s in steps] for i in range(3))
    figures = {
        "steps_recorded": recorded,
        "wall_ms_median": round(statistics.median(walls), 3),
        "wall_ms_mean": round(statistics.fmean(walls), 3),
        "prefill_ms_mean": round(statistics.fmean(prefills), 3),
        "cycle_ms_mean": round(statistics.fmean(cycles), 3),
        "window_ms": round(window_ms, 1),
        "gpu_busy_ms_per_step": round(busy / max(recorded, 1), 3),
        "gpu_idle_share": round(1.0 - busy / window_ms, 4) if window_ms else None,
        "loop_tokens_per_s": round(tokens / seconds, 1),
        "note": "the loop's tokens/s includes the profiler's overhead; compare it only between profiled runs",
    }
    payload = {
        "config": {
            "clients": args.clients,
            "mode": args.mode,
            "max_new_tokens": args.max_new_tokens,
            "requests_per_client": args.requests_per_client,
            "S": spec.num_steps,
            "K": spec.topk,
            "N": spec.num_draft_tokens,
            "dtype": "bfloat16",
            "draft": "eagle",
        },  # fmt: skip
        "figures": figures,
    }
    print(figures)
    print("wrote", write_result("overlap_profile", payload, "cuda"))


if __name__ == "__main__":
    main()
