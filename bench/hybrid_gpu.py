"""GPU check of the hybrid-model and block-draft kernels at real shapes, and a hybrid cycle on CUDA.

1. ``selective_scan_tree`` (Triton) against the torch reference: a tree verify (bs 32, N 16) and a
   ragged prefill (4 x 512 rows), Mamba-2.8B-like channels (Di 5120 / 2048, Ns 16), float32 states;
   max abs differences and the time of each (CUDA events, median of 20).
2. ``verify_block`` (Triton) against the reference, bs 256, B 16: exact equality, times.
3. A random hybrid model (hidden 512, 8 layers, alternating) on CUDA, float32: speculative (layer
   skip, chain and tree) equals autoregressive; accepted-length histogram.

    python -m bench.hybrid_gpu --out $OUT
"""

from __future__ import annotations

import argparse
import statistics

import torch

from .common import write_result

RESULTS: dict = {}


def log(section: str, row: dict) -> None:
    RESULTS.setdefault(section, []).append(row)
    print(f"[{section}] {row}", flush=True)


def _time_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _scan_inputs(kind: str, bs: int, rows: int, channels: int, state: int, device: str):
    from speccycle.backends.torch.recurrent import COMMITTED, PREVIOUS

    gen = torch.Generator().manual_seed(0)
    num_rows = bs * rows
    parent_src, store_index = [], []
    for b in range(bs):
        for i in range(rows):
            if kind == "prefill":
                parent_src.append(COMMITTED if i == 0 else PREVIOUS)
                store_index.append(-1)
                continue
            parent = -1 if i == 0 else int(torch.randint(0, i, (1,), generator=gen))
            src = COMMITTED if parent < 0 else PREVIOUS if parent == i - 1 else b * rows + parent
            parent_src.append(src)
            store_index.append(b * rows + i)
    t = dict(
        x=torch.randn(num_rows, channels, generator=gen),
        dt=torch.nn.functional.softplus(torch.randn(num_rows, channels, generator=gen) - 3),
        A=-torch.exp(torch.randn(channels, state, generator=gen) * 0.5),
        B=torch.randn(num_rows, state, generator=gen),
        C=torch.randn(num_rows, state, generator=gen),
        D=torch.randn(channels, generator=gen),
        row_order=torch.arange(num_rows),
        seg_starts=torch.arange(bs + 1) * rows,
        parent_src=torch.tensor(parent_src),
        init_states=torch.randn(bs, channels, state, generator=gen),
        init_slot=torch.arange(bs),
        row_states=torch.zeros(num_rows if kind == "tree" else 0, channels, state),
        store_index=torch.tensor(store_index),
        final_slot=torch.arange(bs) if kind == "prefill" else torch.full((bs,), -1),
    )
    return {k: v.to(device) for k, v in t.items()}


def check_scan(device: str) -> None:
    from speccycle.backends.cuda.recurrent import selective_scan_tree as fast
    from speccycle.backends.torch.recurrent import selective_scan_tree as ref

    for kind, bs, rows, channels in [("tree", 32, 16, 5120), ("tree", 32, 16, 2048), ("prefill", 4, 512, 2048)]:
        inputs = _scan_inputs(kind, bs, rows, channels, 16, device)
        a = {k: v.clone() for k, v in inputs.items()}
        b = {k: v.clone() for k, v in inputs.items()}
        y_ref, y_fast = ref(**a), fast(**b)
        row = {
            "kind": kind,
            "bs": bs,
            "rows": rows,
            "channels": channels,
            "max_abs_y": float((y_ref - y_fast).abs().max()),
            "max_abs_row_states": float((a["row_states"] - b["row_states"]).abs().max()) if kind == "tree" else 0.0,
            "max_abs_final": float((a["init_states"] - b["init_states"]).abs().max()),
            # Timed on the same buffers again: the in-place state writes do not change the work.
            "ms_reference": _time_ms(lambda a=a: ref(**a), 5),
            "ms_triton": _time_ms(lambda b=b: fast(**b)),
        }
        log("scan", row)


def check_block(device: str) -> None:
    from speccycle.backends.cuda.dflash import verify_block as fast
    from speccycle.backends.torch.block import verify_block as ref

    gen = torch.Generator().manual_seed(1)
    target = torch.randint(0, 8, (256, 16), generator=gen)
    cand = torch.where(torch.rand(256, 16, generator=gen) < 0.85, torch.roll(target, 1, 1), 0)
    cand, target = cand.to(device), target.to(device)
    same = all(torch.equal(x, y) for x, y in zip(ref(cand, target), fast(cand, target)))
    log(
        "verify_block",
        {
            "equal": same,
            "ms_reference": _time_ms(lambda: ref(cand, target)),
            "ms_triton": _time_ms(lambda: fast(cand, target)),
        },
    )


def check_cycle(device: str) -> None:
    from collections import Counter

    from speccycle.core import Ports, Request, SamplingParams, SpecConfig
    from speccycle.engine.memory.kv_pool import PagedKVPool
    from speccycle.engine.memory.recurrent_pool import RecurrentPools
    from speccycle.engine.models.hybrid import (
        HybridConfig,
        HybridSkipDraft,
        HybridTarget,
        hybrid_greedy,
        random_hybrid_weights,
    )
    from speccycle.engine.weights.weights_gguf import LlamaConfig
    from speccycle.statemachine import generate

    llama = LlamaConfig(
        architecture="llama", vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=8, num_heads=8,
        num_kv_heads=4, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5, max_position=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
    )  # fmt: skip
    config = HybridConfig(llama=llama, layer_types=("attention", "mamba") * 4, d_state=16)
    weights = random_hybrid_weights(config, seed=0, scale=0.05)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in (40, 17, 64, 9)]
    pool = PagedKVPool(num_pages=1024, page_size=16, device=device)
    reference = hybrid_greedy(HybridTarget.from_weights(config, weights, pool), pool, prompts, 64)
    for spec in [
        SpecConfig(num_steps=4, topk=1, page_size=16),
        SpecConfig(num_steps=4, topk=4, num_draft_tokens=16, page_size=16),
    ]:
        pool = PagedKVPool(num_pages=1024, page_size=16, device=device)
        target = HybridTarget.from_weights(config, weights, pool, max_rows=spec.num_draft_tokens)
        draft = HybridSkipDraft(target.model, pool, num_layers=4)
        recurrent = RecurrentPools(target.states, draft.states)
        histogram: Counter[int] = Counter()
        commit = recurrent.commit

        def counting(*, request_ids, last_correct_step_indices, commit=commit, histogram=histogram):
            histogram.update(last_correct_step_indices.tolist())
            commit(request_ids=request_ids, last_correct_step_indices=last_correct_step_indices)

        recurrent.commit = counting
        ports = Ports(target=target, draft=draft, kv_pool=pool, recurrent=recurrent)
        requests = [Request(i, tuple(p), SamplingParams(max_new_tokens=64)) for i, p in enumerate(prompts)]
        done = generate(requests, spec, ports)
        log(
            "cycle",
            {
                "config": f"S{spec.num_steps}K{spec.topk}N{spec.num_draft_tokens}P{spec.page_size}",
                "lossless": [list(r.output) for r in done] == reference,
                "last_correct_step_indices": dict(sorted(histogram.items())),
            },
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory of the JSON result (default bench/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.hybrid_gpu needs a CUDA device")
    device = "cuda"
    check_scan(device)
    check_block(device)
    check_cycle(device)
    path = write_result("hybrid_gpu", RESULTS, device=device, directory=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
