"""Where a CPU verify forward of a few rows spends its time, against a decode step, over a long context.

Prefills one Spec-Bench prompt, then times (interleaved, min and median of ``--reps``) the target
forward of

* ``decode``: one causal row with logits for that row, as `greedy.greedy_decode` runs it;
* ``verify n``: the chain verify of ``n`` rows exactly as `statemachine.transitions.target_verify_forward`
  builds it (prefix ``L``, each row's ancestors and itself as extra slots, logits of every row).

``--profile`` adds a `torch.profiler` table (self CPU time per op) for the decode step and each ``n``.
``--compare-before`` also times every case as before the one-request CPU attention plan and the skinny
linears (interleaved). ``--cycle`` decodes the prompt autoregressively and with the CPU ngram default
once and records, in decode steps: the prefill per prompt token, the non-forward time per
autoregressive step and per speculative cycle (the cycle's own overhead). The record (``ratio``:
verify of ``n`` rows over a decode step, and those three) is what ``bench/ngram_cost.py --cost`` reads.
Timings on a shared machine are indicative; run on an idle one for figures of record.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.verify_profile --threads 2 --rows 1,2,5,9,17 --profile
    OMP_NUM_THREADS=2 .venv/bin/python -m bench.verify_profile --threads 2 --rows 1-17 --cycle
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from speccycle.core.ports import ForwardBatch
from speccycle.engine.bench import load_prompts
from speccycle.engine.engine import Engine
from speccycle.engine.greedy import extend_batch
from speccycle.engine.kernels import attention

from .common import write_result
from .ngram_tau import DEV


def verify_batch(engine: Engine, rid: int, tokens: list[int], start: int) -> ForwardBatch:
    """The chain verify batch of ``tokens`` at positions ``start + i`` (as the cycle builds it)."""
    pool, n = engine.pool, len(tokens)
    pool.allocate(rid, start + n)
    page_table = pool.page_table([rid])
    positions = torch.arange(start, start + n)
    slots = pool.slots_for([rid], positions[None, :])[0]  # [n]
    chain = positions[:, None] >= positions[None, :]
    extra = torch.where(chain, slots[None, :], -1)
    return ForwardBatch(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        positions=positions,
        row_request=torch.zeros(n, dtype=torch.long),
        out_slots=slots,
        prefix_lens=torch.full((n,), start, dtype=torch.long),
        extra_slots=extra,
        page_table=page_table,
        page_size=pool.page_size,
        request_ids=(rid,),
        logits_rows=None,
    )


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--category", default="rag")
    parser.add_argument("--index", type=int, default=0, help="which prompt of the category")
    parser.add_argument("--rows", default="1,2,5,9,17", help='"1,2,5" or a range "1-17"')
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--compare-before",
        action="store_true",
        help="also time every case with the reference attention plan and packed (not skinny) linears, interleaved",
    )
    parser.add_argument("--cycle", action="store_true", help="measure prefill and per-cycle overhead (module doc)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(draft="ngram", device="cpu", dtype=torch.float32)
    prompt = engine.chat_prompt(load_prompts(DEV, categories=[args.category])[args.index]["text"])
    rid, start = 10**9, len(prompt)
    engine.target.forward(extend_batch(engine.pool, [rid], [prompt], [0]))
    if "-" in args.rows:
        low, high = args.rows.split("-")
        rows = list(range(int(low), int(high) + 1))
    else:
        rows = [int(n) for n in args.rows.split(",")]
    cases = {"decode": lambda: extend_batch(engine.pool, [rid], [prompt[-1:]], [start])}
    for n in rows:
        cases[f"verify {n}"] = lambda n=n: verify_batch(engine, rid, (prompt * n)[:n], start)
    modes = ["", "before "] if args.compare_before else [""]
    times: dict[str, list[float]] = {mode + name: [] for name in cases for mode in modes}
    one_request = attention._plan_one_request
    packed = [layer.linear for layer in engine.model.layers] + [engine.model.head_linear]

    def run(mode: str, make) -> float:
        attention._plan_one_request = one_request if not mode else (lambda batch: None)
        for linear in packed:
            linear.skinny = not mode  # skinny where it pays on this machine (`llama.skinny_pays`); before: never
        try:
            batch = make()
            tick = time.perf_counter()
            engine.target.forward(batch)
            return time.perf_counter() - tick
        finally:
            attention._plan_one_request = one_request
            for linear in packed:
                linear.skinny = True

    for _ in range(2):  # warm-up: oneDNN packs, allocator
        for make in cases.values():
            for mode in modes:
                run(mode, make)
    for _ in range(args.reps):
        for name, make in cases.items():
            for mode in modes:  # interleaved: drifting load hits both alike
                times[mode + name].append(run(mode, make))
    base = min(times["decode"])
    summary = {
        name: {
            "min_ms": round(1e3 * min(t), 2),
            "median_ms": round(1e3 * statistics.median(t), 2),
            "min_over_decode": round(min(t) / base, 3),
        }
        for name, t in times.items()
    }
    print(f"context {start} tokens, {torch.get_num_threads()} threads")
    for name, s in summary.items():
        print(f"{name:<20} min {s['min_ms']:7.2f} ms  median {s['median_ms']:7.2f} ms  x{s['min_over_decode']:.3f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, make in cases.items():
            batches = [make() for _ in range(5)]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for batch in batches:
                    engine.target.forward(batch)
            print(f"\n=== {name} (5 forwards) ===")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    engine.pool.free(rid)
    record = {
        "category": args.category,
        "index": args.index,
        "context_tokens": start,
        "reps": args.reps,
        "decode_ms": summary["decode"]["min_ms"],
        "ratio": {n: summary[f"verify {n}"]["min_over_decode"] for n in rows},
        "timings": summary,
    }
    if args.cycle:
        record.update(cycle_costs(engine, prompt, base))
        print({k: record[k] for k in ("prefill_per_token", "ar_overhead", "cycle_overhead")})
    if not args.no_write:
        print(f"wrote {write_result('verify_profile', record)}")


def cycle_costs(engine: Engine, prompt: list[int], decode_s: float, max_new_tokens: int = 128) -> dict:
    """Prefill per prompt token, non-forward time per autoregressive step and per speculative cycle, in
    decode steps of ``decode_s`` seconds: one autoregressive and one speculative decode of ``prompt``."""
    spent = {"forward": 0.0, "first": None}
    forward = engine.target.forward

    def timed(batch):
        tick = time.perf_counter()
        out = forward(batch)
        took = time.perf_counter() - tick
        spent["forward"] += took
        if spent["first"] is None:
            spent["first"] = took  # the prefill
        return out

    engine.target.forward = timed
    try:
        engine.generate([prompt], 8)  # warm-up
        spent.update(forward=0.0, first=None)
        tick = time.perf_counter()
        output = engine.generate_autoregressive([prompt], max_new_tokens)[0]
        ar_total, ar_forward, prefill = time.perf_counter() - tick, spent["forward"], spent["first"]
        spent.update(forward=0.0, first=None)
        tick = time.perf_counter()
        _, stats = engine.generate([prompt], max_new_tokens)
        spec_total, spec_forward = time.perf_counter() - tick, spent["forward"]
    finally:
        engine.target.forward = forward
    return {
        "prefill_per_token": round(prefill / len(prompt) / decode_s, 4),
        "ar_overhead": round((ar_total - ar_forward) / len(output) / decode_s, 4),
        "cycle_overhead": round((spec_total - spec_forward) / stats.verifies / decode_s, 4),
    }


if __name__ == "__main__":
    main()
