"""Prefix cache reuse with speculation on and off: multi-turn chats under shared system prompts.

The workload (`bench/prefix_workload.json`): conversations under a few shared system prompts, several user
turns each. Every conversation is a client: its first turn is submitted at the start, each later turn as
soon as its previous answer finished, with the answer rendered back into the chat template (the prompt a
chat client sends back: system prompt, earlier turns, the new question). All conversations run at once
through one `Scheduler` with `max_batch_size` concurrent requests.

Modes, each on a cold prefix cache (`PagedKVPool.drop_cached_pages`):

* ``off``: ``speculation="off"`` (no draft), with the prefix cache;
* ``on``: ``speculation="on"`` (the engine's draft every cycle), with the prefix cache;
* ``off_nocache`` and ``on_nocache``: the same without the prefix cache (every prompt prefilled whole).

Reported per mode: the hit rate (prefill tokens served from cached pages over all prefill tokens, the
prompts and, after a retraction, the output recomputed), prefill tokens computed, new tokens/s (wall time of
the whole workload), tau, pages published and evicted (``--kv-tokens`` small: reservations evict cached
pages), and ``identical_to_off_nocache``: requests whose output equals the
reference mode's token for token (greedy: all, and so every mode sees the same prompts). ``hit_rate_gap``:
``off``'s hit rate minus ``on``'s, in points.

    python -m bench.prefix_cache --device cuda --dtype bfloat16 --draft eagle --fast
    .venv/bin/python -m bench.prefix_cache --max-new-tokens 24 --threads 2          # CPU, small
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.engine import Engine
from speccycle.engine.serving.scheduler import Scheduler

from .common import sync, write_result

WORKLOAD = Path(__file__).resolve().parent / "prefix_workload.json"
MODES = ("off_nocache", "off", "on", "on_nocache")


def run_mode(engine: Engine, mode: str, workload: dict, args) -> dict:
    """Run every conversation to its last turn; returns the figures and each turn's output."""
    speculation = "on" if mode.startswith("on") else "off"
    cache = not mode.endswith("nocache")
    engine.pool.drop_cached_pages()
    evicted = engine.pool.num_evicted_pages
    tokenizer, stops = engine.tokenizer, set(engine.stop_token_ids)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    conversations = workload["conversations"][: args.conversations or None]
    histories = [[{"role": "system", "content": workload["systems"][c["system"]]}] for c in conversations]
    turn_of = [0] * len(conversations)
    owner: dict[int, int] = {}  # request id -> conversation
    outputs: dict[tuple[int, int], list[int]] = {}

    def send(index: int) -> None:
        history = histories[index]
        history.append({"role": "user", "content": conversations[index]["turns"][turn_of[index]]})
        owner[scheduler.submit(tokenizer.apply_chat_template(history), params)] = index

    def finished(request) -> None:
        if request.finish_reason == "error":
            raise RuntimeError(f"{mode}: request {request.request_id} errored: {request.error}")
        index = owner.pop(request.request_id)
        outputs[(index, turn_of[index])] = list(request.output)
        answer = tokenizer.decode([t for t in request.output if t not in stops])
        histories[index].append({"role": "assistant", "content": answer})
        turn_of[index] += 1
        if turn_of[index] < min(len(conversations[index]["turns"]), args.turns):
            send(index)

    scheduler = Scheduler.from_engine(
        engine, speculation=speculation, prefix_cache=cache, max_batch_size=args.max_batch_size, on_finish=finished,
        admit_fraction=args.admit_fraction,
    )  # fmt: skip
    sync(args.device)
    start = time.perf_counter()
    for index in range(len(conversations)):
        send(index)
    scheduler.run()
    sync(args.device)
    seconds = time.perf_counter() - start
    stats = scheduler.stats
    tokens = sum(len(o) for o in outputs.values())
    engine.pool.audit()
    return {
        "requests": len(outputs),
        "prefill_tokens": stats.prefill_tokens,
        "cached_tokens": stats.cached_tokens,
        "computed_tokens": stats.computed_tokens,
        "hit_rate": round(stats.prefix_hit_rate, 4),
        "published_pages": stats.published_pages,
        "evicted_pages": engine.pool.num_evicted_pages - evicted,
        "new_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "tau": round(stats.tau, 3) if stats.verifies else None,
        "retractions": stats.retractions,
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--draft", default="eagle", choices=["ngram", "layerskip", "eagle"])
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=16, help="concurrent requests")
    parser.add_argument(
        "--admit-fraction", type=float, default=None,
        help="the Scheduler's admission batching (0: admit at every step; default: the Scheduler's)",
    )  # fmt: skip
    parser.add_argument("--conversations", type=int, default=0, help="the first N conversations (0: all)")
    parser.add_argument("--turns", type=int, default=3, help="user turns per conversation, at most")
    parser.add_argument("--kv-tokens", type=int, default=65536, help="KV pool size in tokens (small: eviction)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workload", default=str(WORKLOAD))
    parser.add_argument("--fast", action="store_true", help="the engine's fast path (CUDA graphs, Triton kernels)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--tag", default="", help="added to the result's name")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES) or "off_nocache" not in modes:
        raise SystemExit(f"--modes: choose from {MODES} and include 'off_nocache' (the reference); got {modes}")
    workload = json.loads(Path(args.workload).read_text())
    spec = SpecConfig(
        num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens, page_size=args.page_size
    )
    engine = Engine.load(
        draft=args.draft,
        spec=spec,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        kv_tokens=args.kv_tokens,
        fast=args.fast,
        prefix_cache=True,
    )
    # lazy initialization, kernels, the graphs of every batch bucket the first turns pass through: before the clock
    warm = argparse.Namespace(**{**vars(args), "turns": 1, "max_new_tokens": 4})
    for mode in modes:
        run_mode(engine, mode, workload, warm)

    results = {mode: run_mode(engine, mode, workload, args) for mode in modes}
    reference = results["off_nocache"]["outputs"]
    for mode, r in results.items():
        outputs = r.pop("outputs")
        r["identical_to_off_nocache"] = sum(outputs.get(key) == value for key, value in reference.items())
        print(
            f"{mode:>12}: hit rate {100 * r['hit_rate']:5.1f}% ({r['cached_tokens']}/{r['prefill_tokens']} prefill "
            f"tokens cached), {r['tokens_per_s']:.1f} tok/s, tau {r['tau']}, identical "
            f"{r['identical_to_off_nocache']}/{len(reference)}"
        )
    gap = None
    if "on" in results and "off" in results:
        gap = round(100 * (results["off"]["hit_rate"] - results["on"]["hit_rate"]), 2)
        print(f"hit rate gap, speculation off - on: {gap} points")
    payload = {
        "model": f"SmolLM2-135M-Instruct ({args.dtype})",
        "draft": args.draft,
        "fast": args.fast,
        "config": {"S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens, "P": spec.page_size},
        "max_new_tokens": args.max_new_tokens,
        "max_batch_size": args.max_batch_size,
        "admit_fraction": "auto" if args.admit_fraction is None else args.admit_fraction,
        "kv_tokens": args.kv_tokens,
        "workload": Path(args.workload).name,
        "conversations": len(workload["conversations"][: args.conversations or None]),
        "turns": args.turns,
        "hit_rate_gap_points": gap,
        "rows": [{"mode": mode, **r} for mode, r in results.items()],
    }
    name = f"prefix_cache-{args.tag}" if args.tag else "prefix_cache"
    path = write_result(name, payload, args.device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
