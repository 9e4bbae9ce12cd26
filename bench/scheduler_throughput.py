"""Scheduler throughput: speculative vs autoregressive at each load, with and without adaptive speculation.

For each load ``bs``, ``bs`` clients each keep one request in flight (the prompts, cycled) for
``--requests-per-client`` requests in a closed loop (1: ``bs`` requests submitted at once and run to
completion), through the continuous-batching `Scheduler` over one engine (same model, pool and device),
once per mode:

* ``ar``: ``speculation="off"``, the drafter never runs: one token per request per target forward;
* ``spec``: ``speculation="on"``, every cycle in the config's shape;
* ``adaptive``: `AdaptiveSpeculation()`: each cycle the shape of the config's family with the highest
  measured throughput at its batch size. One controller serves every run of the mode, the warm-up's
  included, as one long-running server's would (its measurements carry over).

Tokens/s is new tokens over wall time (EOS may end a request early; the count is what was made). Latency, p50
and p99 over the run's requests: time to first token (``ttft_ms``: from ``submit`` to the request's first
``on_tokens`` call) and time per output token (``tpot_ms``: its first to its last streamed token over the tokens
between); the scheduler streams after each step, so a cycle's tokens share one timestamp.
``--budget-spread F`` gives the requests budgets spread evenly over ``max_new_tokens * [1 - F, 1 + F]`` (the same
per request index in every mode): with one budget for all, autoregressive requests of a prompt finish in the
same step, so its admissions come in few large prefills, while speculation spreads them. ``--repeats R`` runs
the modes of a load ``R`` times, interleaved, and reports the median tokens/s (of two runs: their mean), every
run's figure beside it (an output counts as identical when every run gave the ``ar`` one); the record's other
fields (seconds, cycles, shapes) are its lower median run's.
``identical_to_ar`` counts requests whose output equals the ``ar`` mode's token for token. ``--sampled``: the
share of requests that sample (every ``1/share``-th one, temperature 0.7, top-p 0.95, seeded by its index), so
greedy and sampled requests share batches; a sampled request's output depends on the draft, so only the greedy
ones count toward ``identical_to_ar`` (``greedy_requests``). Warm-up runs
of every mode at every batch size and power of two below precede the timed ones (compilation, graph capture).

    python -m bench.scheduler_throughput --device cuda --dtype bfloat16 --draft eagle --fast \
        --batch-sizes 1,4,16,64,256 --requests-per-client 4 --warm-each --max-new-tokens 128
    python -m bench.scheduler_throughput --device cuda --dtype bfloat16 --draft ngram --fast [--no-fused]
    .venv/bin/python -m bench.scheduler_throughput --batch-sizes 1,4,8 --max-new-tokens 16   # CPU, small
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.engine import Engine
from speccycle.engine.serving.adaptive import AdaptiveSpeculation, ShapeController
from speccycle.engine.serving.scheduler import Scheduler
from speccycle.engine.tokenizers.tokenizer import Tokenizer
from speccycle.engine.weights.weights_gguf import default_model_path

from .common import latency_ms, sync, write_result

MODES = ("ar", "spec", "adaptive")
MIN_REQUESTS = 16  # a closed loop runs at least this many requests (a load of 1: 16 in a row)


def budget_of(i: int, new_tokens: int, spread: float) -> int:
    """Request ``i``'s ``max_new_tokens``: ``new_tokens``, or with ``spread`` > 0 spread evenly over
    ``new_tokens * [1 - spread, 1 + spread]`` by a fixed hash of ``i`` (the same in every mode)."""
    u = (i * 2654435761 % 2**32) / 2**32
    return max(1, round(new_tokens * (1 - spread + 2 * spread * u)))


def params_of(i: int, new_tokens: int, sampled: float, spread: float = 0.0) -> SamplingParams:
    """Request ``i``'s parameters: greedy, or (every ``1 / sampled``-th request) temperature 0.7, top-p 0.95."""
    budget = budget_of(i, new_tokens, spread)
    if sampled > 0 and i % round(1 / sampled) == 0:
        return SamplingParams(max_new_tokens=budget, temperature=0.7, top_p=0.95, seed=1000 + i)
    return SamplingParams(max_new_tokens=budget)


def run_mode(
    engine: Engine,
    mode: str,
    prompts: list[list[int]],
    bs: int,
    new_tokens: int,
    device: str,
    prefill: int | None,
    per_client: int = 1,
    controller: ShapeController | None = None,
    sampled: float = 0.0,
    spread: float = 0.0,
    admit_fraction: float | None = None,
) -> dict:
    speculation = {"ar": "off", "spec": "on", "adaptive": controller or AdaptiveSpeculation()}[mode]
    # latency from the streaming callback: a request's submit, its first and last streamed tokens, how many
    submitted: dict[int, float] = {}
    streamed: dict[int, list] = {}

    def on_tokens(rid: int, tokens: list[int]) -> None:
        now = time.perf_counter()
        seen = streamed.setdefault(rid, [now, now, 0])
        seen[1], seen[2] = now, seen[2] + len(tokens)

    scheduler = Scheduler.from_engine(
        engine, speculation=speculation, max_batch_size=bs, max_prefill_tokens=prefill, on_tokens=on_tokens,
        admit_fraction=admit_fraction,
    )  # fmt: skip
    total = max(bs * per_client, MIN_REQUESTS if per_client > 1 else 0)

    def submit(i: int) -> int:
        rid = scheduler.submit(prompts[i % len(prompts)], params_of(i, new_tokens, sampled, spread))
        submitted[rid] = time.perf_counter()
        return rid

    switches = controller.switches if controller is not None else 0
    sync(device)
    start = time.perf_counter()
    ids = [submit(i) for i in range(bs)]
    while not scheduler.idle:  # closed loop: a client submits its next request when its last one finishes
        for _ in scheduler.step():
            if len(ids) < total:
                ids.append(submit(len(ids)))
    sync(device)
    seconds = time.perf_counter() - start
    outputs = [list(scheduler.finished[rid].output) for rid in ids]
    errors = [scheduler.finished[rid].error for rid in ids if scheduler.finished[rid].finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{mode} at bs={bs}: {len(errors)} requests errored, first: {errors[0]}")
    tokens = sum(len(o) for o in outputs)
    stats = scheduler.stats
    ttft = [streamed[rid][0] - submitted[rid] for rid in ids if rid in streamed]
    tpot = [(last - first) / (n - 1) for first, last, n in (streamed[rid] for rid in ids if rid in streamed) if n > 1]
    return {
        "requests": total,
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2),
        # time to first token (submit to the first streamed token) and per output token (first to last streamed
        # token over the tokens between), p50 and p99: a cycle's tokens share the step's timestamp
        **latency_ms(ttft, tpot),
        "tau": round(stats.tau, 3) if stats.verifies else None,
        "spec_cycles": stats.spec_cycles,
        "plain_cycles": stats.plain_cycles,
        "fused_cycles": stats.fused_cycles,
        "pipelined_cycles": stats.pipelined_cycles,
        "captures": stats.captures,  # graph captures inside the timed run (their time counts)
        "forward_captures": stats.forward_captures,  # and graphs of its admissions' forwards
        "prefills": stats.prefills,
        "held_admissions": stats.held_admissions,
        "switches": (controller.switches - switches) if mode == "adaptive" and controller is not None else 0,
        "first_levels": stats.first_levels,
        "shapes": {_name(c): n for c, n in stats.shapes.items()},
        "retractions": stats.retractions,
        # where the steps' wall time went: admissions (prefills), cycles, the rest (streaming, retiring, the loop)
        "step_seconds": {
            "prefill": round(stats.prefill_seconds, 4),
            "cycles": round(stats.cycle_seconds, 4),
            "other": round(stats.seconds - stats.prefill_seconds - stats.cycle_seconds, 4),
        },
        "outputs": outputs,
        "greedy": [params_of(i, new_tokens, sampled, spread).greedy for i in range(len(ids))],
    }


def _name(c: SpecConfig) -> str:
    return f"S{c.num_steps}K{c.topk}N{c.num_draft_tokens}"


def scale_engine(spec: SpecConfig, kv_tokens: int, tau: float) -> Engine:
    """The Llama-3-8B shape on CUDA, random bfloat16 weights, a random EAGLE-3 head, the fast path, its fused cycles'
    walk forced to accept ``tau`` rows a cycle (shapes that draft; a cycle of ``S == 0`` decodes for real)."""
    from speccycle.engine.drafters.eagle import EagleDraft
    from speccycle.engine.memory.kv_pool import PagedKVPool
    from speccycle.engine.models.llama import LlamaModel
    from speccycle.engine.weights.weights_gguf import LlamaConfig

    from .forced import force_fused_acceptance
    from .gpu_bench import LLAMA3_8B, random_eagle3_head, random_weights_on_device

    config = LlamaConfig(**LLAMA3_8B)
    head = random_eagle3_head(config, "cuda", torch.bfloat16)
    weights = random_weights_on_device(config, "cuda", torch.bfloat16)
    model = LlamaModel(config, weights, dtype=torch.bfloat16, device="cuda", feature_layers=head.config.feature_layers)
    del weights
    torch.cuda.empty_cache()
    pool = PagedKVPool(num_pages=-(-kv_tokens // spec.page_size), page_size=spec.page_size, device="cuda")
    engine = Engine(model, pool, lambda e: EagleDraft(head, model, pool), spec, fast=True)
    force_fused_acceptance(engine, tau)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--draft", default="ngram", choices=["ngram", "layerskip", "eagle"])
    parser.add_argument("--layerskip-layers", type=int, default=8)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=1, help="closed loop: requests each client runs")
    parser.add_argument("--warm-each", action="store_true", help="run each load once untimed before the timed run")
    parser.add_argument("--prompts", default=None, help="Spec-Bench JSONL; default: the 13-prompt sample shipped")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--draft-floor", type=float, default=0.0, help="SpecConfig.draft_floor (a chain's cut rows)")
    parser.add_argument("--max-prefill-tokens", type=int, default=None, help="cap on tokens prefilled per step")
    parser.add_argument(
        "--admit-fraction", type=float, default=None,
        help="the Scheduler's admission batching: admit once this fraction of the running batch waits (0: every "
        "step; default: the Scheduler's, SPECULATIVE_ADMIT_FRACTION when it speculates, 0 for ar)",
    )  # fmt: skip
    parser.add_argument("--fast", action="store_true", help="the engine's fast path (CUDA graphs, Triton kernels)")
    parser.add_argument(
        "--no-fused",
        action="store_true",
        help="with --fast: no graphed executor, every cycle through the eager table (the A/B's other side)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--forced-tau", type=float, default=None,
        help="the Llama-3-8B shape with random bfloat16 weights and a random EAGLE-3 head on CUDA, the verify's walk "
        "forced to accept tau rows a cycle (bench.forced); outputs are then not comparable with ar's",
    )  # fmt: skip
    parser.add_argument("--sampled", type=float, default=0.0, help="share of sampled requests (module docstring)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed runs of each mode a load, interleaved: the median"
    )
    parser.add_argument(
        "--budget-spread",
        type=float,
        default=0.0,
        help="spread each request's max_new_tokens evenly over max_new_tokens * [1 - F, 1 + F], F < 1 (0: the same)",
    )
    args = parser.parse_args()
    if not 0.0 <= args.sampled <= 1.0:
        raise SystemExit(f"--sampled is a share of the requests in [0, 1], got {args.sampled}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats is a count >= 1, got {args.repeats}")
    if not 0.0 <= args.budget_spread < 1.0:
        raise SystemExit(f"--budget-spread is a fraction in [0, 1), got {args.budget_spread}")
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown or "ar" not in modes:
        raise SystemExit(f"--modes: choose from {MODES} and include 'ar' (the reference); got {modes}")
    spec = SpecConfig(
        num_steps=args.num_steps,
        topk=args.topk,
        num_draft_tokens=args.num_draft_tokens,
        page_size=args.page_size,
        draft_floor=args.draft_floor,
    )
    tokenizer = Tokenizer.from_gguf(default_model_path())
    items = load_prompts(args.prompts)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}]) for p in items]
    longest = max(len(p) for p in prompts)
    per_request = args.page_size * math.ceil(
        (longest + round(args.max_new_tokens * (1 + args.budget_spread)) + 2 * spec.reserve_len("aligned"))
        / args.page_size
    )
    # every request in flight fits at once: this measures batching, not retraction
    kv_tokens = max(batch_sizes) * per_request + 4 * per_request
    dtype = getattr(torch, args.dtype)
    if args.forced_tau is not None:
        engine = scale_engine(spec, kv_tokens, args.forced_tau)
    else:
        engine = Engine.load(
            draft=args.draft,
            spec=spec,
            device=args.device,
            dtype=dtype,
            kv_tokens=kv_tokens,
            layerskip_layers=args.layerskip_layers,
            fast=args.fast,
        )
    if args.no_fused:
        engine.fused_cycles = None
    # warm-up: lazy initialization, allocator, kernels, and the graphs of every batch bucket a run passes through
    # (a batch shrinks as its requests finish; the fused cycles capture one graph a power of two)
    warm = sorted({1 << k for bs in batch_sizes for k in range(bs.bit_length())} | set(batch_sizes))
    controller = ShapeController(AdaptiveSpeculation(), spec)  # one for every adaptive run, warm-up included
    captures = {}
    for mode in modes:  # every shape's graphs at every bucket, as a server captures them before it serves
        speculation = {"ar": "off", "spec": "on", "adaptive": controller}[mode]
        scheduler = Scheduler.from_engine(engine, speculation=speculation, max_batch_size=max(batch_sizes))
        captures[mode] = scheduler.warm_up(warm, sampled=args.sampled > 0)  # greedy runs: no sampled buffers
    for mode in modes:
        for bs in warm:
            run_mode(engine, mode, prompts, bs, 8, args.device, args.max_prefill_tokens, controller=controller,
                     sampled=args.sampled, admit_fraction=args.admit_fraction)  # fmt: skip

    rows = []
    for bs in batch_sizes:
        if args.warm_each:  # every mode once at this load untimed first: the buckets and shapes its tail reaches
            for mode in modes:
                run_mode(
                    engine, mode, prompts, bs, args.max_new_tokens, args.device, args.max_prefill_tokens,
                    args.requests_per_client, controller, args.sampled, args.budget_spread, args.admit_fraction,
                )  # fmt: skip
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for _ in range(args.repeats):  # the modes interleaved, so a drift of the machine touches each alike
            for mode in modes:
                runs[mode].append(
                    run_mode(
                        engine,
                        mode,
                        prompts,
                        bs,
                        args.max_new_tokens,
                        args.device,
                        args.max_prefill_tokens,
                        args.requests_per_client,
                        controller,
                        args.sampled,
                        args.budget_spread,
                        args.admit_fraction,
                    )  # fmt: skip
                )
        results = {}
        for mode, done in runs.items():  # the median run's record, its tokens/s the median of every run's
            ranked = sorted(done, key=lambda r: r["tokens_per_s"])
            figures = [r["tokens_per_s"] for r in done]
            results[mode] = dict(
                ranked[(len(ranked) - 1) // 2],
                tokens_per_s=round(statistics.median(figures), 2),
                runs_tokens_per_s=figures,
            )
        ar_outputs = results["ar"]["outputs"]
        row = {"batch_size": bs}
        for mode, r in results.items():
            r.pop("outputs")
            greedy = r.pop("greedy")
            r["greedy_requests"] = sum(greedy)
            # a greedy request counts when every run of the mode gave the ar output (ar's runs: each other's)
            r["identical_to_ar"] = sum(
                all(run["outputs"][j] == ar for run in runs[mode])
                for j, (ar, g) in enumerate(zip(ar_outputs, greedy))
                if g
            )
            if mode != "ar":
                r["speedup_vs_ar"] = round(r["tokens_per_s"] / results["ar"]["tokens_per_s"], 3)
            row[mode] = r
        rows.append(row)
        n = results["ar"]["greedy_requests"]
        print(
            f"bs={bs:>3} "
            + " ".join(f"{m}={row[m]['tokens_per_s']:.1f}tok/s" for m in modes)
            + " "
            + " ".join(f"{m}_identical={row[m]['identical_to_ar']}/{n}" for m in modes if m != "ar")
            + (f" adaptive_shapes={row['adaptive']['shapes']}" if "adaptive" in row else "")
        )
        print(
            "       latency ms (TTFT p50/p99, TPOT p50/p99): "
            + " ".join(
                f"{m}={row[m]['ttft_ms']['p50']}/{row[m]['ttft_ms']['p99']},"
                f"{row[m]['tpot_ms']['p50']}/{row[m]['tpot_ms']['p99']}"
                for m in modes
            )
        )
    policy = AdaptiveSpeculation()
    payload = {
        "requests_per_client": args.requests_per_client,
        "warm_each": args.warm_each,
        "model": f"{default_model_path().name} ({args.dtype})"
        if args.forced_tau is None
        else f"Llama-3-8B shape, random bf16 weights and EAGLE-3 head, acceptance forced to tau {args.forced_tau}",
        "draft": args.draft,
        "fast": args.fast,
        "graphed_executor": engine.fused_cycles is not None,
        "config": {
            "S": spec.num_steps,
            "K": spec.topk,
            "N": spec.num_draft_tokens,
            "P": spec.page_size,
            "draft_floor": spec.draft_floor,
        },
        "max_new_tokens": args.max_new_tokens,
        "budget_spread": args.budget_spread,
        "repeats": args.repeats,
        "max_prefill_tokens": args.max_prefill_tokens,
        "admit_fraction": "auto" if args.admit_fraction is None else args.admit_fraction,
        "sampled": args.sampled,
        "prompts": args.prompts or "speccycle.engine/data/spec_bench_sample.jsonl",
        "num_prompts": len(prompts),
        "adaptive_policy": {
            "ema_weight": policy.ema_weight,
            "probe_every": policy.probe_every,
            "margin": policy.margin,
        },
        "adaptive_shapes": [_name(c) for c in controller.shapes],
        "warm_up_captures": captures,  # graphs `Scheduler.warm_up` captured per mode before the runs
        # the adaptive controller at the end: each shape's committed tokens per request, and per batch bucket each
        # shape's cycle time (ms) and the incumbent
        "adaptive_state": {
            "tau": {_name(c): round(t, 3) for c, t in controller.tau.items()},
            "cycle_ms": {
                b: {_name(c): round(1e3 * t, 3) for (bb, c), t in controller.seconds.items() if bb == b}
                for b in sorted({b for b, _ in controller.seconds})
            },
            "incumbent": {b: _name(c) for b, c in sorted(controller.incumbent.items())},
        },
        "rows": rows,
    }
    path = write_result("scheduler_throughput", payload, args.device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
