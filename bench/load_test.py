"""A load test and soak of the continuous-batching `Scheduler`: closed-loop clients, mixed requests, cancellations.

``--clients`` clients run a closed loop over one scheduler: each submits a request, waits until it finishes
(or gives it up), and submits the next, until ``--requests`` requests are done. The requests are drawn once
from ``--seed`` and replayed identically in every mode:

* prompts: the dev prompts (``engine/data/spec_bench_sample.jsonl``), and ``--long-prompts`` synthetic longer
  ones (dev prompts strung together to about ``--long-prompt-tokens`` tokens), in the chat template;
* output budgets: ``max_new_tokens`` uniform in ``[--min-new-tokens, --max-new-tokens]``;
* sampling: greedy with probability ``--greedy-fraction``, else sampled with a random temperature, top-k,
  top-p and seed; a random ``stop_token_ids`` entry (a frequent token: ".", ",", a newline) on some of both;
* cancellations: with probability ``--cancel-fraction`` the client gives the request up, half the time after
  a random number of scheduler steps (between steps; 0: before it was ever admitted), half the time from the
  streaming callback after a random number of streamed tokens (during a step).

Reported per mode (speculation ``off``, ``on``, ``adaptive``): output tokens/s (every streamed token over the
run's wall time), and time to first token and time per output token at p50 and p99. Both come from the
``on_tokens`` timestamps: TTFT from ``submit`` to a request's first streamed token, TPOT from its first to its
last streamed token over the tokens between (requests with two tokens or more). The scheduler streams after each
step, so a cycle's tokens share one timestamp.

Every run is also a soak, checked: nothing lost (every submitted request finishes exactly once, with a reason;
``error`` counts as a failure), the streamed tokens add up to each output, every greedy request's output equals
its prompt's autoregressive greedy output cut by its stop tokens (a cancelled one: a prefix of it), every
sampled request stops where its own tokens say (a stop token last and nowhere before, or ``max_new_tokens``),
and the KV pool is empty at the end. Sampled outputs are not compared across modes or runs: a seeded request
reproduces its output only in the same batch with the same draft (docs/sampling.md), and a closed loop changes
the batch around it. The greedy references run afterwards, one prompt at a time, speculation off.

Before the timed runs, every mode's graphs (greedy batches', and with a forward draft sampled batches') are
captured at every batch bucket (`Scheduler.warm_up`), then a short warm-up workload runs in each mode (compilation,
the allocator); each run reports the graphs still captured inside it (``captures``: cycles', ``forward_captures``:
its admissions' forwards') and the kernels first compiled inside it (``compiles``).

    python -m bench.load_test --device cuda --dtype bfloat16 --draft eagle --fast --clients 64 --requests 4000
    .venv/bin/python -m bench.load_test --clients 4 --requests 48 --max-new-tokens 24   # CPU, small
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.engine import Engine
from speccycle.engine.serving.adaptive import AdaptiveSpeculation
from speccycle.engine.serving.scheduler import Scheduler
from speccycle.engine.tokenizers.tokenizer import Tokenizer
from speccycle.engine.weights.weights_gguf import default_model_path

from .common import RESULTS, KernelSpecializations, commit, latency_ms, result_record

MODES = ("off", "on", "adaptive")
REASONS = ("stop", "length", "cancelled", "error")


@attrs.frozen
class LoadRequest:
    """One request of the workload: the prompt (an index into the prompt list), its parameters, and when its
    client gives it up: after ``cancel_steps`` scheduler steps or ``cancel_tokens`` streamed tokens (None: never)."""

    prompt: int
    sampling: SamplingParams
    cancel_steps: int | None = None
    cancel_tokens: int | None = None


def synthetic_prompts(texts: Sequence[str], count: int, tokens: int, encode: Callable[[str], list[int]]) -> list[str]:
    """``count`` longer messages: dev prompts strung together, from a different start each, to about ``tokens``
    tokens (the message, before the chat template; a text that would run past ``tokens`` is skipped)."""
    out = []
    for i in range(count):
        parts, length = ["Answer each of the following, one after another."], 0
        for k in range(8 * len(texts)):  # short texts come round again until the message is long enough
            text = texts[(i + k) % len(texts)]
            n = len(encode(text)) + 3
            if length and length + n > tokens:
                continue
            parts.append(f"{len(parts)}. {text}")
            length += n
            if length >= 0.9 * tokens:
                break
        out.append("\n".join(parts))
    return out


def make_workload(
    num_prompts: int,
    requests: int,
    *,
    seed: int,
    min_new: int,
    max_new: int,
    greedy_fraction: float,
    cancel_fraction: float,
    stop_ids: Sequence[int],
    stop_fraction: float = 0.2,
) -> list[LoadRequest]:
    """The workload, drawn from ``seed``: every mode and every run of one seed serves the same requests."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        new = rng.randint(min_new, max_new)
        stops = (rng.choice(stop_ids),) if stop_ids and rng.random() < stop_fraction else ()
        if rng.random() < greedy_fraction:
            sampling = SamplingParams(max_new_tokens=new, stop_token_ids=stops)
        else:
            sampling = SamplingParams(
                temperature=round(rng.uniform(0.3, 1.2), 2),
                top_k=rng.choice((0, 20, 50)),
                top_p=rng.choice((1.0, 0.95, 0.9)),
                seed=rng.randrange(2**31),
                max_new_tokens=new,
                stop_token_ids=stops,
            )
        cancel_steps = cancel_tokens = None
        if rng.random() < cancel_fraction:
            if rng.random() < 0.5:
                cancel_steps = rng.randint(0, max(1, new // 2))
            else:
                cancel_tokens = rng.randint(1, max(1, new - 1))
        out.append(LoadRequest(rng.randrange(num_prompts), sampling, cancel_steps, cancel_tokens))
    return out


@attrs.define
class _Track:
    index: int  # into the workload
    submitted: float
    times: list[float] = attrs.field(factory=list)  # one per streamed token
    streamed: list[int] = attrs.field(factory=list)
    finishes: int = 0


def run_load(scheduler: Scheduler, workload: Sequence[LoadRequest], prompts: Sequence[Sequence[int]], clients: int):
    """Serve ``workload`` with ``clients`` closed-loop clients; returns (tracks by request id, finished requests by
    request id, wall seconds). The scheduler's ``on_tokens`` and ``on_finish`` are taken over for the run."""
    if clients < 1:
        raise ValueError(f"clients={clients} must be >= 1")
    tracks: dict[int, _Track] = {}
    done: dict[int, object] = {}
    free_clients = clients
    clock = time.perf_counter

    def on_tokens(rid: int, tokens: list[int]) -> None:
        track, now = tracks[rid], clock()
        track.streamed += tokens
        track.times += [now] * len(tokens)
        limit = workload[track.index].cancel_tokens
        if limit is not None and len(track.streamed) >= limit and rid not in done:
            scheduler.cancel(rid)  # during a step: it lands when the step ends

    def on_finish(request) -> None:
        nonlocal free_clients
        tracks[request.request_id].finishes += 1
        if request.request_id not in done:
            free_clients += 1
        done[request.request_id] = request

    scheduler.on_tokens, scheduler.on_finish = on_tokens, on_finish
    give_up: dict[int, int] = {}  # request id -> the scheduler step at which its client gives it up
    queue = iter(range(len(workload)))
    remaining = len(workload)
    start = clock()
    while len(done) < len(workload):
        while free_clients and remaining:
            i = next(queue)
            remaining -= 1
            free_clients -= 1
            item = workload[i]
            rid = scheduler.submit(prompts[item.prompt], item.sampling)
            tracks[rid] = _Track(i, clock())
            if item.cancel_steps == 0:
                scheduler.cancel(rid)  # given up before it was ever admitted
            elif item.cancel_steps is not None:
                give_up[rid] = scheduler.stats.steps + item.cancel_steps
        if scheduler.idle:
            continue
        scheduler.step()
        for rid, when in list(give_up.items()):
            if rid in done:
                del give_up[rid]
            elif scheduler.stats.steps >= when:
                del give_up[rid]
                scheduler.cancel(rid)  # between steps: it leaves at once
    seconds = clock() - start
    return tracks, done, seconds


def latency_figures(tracks: dict[int, _Track], seconds: float) -> dict:
    ttft = [t.times[0] - t.submitted for t in tracks.values() if t.times]
    tpot = [(t.times[-1] - t.times[0]) / (len(t.times) - 1) for t in tracks.values() if len(t.times) > 1]
    tokens = sum(len(t.streamed) for t in tracks.values())
    return {
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
        **latency_ms(ttft, tpot),
    }


def greedy_references(engine: Engine, workload: Sequence[LoadRequest], prompts: Sequence[Sequence[int]]) -> dict:
    """Each prompt's autoregressive greedy output (EOS ends it), as long as its longest greedy request asks: run
    one prompt at a time, speculation off. A shorter budget's reference is its prefix."""
    longest: dict[int, int] = {}
    for item in workload:
        if item.sampling.greedy:
            longest[item.prompt] = max(longest.get(item.prompt, 0), item.sampling.max_new_tokens)
    return {i: engine.generate_autoregressive([prompts[i]], n)[0] for i, n in sorted(longest.items())}


def _cut(tokens: Sequence[int], stops: set[int], limit: int) -> list[int]:
    out = []
    for token in tokens[:limit]:
        out.append(token)
        if token in stops:
            break
    return out


def check_run(
    workload: Sequence[LoadRequest],
    tracks: dict[int, _Track],
    done: dict,
    references: dict[int, list[int]] | None,
    eos: Sequence[int],
) -> dict:
    """The soak's checks over one run; every count but ``greedy_identical`` and the reasons must be 0 to pass."""
    reasons = dict.fromkeys(REASONS, 0)
    lost = [rid for rid in tracks if rid not in done]
    twice = [rid for rid, t in tracks.items() if t.finishes != 1]
    stream_mismatch = wrong_stop = 0
    greedy = greedy_identical = greedy_prefix = 0
    mismatches = []
    for rid, request in done.items():
        item, track = workload[tracks[rid].index], tracks[rid]
        reasons[request.finish_reason] = reasons.get(request.finish_reason, 0) + 1
        output = list(request.output)
        if track.streamed != output:
            stream_mismatch += 1
        stops = set(item.sampling.stop_token_ids) | set(eos)
        n = len(output)
        if request.finish_reason == "stop":
            ok = n >= 1 and output[-1] in stops and not stops & set(output[:-1]) and n <= item.sampling.max_new_tokens
        elif request.finish_reason == "length":
            ok = n == item.sampling.max_new_tokens and not stops & set(output)
        elif request.finish_reason == "cancelled":
            ok = n < item.sampling.max_new_tokens and not stops & set(output)
        else:
            ok = False
        wrong_stop += not ok
        if item.sampling.greedy and references is not None and request.finish_reason != "error":
            greedy += 1
            want = _cut(references[item.prompt], stops, item.sampling.max_new_tokens)
            if request.finish_reason == "cancelled":
                same = output == want[:n]
                greedy_prefix += same
            else:
                same = output == want
            greedy_identical += same
            if not same and len(mismatches) < 5:
                first = next((i for i, (a, b) in enumerate(zip(output, want)) if a != b), min(n, len(want)))
                mismatches.append({"request_id": rid, "prompt": item.prompt, "first_difference": first})
    return {
        "submitted": len(tracks),
        "finished": len(done),
        "lost": len(lost),
        "finished_not_once": len(twice),
        "finish_reasons": reasons,
        "stream_mismatches": stream_mismatch,
        "wrong_stops": wrong_stop,
        "greedy": greedy,
        "greedy_identical": greedy_identical,
        "greedy_cancelled_prefix": greedy_prefix,
        "greedy_mismatches": mismatches,
    }


def passed(checks: dict, pool_empty: bool) -> bool:
    return (
        checks["lost"] == 0
        and checks["finished_not_once"] == 0
        and checks["finish_reasons"]["error"] == 0
        and checks["stream_mismatches"] == 0
        and checks["wrong_stops"] == 0
        and checks["greedy_identical"] == checks["greedy"]
        and pool_empty
    )


def run_mode(
    engine: Engine,
    mode: str,
    workload: Sequence[LoadRequest],
    prompts: Sequence[Sequence[int]],
    clients: int,
    max_batch_size: int | None = None,
    max_prefill_tokens: int | None = None,
    sync: Callable[[], None] = lambda: None,
    admit_fraction: float | None = None,
) -> tuple[dict, dict, dict]:
    """One closed-loop run of ``workload`` in ``mode``: (figures, tracks, finished requests)."""
    speculation = {"off": "off", "on": "on", "adaptive": AdaptiveSpeculation()}[mode]
    scheduler = Scheduler.from_engine(
        engine,
        speculation=speculation,
        max_batch_size=max_batch_size or clients,
        max_prefill_tokens=max_prefill_tokens,
        admit_fraction=admit_fraction,
    )
    sync()
    with KernelSpecializations() as compiled:
        tracks, done, seconds = run_load(scheduler, workload, prompts, clients)
        sync()
    stats = scheduler.stats
    figures = latency_figures(tracks, seconds)
    figures.update(
        steps=stats.steps,
        spec_cycles=stats.spec_cycles,
        plain_cycles=stats.plain_cycles,
        tau=round(stats.tau, 3) if stats.verifies else None,
        retractions=stats.retractions,
        cancelled=stats.cancelled,
        captures=stats.captures,  # cycle graphs captured inside the timed run (their time counts)
        forward_captures=stats.forward_captures,  # and forward graphs (an admission's prefill, draft extend)
        compiles=compiled.counts,  # Triton kernel specializations first met inside it, by kernel (None: unknown)
        compiled_variants=compiled.variants,  # and each one's signature, constants and argument specializations
    )
    return figures, tracks, done


def soak(
    engine: Engine,
    workload: Sequence[LoadRequest],
    prompts: Sequence[Sequence[int]],
    clients: int,
    modes: Sequence[str] = MODES,
    check: bool = True,
    **kwargs,
) -> dict:
    """Every mode over the same workload, figures and checks; ``check`` False skips the greedy references."""
    pool = engine.pool
    rows, runs = {}, {}
    for mode in modes:
        figures, tracks, done = run_mode(engine, mode, workload, prompts, clients, **kwargs)
        runs[mode] = (figures, tracks, done, pool.num_free_pages == pool.num_pages)
        print(f"{mode}: {figures['tokens_per_s']} tok/s over {len(done)} requests ({figures['seconds']} s)", flush=True)
    references = greedy_references(engine, workload, prompts) if check else None  # after the timed runs
    for mode, (figures, tracks, done, empty) in runs.items():
        checks = check_run(workload, tracks, done, references, engine.stop_token_ids)
        checks["pool_empty_at_end"] = empty
        checks["passed"] = passed(checks, empty) if check else None
        rows[mode] = {**figures, "checks": checks}
    return rows


def summary_row(mode: str, row: dict) -> dict:
    """One mode's headline figures, flat (the benchmarks page renders ``rows`` as a table)."""
    c = row["checks"]
    return {
        "mode": mode,
        "tokens_per_s": row["tokens_per_s"],
        "ttft_p50_ms": row["ttft_ms"]["p50"],
        "ttft_p99_ms": row["ttft_ms"]["p99"],
        "tpot_p50_ms": row["tpot_ms"]["p50"],
        "tpot_p99_ms": row["tpot_ms"]["p99"],
        "finished": f"{c['finished']}/{c['submitted']}",
        "cancelled": c["finish_reasons"]["cancelled"],
        "captures": row["captures"],
        "forward_captures": row["forward_captures"],
        "compiles": None if row["compiles"] is None else sum(row["compiles"].values()),
        "greedy_identical": f"{c['greedy_identical']}/{c['greedy']}",
        "pool_empty": c["pool_empty_at_end"],
        "passed": c["passed"],
    }


def _stop_ids(engine: Engine) -> list[int]:
    """Frequent single tokens a request may stop at: ".", ",", a newline (those the tokenizer has as one token)."""
    ids = []
    for text in (".", ",", "\n"):
        tokens = engine.tokenizer.encode(text)
        if len(tokens) == 1:
            ids.append(tokens[0])
    return ids


def build_prompts(tokenizer, long_prompts: int, long_tokens: int, prompts_path: str | None = None):
    """The dev prompts, then ``long_prompts`` synthetic longer ones, as chat-template token ids."""
    texts = [p["text"] for p in load_prompts(prompts_path)]
    long = synthetic_prompts(texts, long_prompts, long_tokens, tokenizer.encode)
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts + long]


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--draft", default="ngram", choices=["ngram", "layerskip", "eagle"])
    parser.add_argument("--fast", action="store_true", help="the engine's fast path (CUDA graphs, fused cycles)")
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients")
    parser.add_argument("--max-batch-size", type=int, default=None, help="default: --clients")
    parser.add_argument("--max-prefill-tokens", type=int, default=None)
    parser.add_argument(
        "--admit-fraction", type=float, default=None,
        help="the Scheduler's admission batching (0: admit at every step; default: the Scheduler's)",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=48, help="requests per mode")
    parser.add_argument("--min-new-tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--long-prompts", type=int, default=3, help="synthetic longer prompts beside the dev ones")
    parser.add_argument("--long-prompt-tokens", type=int, default=1000)
    parser.add_argument("--prompts", default=None, help="Spec-Bench JSONL; default: the dev sample shipped")
    parser.add_argument("--greedy-fraction", type=float, default=0.5)
    parser.add_argument("--cancel-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-tokens", type=int, default=None, help="KV pool size; default: every client fits")
    parser.add_argument("--warmup-requests", type=int, default=None, help="default: 2 per client, every mode")
    parser.add_argument("--no-check", action="store_true", help="skip the greedy references (figures only)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--name",
        default=None,
        help="result file name under bench/results (.json added; default: load_test-<date-time>-<commit>.json)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes: choose from {','.join(MODES)}; got {args.modes!r}")
    if not 1 <= args.min_new_tokens <= args.max_new_tokens:
        raise SystemExit("--min-new-tokens and --max-new-tokens: need 1 <= min <= max")
    if not (0 <= args.greedy_fraction <= 1 and 0 <= args.cancel_fraction <= 1):
        raise SystemExit("--greedy-fraction and --cancel-fraction: each a fraction in [0, 1]")
    if args.clients < 1 or args.requests < 1:
        raise SystemExit("--clients and --requests: each >= 1")
    spec = SpecConfig(
        num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens, page_size=args.page_size
    )
    dtype = getattr(torch, args.dtype)
    prompts = build_prompts(
        Tokenizer.from_gguf(default_model_path()), args.long_prompts, args.long_prompt_tokens, args.prompts
    )
    longest = max(len(p) for p in prompts)
    batch = args.max_batch_size or args.clients
    per_request = args.page_size * math.ceil(
        (longest + args.max_new_tokens + 2 * spec.reserve_len("aligned")) / args.page_size
    )
    kv_tokens = args.kv_tokens or batch * per_request
    engine = Engine.load(
        draft=args.draft, spec=spec, device=args.device, dtype=dtype, kv_tokens=kv_tokens, fast=args.fast
    )
    stop_ids = _stop_ids(engine)
    draw = dict(
        min_new=args.min_new_tokens,
        max_new=args.max_new_tokens,
        greedy_fraction=args.greedy_fraction,
        cancel_fraction=args.cancel_fraction,
        stop_ids=stop_ids,
    )
    workload = make_workload(len(prompts), args.requests, seed=args.seed, **draw)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    common = dict(
        max_batch_size=args.max_batch_size, max_prefill_tokens=args.max_prefill_tokens, sync=sync,
        admit_fraction=args.admit_fraction,
    )  # fmt: skip
    warm = make_workload(len(prompts), args.warmup_requests or 2 * args.clients, seed=args.seed + 1, **draw)
    for mode in modes:  # every shape's graphs at every bucket, as a server captures them before it serves
        speculation = {"off": "off", "on": "on", "adaptive": AdaptiveSpeculation()}[mode]
        Scheduler.from_engine(engine, speculation=speculation, max_batch_size=batch).warm_up()
    for mode in modes:  # then compilation and the allocator on the workload's own requests
        run_mode(engine, mode, warm, prompts, args.clients, **common)
    rows = soak(engine, workload, prompts, args.clients, modes, check=not args.no_check, **common)
    for mode, row in rows.items():
        c = row["checks"]
        print(
            f"{mode:>8}: {row['tokens_per_s']:.1f} tok/s, TTFT p50 {row['ttft_ms']['p50']} p99 {row['ttft_ms']['p99']} "
            f"ms, TPOT p50 {row['tpot_ms']['p50']} p99 {row['tpot_ms']['p99']} ms; finished {c['finished']}/"
            f"{c['submitted']} {c['finish_reasons']}, greedy identical {c['greedy_identical']}/{c['greedy']}, "
            f"pool empty {c['pool_empty_at_end']}, passed {c['passed']}; {row['captures']} cycle and "
            f"{row['forward_captures']} forward graphs captured in the run, "
            f"kernels compiled in it: {row['compiles'] if row['compiles'] is not None else 'unknown'}"
        )
    payload = {
        "model": f"{default_model_path().name} ({args.dtype})",
        "draft": args.draft,
        "fast": args.fast,
        "config": {"S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens, "P": spec.page_size},
        "workload": {
            "clients": args.clients,
            "max_batch_size": batch,
            "admit_fraction": "auto" if args.admit_fraction is None else args.admit_fraction,
            "requests": args.requests,
            "new_tokens": [args.min_new_tokens, args.max_new_tokens],
            "prompts": args.prompts or "speccycle.engine/data/spec_bench_sample.jsonl",
            "long_prompts": args.long_prompts,
            "prompt_tokens": [min(len(p) for p in prompts), longest],
            "greedy_fraction": args.greedy_fraction,
            "cancel_fraction": args.cancel_fraction,
            "stop_token_ids": stop_ids,
            "seed": args.seed,
            "kv_tokens": kv_tokens,
        },
        "modes": rows,
        "rows": [summary_row(mode, row) for mode, row in rows.items()],
    }
    record = result_record("load_test", payload, args.device)
    name = args.name or f"load_test-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{commit()}"
    name = name if name.endswith(".json") else f"{name}.json"  # a name given without the suffix gets it
    path = Path(RESULTS) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    if not args.no_check and not all(row["checks"]["passed"] for row in rows.values()):
        raise SystemExit("the soak failed a check: see the 'checks' of each mode in the result")
    return record


if __name__ == "__main__":
    main()
