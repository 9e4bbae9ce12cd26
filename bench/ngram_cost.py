"""Which prompt-lookup config a CPU's costs favour: replayed verifies weighed by measured costs.

`bench/ngram_tau.py` replays the `ngram` draft over the engine's greedy outputs (tau and verify rows
per verify, no timing). This script replays a grid of configs the same way (chains over ``S`` x
``min_ngram`` x ``depth_per_match`` x ``min_depth``, and a few trees) and predicts each one's speedup
over autoregressive decoding, in decode steps:

* ``decode``: ``committed * (1 + ar_overhead) / sum(cycle_overhead + cost[rows])`` over the verifies;
* ``e2e``: the same with the prefill (``prefill_per_token * prompt tokens``) added to both sides, as
  ``speccycle bench`` times it.

``--cost`` is a ``bench/verify_profile.py --cycle`` record (``ratio``: a verify of ``n`` rows over a decode step,
with the attention and linears the engine runs; ``cycle_overhead``, ``ar_overhead``, ``prefill_per_token``) or an
older ``cpu_linear --model`` record (``modes``, bench/results/cpu_linear_model-*; the overheads then come from the
flags; that benchmark was removed). Row counts between measured ones are interpolated. The predictions are per
category over the first ``--per-category`` prompts and over the first ``--first`` of them (the sample of
``speccycle bench --limit``). ``--oracle`` adds bounds: a chain that knows how many of the best match's tokens will
be accepted and proposes exactly those, and one that also picks the best of the ranked matches.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.ngram_cost --cost bench/results/verify_profile-<date>.json --oracle
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from speccycle.core import SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.drafters.ngram import NgramDraft
from speccycle.engine.engine import Engine
from speccycle.engine.tokenizers.tokenizer import Tokenizer
from speccycle.engine.weights.weights_gguf import default_model_path

from .common import write_result
from .ngram_tau import DEV, autoregressive_outputs, pick, replay

STEPS = (8, 16)
# (min_ngram, depth_per_match, min_depth); depth None: every match proposes S tokens
DRAFTERS = [
    (1, None, 1),
    (1, 1.0, 1),
    (1, 2.0, 1),
    (2, 2.0, 1),
    (1, 3.0, 1),
    (1, 1.0, 2),
    (1, 1.5, 2),
    (1, 1.0, 3),
    (1, 1.5, 3),
    (1, 2.0, 3),
    (1, 3.0, 3),
    (1, 1.5, 4),
    (2, 1.5, 3),
]
TREES = [(16, 2, 8), (16, 4, 8), (16, 4, 16)]  # S, K, N with depth_per_match 1.5, min_depth 3


def row_costs(record: dict) -> dict[int, float]:
    """Verify rows -> cost in decode steps, from either kind of record (module docstring)."""
    if "ratio" in record:
        return {int(n): float(r) for n, r in record["ratio"].items()}
    return {int(n): float(r) for n, r in record["modes"]["packed"]["ratio"].items()}


def interpolate(cost: dict[int, float], rows: int) -> float:
    """``cost[rows]``, linear between measured row counts; beyond the widest is an error."""
    if rows in cost:
        return cost[rows]
    known = sorted(cost)
    if not known[0] <= rows <= known[-1]:
        raise ValueError(f"no cost for {rows} rows: the record measured {known[0]}..{known[-1]}")
    high = next(n for n in known if n > rows)
    low = max(n for n in known if n < rows)
    return cost[low] + (cost[high] - cost[low]) * (rows - low) / (high - low)


def predict(parts: list[dict], cost: dict[int, float], overhead: dict[str, float]) -> dict:
    """Decode-only and end-to-end speedups of replayed prompts (``parts``: `ngram_tau.replay` results with
    ``prompt_tokens``)."""
    committed = sum(p["committed"] for p in parts)
    spent = sum(
        (overhead["cycle_overhead"] + interpolate(cost, int(rows))) * count
        for p in parts
        for rows, count in p["row_histogram"].items()
    )
    prefill = overhead["prefill_per_token"] * sum(p["prompt_tokens"] for p in parts)
    ar = committed * (1 + overhead["ar_overhead"])
    return {"decode": round(ar / spent, 3), "e2e": round((ar + prefill) / (spent + prefill), 3)}


def replay_parts(make_draft, spec: SpecConfig, runs: list[dict]) -> dict[str, list[dict]]:
    """Per category, the replay of every prompt (`ngram_tau.replay`) with its prompt length."""
    by_cat: dict[str, list[dict]] = {}
    for i, run in enumerate(runs):
        part = replay(make_draft(), spec, run["prompt"], run["output"], request_id=i)
        part["prompt_tokens"] = len(run["prompt"])
        by_cat.setdefault(run["category"], []).append(part)
    return by_cat


def oracle_parts(vocab: int, runs: list[dict], any_match: bool, steps: int = 16) -> dict[str, list[dict]]:
    """Replays of a chain that proposes exactly the tokens that will be accepted: of the best match
    (``any_match`` False) or of the best of up to 8 ranked matches; no guess when none would be."""
    draft = NgramDraft(vocab)
    by_cat: dict[str, list[dict]] = {}
    for run in runs:
        prompt, output = run["prompt"], run["output"]
        c, verifies, committed, rows = 1, 0, 0, {}
        while c < len(output):
            conts = draft.continuations(prompt + output[:c], steps, 8 if any_match else 1)
            best = 0
            for cont in conts:
                accepted = 0
                while accepted < len(cont) and c + accepted < len(output) and cont[accepted] == output[c + accepted]:
                    accepted += 1
                best = max(best, accepted)
            accept_len = min(best + 1, len(output) - c)
            c += accept_len
            verifies += 1
            committed += accept_len
            rows[1 + best] = rows.get(1 + best, 0) + 1
        part = {"verifies": verifies, "committed": committed, "row_histogram": rows, "prompt_tokens": len(prompt)}
        by_cat.setdefault(run["category"], []).append(part)
    return by_cat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cost", required=True, help="a bench/verify_profile.py --cycle (or cpu_linear --model) record"
    )
    parser.add_argument("--categories", default="summarization,rag")
    parser.add_argument("--per-category", type=int, default=10)
    parser.add_argument("--first", type=int, default=5, help="also predict over the first N prompts of each")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--cycle-overhead", type=float, default=None, help="decode steps per verify (record's)")
    parser.add_argument("--ar-overhead", type=float, default=None, help="decode steps per AR step (record's)")
    parser.add_argument("--prefill-per-token", type=float, default=None, help="decode steps per prompt token")
    parser.add_argument("--oracle", action="store_true", help="add the oracle chains (module docstring)")
    parser.add_argument("--cache", default="/tmp/ngram_tau_ar.json", help="autoregressive outputs ('' for none)")
    args = parser.parse_args()
    record = json.loads(Path(args.cost).read_text())
    cost = row_costs(record)
    overhead = {}
    for name, default in (("cycle_overhead", 0.065), ("ar_overhead", 0.015), ("prefill_per_token", 0.038)):
        flag = getattr(args, name)
        overhead[name] = flag if flag is not None else float(record.get(name, default))
    categories = args.categories.split(",")
    prompts = pick(load_prompts(DEV, categories=categories), str(args.per_category))
    engines: list[Engine] = []

    def load_engine() -> Engine:
        if not engines:
            engines.append(Engine.load(draft="ngram", device="cpu", dtype=torch.float32))
        return engines[0]

    tokenizer = Tokenizer.from_gguf(default_model_path())
    vocab = tokenizer.vocab_size
    runs = autoregressive_outputs(
        tokenizer, load_engine, prompts, args.max_new_tokens, Path(args.cache) if args.cache else None
    )
    seen: dict[str, int] = {}
    first = []
    for run in runs:
        seen[run["category"]] = seen.get(run["category"], 0) + 1
        if seen[run["category"]] <= args.first:
            first.append(run)
    samples = {f"{args.per_category}": runs, f"first{args.first}": first}
    widest = max(cost)
    configs: dict[str, tuple] = {}
    for steps in STEPS:
        for min_ngram, depth, min_depth in DRAFTERS:
            options = {"min_ngram": min_ngram, "depth_per_match": depth, "min_depth": min_depth}
            configs[f"chain-S{steps}-min{min_ngram}-d{depth}-at-least{min_depth}"] = (
                SpecConfig(num_steps=steps),
                options,
            )
    for steps, topk, nodes in TREES:
        options = {"min_ngram": 1, "depth_per_match": 1.5, "min_depth": 3}
        configs[f"tree-S{steps}-K{topk}-N{nodes}-d1.5-at-least3"] = (
            SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=nodes),
            options,
        )
    out: dict = {"cost_record": args.cost, "row_cost": cost, "overhead": overhead, "configs": {}}
    print(f"row costs {cost}\noverheads {overhead}")

    def report(name: str, per_sample: dict[str, dict[str, list[dict]]]) -> None:
        entry = {}
        for label, by_cat in per_sample.items():
            for cat, parts in by_cat.items():
                verifies = sum(p["verifies"] for p in parts)
                committed = sum(p["committed"] for p in parts)
                rows = sum(int(n) * k for p in parts for n, k in p["row_histogram"].items())
                entry[f"{cat} {label}"] = {
                    "tau": round(committed / verifies, 3),
                    "rows": round(rows / verifies, 2),
                    **predict(parts, cost, overhead),
                }
        out["configs"][name] = entry
        cells = "  ".join(
            f"{k} {v['tau']:.2f}/{v['rows']:.1f} {v['decode']:.3f}/{v['e2e']:.3f}" for k, v in entry.items()
        )
        print(f"{name:<40} {cells}", flush=True)

    print("per sample: tau/rows per verify, predicted decode-only/e2e speedup")
    for name, (spec, options) in configs.items():
        if spec.num_draft_tokens > widest:
            continue
        per_sample = {
            label: replay_parts(lambda o=options: NgramDraft(vocab, **o), spec, sample)
            for label, sample in samples.items()
        }
        report(name, per_sample)
    if args.oracle:
        for any_match in (False, True):
            name = "oracle-chain-any-match" if any_match else "oracle-chain-best-match"
            report(name, {label: oracle_parts(vocab, sample, any_match) for label, sample in samples.items()})
    out["note"] = (
        "per config and sample: tau, verify rows per verify, predicted speedup over autoregressive decoding "
        "(decode: decode steps only; e2e: with the prefill in both, as speccycle bench times it)"
    )
    print(f"wrote {write_result('ngram_cost', out)}")


if __name__ == "__main__":
    main()
