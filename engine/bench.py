"""`speccycle bench`: autoregressive and speculative decoding side by side on a prompts file.

Both sides run on the same engine (same model, pool and device), batch 1, greedy. Before the clock
starts each side decodes a few tokens untimed (`WARMUP_TOKENS`): of every prompt on a GPU, where each new
prompt length can mean a new graph bucket to capture and new kernel shapes to compile, of the first prompt on a
CPU; so compilation, graph capture and first allocations are paid there, not by a timed prompt. Then every prompt
runs on both sides, autoregressive first on the 1st, 3rd, ... prompt and speculative first on the
2nd, 4th, ..., so neither side always runs second on a warm cache.

The headline is each side's whole-run tokens/s (its new tokens over its time, all prompts summed) and
their ratio, ``speedup``; the rows per category below it are summed the same way over their prompts.
``identical_to_ar`` counts prompts whose speculative output equals the autoregressive one token for
token (greedy decoding is lossless: every prompt should be); ``tau`` is the mean tokens committed per
verify (None for ``--draft none``, which has no verify).
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
from .errors import UsageError

SAMPLE_PROMPTS = "spec_bench_sample.jsonl"
WARMUP_TOKENS = 8  # on a CPU, each side's untimed decode of the first prompt before the clock starts
LEGEND = (
    "identical: prompts whose greedy speculative output equals the autoregressive one, token for token; "
    "tau: mean tokens committed per verify (- without a draft)"
)
_EXAMPLE = '{"category": "writing", "turns": ["Write a haiku about KV caches."]}'


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during `run_bench`: ``summary`` holds the prompts that finished (``interrupted`` True)."""

    def __init__(self, summary: dict) -> None:
        super().__init__("bench interrupted")
        self.summary = summary


def load_prompts(path: str | None, limit: int | None = None, categories: Sequence[str] | None = None) -> list[dict]:
    """Spec-Bench style JSONL (``category``, ``turns``); None: the 13-prompt sample shipped with speccycle.

    Every line is one JSON object with a ``turns`` list whose first item, a non-empty string, is the
    prompt; ``category`` (a string) is optional. ``limit`` keeps the first prompts (None or 0: all);
    ``categories`` keeps those categories, each of which must occur in the file. Anything else is a
    `UsageError` naming the file and line."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise UsageError(f"limit={limit!r}: pass a number of prompts >= 1 (None or 0 keeps them all)")
    if path is None:
        data = resources.files("speccycle.engine").joinpath("data", SAMPLE_PROMPTS).read_bytes()
        source = f"speccycle.engine/data/{SAMPLE_PROMPTS}"
    else:
        if not Path(path).is_file():
            raise UsageError(f"no prompts file at {path}: pass a JSONL file with 'turns' (and 'category')")
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise UsageError(f"cannot read the prompts file {path}: {err.strerror or err}") from err
        source = path
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise UsageError(
            f"{source} is not UTF-8 text (line {line}, byte {err.start}: {err.reason}): save the prompts file "
            "as UTF-8 JSONL"
        ) from err
    prompts = [_prompt(line, number, source) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not prompts:
        raise UsageError(f"{source} holds no prompts: write one JSON object per line, e.g. {_EXAMPLE}")
    if categories:
        present = sorted({p["category"] for p in prompts})
        missing = [c for c in categories if c not in present]
        if missing:
            raise UsageError(
                f"no prompts of category {', '.join(map(repr, missing))} in {source}: its categories are "
                f"{', '.join(present)}"
            )
        prompts = [p for p in prompts if p["category"] in categories]
    return prompts[:limit] if limit else prompts


def _prompt(line: str, number: int, source: str) -> dict:
    """One prompts-file line as ``{category, text, id, line}``; a `UsageError` naming the line otherwise."""
    where = f"{source} line {number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise UsageError(
            f"{where}: not valid JSON ({err.msg}, column {err.colno}): each line is one JSON object, e.g. {_EXAMPLE}"
        ) from err
    if not isinstance(item, dict):
        raise UsageError(
            f"{where}: a JSON {_json_type(item)} where a JSON object belongs: each line is one object, e.g. {_EXAMPLE}"
        )
    if "turns" not in item:
        raise UsageError(
            f"{where}: the object has no 'turns' (its keys: {', '.join(item) or 'none'}): add a 'turns' list"
        )
    turns = item["turns"]
    if not isinstance(turns, list) or not turns:
        got = "an empty list" if isinstance(turns, list) else f"a JSON {_json_type(turns)}"
        raise UsageError(f'{where}: \'turns\' is {got}, not a list of strings: write "turns": ["the prompt"]')
    if not isinstance(turns[0], str) or not turns[0].strip():
        got = "an empty string" if isinstance(turns[0], str) else f"a JSON {_json_type(turns[0])}"
        raise UsageError(f"{where}: the first turn is {got}: the prompt must be a non-empty string")
    category = item.get("category", "all")
    if not isinstance(category, str) or not category:
        raise UsageError(f"{where}: 'category' is {category!r}: it must be a non-empty string")
    return {"category": category, "text": turns[0], "id": item.get("question_id", number), "line": number}


def _json_type(value) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def run_bench(
    engine: Engine,
    prompts: list[dict],
    max_new_tokens: int,
    progress: bool = True,
    warmup_tokens: int = WARMUP_TOKENS,
) -> dict:
    """Warm both sides (module docstring), then run every prompt on both, in alternating order; return
    the summary dict (module docstring). Ctrl-C raises `BenchInterrupted` with the finished prompts' summary."""
    if not prompts:
        raise UsageError("no prompts to bench: pass a prompts file with at least one prompt")
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
    warmed = 0  # tokens each warm-up decode ran
    if warmup_tokens > 0:  # untimed: each path compiles, captures and allocates before the clock starts
        # on a GPU every prompt at its full length: a decode reaching longer keys than a short warm-up's compiles
        # and captures new kernel shapes (a cold H200 spent 1.9 s in one prompt's timed run at 8 warm-up tokens)
        cuda = engine.model.device.type == "cuda"
        warm, tokens = (prompts, max_new_tokens) if cuda else (prompts[:1], min(warmup_tokens, max_new_tokens))
        warmed = tokens
        for item in warm:
            ids = engine.chat_prompt(item["text"])
            engine.generate_autoregressive([ids], tokens)
            engine.generate([ids], tokens)

    def autoregressive(ids):
        start = time.perf_counter()
        out = engine.generate_autoregressive([ids], max_new_tokens)[0]
        return list(out), time.perf_counter() - start

    def speculative(ids):
        start = time.perf_counter()
        results, stats = engine.generate([ids], max_new_tokens)
        return list(results[0].output), stats, time.perf_counter() - start

    try:
        for i, item in enumerate(tqdm(prompts, desc=f"bench {engine_draft_name(engine)}", disable=not progress)):
            ids = engine.chat_prompt(item["text"])
            if i % 2 == 0:
                ar, ar_s = autoregressive(ids)
                spec, stats, spec_s = speculative(ids)
            else:
                spec, stats, spec_s = speculative(ids)
                ar, ar_s = autoregressive(ids)
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
    except KeyboardInterrupt as interrupt:
        raise BenchInterrupted(_summary(per_cat, histogram, warmed, interrupted=True)) from interrupt
    return _summary(per_cat, histogram, warmed, interrupted=False)


def _summary(per_cat: dict, histogram: Counter, warmup_tokens: int, interrupted: bool) -> dict:
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
            "ar_new_tokens": total["ar_tokens"],
            "ar_seconds": round(total["ar_s"], 4),
            "spec_seconds": round(total["spec_s"], 4),
        }

    rows = [r for r in per_cat.values() if r["prompts"]]
    overall = summarize(rows) if rows else {"prompts": 0}
    return {
        **overall,
        "accept_len_histogram": {str(k): v for k, v in sorted(histogram.items())},
        "categories": {cat: summarize([row]) for cat, row in per_cat.items() if row["prompts"]},
        "warmup_tokens": warmup_tokens,
        "order": "autoregressive first on the 1st, 3rd, ... prompt, speculative first on the 2nd, 4th, ...",
        "interrupted": interrupted,
    }


def engine_draft_name(engine: Engine) -> str:
    return type(engine.draft).__name__ if engine.draft is not None else "none"


def bench_header(record: dict) -> str:
    """What ran, in one line: model, draft and its S/K/N/P, dtype, device, new tokens a prompt, prompts."""
    c = record["config"]
    if record["draft"] == "none":
        draft = f"draft none (autoregressive on both sides), P{c['P']}"
    else:
        draft = f"draft {record['draft']} S{c['S']} K{c['K']} N{c['N']} P{c['P']}"
    return (
        f"model {record.get('model_file', record['model'])}, {draft}, {c['dtype']}, {record['device']}, "
        f"{record['max_new_tokens']} new tokens a prompt, {record['prompt_count']} prompts"
    )


def format_table(summary: dict) -> str:
    """The rows per category and ``all``; ``tau`` is ``-`` where no verify ran (``--draft none``)."""
    lines = [
        f"{'category':<16}{'prompts':>8}{'AR tok/s':>10}{'spec tok/s':>12}{'speedup':>9}{'tau':>7}{'identical':>11}"
    ]
    rows = list(summary["categories"].items()) + [("all", summary)]
    for name, r in rows:
        speedup = f"{r['speedup']:.2f}" if r["speedup"] is not None else "-"
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        lines.append(
            f"{name:<16}{r['prompts']:>8}{r['ar_tokens_per_s']:>10.1f}{r['spec_tokens_per_s']:>12.1f}"
            f"{speedup:>9}{tau:>7}{r['identical_to_ar']:>6}/{r['prompts']:<4}"
        )
    return "\n".join(lines)


def format_report(record: dict) -> str:
    """The whole printout: what ran, the whole-run headline, the table, the legend."""
    lines = [bench_header(record)]
    if record.get("interrupted"):
        lines.append(f"interrupted: {record['prompts']} of {record['prompt_count']} prompts finished")
    if record["prompts"]:
        speedup = f"{record['speedup']:.2f}x" if record["speedup"] is not None else "-"
        lines += [
            f"autoregressive {record['ar_tokens_per_s']:.1f} tok/s, speculative {record['spec_tokens_per_s']:.1f} "
            f"tok/s: {speedup} (whole run: {record['ar_new_tokens']} / {record['new_tokens']} new tokens in "
            f"{record['ar_seconds']:.2f} / {record['spec_seconds']:.2f} s)",
            format_table(record),
            LEGEND,
        ]
    return "\n".join(lines)


def git_commit() -> str:
    """The measured commit: ``$SPECCYCLE_COMMIT`` where set (a copy of the tree whose git snapshot is stale),
    else the checkout's (``+dirty`` with local changes), or ``unknown`` outside a git checkout."""
    import os
    import subprocess

    if os.environ.get("SPECCYCLE_COMMIT"):
        return os.environ["SPECCYCLE_COMMIT"]

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
