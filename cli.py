"""The ``speccycle`` command: ``demo`` (the cycle on test models), ``generate`` and ``bench`` (real models)."""

from __future__ import annotations

import argparse
import sys
import time


def _demo(args: argparse.Namespace) -> int:
    from .core import Ports, Request, SamplingParams, SpecConfig
    from .statemachine import generate
    from .statemachine.checks import INVARIANTS
    from .testing import FingerprintPool, HashedNgramTarget, NoisyDraft

    config = SpecConfig(
        num_steps=args.steps, topk=args.topk, num_draft_tokens=args.draft_tokens, page_size=args.page_size
    )
    pool = FingerprintPool(num_pages=4096, page_size=config.page_size)
    target = HashedNgramTarget(pool, vocab_size=64, n=3)
    ports = Ports(target=target, draft=NoisyDraft(target, agreement=args.agreement), kv_pool=pool)
    requests = [
        Request(i, tuple(range(i + 1, i + 6 + 3 * i)), SamplingParams(max_new_tokens=args.max_new_tokens))
        for i in range(args.batch)
    ]
    events = []
    start = time.perf_counter()
    done = generate(requests, config, ports, checked=True, trace=events.append)
    elapsed = time.perf_counter() - start
    print(f"config: {config}")
    for e in events[: args.trace_lines]:
        print(
            f"  {e.source:>9} --{e.event:<7}--> {e.target:<9} bs={e.batch_size:<3} rows={e.rows:<4} "
            f"{e.duration_s * 1e6:8.1f} us"
        )
    if len(events) > args.trace_lines:
        print(f"  ... {len(events) - args.trace_lines} more transitions")
    cycles = sum(e.event == "verify" for e in events)
    verifies = sum(e.batch_size for e in events if e.event == "verify")  # request-cycles
    committed = sum(len(r.output) for r in done)
    lossless = all(list(r.output) == target.greedy(r.prompt, r.sampling.max_new_tokens) for r in done)
    print(
        f"{len(done)} requests, {committed} tokens in {cycles} cycles "
        f"(tau {(committed - len(done)) / max(verifies, 1):.2f}), {elapsed:.2f} s"
    )
    print(
        "checked at every boundary: "
        + "; ".join(f"{k} {v}" for k, v in INVARIANTS.items() if k in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12))
    )
    print(
        f"greedy output equals target-only greedy decoding: {lossless}; "
        f"KV pages all free: {pool.num_free_pages == pool.num_pages}"
    )
    return 0 if lossless else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speccycle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the cycle in checked mode on the deterministic test models, print a trace")
    demo.add_argument("--steps", type=int, default=4)
    demo.add_argument("--topk", type=int, default=2)
    demo.add_argument("--draft-tokens", type=int, default=8)
    demo.add_argument("--page-size", type=int, default=4)
    demo.add_argument("--batch", type=int, default=3)
    demo.add_argument("--agreement", type=float, default=0.8)
    demo.add_argument("--max-new-tokens", type=int, default=32)
    demo.add_argument("--trace-lines", type=int, default=14)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:  # bad configs and inputs: say what, without a traceback
        print(f"speccycle: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
