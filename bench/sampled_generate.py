"""Sampled `Engine.generate`: the whole-run fused cycles against the eager table, the same seeded calls.

Each call samples every prompt (temperature ``--temperature``, top-p ``--top-p``, prompt ``i`` seeded ``i``) with
the engine's EAGLE draft; the fused run (`FusedCycles.serves` takes a plainly sampled call) and the table (the
same engine with its fused cycles set aside) draw with one counter-based generator at the same counters, so
their outputs agree until the two compute a token's probabilities in other last bits (the run reports how many
agree, and where the others part). Per batch size (the first ``b`` prompts of the shipped 13 in one call): a
warm-up call of each, then ``--repeats`` timed calls of each, interleaved; tokens/s of the median call.

    python -m speccycle.bench.sampled_generate --device cuda --dtype bfloat16 --batch-sizes 1,13
    .venv/bin/python -m bench.sampled_generate --batch-sizes 1 --max-new-tokens 16 --repeats 1   # CPU, small
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.engine import Engine

from .common import sync, write_result


def timed(engine: Engine, prompts, new_tokens: int, sampling, device: str, fused: bool):
    """One `generate` call, with the fused cycles or without: (seconds, outputs, tokens, tau)."""
    keep = engine.fused_cycles
    if not fused:
        engine.fused_cycles = None
    try:
        sync(device)
        start = time.perf_counter()
        results, stats = engine.generate(prompts, new_tokens, sampling=sampling)
        sync(device)
        seconds = time.perf_counter() - start
    finally:
        engine.fused_cycles = keep
    outputs = [list(r.output) for r in results]
    return seconds, outputs, sum(len(o) for o in outputs), stats.tau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", default="1,13")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.repeats < 1 or args.temperature <= 0:
        raise SystemExit("--repeats must be >= 1 and --temperature > 0 (a sampled call)")
    spec = SpecConfig(num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens)
    engine = Engine.load(draft="eagle", spec=spec, device=args.device, dtype=getattr(torch, args.dtype), fast=True)
    if engine.fused_cycles is None:
        raise SystemExit("this engine has no fused cycles (fast=True with an EAGLE draft builds them)")
    texts = [p["text"] for p in load_prompts(None)]
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = [engine.chat_prompt(t) for t in texts[:bs]]
        sampling = [SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=i) for i in range(bs)]
        times: dict[str, list[float]] = {"fused": [], "table": []}
        seen: dict[str, list] = {}
        for i in range(args.repeats + 1):  # the first of each: warm-up (graph captures, lazy initialization)
            for mode in ("fused", "table"):
                seconds, outputs, tokens, tau = timed(
                    engine, prompts, args.max_new_tokens, sampling, args.device, mode == "fused"
                )
                seen.setdefault(mode, [outputs, tokens, tau])
                if outputs != seen[mode][0]:
                    raise SystemExit(f"{mode} at batch {bs}: a seeded call drew other tokens the second time")
                if i:
                    times[mode].append(seconds)
        pairs = list(zip(seen["fused"][0], seen["table"][0]))
        identical = sum(a == b for a, b in pairs)
        # where a differing output first leaves the table's: the draws agree up to a token whose probabilities
        # the two executors computed in other last bits (another batch layout of the same rows)
        diverge = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs
                   if a != b]  # fmt: skip
        row = {"batch_size": bs, "identical": identical, "prompts": bs, "first_divergence": diverge}
        for mode, values in times.items():
            median = statistics.median(values)
            row[mode] = {
                "seconds": [round(v, 4) for v in values],
                "tokens": seen[mode][1],  # each mode's own: a differing output may end at another length
                "tokens_per_s": round(seen[mode][1] / median, 2),
                "tau": round(seen[mode][2], 3),
            }
        row["speedup"] = round(row["fused"]["tokens_per_s"] / row["table"]["tokens_per_s"], 3)
        rows.append(row)
        print(
            f"bs={bs:>3} fused={row['fused']['tokens_per_s']:.1f} table={row['table']['tokens_per_s']:.1f} tok/s "
            f"({row['speedup']:.2f}x) tau={row['fused']['tau']} identical {identical}/{bs} {diverge}"
        )
    payload = {
        "config": {"S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens},
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "repeats": args.repeats,
        "rows": rows,
    }
    print(f"wrote {write_result('sampled_generate', payload, args.device)}")


if __name__ == "__main__":
    main()
