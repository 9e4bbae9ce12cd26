"""tau of the prompt-lookup (`ngram`) draft per Spec-Bench category, for several drafter configs.

tau (mean ``accept_len`` per verify) of a lookup draft under greedy decoding does not depend on the
machine or its load: the committed tokens are the target's greedy output, and what the draft proposes
at each cycle is a function of the history alone. So the target runs once per prompt (the engine's
autoregressive decode, SmolLM2-135M, float32, CPU; cached in ``--cache``) and every config is
*replayed* over that output: each cycle the draft proposes a tree from ``prompt + output[:c]``, the
greedy walk follows the nodes that equal ``output[c], output[c + 1], ...``, and ``c`` moves on by the
accept length (cut at the end of the output, as EOS and ``max_new_tokens`` cut it in the engine). A
replay also counts verify rows per verify (``rows``, root included; ``rows_histogram``), the cost side.

``--engine`` configs also run through the real engine (``Engine.generate``); the record then holds the
engine's tau, ``identical_to_ar`` and whether the replay's tau equals the engine's (it must: it is the
same arithmetic). ``--repeats`` adds a category of raw-text prompts whose greedy output is a repeated
run ("1 1 1 1"), where a match's continuation runs into the end of the history.

``--row-cost`` times the target forward of ``n`` rows after a long prompt against a one-row forward
(minimum of ``--row-cost-reps``) and writes ``row_cost`` and, per config and category,
``predicted_speedup = committed / sum(row_cost[rows] per verify)``: a model of the speedup over
autoregressive decoding that leaves out the cycle's own overhead (~2 ms) and prefill. Run it on an
idle machine; the timing of record is ``speccycle bench``.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.ngram_tau --categories all \
        --per-category summarization=10,rag=10,3 --repeats --engine chain-S16-cpu
    OMP_NUM_THREADS=2 .venv/bin/python -m bench.ngram_tau --threads 2 --row-cost   # idle machine
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from speccycle.core import SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.drafters.ngram import CPU_OPTIONS, NgramDraft
from speccycle.engine.engine import Engine
from speccycle.engine.greedy import extend_batch
from speccycle.engine.tokenizers.tokenizer import Tokenizer
from speccycle.engine.weights.weights_gguf import default_model_path

from .common import write_result

# the Spec-Bench dev prompts where $SPEC_BENCH_DEV names their file, else None: the 13 prompts the package ships
DEV = os.environ.get("SPEC_BENCH_DEV") or None

# name -> (SpecConfig, NgramDraft options). "full": every match proposes S tokens (NgramDraft's
# defaults); "cpu": NgramDraft.CPU_OPTIONS (max(3, ceil(1.5 m)) tokens for a match of m).
FULL = {"depth_per_match": None}
CPU = dict(CPU_OPTIONS)
CONFIGS: dict[str, tuple[SpecConfig, dict]] = {
    "chain-S5-full": (SpecConfig(num_steps=5), FULL),
    "chain-S16-full": (SpecConfig(num_steps=16), FULL),
    "chain-S5-cpu": (SpecConfig(num_steps=5), CPU),
    "chain-S8-cpu": (SpecConfig(num_steps=8), CPU),
    "chain-S12-cpu": (SpecConfig(num_steps=12), CPU),
    "chain-S16-cpu": (SpecConfig(num_steps=16), CPU),
    "chain-S24-cpu": (SpecConfig(num_steps=24), CPU),
    "chain-S16-min1-d1": (SpecConfig(num_steps=16), {"min_ngram": 1, "depth_per_match": 1.0}),
    "chain-S16-min2-d1": (SpecConfig(num_steps=16), {"min_ngram": 2, "depth_per_match": 1.0}),
    "chain-S16-min2-d3": (SpecConfig(num_steps=16), {"min_ngram": 2, "depth_per_match": 3.0}),
    "chain-S16-min3-d2": (SpecConfig(num_steps=16), {"min_ngram": 3, "depth_per_match": 2.0}),
    "tree-S5-K4-N16-full": (SpecConfig(num_steps=5, topk=4, num_draft_tokens=16), FULL),
    "tree-S16-K4-N24-d2": (SpecConfig(num_steps=16, topk=4, num_draft_tokens=24), {"depth_per_match": 2.0}),
    "tree-S16-K4-N16-cpu": (SpecConfig(num_steps=16, topk=4, num_draft_tokens=16), CPU),
}

# Raw-text prompts (no chat template) whose SmolLM2 greedy output is a repeated run.
REPEATS = ["1 1 1 1 1 1 1 1", "ha ha ha ha ha ha", "a, a, a, a, a,", "0000000000"]


def pick(prompts: list[dict], per_category: str) -> list[dict]:
    """The first prompts of each category: ``per_category`` is ``"4"`` or ``"summarization=10,rag=10,3"``
    (a bare number: every other category)."""
    counts, default = {}, 0
    for item in per_category.split(","):
        name, _, number = item.rpartition("=")
        if name:
            counts[name] = int(number)
        else:
            default = int(number)
    seen: dict[str, int] = defaultdict(int)
    out = []
    for p in prompts:
        if seen[p["category"]] < counts.get(p["category"], default):
            seen[p["category"]] += 1
            out.append(p)
    return out


def autoregressive_outputs(
    tokenizer, load_engine: Callable[[], Engine], prompts: list[dict], max_new_tokens: int, cache: Path | None
) -> list[dict]:
    """``{"id", "category", "prompt", "output"}`` per prompt: the engine's greedy decode, cached in ``cache``."""
    stored = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    key = f"{max_new_tokens}"
    stored.setdefault(key, {})
    rows = []
    for item in prompts:
        if item.get("raw"):
            ids = tokenizer.encode(item["text"])
        else:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": item["text"]}])
        entry = stored[key].get(str(item["id"]))
        if entry is None or entry["prompt"] != ids:
            entry = {"prompt": ids, "output": load_engine().generate_autoregressive([ids], max_new_tokens)[0]}
            stored[key][str(item["id"])] = entry
            if cache is not None:
                cache.write_text(json.dumps(stored))
            print(f"  autoregressive {item['category']} #{item['id']}: {len(ids)} prompt tokens", flush=True)
        rows.append({"id": item["id"], "category": item["category"], **entry})
    return rows


def replay(draft, spec: SpecConfig, prompt: list[int], output: list[int], request_id: int = 0) -> dict:
    """The greedy cycle of a lookup ``draft`` over a known greedy ``output``: verifies, committed, rows."""
    c, verifies, committed, rows = 1, 0, 0, 0  # prefill commits output[0]; the first verify follows it
    histogram: dict[int, int] = defaultdict(int)
    row_histogram: dict[int, int] = defaultdict(int)
    while c < len(output):
        history = prompt + output[:c]
        tokens, parents = draft.propose([request_id], [history], spec.num_steps, spec.num_draft_tokens - 1, spec.topk)
        tokens, parents = tokens[0].tolist(), parents[0].tolist()
        row, depth = 0, 0
        while c + depth < len(output):
            child = next(
                (i + 1 for i, (t, p) in enumerate(zip(tokens, parents)) if p == row and t == output[c + depth]), None
            )
            if child is None:
                break
            row, depth = child, depth + 1
        accept_len = min(depth + 1, len(output) - c)
        c += accept_len
        verifies += 1
        committed += accept_len
        rows += 1 + len(tokens)
        histogram[accept_len] += 1
        row_histogram[1 + len(tokens)] += 1
    return {
        "verifies": verifies,
        "committed": committed,
        "rows": rows,
        "histogram": dict(histogram),
        "row_histogram": dict(row_histogram),
    }


def summarize(parts: list[dict]) -> dict:
    verifies = sum(p["verifies"] for p in parts)
    committed = sum(p["committed"] for p in parts)
    rows = sum(p["rows"] for p in parts)
    row_histogram: dict[int, int] = defaultdict(int)
    for p in parts:
        for k, v in p["row_histogram"].items():
            row_histogram[k] += v
    return {
        "prompts": len(parts),
        "verifies": verifies,
        "committed": committed,
        "tau": round(committed / verifies, 3) if verifies else None,
        "rows": round(rows / verifies, 2) if verifies else None,
        "rows_histogram": {str(k): v for k, v in sorted(row_histogram.items())},
    }


def replay_config(name: str, make_draft: Callable[[], object], spec: SpecConfig, runs: list[dict]) -> dict:
    by_cat: dict[str, list[dict]] = defaultdict(list)
    histogram: dict[int, int] = defaultdict(int)
    for i, run in enumerate(runs):
        part = replay(make_draft(), spec, run["prompt"], run["output"], request_id=i)
        by_cat[run["category"]].append(part)
        for k, v in part["histogram"].items():
            histogram[k] += v
    return {
        "categories": {cat: summarize(parts) for cat, parts in by_cat.items()},
        "all": summarize([p for parts in by_cat.values() for p in parts]),
        "accept_len_histogram": {str(k): v for k, v in sorted(histogram.items())},
    }


@torch.no_grad()
def row_cost(engine: Engine, prompt: list[int], rows: list[int], reps: int) -> dict[int, float]:
    """Seconds of a target forward of ``n`` causal rows after ``prompt``, over a one-row forward (min of ``reps``)."""
    pool, target, start = engine.pool, engine.target, len(prompt)
    rid = 10**9  # a request id no generate call uses
    target.forward(extend_batch(pool, [rid], [prompt], [0]))
    times: dict[int, float] = {n: float("inf") for n in sorted({1, *rows})}
    try:
        for _ in range(reps):
            for n in times:  # interleaved, so drifting load hits every n alike
                batch = extend_batch(pool, [rid], [(prompt * n)[:n]], [start], last_logits_only=False)
                tick = time.perf_counter()
                target.forward(batch)
                times[n] = min(times[n], time.perf_counter() - tick)
    finally:
        pool.free(rid)
    return {n: round(t / times[1], 3) for n, t in times.items()}


def predicted_speedup(summary: dict, cost: dict[int, float]) -> float | None:
    """``committed / sum(cost[rows])`` over the verifies of a replay summary (see the module docstring)."""
    spent = sum(cost[int(n)] * count for n, count in summary["rows_histogram"].items())
    return round(summary["committed"] / spent, 3) if spent else None


def engine_config(engine: Engine, spec: SpecConfig, draft, runs: list[dict], max_new_tokens: int) -> dict:
    """The real cycle: tau and identical_to_ar per category."""
    engine.spec, engine.draft = spec, draft
    by_cat: dict[str, dict] = defaultdict(lambda: {"prompts": 0, "verifies": 0, "committed": 0, "identical": 0})
    for run in runs:
        results, stats = engine.generate([run["prompt"]], max_new_tokens)
        row = by_cat[run["category"]]
        row["prompts"] += 1
        row["verifies"] += stats.verifies
        row["committed"] += stats.committed
        row["identical"] += int(list(results[0].output) == run["output"])
    return {
        cat: {
            "prompts": r["prompts"],
            "tau": round(r["committed"] / r["verifies"], 3) if r["verifies"] else None,
            "identical_to_ar": r["identical"],
        }
        for cat, r in by_cat.items()
    }


def display_rows(record: dict, categories: tuple[str, ...] = ("summarization", "rag", "repeats")) -> list[dict]:
    """One row per config for the benchmarks page: ``tau (rows per verify)`` per category, as text (the
    page prints numbers with one decimal); the numbers are under ``configs``."""
    rows = []
    for name, entry in record["configs"].items():
        if "categories" not in entry:
            continue
        config = entry["config"]
        row = {"config": name, "S/K/N": f"{config['S']}/{config['K']}/{config.get('N')}"}
        for cat in [c for c in categories if c in entry["categories"]] + ["all"]:
            summary = entry["all"] if cat == "all" else entry["categories"][cat]
            row[cat] = f"{summary['tau']:.3f} ({summary['rows']:.2f})"
            if "predicted_speedup" in summary:
                row[f"{cat} predicted"] = f"{summary['predicted_speedup']:.2f}"
        if "engine" in entry:
            engine = entry["engine"]
            row["engine identical"] = f"{sum(r['identical_to_ar'] for r in engine.values())}/" + str(
                sum(r["prompts"] for r in engine.values())
            )
            row["replay == engine"] = str(entry.get("replay_equals_engine"))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--prompts",
        default=DEV,
        help="Spec-Bench style JSONL (default: $SPEC_BENCH_DEV, else the 13 prompts the package ships)",
    )
    parser.add_argument("--categories", default="summarization,rag", help="comma-separated; 'all' for every one")
    parser.add_argument("--per-category", default="4", help='prompts per category: "4" or "summarization=10,rag=10,3"')
    parser.add_argument("--repeats", action="store_true", help="add raw-text repeated-run prompts (category repeats)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"replayed configs, of: {', '.join(CONFIGS)}")
    parser.add_argument("--engine", default="", help="configs also run through the real engine (comma-separated)")
    parser.add_argument("--row-cost", action="store_true", help="time forwards of n rows; predict speedups")
    parser.add_argument("--row-cost-reps", type=int, default=15)
    parser.add_argument("--cache", default="/tmp/ngram_tau_ar.json", help="autoregressive outputs ('' for none)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tag", default="", help="a label stored in the record (e.g. before / after)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = [n for n in args.configs.split(",") if n]
    engine_names = [n for n in args.engine.split(",") if n]
    unknown = [n for n in names + engine_names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}: choose from {', '.join(CONFIGS)}")
    categories = None if args.categories == "all" else args.categories.split(",")
    prompts = pick(load_prompts(args.prompts, categories=categories), args.per_category)
    if args.repeats:
        prompts += [{"category": "repeats", "text": t, "id": f"repeat-{i}", "raw": True} for i, t in enumerate(REPEATS)]
    engines: list[Engine] = []

    def load_engine() -> Engine:  # only when an output is not cached, or for --engine / --row-cost
        if not engines:
            engines.append(Engine.load(draft="ngram", device="cpu", dtype=torch.float32))
        return engines[0]

    tokenizer = Tokenizer.from_gguf(default_model_path())
    vocab = tokenizer.vocab_size
    cache = Path(args.cache) if args.cache else None
    runs = autoregressive_outputs(tokenizer, load_engine, prompts, args.max_new_tokens, cache)
    record: dict = {
        "tag": args.tag,
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf, dequantized to float32",
        "prompts_file": args.prompts,
        "per_category": args.per_category,
        "new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "prompt_ids": {
            cat: [r["id"] for r in runs if r["category"] == cat] for cat in dict.fromkeys(r["category"] for r in runs)
        },
        "configs": {},
    }
    for name in names:
        spec, kwargs = CONFIGS[name]
        result = replay_config(name, lambda kwargs=kwargs: NgramDraft(vocab, **kwargs), spec, runs)
        result["config"] = {"S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens, "drafter": kwargs}
        record["configs"][name] = result
        cats = "  ".join(f"{c} {r['tau']:.3f} ({r['rows']} rows)" for c, r in result["categories"].items())
        print(f"{name:<20} all {result['all']['tau']:.3f} ({result['all']['rows']} rows)  {cats}", flush=True)
    if args.row_cost:
        longest = max((r["prompt"] for r in runs if r["category"] != "repeats"), key=len)
        widths = [1 + n for name in names for n in range(CONFIGS[name][0].num_draft_tokens)]
        cost = row_cost(load_engine(), longest, widths, args.row_cost_reps)
        record["row_cost"] = {"context_tokens": len(longest), "reps": args.row_cost_reps, "ratio": cost}
        print(f"row cost (forward of n rows / 1 row, context {len(longest)}): {cost}", flush=True)
        for name in names:
            entry = record["configs"][name]
            for summary in [*entry["categories"].values(), entry["all"]]:
                summary["predicted_speedup"] = predicted_speedup(summary, cost)
            cats = "  ".join(f"{c} {r['predicted_speedup']}" for c, r in entry["categories"].items())
            print(f"{name:<20} predicted speedup: all {entry['all']['predicted_speedup']}  {cats}", flush=True)
    for name in engine_names:
        spec, kwargs = CONFIGS[name]
        measured = engine_config(load_engine(), spec, NgramDraft(vocab, **kwargs), runs, args.max_new_tokens)
        entry = record["configs"].setdefault(name, {"config": {"S": spec.num_steps, "K": spec.topk}})
        entry["engine"] = measured
        replayed = entry.get("categories")
        if replayed is not None:
            entry["replay_equals_engine"] = all(measured[c]["tau"] == replayed[c]["tau"] for c in measured)
        print(f"{name:<20} engine {measured}  replay == engine: {entry.get('replay_equals_engine')}", flush=True)
    record["note"] = (
        "tau (mean accept_len per verify) and, in parentheses, verify rows per verify, replayed over the "
        "engine's greedy outputs (bench/ngram_tau.py); full numbers under configs"
    )
    record["rows"] = display_rows(record)
    path = write_result("ngram_tau", record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
