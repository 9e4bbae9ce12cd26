"""`speccycle bench`: autoregressive and speculative decoding side by side on a prompts file.

Each prompt runs autoregressive first, then speculative, on the same engine (same model, pool and
device), batch 1, greedy. Tokens/s are new tokens over wall time per mode; ``identical_to_ar``
counts prompts whose speculative output equals the autoregressive one token for token.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import torch

from .engine import Engine

SAMPLE_PROMPTS = "spec_bench_sample.jsonl"


def load_prompts(path: str | None, limit: int | None = None, categories: Sequence[str] | None = None) -> list[dict]:
    """Spec-Bench style JSONL (``category``, ``turns``); None: the 13-prompt sample shipped with speccycle."""
    if path is None:
        text = resources.files("speccycle.engine").joinpath("data", SAMPLE_PROMPTS).read_text()
        source = f"speccycle.engine/data/{SAMPLE_PROMPTS}"
    else:
        if not Path(path).is_file():
            raise ValueError(f"no prompts file at {path}: pass a JSONL file with 'turns' (and 'category')")
        text, source = Path(path).read_text(), path
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompts.append(
                {
                    "category": item.get("category", "all"),
                    "text": item["turns"][0],
                    "id": item.get("question_id", number),
                }
            )
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
            raise ValueError(f"{source} line {number}: expected a JSON object with a 'turns' list ({err})") from err
    if categories:
        prompts = [p for p in prompts if p["category"] in categories]
    return prompts[:limit] if limit else prompts


def run_bench(engine: Engine, prompts: list[dict], max_new_tokens: int, progress: bool = True) -> dict:
    """Run every prompt autoregressive then speculative; return the summary dict (see module docstring)."""
    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is a nicety

        def tqdm(x, **_):
            return x

    per_cat = defaultdict(
        lambda: {
            "prompts": 0,
            "ar_tokens": 0,
            "ar_s": 0.0,
            "spec_tokens": 0,
            "spec_s": 0.0,
            "verifies": 0,
            "committed": 0,
            "identical": 0,
        }
    )
    histogram: Counter[int] = Counter()
    for item in tqdm(prompts, desc=f"bench {engine_draft_name(engine)}", disable=not progress):
        ids = engine.chat_prompt(item["text"])
        start = time.perf_counter()
        ar = engine.generate_autoregressive([ids], max_new_tokens)[0]
        ar_s = time.perf_counter() - start
        start = time.perf_counter()
        results, stats = engine.generate([ids], max_new_tokens)
        spec_s = time.perf_counter() - start
        spec = list(results[0].output)
        row = per_cat[item["category"]]
        row["prompts"] += 1
        row["ar_tokens"] += len(ar)
        row["ar_s"] += ar_s
        row["spec_tokens"] += len(spec)
        row["spec_s"] += spec_s
        row["verifies"] += stats.verifies
        row["committed"] += stats.committed
        row["identical"] += int(spec == ar)
        histogram.update(stats.accept_len_histogram)

    def summarize(rows: list[dict]) -> dict:
        total = {k: sum(r[k] for r in rows) for k in rows[0]}
        ar_tps = total["ar_tokens"] / total["ar_s"] if total["ar_s"] else 0.0
        spec_tps = total["spec_tokens"] / total["spec_s"] if total["spec_s"] else 0.0
        return {
            "prompts": total["prompts"],
            "ar_tokens_per_s": round(ar_tps, 2),
            "spec_tokens_per_s": round(spec_tps, 2),
            "speedup": round(spec_tps / ar_tps, 3) if ar_tps else None,
            "tau": round(total["committed"] / total["verifies"], 3) if total["verifies"] else None,
            "identical_to_ar": total["identical"],
            "new_tokens": total["spec_tokens"],
        }

    categories = {cat: summarize([row]) for cat, row in per_cat.items()}
    overall = summarize(list(per_cat.values())) if per_cat else {}
    return {
        **overall,
        "accept_len_histogram": {str(k): v for k, v in sorted(histogram.items())},
        "categories": categories,
    }


def engine_draft_name(engine: Engine) -> str:
    return type(engine.draft).__name__ if engine.draft is not None else "none"


def format_table(summary: dict) -> str:
    lines = [
        f"{'category':<16}{'prompts':>8}{'AR tok/s':>10}{'spec tok/s':>12}{'speedup':>9}{'tau':>7}{'identical':>11}"
    ]
    rows = list(summary["categories"].items()) + [("all", summary)]
    for name, r in rows:
        lines.append(
            f"{name:<16}{r['prompts']:>8}{r['ar_tokens_per_s']:>10.1f}{r['spec_tokens_per_s']:>12.1f}"
            f"{(r['speedup'] or 0):>9.2f}{(r['tau'] or 0):>7.2f}{r['identical_to_ar']:>6}/{r['prompts']:<4}"
        )
    return "\n".join(lines)


def git_commit() -> str:
    """The checkout's commit (``+dirty`` with local changes), or ``unknown`` outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def device_label(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({torch.get_num_threads()} threads)"
