"""Where a fused EAGLE call spends the time outside its cycles: the prefill and the first draft extend.

`Engine.generate` with fused cycles steps the state machine on the host up to `Ready` (the target's
prefill, the first token, the draft's extend over the prompt) and then hands the batch to
`FusedCycles.run`. `fused_bench` reports that part as ``outside_cycles_ms_per_prompt`` (7-11 ms of ~80 per
256-token prompt at 9d34952, ~10% of the call). This splits it per transition, with a sync after
each, beside the autoregressive engine's own prefill (one new token) on the same prompts, and counts the
kernels of each part with the torch profiler on one prompt.

    python -m bench.outside_profile --prompts spec_bench_dev.jsonl --per-category 1 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from .common import write_result
from .gpu_bench import eagle_head_path, parse_config, pick, say, sync, timed


def main() -> None:
    from speccycle.core import Admitted, Ports, Ready, Request, SamplingParams
    from speccycle.engine.engine import Engine
    from speccycle.statemachine import step

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--config", default="S5K4N16")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--eagle-head", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prompts = [json.loads(line) for line in open(args.prompts)]
    for p in prompts:
        p.setdefault("text", p.get("prompt") or p["turns"][0])
    if args.per_category:
        prompts = pick(prompts, args.per_category)
    spec = parse_config(f"eagle:{args.config}")[1]
    engine = Engine.load(draft="eagle", spec=spec, device="cuda", dtype=torch.bfloat16, kv_tokens=4096, fast=True,
                         eagle_head=eagle_head_path(args.eagle_head))  # fmt: skip
    fused = engine.fused_cycles
    ports = Ports(target=engine.target, draft=engine.draft, kv_pool=engine.pool)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=engine.stop_token_ids)
    ids = [engine.chat_prompt(p["text"]) for p in prompts]

    def until_ready(x, parts):
        """Step the state machine from admission to `Ready`, each transition timed into ``parts``; the request
        id and the record. The caller frees the request's pages (this frees them where a transition fails)."""
        rid = next(engine._ids)
        record = Admitted(config=engine.spec, requests=(Request(rid, tuple(x), params),))
        try:
            while not isinstance(record, Ready):
                name = type(record).__name__
                record, seconds = timed(lambda record=record: step(record, ports, engine.backend))
                parts.append((f"{name}->{type(record).__name__}", seconds))
        except BaseException:
            if engine.pool.pages_held(rid):
                engine.pool.free(rid)
            raise
        return rid, record

    def spec_call(x, n, timings=None):
        parts, rid = [], None
        try:
            rid, record = until_ready(x, parts)
            run, seconds = timed(lambda: fused.run(record, n, engine.stop_token_ids))
            parts.append(("cycles", seconds))
        finally:
            if rid is not None and engine.pool.pages_held(rid):
                engine.pool.free(rid)
        if timings is not None:
            for name, seconds in parts:
                timings.setdefault(name, []).append(seconds * 1e3)
        return list(run.final.requests[0].output)

    for x in ids:  # warm-up: every prompt's shapes once, both ways
        engine.generate_autoregressive([x], 2)
        spec_call(x, 2)
    spec_call(ids[0], args.max_new_tokens)
    ar_first, ar_full, spec_parts, spec_total = [], [], {}, []
    identical = 0
    for x in ids:
        _, seconds = timed(lambda x=x: engine.generate_autoregressive([x], 1))
        ar_first.append(seconds * 1e3)
        ref, seconds = timed(lambda x=x: engine.generate_autoregressive([x], args.max_new_tokens))
        ar_full.append(seconds * 1e3)
        out, seconds = timed(lambda x=x: spec_call(x, args.max_new_tokens, spec_parts))
        spec_total.append(seconds * 1e3)
        identical += out == ref[0]
    med = {name: round(statistics.median(v), 3) for name, v in spec_parts.items()}
    row = {
        "config": args.config,
        "prompts": len(ids),
        "prompt_tokens_median": statistics.median(len(x) for x in ids),
        "ar_prefill_plus_one_token_ms_median": round(statistics.median(ar_first), 3),
        "ar_call_ms_median": round(statistics.median(ar_full), 3),
        "spec_ms_median_by_part": med,
        "spec_call_ms_median": round(statistics.median(spec_total), 3),
        "identical_to_ar": identical,
    }
    say(json.dumps(row))
    # kernels per part, one prompt, torch profiler
    from torch.profiler import ProfilerActivity, profile

    kernels = {}
    x = ids[len(ids) // 2]

    def spec_until_ready():
        rid, _ = until_ready(x, [])
        engine.pool.free(rid)

    for name, fn in (
        ("ar_prefill_plus_one_token", lambda: engine.generate_autoregressive([x], 1)),
        ("spec_until_ready", spec_until_ready),
    ):
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        kernels[name] = {
            "kernels": sum(e.count for e in events),
            "cuda_us": round(sum(e.self_device_time_total for e in events), 1),
            "top": sorted(
                ((e.key[:80], e.count, round(e.self_device_time_total, 1)) for e in events), key=lambda t: -t[2]
            )[:12],
        }
    row["kernels_one_prompt"] = kernels
    say(json.dumps(kernels))
    path = write_result("outside_profile", {"rows": [row]}, device="cuda", directory=args.out)
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
