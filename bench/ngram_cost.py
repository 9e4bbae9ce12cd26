"""Which prompt-lookup config a row-cost curve favours: replayed tau and rows, weighed by measured row costs.

`bench/ngram_tau.py` replays the `ngram` draft over the engine's greedy outputs (tau and verify rows
per verify, no timing). This script replays a grid of chain configs (``S`` x ``min_ngram`` x
``depth_per_match``) the same way and predicts each one's speedup over autoregressive decoding,
``committed / sum(cost[rows])`` over the verifies (prefill and cycle overhead left out), under the row
costs of a ``bench/cpu_linear.py --model`` record (``packed``: the engine's linears; ``f_linear``:
before). The predictions are per category over the first ``--per-category`` prompts and over the
first ``--first`` of them (the sample of ``speccycle bench --limit``).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.ngram_cost --cost bench/results/cpu_linear_model-20261122-113905.json
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
from speccycle.engine.tokenizer import Tokenizer
from speccycle.engine.weights_gguf import default_model_path

from .common import write_result
from .ngram_tau import DEV, autoregressive_outputs, pick, predicted_speedup, replay_config

STEPS = (4, 6, 8, 12, 16, 24)
DRAFTERS = [(1, None), (2, None), (1, 1.0), (2, 1.0), (1, 2.0), (2, 2.0), (2, 3.0), (3, 2.0)]  # min_ngram, depth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost", required=True, help="a bench/cpu_linear.py --model record")
    parser.add_argument("--categories", default="summarization,rag")
    parser.add_argument("--per-category", type=int, default=10)
    parser.add_argument("--first", type=int, default=5, help="also predict over the first N prompts of each")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--cache", default="/tmp/ngram_tau_ar.json", help="autoregressive outputs ('' for none)")
    args = parser.parse_args()
    record = json.loads(Path(args.cost).read_text())
    costs = {mode: {int(n): r for n, r in entry["ratio"].items()} for mode, entry in record["modes"].items()}
    categories = args.categories.split(",")
    prompts = pick(load_prompts(DEV, categories=categories), str(args.per_category))
    engines: list[Engine] = []

    def load_engine() -> Engine:
        if not engines:
            engines.append(Engine.load(draft="ngram", device="cpu", dtype=torch.float32))
        return engines[0]

    tokenizer = Tokenizer.from_gguf(default_model_path())
    runs = autoregressive_outputs(
        tokenizer, load_engine, prompts, args.max_new_tokens, Path(args.cache) if args.cache else None
    )
    samples = {f"{args.per_category}": runs}
    seen: dict[str, int] = {}
    first = []
    for run in runs:
        seen[run["category"]] = seen.get(run["category"], 0) + 1
        if seen[run["category"]] <= args.first:
            first.append(run)
    samples[f"first{args.first}"] = first
    widest = max(costs["packed"])
    out: dict = {"cost_record": args.cost, "threads": record.get("threads"), "configs": {}}
    for steps in STEPS:
        if steps + 1 > widest:
            continue
        for min_ngram, depth in DRAFTERS:
            name = f"chain-S{steps}-min{min_ngram}-d{depth}"
            entry = {}
            for label, sample in samples.items():
                result = replay_config(
                    name,
                    lambda m=min_ngram, d=depth: NgramDraft(tokenizer.vocab_size, min_ngram=m, depth_per_match=d),
                    SpecConfig(num_steps=steps),
                    sample,
                )
                for cat, summary in result["categories"].items():
                    entry[f"{cat} {label}"] = {
                        "tau": summary["tau"],
                        "rows": summary["rows"],
                        **{mode: predicted_speedup(summary, cost) for mode, cost in costs.items()},
                    }
            out["configs"][name] = entry
            cells = "  ".join(f"{k} {v['tau']:.2f}/{v['rows']:.1f} {v['packed']:.3f}" for k, v in entry.items())
            print(f"{name:<22} {cells}", flush=True)
    out["note"] = (
        "per config and sample: tau, verify rows per verify, predicted speedup under each row-cost curve "
        "(committed / sum of row costs; prefill and cycle overhead left out)"
    )
    print(f"wrote {write_result('ngram_cost', out)}")


if __name__ == "__main__":
    main()
