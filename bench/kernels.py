"""Micro-benchmark and correctness pass of the CUDA backend's kernels against the torch reference.

For each op of `speccycle.backends.cuda.ops.CudaBackend` at real shapes (vocabulary 49152 as
SmolLM2's, ``bs`` 1 / 16 / 64, trees up to ``N = 64`` rows, ``S`` up to 8, the engine's slot-major
KV cache for SmolLM2 and a Llama-3-8B shape, a sampled draw's uniforms over the vocabulary):

1. correctness: the kernel's output equals the reference's (exactly for integer outputs and moved
   bytes; top-K probabilities to float32 rounding, ids tie-aware in bfloat16, where the reference
   leaves the order of equal probabilities unspecified);
2. time per call, eager (Python launch included: what the cycle pays without graphs) and replayed
   from a CUDA graph (GPU time only; ``null`` where the op syncs with the host and cannot be
   captured: the slot check and the move count, in both backends, and the reference's tree mask).

    python -m bench.kernels --out $OUT [--iters 200] [--quick]

Writes ``kernels-<date>.json`` (device, commit, one row per op and shape); exits 1 if any kernel
differs from its reference.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from .common import write_result

VOCAB = 49152
ROWS: list[dict] = []


def eager_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def graph_us(fn: Callable[[], object], iters: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters * 1e3


def measure(op: str, case: str, fast_fn, ref_fn, args: tuple, iters: int, equal=None, capturable=(True, True), **extra):
    """Check ``fast_fn(*args)`` against ``ref_fn(*args)`` (``equal``: a verdict or a comparator) and time both."""
    if equal is None or callable(equal):
        compare = equal or outputs_equal
        equal = compare(args, fast_fn(*args), ref_fn(*args))
    row = {"op": op, "case": case, **extra, "equal": bool(equal)}
    row["eager_us"] = {
        "kernel": round(eager_us(lambda: fast_fn(*args), iters), 2),
        "torch": round(eager_us(lambda: ref_fn(*args), iters), 2),
    }
    row["graph_us"] = {}
    for name, fn, can in (("kernel", fast_fn, capturable[0]), ("torch", ref_fn, capturable[1])):
        try:
            row["graph_us"][name] = round(graph_us(lambda f=fn: f(*args), iters), 2) if can else None
        except RuntimeError as err:  # a capture that fails says so in the row; the other rows go on
            row["graph_us"][name] = None
            row[f"graph_error_{name}"] = str(err).splitlines()[0]
            torch.cuda.synchronize()
    row["speedup_eager"] = round(row["eager_us"]["torch"] / row["eager_us"]["kernel"], 2)
    if None not in row["graph_us"].values():
        row["speedup_graph"] = round(row["graph_us"]["torch"] / row["graph_us"]["kernel"], 2)
    ROWS.append(row)
    print(row, flush=True)


def outputs_equal(args, got, want) -> bool:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def topk_equal(args: tuple, got: tuple, want: tuple) -> bool:
    """Probabilities to float32 rounding; ids exact, or (ties) ids whose probabilities are the reference's."""
    logits = args[0]
    probs, ids = got
    want_probs, want_ids = want
    if not torch.allclose(probs, want_probs, rtol=1e-4, atol=1e-6):
        return False
    if torch.equal(ids, want_ids):
        return True
    full = torch.softmax(logits.float(), dim=-1)
    distinct = bool((ids.sort(-1).values.diff(dim=-1) != 0).all()) if ids.shape[1] > 1 else True
    return distinct and torch.equal(full.gather(1, ids), want_probs)


def level_parents(steps: int, k: int, rng: random.Random) -> list[int]:
    """Candidate parents as the draft lays them out: K roots' children, then K * K per level, each under
    a node of the level before."""
    parents, prev_start, prev_size = [-1] * k, 0, k
    for _ in range(steps - 1):
        start = len(parents)
        parents += [prev_start + rng.randrange(prev_size) for _ in range(k * k)]
        prev_start, prev_size = start, k * k
    return parents


def random_parents(bs: int, n: int, rng: random.Random, device) -> torch.Tensor:
    rows = [[-1] + [rng.randrange(max(0, i - 8), i) for i in range(1, n)] for _ in range(bs)]
    return torch.tensor(rows, dtype=torch.long, device=device)


def bench_logits(fast, ref, batch_sizes, iters, device) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    for bs in batch_sizes:
        for dtype in (torch.bfloat16, torch.float32):
            name = str(dtype).removeprefix("torch.")
            logits = (torch.randn(bs, VOCAB, device=device, generator=gen) * 2).to(dtype)
            measure("select_topk K=1", f"[{bs}, {VOCAB}] {name}", fast.select_topk, ref.select_topk, (logits, 1), iters,
                    bs=bs)  # fmt: skip
            for k in (4, 8):
                rows = (torch.randn(bs * k, VOCAB, device=device, generator=gen) * 2).to(dtype)
                measure(f"select_topk K={k}", f"[{bs * k}, {VOCAB}] {name}", fast.select_topk, ref.select_topk,
                        (rows, k), iters, equal=topk_equal, bs=bs)  # fmt: skip
        for n in (9, 64):
            logits = (torch.randn(bs * n, VOCAB, device=device, generator=gen) * 2).to(torch.bfloat16)
            measure("greedy_predict", f"[{bs * n}, {VOCAB}] bfloat16 (N={n})", fast.greedy_predict,
                    ref.greedy_predict, (logits,), iters, bs=bs)  # fmt: skip
        torch.cuda.empty_cache()


def bench_tree(fast, ref, batch_sizes, iters, device) -> None:
    rng = random.Random(0)
    gen = torch.Generator(device=device).manual_seed(1)
    for bs in batch_sizes:
        for k in (4, 8):
            frontier = torch.rand(bs, k, device=device, generator=gen)
            child_p = torch.rand(bs, k, k, device=device, generator=gen)
            child_ids = torch.randint(0, VOCAB, (bs, k, k), device=device, generator=gen)
            measure("expand_frontier", f"bs={bs} K={k}", fast.expand_frontier, ref.expand_frontier,
                    (frontier, child_p, child_ids, k), iters, bs=bs)  # fmt: skip
        for steps, k, n in ((8, 4, 64), (8, 8, 64), (5, 4, 32)):
            parents, num = level_parents(steps, k, rng), k + (steps - 1) * k * k
            cand_parents = torch.tensor([parents] * bs, device=device)
            scores = torch.rand(bs, num, device=device, generator=gen)
            tokens = torch.randint(0, VOCAB, (bs, num), device=device, generator=gen)
            roots = torch.randint(0, VOCAB, (bs,), device=device, generator=gen)
            measure("rerank_tree", f"bs={bs} S={steps} K={k} C={num} N={n}", fast.rerank_tree, ref.rerank_tree,
                    (roots, tokens, scores, cand_parents, n), iters, bs=bs)  # fmt: skip
        for n in (9, 32, 64):
            parents = random_parents(bs, n, rng, device)
            for op in ("tree_mask", "tree_mask_packed"):  # the reference stops early: a host sync, no graph
                measure(op, f"bs={bs} N={n}", getattr(fast, op), getattr(ref, op), (parents,), iters,
                        capturable=(True, False), bs=bs)  # fmt: skip


def verified(bs: int, n: int, width: int, rng: random.Random, gen, device):
    """A tree, its tokens and the target's predictions over a two-token alphabet (long accepted paths)."""
    parents = random_parents(bs, n, rng, device) if n > width else torch.arange(-1, n - 1, device=device).repeat(bs, 1)
    tokens = torch.randint(0, 2, (bs, n), device=device, generator=gen)
    predict = torch.randint(0, 2, (bs, n), device=device, generator=gen)
    return tokens, parents, predict, width


def engine_cache(layers: int, heads: int, dim: int, num_slots: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's target cache ``[layers, 2, slots, Hkv, D]`` and its slot-major view (not contiguous)."""
    storage = torch.randn(layers, 2, num_slots, heads, dim, device=device).to(torch.bfloat16)
    return storage, storage.view(layers * 2, num_slots, heads, dim).transpose(0, 1)


def bench_accept_and_compact(fast, ref, batch_sizes, iters, device) -> None:
    rng = random.Random(2)
    gen = torch.Generator(device=device).manual_seed(2)
    for bs in batch_sizes:
        for n, width in ((9, 9), (64, 9)):
            args = verified(bs, n, width, rng, gen, device)
            shape = "chain" if n == width else "tree"
            measure("verify_greedy", f"bs={bs} N={n} S+1={width} {shape}", fast.verify_greedy, ref.verify_greedy,
                    args, iters, bs=bs)  # fmt: skip
            accept_index, accept_len = ref.verify_greedy(*args)
            for features in (0, 576, 4096):
                if features:
                    rows = torch.randn(bs * n, features, device=device, generator=gen).to(torch.bfloat16)
                    label = f"hidden [{bs * n}, {features}] bfloat16"
                else:
                    rows, label = args[2].reshape(-1), "predict int64"
                measure("gather_accepted", f"bs={bs} N={n} {label}", fast.gather_accepted, ref.gather_accepted,
                        (rows, accept_index), iters, bs=bs)  # fmt: skip
            predict = ref.gather_accepted(args[2].reshape(-1), accept_index)
            measure("fill_bonus", f"bs={bs} S+1={width}", fast.fill_bonus, ref.fill_bonus,
                    (predict, accept_len, width), iters, bs=bs)  # fmt: skip
            for page_size in (1, 16):
                seq_lens = torch.randint(100, 2000, (bs,), device=device, generator=gen)
                pages_each = (2000 + n) // page_size + 1
                table = torch.randperm(bs * pages_each, device=device, generator=gen).view(bs, pages_each)
                positions = seq_lens[:, None] + torch.arange(n, device=device)
                measure("slots_for_positions", f"bs={bs} X={n} P={page_size}", fast.slots_for_positions,
                        ref.slots_for_positions, (table, positions, page_size), iters, capturable=(False, False),
                        bs=bs)  # fmt: skip
                if n == width:
                    continue  # a chain moves nothing
                plan = (accept_index, accept_len, ref.slots_for_positions(table, positions, page_size))
                measure("plan_kv_move", f"bs={bs} N={n} P={page_size}", fast.plan_kv_move, ref.plan_kv_move, plan,
                        iters, capturable=(False, False), bs=bs)  # fmt: skip
                if page_size != 16:
                    continue
                src, dst = ref.plan_kv_move(*plan)
                num_slots = bs * pages_each * page_size
                for model, (layers, heads, dim) in (("SmolLM2", (30, 3, 64)), ("Llama-3-8B", (32, 8, 128))):
                    storage, view = engine_cache(layers, heads, dim, num_slots, device)
                    expected, expected_view = engine_cache(layers, heads, dim, num_slots, device)
                    expected.copy_(storage)
                    ref.move_kv([expected_view], src, dst)
                    fast.move_kv([view], src, dst)
                    measure("move_kv", f"bs={bs} moves={src.numel()} {model} cache", fast.move_kv, ref.move_kv,
                            ([view], src, dst), iters, equal=same(storage, expected), bs=bs,
                            moves=src.numel())  # fmt: skip
                    del storage, view, expected, expected_view
                torch.cuda.empty_cache()


def bench_sampling(fast, ref, batch_sizes, iters, device) -> None:
    """A sampled draw's keyed uniforms (`uniforms_from_keys`): one key a request, a ``[V]`` row each (the final
    token's Gumbel noise, a chain's draft level)."""
    gen = torch.Generator(device=device).manual_seed(0)
    for bs in batch_sizes:
        keys = torch.randint(-(2**62), 2**62, (bs,), dtype=torch.long, device=device, generator=gen)
        measure("uniforms_from_keys", f"[{bs}] keys x {VOCAB}", fast.uniforms_from_keys, ref.uniforms_from_keys,
                (keys, VOCAB), iters, bs=bs)  # fmt: skip
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory for the JSON result (default bench/results)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="bs 1 and 64 only, 50 iterations")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels needs a CUDA device (the kernels' CPU check is tests/kernels)")
    from speccycle.backends.cuda.ops import CudaBackend
    from speccycle.backends.torch import TorchBackend

    fast, ref, device = CudaBackend(), TorchBackend(), torch.device("cuda")
    batch_sizes = (1, 64) if args.quick else (1, 16, 64)
    iters = 50 if args.quick else args.iters
    start = time.time()
    for section in (bench_logits, bench_tree, bench_accept_and_compact, bench_sampling):
        section(fast, ref, batch_sizes, iters, device)
    unequal = [f"{r['op']} {r['case']}" for r in ROWS if not r["equal"]]
    payload = {
        "rows": ROWS,
        "summary": {"ops": len(ROWS), "unequal": unequal, "seconds": round(time.time() - start, 1)},
        "note": "eager_us: per call with Python launch; graph_us: CUDA-graph replay; null: the op syncs with the host",
    }
    path = write_result("kernels", payload, "cuda", directory=args.out)
    print(f"{len(unequal)} unequal of {len(ROWS)}: {unequal}; wrote {path}", flush=True)
    if unequal:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
