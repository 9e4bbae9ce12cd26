"""The paged row attention on a GPU: the single-pass kernel against the split (flash-decoding) kernel.

`engine.kernels.attention_triton` cuts each row's keys into chunks of ``CHUNK`` keys (``block_n`` per block,
at most ``max_chunks`` chunks: longer rows get longer chunks), runs programs per (row, KV head) that
each take every ``P``-th chunk (``programs_per_row``, default `default_programs_per_row`), and merges
a row's chunks in the last of its programs to finish (or, ``fused_combine=False``, in a second
kernel); ``max_chunks=1`` is the single pass (one program per (row, KV head) walks all the row's keys,
one kernel). Variants (``--variants``): ``single``, ``split`` (the defaults), ``split-2k`` (the merge
in a second kernel), ``split-pmax`` / ``split-p4`` (one program per chunk of the static bound / 4
programs), and other ``b{block_n}-c{chunk}-m{max_chunks}`` constants (``-2k``: with the second
kernel; ``b64-c128-m32-2k`` is the first design's). ``P`` and the merge's place change no bit of a
row against another row of the same setting; the constants change bits (all rows of an engine must
share them).

* ``time``: SmolLM2-135M (9 / 3 heads of 64) and Llama-3-8B (32 / 8 of 128) in bfloat16, page size 16,
  decode rows (each its own request with ``ctx`` keys) at 1, 1 + 7 and 1 + 15 padding rows (an
  engine's decode buckets at batch 1), 6 and 32 rows, and a 16-row verify of one request (a chain: row
  ``i`` has ``i + 1`` extra slots); contexts 128 / 512 / 2048 / 8192; page tables ``tight`` (the
  context's pages) or ``wide`` (8192 + 16 keys for every request, as an engine's static table, whose
  bound on the chunks sets the launch). µs per call: 20 calls captured in one CUDA graph, replayed
  (median of rounds; the KV cache warm in L2 where it fits). Every output is checked against the
  float32 torch twin.
* ``bitwise``: a verify row at ``L + d`` equals a decode row at ``L + d`` (chain rows, and a tree path
  with holes in a 64-column extra buffer), a row alone equals the row among 16 rows and padding rows,
  1 program per row equals the default launch, eager equals graph replay; bfloat16 and float32, at
  lengths that split into one, several and grown chunks.

    python -m bench.attention_bench --out $OUT                  # both parts, a few minutes
    python -m bench.attention_bench --out $OUT --parts time --variants single,split --models smollm2

Writes ``attention_bench-<date>.json`` into ``--out`` (default bench/results); exits 1 if a bitwise
check fails or an output differs from the twin beyond tolerance.
"""

from __future__ import annotations

import argparse

import torch

from .common import write_result
from .row_linear_bench import graph_us

MODELS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # (heads, KV heads, head dim)
PAGE = 16
WIDE_KEYS = 8192 + 16
ROWS = {
    "1": (1, 0),
    "1+7pad": (1, 7),
    "1+15pad": (1, 15),
    "6": (6, 0),
    "32": (32, 0),
    "verify16": (16, 0),
    "verify24": (24, 0),
    "verify32": (32, 0),
    "tree32": (32, 0),  # a 32-node tree verify: row i's extra slots are its ancestors in a binary heap, and itself
}
CONTEXTS = (128, 512, 2048, 8192)
# name -> keyword options of paged_attention_rows_triton ({} = the defaults; since fe47623 the default launch takes
# one pipelining stage for a call of more rows than page-table rows, so `split`'s verify and padded-decode cases run
# at one stage and `split-s3` is the earlier default's launch)
VARIANTS = {
    "single": dict(max_chunks=1),
    "split": {},
    "split-s3": dict(num_stages=3),  # Triton's default stages for every call
    "split-2k": dict(fused_combine=False),  # the merge in a second kernel
    "split-pmax": dict(programs_per_row=1 << 20),  # one program per chunk of the static bound
    "split-p4": dict(programs_per_row=4),
    "b64-c128-m32": dict(block_n=64, chunk=128, max_chunks=32),  # the first constants
    "b64-c128-m32-2k": dict(block_n=64, chunk=128, max_chunks=32, fused_combine=False),  # and the second kernel
    "b64-c64-m32": dict(block_n=64, chunk=64, max_chunks=32),
    "b64-c64-m64": dict(block_n=64, chunk=64, max_chunks=64),
    "b32-c128-m32": dict(block_n=32, chunk=128, max_chunks=32),
    "split-w1": dict(num_warps=1),  # warps per program (default: 1 at head dim 64, 4 at 128)
    "split-w2": dict(num_warps=2),
    "split-w4": dict(num_warps=4),
    "split-w8": dict(num_warps=8),
    "b64-c64-m32-w2": dict(block_n=64, chunk=64, max_chunks=32, num_warps=2),
    # launch choices of the rows kernel (no bit changes): pipelining stages, a register cap
    "split-s1": dict(num_stages=1),
    "split-s2": dict(num_stages=2),
    "split-s4": dict(num_stages=4),
    "split-r96": dict(maxnreg=96),
    "split-s1-r96": dict(num_stages=1, maxnreg=96),
    # the tile kernel (engine/kernels/attention_tiles.py): a verify's rows share their request's prefix blocks
    "tiles": dict(kernel="tiles"),
    "tiles-r2": dict(kernel="tiles", rows_per_tile=2),
    "tiles-p64": dict(kernel="tiles", programs=64),
    # launch choices of the tile kernel (no bit changes): programs per (tile, KV head), pipelining stages, rows
    "tiles-r1": dict(kernel="tiles", rows_per_tile=1),
    "tiles-p2": dict(kernel="tiles", programs=2),
    "tiles-p4": dict(kernel="tiles", programs=4),
    "tiles-p8": dict(kernel="tiles", programs=8),
    "tiles-s1": dict(kernel="tiles", num_stages=1),
    "tiles-s2": dict(kernel="tiles", num_stages=2),
    "tiles-s4": dict(kernel="tiles", num_stages=4),
    "tiles-p4-s1": dict(kernel="tiles", programs=4, num_stages=1),
    "tiles-s3": dict(kernel="tiles", num_stages=3),  # Triton's default stages (the tile kernel's before c6a5d39)
    "tiles-s3-p17": dict(kernel="tiles", num_stages=3, programs=17),  # the launch before c6a5d39 at 32 rows
    "tiles-p5": dict(kernel="tiles", programs=5),
    "tiles-p17": dict(kernel="tiles", programs=17),
    "tiles-r168": dict(kernel="tiles", maxnreg=168),  # 3 programs a multiprocessor
    "tiles-r128": dict(kernel="tiles", maxnreg=128),  # 4
    "tiles-p8-r168": dict(kernel="tiles", programs=8, maxnreg=168),
    "tiles-p6-r168": dict(kernel="tiles", programs=6, maxnreg=168),
    "tiles-p8-r128": dict(kernel="tiles", programs=8, maxnreg=128),
    "tiles-p12-r128": dict(kernel="tiles", programs=12, maxnreg=128),
    "tiles-r96": dict(kernel="tiles", maxnreg=96),  # 5
    "tiles-r0": dict(kernel="tiles", maxnreg=0),  # uncapped
    "tiles-cw4": dict(kernel="tiles", combine_warps=4),  # the merge kernel's warps before e6b79a9 (bits change)
    "tiles-cw2": dict(kernel="tiles", combine_warps=2),
    # wider tiles (bits change: decode and verify must share them)
    "tiles-l32": dict(kernel="tiles", tile_lines=32),
    "tiles-l32-r0": dict(kernel="tiles", tile_lines=32, maxnreg=0),
    "tiles-l32-r168": dict(kernel="tiles", tile_lines=32, maxnreg=168),
    "tiles-l32-p4": dict(kernel="tiles", tile_lines=32, programs=4),
    "tiles-l64": dict(kernel="tiles", tile_lines=64),
    "tiles-l64-r0": dict(kernel="tiles", tile_lines=64, maxnreg=0),
    "tiles-r0-s3": dict(kernel="tiles", maxnreg=0, num_stages=3),
    "tiles-p10-r96": dict(kernel="tiles", programs=10, maxnreg=96),
    # after the int32 preamble (165 registers uncapped, fff0a2d): uncapped at 3 resident, 5 at 96
    "tiles-p6-r0": dict(kernel="tiles", programs=6, maxnreg=0),
    "tiles-p20-r96": dict(kernel="tiles", programs=20, maxnreg=96),
    "tiles-p16-r128": dict(kernel="tiles", programs=16, maxnreg=128),
    # constants of the tile kernel (bits change: decode and verify must share them)
    "tiles-b64": dict(kernel="tiles", block_n=64, chunk=64),
    "tiles-c128": dict(kernel="tiles", chunk=128),
    "tiles-b64-c128": dict(kernel="tiles", block_n=64, chunk=128),
    "tiles-w2": dict(kernel="tiles", num_warps=2),
    "tiles-w8": dict(kernel="tiles", num_warps=8),
}
FAILURES: list[str] = []
DEVICE = "cuda"  # a CPU smoke run (TRITON_INTERPRET=1, tiny contexts) sets "cpu" and skips the timing graphs


def say(*parts) -> None:
    print(*parts, flush=True)


def rows_case(model: str, rows: str, ctx: int, table: str, dtype, gen) -> dict:
    """Tensors of one call: decode rows (one request each) or a chain verify of one request (16 or 32 rows)."""
    heads, kv_heads, dim = MODELS[model]
    live, pad = ROWS[rows]
    verify = rows.startswith(("verify", "tree"))
    requests = 1 if verify else live
    keys = ctx + (live if verify else 0)  # positions a request holds (a verify's rows write theirs after ctx)
    pages = -(-keys // PAGE)
    width = pages if table == "tight" else -(-WIDE_KEYS // PAGE)
    perm = torch.randperm(requests * pages, generator=gen)
    page_table = torch.full((requests, width), -1, dtype=torch.long)
    page_table[:, :pages] = perm.view(requests, pages)
    slots = requests * pages * PAGE
    k_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    total = live + pad
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    row_request = torch.zeros(total, dtype=torch.long)
    prefix = torch.zeros(total, dtype=torch.long)
    if verify:
        prefix[:live] = ctx
        extra = torch.full((total, live), -1, dtype=torch.long)
        own = [int(page_table[0, p // PAGE]) * PAGE + p % PAGE for p in range(ctx, ctx + live)]
        for i in range(live):
            if rows.startswith("tree"):
                path, node = [], i
                while node > 0:
                    path.append(node)
                    node = (node - 1) // 2
                path = sorted([0, *path])
                extra[i, path] = torch.tensor([own[n] for n in path])
            else:
                extra[i, : i + 1] = torch.tensor(own[: i + 1])
    else:
        row_request[:live] = torch.arange(live)
        prefix[:live] = ctx
        extra = torch.empty((total, 0), dtype=torch.long)
    args = (q, k_cache, v_cache, row_request, prefix, extra, page_table)
    return dict(args=tuple(t.to(DEVICE) for t in args), keys=keys)


def attend(args, options=None, **kwargs):
    """One call of the variant: ``kernel="tiles"`` the tile kernel (`engine.kernels.attention_tiles`), else the rows
    kernel."""
    from speccycle.engine.kernels.attention_tiles import paged_attention_tiles_triton
    from speccycle.engine.kernels.attention_triton import paged_attention_rows_triton

    options = {**(options or {}), **kwargs}
    kernel = options.pop("kernel", "rows")
    if kernel == "tiles":
        if "programs_per_row" in options:
            options["programs"] = options.pop("programs_per_row")
        return paged_attention_tiles_triton(*args, PAGE, **options)
    return paged_attention_rows_triton(*args, PAGE, **options)


def twin(args, keys: int) -> torch.Tensor:
    from speccycle.engine.kernels.attention_triton import paged_attention_rows_torch

    return paged_attention_rows_torch(*args, PAGE, kv_bound=keys).float()


def time_part(models, variants, contexts, rows_cases, tables) -> list[dict]:
    out = []
    gen = torch.Generator().manual_seed(0)
    for model in models:
        for rows in rows_cases:
            for ctx in contexts:
                for table in tables:
                    case = rows_case(model, rows, ctx, table, torch.bfloat16, gen)
                    reference = twin(case["args"], case["keys"])
                    row = {"model": model, "rows": rows, "ctx": ctx, "table": table, "us": {}, "max_err": {}}
                    # launch choices keep a kernel's bits, constants not
                    tiles, split = attend(case["args"], VARIANTS["tiles"]), attend(case["args"], VARIANTS["split"])
                    row["same_bits_as_tiles"], row["same_bits_as_split"] = {}, {}
                    for name in variants:
                        options = VARIANTS[name]
                        got = attend(case["args"], options)
                        row["same_bits_as_tiles"][name] = torch.equal(got, tiles)
                        row["same_bits_as_split"][name] = torch.equal(got, split)
                        got = got.float()
                        err = (got - reference).abs().max().item()
                        row["max_err"][name] = err
                        if not err <= 2e-2:
                            FAILURES.append(f"time {model} {rows} ctx {ctx} {table} {name}: max error {err:.3g}")
                        row["us"][name] = round(graph_us(attend, case["args"], options), 2) if DEVICE == "cuda" else 0.0
                    if row["us"].get("single") and row["us"].get("split"):
                        row["speedup"] = round(row["us"]["single"] / row["us"]["split"], 2)
                    say(f"{model:9s} rows {rows:8s} ctx {ctx:5d} {table:5s}",
                        "  ".join(f"{k} {v:7.2f}" for k, v in row["us"].items()))  # fmt: skip
                    out.append(row)
                    del case, reference
                    torch.cuda.empty_cache()
    return out


def compiled_kernels() -> list[dict]:
    """Registers, spills and shared memory of every compiled attention kernel (occupancy: what limits it)."""
    from speccycle.engine.kernels import attention_tiles, attention_triton

    out = []
    for module, name in ((attention_tiles, "_paged_attention_tile_kernel"),
                         (attention_triton, "_paged_attention_kernel")):  # fmt: skip
        kernel = getattr(module, name, None)
        for caches in getattr(kernel, "device_caches", {}).values():
            for compiled in caches[0].values():
                meta = compiled.metadata
                row = {"kernel": name, "num_warps": meta.num_warps, "num_stages": meta.num_stages,
                       "n_regs": getattr(compiled, "n_regs", None), "n_spills": getattr(compiled, "n_spills", None),
                       "shared": meta.shared}  # fmt: skip
                out.append(row)
                say("[compiled]", row)
    return out


def check(name: str, ok: bool, results: list[dict]) -> None:
    results.append({"check": name, "ok": bool(ok)})
    if not ok:
        FAILURES.append(f"bitwise: {name}")
    say(("ok  " if ok else "FAIL"), name)


def bitwise_case(model: str, dtype, length: int, variants, gen, results: list[dict]) -> None:
    """One request of ``length`` positions and 16 rows after it, on a page table scattered over the cache."""
    heads, kv_heads, dim = MODELS[model]
    n, pages = 16, -(-(length + 64) // PAGE)
    host_table = torch.randperm(pages + 8, generator=gen)[:pages][None]
    slots = [int(host_table[0, p // PAGE]) * PAGE + p % PAGE for p in range(length + n)]
    table = host_table.to(DEVICE)
    wide = torch.cat([table, torch.full((1, 300), -1, device=DEVICE)], dim=1)  # more chunks in the grid
    k_cache = torch.randn((pages + 8) * PAGE, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn((pages + 8) * PAGE, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype).to(DEVICE)
    own = torch.tensor(slots[length:], device=DEVICE)  # the 16 rows' slots
    chain = torch.full((n, n), -1, dtype=torch.long, device=DEVICE)  # row i: rows 0 .. i as extra slots
    for i in range(n):
        chain[i, : i + 1] = own[: i + 1]
    zeros = torch.zeros(n, dtype=torch.long, device=DEVICE)
    positions = length + 1 + torch.arange(n, device=DEVICE)  # decode row i's prefix: L + i + 1
    verify_args = (q, k_cache, v_cache, zeros, torch.full_like(zeros, length), chain, table)
    decode_args = (q, k_cache, v_cache, zeros, positions, chain[:, :0], wide)
    # a tree path with holes, rows 0 -> 2 -> 5 of a 64-column buffer, and its compacted decode row
    path = [0, 2, 5]
    tree_extra = torch.full((1, 64), -1, dtype=torch.long, device=DEVICE)
    tree_extra[0, path] = own[path]
    k2, v2 = k_cache.clone(), v_cache.clone()
    for depth, r in enumerate(path):
        k2[slots[length + depth]] = k_cache[slots[length + r]]
        v2[slots[length + depth]] = v_cache[slots[length + r]]
    wide_extra = torch.full((2 * n, 64), -1, dtype=torch.long, device=DEVICE)
    padded = (torch.cat([torch.zeros_like(q), q]), k_cache, v_cache, torch.cat([zeros, zeros]),
              torch.cat([zeros, positions]), wide_extra, wide)  # fmt: skip
    tag = f"{model} {str(dtype)[6:]} L={length}"
    for name in variants:
        options = VARIANTS[name]
        verify = attend(verify_args, options)
        decode = attend(decode_args, options)
        check(f"{tag} {name}: 16 chain verify rows == 16 decode rows", torch.equal(verify, decode), results)
        alone = [attend((q[i : i + 1], k_cache, v_cache, zeros[:1], positions[i : i + 1], chain[:1, :0], table),
                        options) for i in (0, 7, 15)]  # fmt: skip
        check(f"{tag} {name}: decode rows alone == in the batch", torch.equal(torch.cat(alone), decode[[0, 7, 15]]),
              results)  # fmt: skip
        check(f"{tag} {name}: decode rows after 16 padding rows, 64 extra columns == alone",
              torch.equal(attend(padded, options)[n:], decode), results)  # fmt: skip
        tree = attend((q[:1], k_cache, v_cache, zeros[:1], zeros[:1] + length, tree_extra, table), options)
        flat = attend((q[:1], k2, v2, zeros[:1], zeros[:1] + length + 3, chain[:1, :0], table), options)
        check(f"{tag} {name}: tree row with holes == decode row", torch.equal(tree, flat), results)
        one_program = attend(decode_args, options, programs_per_row=1)
        check(f"{tag} {name}: 1 program per row == the default launch", torch.equal(one_program, decode), results)
        if DEVICE == "cpu":
            continue
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = attend(verify_args, options)
        graph.replay()
        torch.cuda.synchronize()
        check(f"{tag} {name}: graph replay == eager", torch.equal(replayed, verify), results)
        del graph


def bitwise_part(models, variants) -> list[dict]:
    results: list[dict] = []
    gen = torch.Generator().manual_seed(1)
    lengths = (100, 300, 1000, 6000)  # one chunk of 128 keys, several, several, grown (> 128 * 32 keys)
    for model in models:
        for dtype in (torch.bfloat16, torch.float32):
            for length in lengths:
                bitwise_case(model, dtype, length, variants, gen, results)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    parser.add_argument("--parts", default="time,bitwise")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--tables", default="tight,wide")
    parser.add_argument(
        "--bitwise-variants",
        default=None,
        help="variants the bitwise part checks (default: single, split and tiles among --variants)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_bench needs a CUDA GPU")
    from speccycle.engine.kernels import attention_triton

    models = args.models.split(",")
    variants = args.variants.split(",")
    for name in (*models, *variants):
        if name not in MODELS and name not in VARIANTS:
            raise SystemExit(f"unknown model or variant {name!r}: models {list(MODELS)}, variants {list(VARIANTS)}")
    payload = {
        "defaults": dict(
            block_n=attention_triton.BLOCK_N, chunk=attention_triton.CHUNK, max_chunks=attention_triton.MAX_CHUNKS
        ),  # fmt: skip
        "variants": {name: VARIANTS[name] for name in variants},
        "page_size": PAGE,
        "dtype": "bfloat16 (time); bfloat16 and float32 (bitwise)",
    }
    parts = args.parts.split(",")
    if "time" in parts:
        payload["time"] = time_part(models, variants, [int(c) for c in args.contexts.split(",")],
                                    args.rows.split(","), args.tables.split(","))  # fmt: skip
        totals = {name: round(sum(r["us"][name] for r in payload["time"]), 1) for name in variants}
        payload["total_us_by_variant"] = totals
        say("total us over all cases:", totals)
        payload["compiled"] = compiled_kernels()
    if "bitwise" in parts:
        checked = [v for v in ("single", "split", "tiles") if v in variants] or variants[:1]
        if args.bitwise_variants:
            checked = args.bitwise_variants.split(",")
        payload["bitwise"] = bitwise_part(models, checked)
    payload["failures"] = FAILURES
    path = write_result("attention_bench", payload, device=DEVICE, directory=args.out)
    say(f"wrote {path}; {len(FAILURES)} failures")
    for failure in FAILURES:
        say(failure)
    raise SystemExit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
