"""Evaluate EAGLE heads with the engine: tau per Spec-Bench category and acceptance per draft position.

Every configuration runs all prompts as one ragged batch (greedy). Per request the accept lengths
of its verifies are recorded (`accept_lengths`), so tau is reported per category; the acceptance
rate at draft position ``d`` is ``P(accept_len >= d + 1 | accept_len >= d)`` over all verifies (the
share of verifies that got past depth ``d - 1`` and also accepted a depth-``d`` token).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..core import Accepted, Admitted, Compacted, Ports, Request, SamplingParams, SpecConfig
from ..statemachine import step

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CHAINS = (3, 4, 5, 6)
TREES = ((4, 2, 8), (5, 4, 16), (6, 4, 32), (6, 8, 64))  # (S, K, N)


def eval_configs(chains: Sequence[int] = CHAINS, trees: Sequence[tuple[int, int, int]] = TREES) -> list[SpecConfig]:
    """Chains ``S`` (``K = 1``) and trees ``(S, K, N)``; page size 16."""
    configs = [SpecConfig(num_steps=s, topk=1, page_size=16) for s in chains]
    return configs + [SpecConfig(num_steps=s, topk=k, num_draft_tokens=n, page_size=16) for s, k, n in trees]


def accept_lengths(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> tuple[list, list[list[int]]]:
    """Speculative greedy decoding of the batch; the outputs and each request's accept lengths.

    Like `Engine.generate`, but a verify is counted once, at the compact that follows it (a retire
    re-emits the same `Compacted` record without the finished requests).
    """
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=engine.stop_token_ids)
    ids = [next(engine._ids) for _ in prompts]
    index = {rid: i for i, rid in enumerate(ids)}
    record = Admitted(
        config=engine.spec, requests=tuple(Request(rid, tuple(p), params) for rid, p in zip(ids, prompts))
    )
    ports = Ports(target=engine.target, draft=engine.draft, kv_pool=engine.pool)
    lengths: list[list[int]] = [[] for _ in prompts]
    done: dict[int, Request] = {}
    try:
        while True:
            previous, record = record, step(record, ports, engine.backend)
            if not isinstance(record, Compacted):
                continue
            if isinstance(previous, Accepted):
                for request, n in zip(record.requests, record.accept_len.tolist()):
                    lengths[index[request.request_id]].append(n)
            done.update({r.request_id: r for r in record.retired})
            if not record.requests and len(done) == len(ids):
                break
    finally:
        for rid in ids:
            if rid not in done and engine.pool.pages_held(rid):
                engine.pool.free(rid)
    return [list(done[rid].output) for rid in ids], lengths


def summarize(categories: Sequence[str], lengths: Sequence[Sequence[int]], num_steps: int) -> dict:
    """tau per category (and over MT-bench's eight, and all), acceptance rate per draft position."""
    by_cat: dict[str, list[int]] = defaultdict(list)
    for cat, lens in zip(categories, lengths):
        by_cat[cat] += lens
    mt = [n for cat in MT_BENCH for n in by_cat.get(cat, [])]
    every = [n for lens in lengths for n in lens]

    def tau(lens: list[int]) -> float | None:
        return round(sum(lens) / len(lens), 3) if lens else None

    histogram = Counter(every)
    at_least = [sum(v for k, v in histogram.items() if k >= d) for d in range(1, num_steps + 2)]
    rates = [round(at_least[d] / at_least[d - 1], 4) if at_least[d - 1] else None for d in range(1, num_steps + 1)]
    return {
        "tau": tau(every),
        "tau_mt_bench": tau(mt),
        "tau_by_category": {cat: tau(lens) for cat, lens in sorted(by_cat.items())},
        "accept_rate_by_position": rates,  # [S]: P(depth d accepted | depth d - 1 accepted)
        "accept_len_histogram": {str(k): v for k, v in sorted(histogram.items())},
        "verifies": len(every),
    }


def evaluate_heads(
    heads: dict[str, Path],
    prompts: Sequence[dict],
    model_path: str | None,
    device: str,
    dtype: torch.dtype,
    max_new_tokens: int,
    configs: Sequence[SpecConfig],
    log: Callable[[str], None] = print,
    check_lossless: bool = True,
) -> dict:
    """Every head x every config over ``prompts`` (`bench.load_prompts` items). Returns the result dict."""
    from ..engine.drafters.eagle import EagleDraft, EagleHead
    from ..engine.engine import Engine, load_model
    from ..engine.memory.kv_pool import PagedKVPool
    from ..engine.models.llama import LlamaModel
    from ..engine.tokenizers.tokenizer import Tokenizer
    from ..engine.weights.weights_gguf import default_model_path

    config, weights, path = load_model(model_path, torch.float32)
    tokenizer_path = path if path.suffix == ".gguf" else default_model_path()
    tokenizer = Tokenizer.from_gguf(tokenizer_path)
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}]) for p in prompts]
    categories = [p["category"] for p in prompts]
    widest = max(c.reserve_len("shifted") for c in configs)
    kv_tokens = sum(len(p) for p in ids) + len(ids) * (max_new_tokens + 2 * widest + 2 * 16)
    result: dict = {
        "prompts": len(prompts),
        "new_tokens": max_new_tokens,
        "dtype": str(dtype).replace("torch.", ""),
        "heads": {},
    }
    reference = None
    models: dict = {}
    for name, head_path in heads.items():
        head = EagleHead.load(head_path, dtype, device)
        features = head.config.feature_layers if head.config.version == 3 else None
        if features not in models:
            models.clear()  # one target copy on the device at a time
            models[features] = LlamaModel(config, weights, dtype=dtype, device=device, feature_layers=features)
        model = models[features]
        if check_lossless and reference is None:
            pool = PagedKVPool(num_pages=-(-kv_tokens // 16), page_size=16, device=device)
            engine = Engine(model, pool, None, SpecConfig(page_size=16), tokenizer)
            start = time.perf_counter()
            reference = engine.generate_autoregressive(ids, max_new_tokens)
            result["autoregressive_s"] = round(time.perf_counter() - start, 2)
            del engine, pool
        size = head_path.stat().st_size
        entry = {
            "head": str(head_path),
            "version": head.config.version,
            "lm_head": "target" if head.config.target_lm_head else "own",
            "file_mb": round(size / 2**20, 2),
        }
        entry["configs"] = []
        for spec in configs:
            pool = PagedKVPool(num_pages=-(-kv_tokens // spec.page_size), page_size=spec.page_size, device=device)
            engine = Engine(model, pool, lambda e, head=head: EagleDraft(head, e.model, e.pool), spec, tokenizer)
            start = time.perf_counter()
            outputs, lengths = accept_lengths(engine, ids, max_new_tokens)
            seconds = time.perf_counter() - start
            row = {"S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens, "seconds": round(seconds, 2)}
            row.update(summarize(categories, lengths, spec.num_steps))
            if reference is not None:
                row["identical_to_ar"] = sum(list(o) == list(r) for o, r in zip(outputs, reference))
            entry["configs"].append(row)
            log(
                f"[eval] {name} S={spec.num_steps} K={spec.topk} N={spec.num_draft_tokens}: tau {row['tau']} "
                f"(MT-bench {row['tau_mt_bench']}), accept by position {row['accept_rate_by_position']}, "
                f"{seconds:.1f}s" + (f", identical {row['identical_to_ar']}/{len(ids)}" if reference else "")
            )
            del engine, pool
        entry["score"] = round(sum(c["tau"] or 0 for c in entry["configs"]) / len(entry["configs"]), 3)
        result["heads"][name] = entry
    if result["heads"]:
        result["best"] = max(result["heads"], key=lambda n: result["heads"][n]["score"])
    return result


def plot(result: dict, path: Path) -> Path | None:
    """Two panels: tau per category (a table of head x config rows), acceptance rate per draft position."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [
        (f"{name} S{c['S']} K{c['K']} N{c['N']}", c)
        for name, entry in result["heads"].items()
        for c in entry["configs"]
    ]
    if not runs:
        return None
    cats = sorted({cat for _, c in runs for cat in c["tau_by_category"]})
    columns = [*cats, "MT-bench", "all"]
    table = [[c["tau_by_category"].get(cat) for cat in cats] + [c["tau_mt_bench"], c["tau"]] for _, c in runs]
    height = max(4.5, 0.42 * len(runs) + 2)
    fig, (grid, lines) = plt.subplots(1, 2, figsize=(20, height), gridspec_kw={"width_ratios": [2.3, 1]})
    values = [[float("nan") if v is None else v for v in row] for row in table]
    image = grid.imshow(values, cmap="viridis", aspect="auto")
    for i, row in enumerate(table):
        for j, v in enumerate(row):
            if v is not None:
                grid.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white")
    grid.set_xticks(range(len(columns)), columns, rotation=40, ha="right")
    grid.set_yticks(range(len(runs)), [label for label, _ in runs], fontsize=8)
    grid.set_title(f"tau per Spec-Bench category ({result['prompts']} prompts, {result['new_tokens']} new tokens)")
    fig.colorbar(image, ax=grid, fraction=0.03, label="tau (tokens per verify)")
    for label, c in runs:
        rates = c["accept_rate_by_position"]
        lines.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    lines.set_xlabel("draft position d")
    lines.set_ylabel("P(depth d accepted | depth d-1 accepted)")
    lines.set_title("acceptance rate per draft position")
    lines.set_ylim(0, 1)
    lines.xaxis.get_major_locator().set_params(integer=True)
    lines.grid(alpha=0.3)
    lines.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
