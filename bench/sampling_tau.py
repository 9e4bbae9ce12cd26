"""Acceptance under sampling: tau at temperature 0, 0.7 and 1.0 for the engine's drafters, on Spec-Bench prompts.

tau is the mean number of tokens a verify commits per request (accepted drafts + 1), counted over
every verify of every prompt. Sampling is lossless, so a temperature changes only how often drafts
are accepted: the target's distribution flattens and a draft's guess matches it less often.

Drafters: ``ngram`` (prompt lookup; its proposals are point masses), ``layerskip`` (the target's first
layers, ``q`` from its own logits) and ``eagle`` (the shipped head when speccycle has one for the model,
else a randomly initialized head, whose tau is close to 1: the JSON says which). One prompt of each
of ``--categories`` (a spread: prompt-copying summarization and rag, open writing), all in one batch,
SmolLM2-135M-Instruct float32 on the given device; each prompt gets seed ``--seed + index``.

    .venv/bin/python -m bench.sampling_tau --limit 6 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import os
from collections import Counter

import torch
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.drafters.eagle_heads import shipped_eagle_head
from speccycle.engine.engine import Engine, eagle_head_for
from speccycle.engine.weights.weights_gguf import default_model_path

from .common import write_result

# the Spec-Bench dev prompts where $SPEC_BENCH_DEV names their file, else None: the 13 prompts the package ships
DEV = os.environ.get("SPEC_BENCH_DEV") or None


def one_per_category(prompts: list[dict], categories: list[str], limit: int) -> list[dict]:
    """The first prompt of each of ``categories`` (in that order), at most ``limit``."""
    picked: dict[str, dict] = {}
    for item in prompts:
        picked.setdefault(item["category"], item)
    missing = [c for c in categories if c not in picked]
    if missing:
        raise ValueError(f"no prompt of categories {missing} in the prompts file: pick from {sorted(picked)}")
    return [picked[c] for c in categories][:limit]


def build_engine(draft: str, spec: SpecConfig, device: str, kv_tokens: int) -> tuple[Engine, str]:
    """The engine for ``draft`` and, for eagle, which head it runs (``shipped`` or ``random``)."""
    if draft != "eagle":
        return Engine.load(draft=draft, spec=spec, device=device, kv_tokens=kv_tokens), ""
    head = shipped_eagle_head(default_model_path())
    if head is not None:
        return Engine.load(draft="eagle", eagle_head=head, spec=spec, device=device, kv_tokens=kv_tokens), "shipped"
    probe = Engine.load(draft="none", spec=spec, device=device, kv_tokens=1024)
    random_head = eagle_head_for(probe, seed=0)
    engine = Engine.load(draft="eagle", eagle_head=random_head, spec=spec, device=device, kv_tokens=kv_tokens)
    return engine, "random (untrained: tau near 1 expected)"


def measure(engine: Engine, token_ids: list[list[int]], temperature: float, max_new_tokens: int, seed: int) -> dict:
    sampling = SamplingParams(temperature=temperature, seed=seed)
    results, stats = engine.generate(token_ids, max_new_tokens, sampling=sampling)
    assert engine.pool.num_free_pages == engine.pool.num_pages, "KV pages leaked"
    return {
        "temperature": temperature,
        "tau": round(stats.tau, 3),
        "verifies": stats.verifies,
        "committed": stats.committed,
        "new_tokens": sum(len(r.output) for r in results),
        "accept_len_histogram": {str(k): v for k, v in sorted(Counter(stats.accept_len_histogram).items())},
        "seconds": round(stats.seconds, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--prompts",
        default=DEV,
        help="Spec-Bench style JSONL (default: $SPEC_BENCH_DEV, else the 13 prompts the package ships)",
    )
    parser.add_argument("--categories", default="writing,coding,translation,summarization,qa,rag")
    parser.add_argument("--limit", type=int, default=6, help="at most this many prompts (one per category)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperatures", default="0,0.7,1.0")
    parser.add_argument("--drafts", default="ngram,layerskip,eagle")
    parser.add_argument("--steps", type=int, default=4, help="S")
    parser.add_argument("--topk", type=int, default=1, help="K (1: chain)")
    parser.add_argument("--draft-tokens", type=int, default=None, help="N (trees)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = SpecConfig(num_steps=args.steps, topk=args.topk, num_draft_tokens=args.draft_tokens, page_size=16)
    prompts = one_per_category(load_prompts(args.prompts), args.categories.split(","), args.limit)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    runs = []
    for draft in args.drafts.split(","):
        engine, head = build_engine(draft, spec, args.device, kv_tokens=len(prompts) * 2048)
        token_ids = [engine.chat_prompt(p["text"]) for p in prompts]
        for temperature in temperatures:
            row = {"draft": draft, **({"eagle_head": head} if head else {})}
            row.update(measure(engine, token_ids, temperature, args.max_new_tokens, args.seed))
            runs.append(row)
            print(f"{draft:<10} T={temperature:<4} tau {row['tau']:.3f}  ({row['verifies']} verifies)", flush=True)
    payload = {
        "model": default_model_path().name,
        "dtype": "float32",
        "config": {"S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens, "P": spec.page_size},
        "prompts_file": args.prompts,
        "prompts": [{"id": p["id"], "category": p["category"]} for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "sampling": "temperature only (top_k 0, top_p 1); prompt i gets seed + i",
        "note": "tau = tokens committed per verify; an untrained (random) EAGLE head is near 1 by construction",
        "rows": runs,
    }
    path = write_result("sampling_tau", payload, device=args.device, directory=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
