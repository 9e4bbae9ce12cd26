"""The row-invariant GEMMs of `engine.kernels.linear_triton` on a GPU: speed against cuBLAS, invariance, model steps.

Parts (``--parts``, comma-separated):

* ``gemm``: at SmolLM2-135M's shapes (QKV 576->960 with the norm prologue, and with RoPE + KV write
  too, O 576->576, gate-up 576->2x1536 with the norm prologue and SiLU-mul, down 1536->576, LM head
  576->49152) and Llama-3-8B's (QKV 4096->6144, gate-up 4096->2x14336, down 14336->4096), rows 1..64:
  the time of one call of the fused Triton kernel against what it replaces (``F.linear``, plus the
  unfused Triton RMSNorm / RoPE / SiLU-mul for the fused ones), both replayed from a CUDA graph (GPU
  time, launch gaps included, the weights warm in L2 for the small ones; median of rounds); and bitwise
  invariance: row ``r`` of a ``T``-row call equals the 64-row call's row ``r`` and the one-row call on
  it, for every ``T`` (the same counted for the cuBLAS path, for contrast).
* ``configs``: other tiles (``BLOCK_N``, ``BLOCK_K``, warps, stages) per shape at 1 and 16 rows, to
  check `linear_triton.row_linear_config`'s choice (every tile is row-invariant; pick the fastest).
* ``model``: SmolLM2-135M (``$SPECCYCLE_DEFAULT_MODEL``) in bfloat16 on the fast path, with
  ``TritonCublasOps`` (cuBLAS GEMMs, 9 kernels a layer) and ``TritonOps`` (these kernels, 6): the
  autoregressive decode (tokens/s, one graph replay per token, at 1 row and at rows padded to 8 as a
  speculative engine with N = 6 pads them), the verify forward time at 6 / 32 / 64 rows, and whether a
  16-row verify's logits are bitwise the 1-row decode steps' logits for the same tokens (the bfloat16
  parity the kernels exist for).

    python -m bench.row_linear_bench --out $OUT                 # all parts, a few minutes
    python -m bench.row_linear_bench --out $OUT --parts gemm --rows 1,8,64

Writes ``row_linear_bench-<date>.json`` (device, date, commit) into ``--out`` (default bench/results);
exits 1 if a Triton kernel is not row-invariant on this GPU.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from .common import write_result

SHAPES = [  # (name, kind, N columns out, K); rope: (H, Hkv, D) in HEADS
    ("smollm2 qkv (norm)", "norm", 960, 576),
    ("smollm2 qkv (norm, rope + kv write)", "rope", 960, 576),
    ("smollm2 o", "plain", 576, 576),
    ("smollm2 gate-up (norm, silu)", "silu", 1536, 576),
    ("smollm2 down", "plain", 576, 1536),
    ("smollm2 lm head (float32 out)", "head", 49152, 576),
    ("llama3-8b qkv (norm)", "norm", 6144, 4096),
    ("llama3-8b qkv (norm, rope + kv write)", "rope", 6144, 4096),
    ("llama3-8b gate-up (norm, silu)", "silu", 14336, 4096),
    ("llama3-8b down", "plain", 4096, 14336),
]
HEADS = {576: (9, 3, 64), 4096: (32, 8, 128)}  # by K: SmolLM2-135M, Llama-3-8B
FAILURES: list[str] = []


def say(*parts) -> None:
    print(*parts, flush=True)


def graph_us(fn, *args, reps: int = 20, rounds: int = 7, iters: int = 10, **kwargs) -> float:
    """Median GPU time of one ``fn(*args, **kwargs)`` (µs): ``reps`` calls captured in one graph, replayed."""
    fn = functools.partial(fn, *args, **kwargs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / (iters * reps))
    del graph
    return statistics.median(times)


def ops_for(kind: str, n: int, k: int, dtype, gen):
    """(fused Triton call, the call it replaces) for one shape: ``f(x, r, start) -> output`` (``x``: rows
    ``start ..`` of the 64 the invariance check uses; the RoPE kernel reads their positions and slots)."""
    from speccycle.engine.kernels import fused_ops as kernels
    from speccycle.engine.kernels import linear_triton as lt

    rows_w = 2 * n if kind == "silu" else n
    w = (torch.randn(rows_w, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(dtype)
    if kind == "plain":
        return (lambda x, r, start=0: lt.row_linear(x, w)), (lambda x, r, start=0: F.linear(x, w))
    if kind == "head":
        fused = lambda x, r, start=0: lt.row_linear(x, w, torch.float32)  # noqa: E731
        return fused, (lambda x, r, start=0: F.linear(x, w).float())
    if kind == "norm":
        fused = lambda x, r, start=0: lt.norm_linear_triton(x, r, nw, 1e-5, w)[1]  # noqa: E731
        plain = lambda x, r, start=0: F.linear(kernels.add_rms_norm_triton(x, r, nw, 1e-5)[1], w)  # noqa: E731
        return fused, plain
    if kind == "rope":  # Q compared; K and V go to 64 distinct slots of a cache
        from speccycle.engine.models.llama import rope_cos_sin

        heads, kv_heads, head_dim = HEADS[k]
        cos, sin = rope_cos_sin(torch.arange(4096, device="cuda"), head_dim, 500000.0, dtype)
        positions = torch.randint(0, 4096, (64,), device="cuda", generator=gen)
        slots = torch.randperm(256, device="cuda", generator=gen)[:64]
        k_cache, v_cache = (torch.zeros(256, kv_heads, head_dim, dtype=dtype, device="cuda") for _ in range(2))
        # rows start .. start + T - 1 of the 64: their positions and slots
        rest = lambda x, start: (positions[start : start + x.shape[0]], cos, sin, slots[start : start + x.shape[0]],  # noqa: E731
                                 k_cache, v_cache, heads, kv_heads)  # fmt: skip
        fused = lambda x, r, start=0: lt.norm_qkv_rope_triton(x, r, nw, 1e-5, w, None, *rest(x, start))[1]  # noqa: E731
        plain = lambda x, r, start=0: kernels.rope_write_kv_triton(  # noqa: E731
            F.linear(kernels.add_rms_norm_triton(x, r, nw, 1e-5)[1], w), *rest(x, start)
        )
        return fused, plain
    fused = lambda x, r, start=0: lt.norm_gate_up_silu_triton(x, r, nw, 1e-5, w)[1]  # noqa: E731
    plain = lambda x, r, start=0: kernels.silu_mul_triton(F.linear(kernels.add_rms_norm_triton(x, r, nw, 1e-5)[1], w))  # noqa: E731
    return fused, plain


def invariance(fn, x, r, rows_list) -> dict:
    """Rows of each ``T``-row call that differ from the 64-row call, and single rows that differ."""
    full = fn(x, r)
    differ = {}
    for t in rows_list:
        differ[t] = int((fn(x[:t], r[:t]) != full[:t]).reshape(t, -1).any(dim=1).sum())
    singles = sum(int(not torch.equal(fn(x[i : i + 1], r[i : i + 1], i)[0], full[i])) for i in range(0, x.shape[0], 7))
    return {"rows_differing_by_T": differ, "single_rows_differing": singles}


def part_gemm(args, record) -> None:
    dtype = torch.bfloat16
    rows_list = [int(v) for v in args.rows.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name, kind, n, k in SHAPES:
        fused, plain = ops_for(kind, n, k, dtype, gen)
        x = torch.randn(64, k, device="cuda", generator=gen).to(dtype)
        r = torch.randn(64, k, device="cuda", generator=gen).to(dtype)
        check = {"triton": invariance(fused, x, r, rows_list), "replaced (cuBLAS)": invariance(plain, x, r, rows_list)}
        tri = check["triton"]
        if any(tri["rows_differing_by_T"].values()) or tri["single_rows_differing"]:
            FAILURES.append(f"{name}: not row-invariant {tri}")
        for t in rows_list:
            xt, rt = x[:t].contiguous(), r[:t].contiguous()
            row = {"shape": name, "N": n, "K": k, "rows": t, "triton_us": round(graph_us(fused, xt, rt), 2),
                   "replaced_us": round(graph_us(plain, xt, rt), 2)}  # fmt: skip
            row["speedup"] = round(row["replaced_us"] / row["triton_us"], 3)
            out.append(row)
            say("[gemm]", row)
        say("[gemm] invariance", name, check)
        record.setdefault("invariance", {})[name] = check
        torch.cuda.empty_cache()
    record["gemm"] = out


def part_configs(args, record) -> None:
    from speccycle.engine.kernels import linear_triton as lt

    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for name, kind, n, k in SHAPES:
        rows_w = 2 * n if kind == "silu" else n
        w = (torch.randn(rows_w, k, device="cuda", generator=gen) / k**0.5).to(dtype)
        nw = torch.ones(k, device="cuda", dtype=dtype)
        default = lt.row_linear_config(n, k, dtype)
        for t in (1, 16):
            x = torch.randn(t, k, device="cuda", generator=gen).to(dtype)
            results = []
            for block_n in (16, 32, 64, 128):
                for block_k in (32, 64, 128, 256):
                    for warps, stages in ((2, 3), (4, 3), (4, 4), (8, 3)):
                        if block_k > max(32, k) or block_n > max(16, n):
                            continue
                        config = lt.RowLinearConfig(block_n, block_k, warps, stages)
                        if kind == "rope":  # its tile is the head: timed in gemm
                            continue
                        if kind in ("silu", "norm"):
                            fn = lt.norm_gate_up_silu_triton if kind == "silu" else lt.norm_linear_triton
                            args_ = (x, None, nw, 1e-5, w)
                        else:
                            fn, args_ = lt.row_linear, (x, w)
                        try:
                            us = graph_us(fn, *args_, reps=10, rounds=3, iters=5, config=config)
                        except Exception as err:  # a tile that does not fit (shared memory): skip it
                            say("[configs] skip", name, config, type(err).__name__)
                            continue
                        results.append((us, config))
            results.sort(key=lambda item: item[0])
            default_us = next((us for us, c in results if c == default), None)
            row = {"shape": name, "rows": t, "default": attrs_dict(default), "default_us": default_us,
                   "best": [dict(attrs_dict(c), us=round(us, 2)) for us, c in results[:5]]}  # fmt: skip
            out.append(row)
            say("[configs]", row)
        torch.cuda.empty_cache()
    record["configs"] = out


def attrs_dict(config) -> dict:
    return {"block_n": config.block_n, "block_k": config.block_k, "warps": config.num_warps,
            "stages": config.num_stages}  # fmt: skip


def chain_verify_batch(pool, rid: int, length: int, tokens: list[int]):
    """Verify rows of a chain: row ``d`` at ``length + d``, prefix ``length``, its ancestors (itself last) as extras."""
    from speccycle.core.ports import ForwardBatch

    n = len(tokens)
    pool.allocate(rid, length + n)
    positions = torch.arange(length, length + n, device=pool.device)
    slots = pool.slots_for([rid], positions[None])[0]
    extra = torch.full((n, n), -1, dtype=torch.long, device=pool.device)
    for d in range(n):
        extra[d, : d + 1] = slots[: d + 1]
    return ForwardBatch(
        input_ids=torch.tensor(tokens, device=pool.device),
        positions=positions,
        row_request=torch.zeros(n, dtype=torch.long, device=pool.device),
        out_slots=slots,
        prefix_lens=torch.full((n,), length, device=pool.device),
        extra_slots=extra,
        page_table=pool.page_table([rid]),
        page_size=pool.page_size,
        request_ids=(rid,),
    )


def part_model(args, record) -> None:
    from speccycle.core import SpecConfig
    from speccycle.engine.engine import Engine
    from speccycle.engine.fast.path import FastGreedyDecoder, FastOptions, accelerate
    from speccycle.engine.greedy import extend_batch
    from speccycle.engine.kernels.fused_ops import TritonCublasOps, TritonOps

    prompt_text = "Explain how a hash map handles collisions, with a short example in Python."
    out = []
    for ops in (TritonCublasOps, TritonOps):
        engine = Engine.load(draft="none", spec=SpecConfig(num_steps=5, topk=1, page_size=16), device="cuda",
                             dtype=torch.bfloat16, kv_tokens=4096)  # fmt: skip
        # target forwards not padded (the engine pads to N = 6 rows by default): a decode step is 1 row
        accelerate(engine, ops=ops, min_target_rows=1)
        prompt = engine.chat_prompt(prompt_text)
        row = {"ops": ops.name}
        padded = FastOptions("cuda", ops=ops, min_target_rows=6)  # what a speculative engine with N = 6 runs
        for label, decoder in (
            ("ar_rows_1", engine.fast_decoder),
            ("ar_rows_8", FastGreedyDecoder(engine.target, engine.pool, padded)),
        ):
            decoder.decode([prompt], 8)  # warm-up: captures the prefill and decode graphs
            torch.cuda.synchronize()
            start = time.perf_counter()
            tokens = decoder.decode([prompt], args.new_tokens)[0]
            torch.cuda.synchronize()
            row[f"{label}_tokens_per_s"] = round(len(tokens) / (time.perf_counter() - start), 1)
        continuation = tokens
        target, pool = engine.target, engine.pool
        # verify forward time (static buffers + graph replay + clone, as the cycle calls it)
        rid = 100
        target.forward(extend_batch(pool, [rid], [prompt], [0]))
        for n in (6, 32, 64):
            batch = chain_verify_batch(pool, rid, len(prompt), continuation[:n])
            target.forward(batch)
            times = []
            for _ in range(5):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(20):
                    target.forward(batch)
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end) * 1e3 / 20)
            row[f"verify_{n}_rows_us"] = round(statistics.median(times), 1)
        pool.free(rid)
        # parity: verify rows against 1-row decode steps of the same tokens (fresh requests, same prefill)
        n = 16
        verify_rid, decode_rid = 101, 102
        target.forward(extend_batch(pool, [verify_rid], [prompt], [0]))
        verify = target.forward(chain_verify_batch(pool, verify_rid, len(prompt), continuation[:n])).logits
        target.forward(extend_batch(pool, [decode_rid], [prompt], [0]))
        equal = argmax_equal = 0
        for d in range(n):
            step = target.forward(extend_batch(pool, [decode_rid], [[continuation[d]]], [len(prompt) + d])).logits[0]
            equal += int(torch.equal(step, verify[d]))
            argmax_equal += int(int(step.argmax()) == int(verify[d].argmax()))
        pool.free(verify_rid)
        pool.free(decode_rid)
        row.update({"parity_rows": n, "verify_rows_bitwise_decode": equal, "verify_argmax_equal_decode": argmax_equal,
                    "target_min_rows": engine.fast_options.min_target_rows})  # fmt: skip
        if ops is TritonOps and equal != n:
            FAILURES.append(f"model: {n - equal} of {n} verify rows differ from the decode rows with TritonOps")
        out.append(row)
        say("[model]", row)
        del engine, target, pool
        torch.cuda.empty_cache()
    record["model"] = out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory of the JSON result (default bench/results)")
    parser.add_argument("--parts", default="gemm,configs,model")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("row_linear_bench needs a CUDA GPU")
    import triton

    record: dict = {"triton": triton.__version__, "dtype": "bfloat16", "parts": args.parts}
    parts = {"gemm": part_gemm, "configs": part_configs, "model": part_model}
    for name in args.parts.split(","):
        start = time.time()
        parts[name](args, record)
        say(f"[{name}] done in {time.time() - start:.0f} s")
    record["failures"] = FAILURES
    path = write_result("row_linear_bench", record, device="cuda", directory=args.out)
    say("wrote", path)
    for failure in FAILURES:
        say("FAIL", failure)
    raise SystemExit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
