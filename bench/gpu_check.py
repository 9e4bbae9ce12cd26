"""GPU smoke test of the fast path (engine/fast/path.py): run on the CUDA machine before trusting its numbers.

Checks, each printed as it finishes and written to one JSON (``--out`` directory):

1. kernels at real shapes: the Triton paged attention against the reference (plan + SDPA) and its
   torch twin, SmolLM2 (9/3 heads, D 64) and Llama-3-8B (32/8, D 128) shapes, decode / extend /
   tree rows, P 1 and 16, float32 and bfloat16; a verify row and a decode row of the same position
   bitwise equal; the fused ops against their torch references (bfloat16 roundings exact);
2. graphs: a replay leaves its inputs (the batch and the static buffers) as it found them and gives
   the same bits twice; graphs on == graphs off (same kernels, eager);
3. fast == reference: float32 SmolLM2 autoregressive tokens of the fast path equal the reference
   engine's; speculative == autoregressive on the fast path for ngram, layerskip and EAGLE (chain and
   tree) in float32 and bfloat16 (bfloat16 works because decode and verify share GEMM shapes and the
   attention's key order);
4. rebuild: fast layer-skip engines built, run (capturing target, draft-loop and decode graphs, batch 1
   and 4), dropped and collected, then built again in the same process, float32 and bfloat16: every
   rebuilt engine captures again (a retired graph pool reused through a process-wide handle made the
   allocator assert ``use_count > 0``) and gives the same tokens; the dropped engine's pool is freed.

    python -m bench.gpu_check --out $OUT [--prompts spec_bench_dev.jsonl] [--skip-kernels] [--only rebuild]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from .common import write_result

RESULTS: dict = {}


def log(section: str, row: dict) -> None:
    RESULTS.setdefault(section, []).append(row)
    print(f"[{section}] {row}", flush=True)


# ---- 1. kernels ------------------------------------------------------------------------------------
def _paged_case(gen, page_size, heads, kv_heads, dim, dtype, device):
    """Three requests: one decode row, a causal extend of 4 rows, a tree of 8 rows; scattered pages."""
    from speccycle.core.ports import ForwardBatch

    lens = [300, 57, 129]
    extra_room = 16
    width = max(math.ceil((n + extra_room) / page_size) for n in lens)
    num_pages = 3 * width + 5
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.stack([perm[i * width : (i + 1) * width] for i in range(3)])

    def slot(b, p):
        return int(table[b, p // page_size]) * page_size + p % page_size

    rows = {k: [] for k in ("row_request", "positions", "prefix_lens", "out_slots", "extra")}

    def add(b, pos, prefix, out, extra):
        rows["row_request"].append(b)
        rows["positions"].append(pos)
        rows["prefix_lens"].append(prefix)
        rows["out_slots"].append(out)
        rows["extra"].append(extra)

    add(0, lens[0], lens[0] + 1, slot(0, lens[0]), [])  # decode
    for i in range(4):  # extend
        add(1, lens[1] + i, lens[1] + i + 1, slot(1, lens[1] + i), [])
    parents = [-1, 0, 0, 1, 1, 2, 3, 6]
    for i in range(len(parents)):  # tree verify at L = lens[2]
        path, node = [], i
        while node >= 0:
            path.append(node)
            node = parents[node]
        mask = [slot(2, lens[2] + j) if j in path else -1 for j in range(len(parents))]
        add(2, lens[2] + len(path) - 1, lens[2], slot(2, lens[2] + i), mask)
    m = max(len(e) for e in rows["extra"])
    extra = torch.tensor([e + [-1] * (m - len(e)) for e in rows["extra"]], dtype=torch.long)
    t = len(rows["positions"])
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.long, device=device),
        positions=torch.tensor(rows["positions"], device=device),
        row_request=torch.tensor(rows["row_request"], device=device),
        out_slots=torch.tensor(rows["out_slots"], device=device),
        prefix_lens=torch.tensor(rows["prefix_lens"], device=device),
        extra_slots=extra.to(device),
        page_table=table.to(device),
        page_size=page_size,
        request_ids=(0, 1, 2),
    )
    slots = num_pages * page_size
    q = torch.randn(t, heads, dim, generator=gen).to(device, dtype)
    k = torch.randn(slots, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(slots, kv_heads, dim, generator=gen).to(device, dtype)
    return batch, q, k, v


def check_kernels(device: str) -> None:
    from speccycle.engine.kernels.attention import paged_attention, plan_attention
    from speccycle.engine.kernels.attention_triton import paged_attention_rows_torch, paged_attention_rows_triton

    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim in ((9, 3, 64), (32, 8, 128)):
        for page_size in (1, 16):
            for dtype in (torch.float32, torch.bfloat16):
                batch, q, k, v = _paged_case(gen, page_size, heads, kv_heads, dim, dtype, device)
                args = (batch.row_request, batch.prefix_lens, batch.extra_slots, batch.page_table, page_size)
                reference = paged_attention(plan_attention(batch), q, k, v).float()
                fast = paged_attention_rows_triton(q, k, v, *args).float()
                twin = paged_attention_rows_torch(q, k, v, *args, kv_bound=512).float()
                err, twin_err = (fast - reference).abs().max().item(), (twin - reference).abs().max().item()
                bound = 2e-5 if dtype == torch.float32 else 2e-2
                log("kernels", {"op": "attention", "heads": f"{heads}/{kv_heads}x{dim}", "P": page_size,
                                "dtype": str(dtype), "max_err_vs_sdpa": err, "twin_err": twin_err,
                                "ok": err < bound and twin_err < bound})  # fmt: skip
    # verify row == decode row, bitwise, bfloat16 and float32
    import pytest

    code = pytest.main(["-q", "-x", "tests/kernels/test_attention_kernel.py", "tests/kernels/test_fused_ops.py",
                        "tests/kernels/test_attention_prefill.py"])  # fmt: skip
    log("kernels", {"op": "pytest tests/kernels (attention, prefill attention, fused ops; bfloat16 roundings exact "
                          "on GPU)",
                    "ok": int(code) == 0})  # fmt: skip


# ---- 2. graphs ---------------------------------------------------------------------------------------
def check_graphs(device: str, prompts: list[str]) -> None:
    from speccycle.core import SpecConfig
    from speccycle.engine.engine import Engine
    from speccycle.engine.fast.graphs import bucket
    from speccycle.engine.greedy import extend_batch

    engine = Engine.load(draft="layerskip", spec=SpecConfig(num_steps=4, topk=1, page_size=16), device=device,
                         dtype=torch.bfloat16, layerskip_layers=8, fast=True, kv_tokens=8192)  # fmt: skip
    ids = engine.chat_prompt(prompts[0])
    engine.generate([ids], 24)
    target, pool = engine.target, engine.pool
    pool.allocate(999, len(ids) + 8)
    pool.allocate(998, 40)
    target.forward(extend_batch(pool, [999], [ids], [0]))
    batch = extend_batch(pool, [999, 998], [[5, 6, 7], [8]], [len(ids), 0], last_logits_only=False)
    before = {name: getattr(batch, name).clone() for name in ("input_ids", "positions", "out_slots", "prefix_lens")}
    first = target.forward(batch)  # captures the graph of this bucket, then replays it
    g = target.graphs
    rows = bucket(max(batch.num_rows, g.min_rows))
    g._load(batch, rows, 0, None)
    loaded, table = g.packed.clone(), g.table.clone()
    g._graphs[(rows, 0, 0, False, None, False)][0].replay()  # a bare replay: what it leaves in the buffers
    torch.cuda.synchronize()
    untouched = torch.equal(loaded, g.packed) and torch.equal(table, g.table)
    second = target.forward(batch)
    same_inputs = all(torch.equal(v, getattr(batch, k)) for k, v in before.items())
    log("graphs", {"check": "replay leaves the batch and the static buffers unchanged, same output twice",
                   "graphs_captured": g.num_graphs, "replays": g.replays,
                   "ok": same_inputs and untouched and torch.equal(first.logits, second.logits)})  # fmt: skip
    # graphs off: the same kernels, eagerly, over the same buffers -> the same bits
    g.use_graphs = False
    eager = target.forward(batch)
    g.use_graphs = True
    log("graphs", {"check": "graphs on == graphs off (bitwise logits)", "ok": torch.equal(eager.logits, first.logits),
                   "max_diff": (eager.logits - first.logits).abs().max().item()})  # fmt: skip
    pool.free(999)
    pool.free(998)
    # a first speed reading (bfloat16, batch 1): autoregressive and layer-skip speculative
    runs = {
        "autoregressive": lambda: engine.generate_autoregressive([ids], 128)[0],
        "speculative layerskip S4": lambda: list(engine.generate([ids], 128)[0][0].output),
    }
    for label, run in runs.items():
        run()
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = run()
        torch.cuda.synchronize()
        log(
            "graphs",
            {
                "speed": label,
                "tokens": len(tokens),
                "tokens_per_s": round(len(tokens) / (time.perf_counter() - start), 1),
            },
        )
    # the decode graphs: a replay leaves its input parity untouched
    loop = engine.fast_decoder.loop
    engine.generate_autoregressive([ids], 8)
    rows = next(iter(loop._graphs))[0]
    snap = [loop.ids[0].clone(), loop.positions[0].clone(), loop.step[0].clone()]
    loop._graphs[(rows, 0)].replay()
    torch.cuda.synchronize()
    after = [loop.ids[0], loop.positions[0], loop.step[0]]
    log("graphs", {"check": "decode step graph leaves (ids, positions, step) of its input parity unchanged",
                   "ok": all(torch.equal(a, b) for a, b in zip(snap, after))})  # fmt: skip


# ---- 3. fast == reference, speculative == autoregressive -----------------------------------------------
def check_tokens(device: str, prompts: list[str], new_tokens: int) -> None:
    from speccycle.core import SpecConfig
    from speccycle.engine.engine import Engine, eagle_head_for
    from speccycle.engine.weights.weights_gguf import default_model_path, load_gguf_config

    config = load_gguf_config(default_model_path())
    reference = Engine.load(draft="none", device=device, dtype=torch.float32, kv_tokens=8192)
    fast = Engine.load(draft="none", device=device, dtype=torch.float32, kv_tokens=8192, fast=True)
    ids = [reference.chat_prompt(p) for p in prompts]
    ref_out = [reference.generate_autoregressive([x], new_tokens)[0] for x in ids]
    fast_out = [fast.generate_autoregressive([x], new_tokens)[0] for x in ids]
    log("tokens", {"check": "float32 autoregressive: fast == reference", "prompts": len(ids),
                   "identical": sum(a == b for a, b in zip(ref_out, fast_out)), "ok": ref_out == fast_out})  # fmt: skip
    del reference, fast
    cases = [
        ("ngram", SpecConfig(num_steps=5, topk=1, page_size=16)),
        ("ngram", SpecConfig(num_steps=4, topk=4, num_draft_tokens=16, page_size=1)),
        ("layerskip", SpecConfig(num_steps=4, topk=1, page_size=16)),
        ("layerskip", SpecConfig(num_steps=3, topk=4, num_draft_tokens=12, page_size=16)),
        ("eagle", SpecConfig(num_steps=4, topk=1, page_size=16)),
        ("eagle", SpecConfig(num_steps=4, topk=4, num_draft_tokens=16, page_size=1)),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        head = eagle_head_for(config, version=1, seed=1).to(device, dtype)
        head.dtype = dtype
        for draft, spec in cases:
            start = time.time()
            engine = Engine.load(draft=draft, spec=spec, device=device, dtype=dtype, layerskip_layers=8,
                                 eagle_head=head if draft == "eagle" else None, fast=True, kv_tokens=8192)  # fmt: skip
            ids = [engine.chat_prompt(p) for p in prompts]
            ar = [engine.generate_autoregressive([x], new_tokens)[0] for x in ids]
            spec_out, taus = [], []
            for x in ids:
                results, stats = engine.generate([x], new_tokens)
                spec_out.append(list(results[0].output))
                taus.append(stats.tau)
            same = sum(a == b for a, b in zip(ar, spec_out))
            log("tokens", {"check": f"{str(dtype)[6:]} speculative == autoregressive (fast path)", "draft": draft,
                           "S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens, "P": spec.page_size,
                           "identical": same, "prompts": len(ids), "tau": round(sum(taus) / len(taus), 3),
                           "seconds": round(time.time() - start, 1), "ok": same == len(ids)})  # fmt: skip
            del engine
            torch.cuda.empty_cache()


# ---- 4. drop an engine, build another, capture again --------------------------------------------------
def check_rebuild(device: str, prompts: list[str], new_tokens: int = 24) -> None:
    import gc
    import weakref

    from speccycle.core import SpecConfig
    from speccycle.engine.engine import Engine

    spec = SpecConfig(num_steps=4, topk=1, page_size=16)
    for dtype in (torch.float32, torch.bfloat16):
        first = None
        # round 1: the reference; round 2: after the first engine was collected without empty_cache (its pool
        # retired but still known to the allocator: the case that asserted); round 3: after empty_cache.
        for round_ in (1, 2, 3):
            engine = Engine.load(draft="layerskip", spec=spec, device=device, dtype=dtype, layerskip_layers=8,
                                 fast=True, kv_tokens=4096)  # fmt: skip
            ids = [engine.chat_prompt(p) for p in prompts[:4]]
            ids = [ids[i % len(ids)] for i in range(4)]
            out, error = None, None
            try:
                out = {
                    "ar_1": engine.generate_autoregressive(ids[:1], new_tokens),
                    "ar_4": engine.generate_autoregressive(ids, new_tokens),
                    "spec_1": [list(r.output) for r in engine.generate(ids[:1], new_tokens)[0]],
                    "spec_4": [list(r.output) for r in engine.generate(ids, new_tokens)[0]],
                }
            except RuntimeError as err:
                error = f"{type(err).__name__}: {err}"
            first = out if first is None else first
            graphs = engine.fast_options.graph_pool.num_graphs
            pool = weakref.ref(engine.fast_options.graph_pool)
            del engine
            gc.collect()
            if round_ == 2:
                torch.cuda.empty_cache()
            # batch 1: speculative == autoregressive is the fast path's claim; batch 4 runs verify and decode at
            # different GEMM shapes, so there it is only reported
            row = {"check": f"{str(dtype)[6:]} engine #{round_} of one process: captures, same tokens as #1, "
                            "its graph pool freed when dropped", "graphs": graphs, "error": error,
                   "same_tokens_as_first": out is not None and out == first, "pool_freed": pool() is None,
                   "spec_equals_ar_batch_1": out is not None and out["spec_1"] == out["ar_1"],
                   "spec_equals_ar_batch_4": out is not None and out["spec_4"] == out["ar_4"]}  # fmt: skip
            row["ok"] = (
                row["same_tokens_as_first"] and graphs > 0 and row["pool_freed"] and row["spec_equals_ar_batch_1"]
            )
            log("rebuild", row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the JSON result")
    parser.add_argument("--prompts", default=None, help="Spec-Bench JSONL (default: the shipped sample)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-tokens", action="store_true")
    parser.add_argument("--only", default=None, help="comma list of checks: kernels,graphs,tokens,rebuild")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_check needs a CUDA device")
    from speccycle.engine.bench import load_prompts

    items = load_prompts(args.prompts)
    by_category: dict[str, dict] = {}
    for item in items:
        by_category.setdefault(item["category"], item)
    picked = list(by_category.values())[: args.num_prompts]
    prompts = [p["text"] for p in picked]
    device = "cuda"
    start = time.time()
    for name, fn in (
        ("kernels", None if args.skip_kernels else lambda: check_kernels(device)),
        ("graphs", lambda: check_graphs(device, prompts)),
        ("tokens", None if args.skip_tokens else lambda: check_tokens(device, prompts, args.new_tokens)),
        ("rebuild", lambda: check_rebuild(device, prompts)),
    ):
        if fn is None or (args.only and name not in args.only.split(",")):
            continue
        try:
            fn()
        except Exception as err:  # report and go on: the other checks still say something
            import traceback

            traceback.print_exc()
            log(name, {"check": "raised", "error": f"{type(err).__name__}: {err}", "ok": False})
    failed = [row for rows in RESULTS.values() for row in rows if not row.get("ok", True)]
    RESULTS["summary"] = {"failed": len(failed), "seconds": round(time.time() - start, 1)}
    path = write_result("gpu_check", RESULTS, device, directory=args.out)
    print(f"{len(failed)} failed; wrote {path}", flush=True)


if __name__ == "__main__":
    main()
