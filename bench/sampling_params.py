"""What the history-dependent sampling parameters cost under speculation, and what speculation still buys.

One batch of Spec-Bench prompts (one per category) on SmolLM2-135M-Instruct float32 with its shipped EAGLE head,
decoded under each setting below, speculating and with ``speculate=False`` (one token a cycle through the same
cycle, no draft work: autoregressive decoding with the same parameters). For each: seconds, tokens/s, tau, the
time spent in `statemachine.logits.adjust` (every prefill, draft and verify row's penalties, bias, bad words and
processor) per cycle, and, for greedy settings, whether the speculative output equals the one-token-a-cycle
output token for token.

    .venv/bin/python -m bench.sampling_params --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.drafters.eagle_heads import shipped_eagle_head
from speccycle.engine.engine import Engine
from speccycle.engine.weights.weights_gguf import default_model_path
from speccycle.statemachine import logits as row_logits
from speccycle.statemachine import transitions

from .common import write_result
from .sampling_tau import one_per_category

DEV = os.environ.get("SPEC_BENCH_DEV") or None


def favor_recent(history, row):
    """A processor hook: the last token's logit down by 2 (a host call per row)."""
    row[history[-1]] -= 2.0
    return row


PENALTIES = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, logit_bias={13: -1.0},
                 bad_words=((28,), (30, 31)))  # fmt: skip
SETTINGS = {
    "greedy": dict(),
    "greedy + penalties, bias, bad words": PENALTIES,
    "greedy + processor hook": dict(logits_processor=favor_recent),
    "sampled T 0.7 min_p 0.05 + penalties": dict(temperature=0.7, min_p=0.05, seed=0, **PENALTIES),
}


class AdjustClock:
    """Wall time inside `logits.adjust` (the cycle looks the module attribute up at each call)."""

    def __init__(self):
        self.seconds, self.calls, self._inner = 0.0, 0, row_logits.adjust

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run(engine: Engine, token_ids, params: SamplingParams, max_new_tokens: int) -> tuple[dict, list]:
    clock = AdjustClock()
    transitions.row_logits.adjust = clock
    try:
        results, stats = engine.generate(token_ids, max_new_tokens, sampling=params)
    finally:
        transitions.row_logits.adjust = clock._inner
    new = sum(len(r.output) for r in results)
    cycles = max(stats.verifies // max(len(token_ids), 1), 1)
    return {
        "seconds": round(stats.seconds, 3),
        "tokens_per_s": round(new / stats.seconds, 2),
        "tau": round(stats.tau, 3) if stats.verifies else None,
        "new_tokens": new,
        "adjust_calls": clock.calls,
        "adjust_ms_per_cycle": round(1000 * clock.seconds / cycles, 3),
    }, [list(r.output) for r in results]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default=DEV, help="Spec-Bench JSONL (default: the prompts the package ships)")
    parser.add_argument("--categories", default="writing,qa,summarization")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--draft-tokens", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = SpecConfig(num_steps=args.steps, topk=args.topk, num_draft_tokens=args.draft_tokens, page_size=16)
    prompts = one_per_category(load_prompts(args.prompts), args.categories.split(","), 8)
    head = shipped_eagle_head(default_model_path())
    engine = Engine.load(draft="eagle", eagle_head=head, spec=spec, device="cpu", kv_tokens=len(prompts) * 2048)
    token_ids = [engine.chat_prompt(p["text"]) for p in prompts]
    engine.generate(token_ids[:1], 4)  # warm up
    rows = []
    for name, options in SETTINGS.items():
        spec_row, spec_out = run(engine, token_ids, SamplingParams(**options), args.max_new_tokens)
        plain_row, plain_out = run(engine, token_ids, SamplingParams(**options, speculate=False), args.max_new_tokens)
        row = {"setting": name, "speculative": spec_row, "speculate_false": plain_row,
               "speedup": round(plain_row["seconds"] / spec_row["seconds"], 3)}  # fmt: skip
        if not options.get("temperature"):
            row["identical"] = spec_out == plain_out
        rows.append(row)
        print(f"{name:<40} {spec_row['tokens_per_s']:>7} tok/s (tau {spec_row['tau']}) "
              f"vs {plain_row['tokens_per_s']:>7} "
              f"one a cycle: {row['speedup']}x, adjust {spec_row['adjust_ms_per_cycle']} ms/cycle"
              f"{'' if 'identical' not in row else ', identical ' + str(row['identical'])}", flush=True)  # fmt: skip
    payload = {
        "model": default_model_path().name,
        "dtype": "float32",
        "draft": "eagle (shipped head)",
        "threads": torch.get_num_threads(),
        "config": {"S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens, "P": spec.page_size},
        "prompts": [{"id": p["id"], "category": p["category"]} for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "penalties": {k: (sorted(v.items()) if isinstance(v, dict) else v) for k, v in PENALTIES.items()},
        "note": "speculate_false: the same parameters, one token a cycle, no draft work (autoregressive through the "
        "cycle); adjust_ms_per_cycle: time in statemachine.logits.adjust (prefill, draft and verify rows) per cycle",
        "rows": rows,
    }
    path = write_result("sampling_params", payload, device="cpu", directory=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
