"""Greedy losslessness on a whole prompts file: speculative output vs the engine's autoregressive output.

All prompts run as one ragged batch per configuration (so 240 prompts take a few dozen forwards),
in float32; each drafter, chain and tree, P 1 and 16. Results are written after every configuration,
so a run cut short still reports what it finished.

    python -m bench.lossless_sweep --prompts spec_bench_dev.jsonl --device cuda --out sweep.json

``--fast`` runs the engine's fast path (`engine.fast.path`) with one of its op sets: ``invariant``
(`kernels.fused_ops.BatchInvariantOps`: the row-invariant GEMMs of `engine.kernels.linear_triton` at every row count, so
the 240-prompt batch's decode rows and verify rows compute the same bits: the bfloat16 parity run),
``triton`` (the default `kernels.fused_ops.TritonOps`: those GEMMs up to 64 rows, cuBLAS above) or ``cublas``
(`kernels.fused_ops.TritonCublasOps`: cuBLAS GEMMs, the fast path before them). ``off``: the reference path.

    python -m bench.lossless_sweep --prompts spec_bench_dev.jsonl --device cuda --dtype bfloat16 \
        --max-new-tokens 128 --fast invariant --out sweep-bf16-invariant.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from speccycle.core import SpecConfig
from speccycle.engine.bench import device_label, load_prompts
from speccycle.engine.engine import Engine, eagle_head_for
from speccycle.engine.weights.weights_gguf import default_model_path, load_gguf_config

CASES = [
    ("ngram", SpecConfig(num_steps=5, topk=1, page_size=1)),
    ("ngram", SpecConfig(num_steps=4, topk=4, num_draft_tokens=32, page_size=16)),
    ("layerskip", SpecConfig(num_steps=3, topk=1, page_size=16)),
    ("layerskip", SpecConfig(num_steps=3, topk=4, num_draft_tokens=16, page_size=1)),
    ("eagle", SpecConfig(num_steps=3, topk=1, page_size=1)),
    ("eagle", SpecConfig(num_steps=4, topk=4, num_draft_tokens=32, page_size=16)),
]


def fast_ops(name: str):
    """The op set of ``--fast`` (None: the reference path)."""
    from speccycle.engine.kernels import fused_ops as kernels

    return {"off": None, "invariant": kernels.BatchInvariantOps, "triton": kernels.TritonOps,
            "cublas": kernels.TritonCublasOps}[name]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--fast", default="off", choices=["off", "invariant", "triton", "cublas"])
    parser.add_argument("--max-requests", type=int, default=256, help="fast path: requests its static buffers hold")
    args = parser.parse_args()
    prompts = load_prompts(args.prompts, args.limit)
    record = {
        "device": device_label(args.device),
        "dtype": args.dtype,
        "prompts": len(prompts),
        "new_tokens": args.max_new_tokens,
        "fast": args.fast,
        "configs": [],
    }
    head = eagle_head_for(load_gguf_config(default_model_path()), version=1, seed=1)
    head = head.to(args.device, getattr(torch, args.dtype))
    head.dtype = getattr(torch, args.dtype)
    from speccycle.engine.tokenizers.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(default_model_path())
    lengths = [len(tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}])) for p in prompts]
    kv_tokens = sum(lengths) + len(prompts) * (args.max_new_tokens + 2 * 64 + 2 * 16)  # + reservations, pages
    record["kv_tokens"] = kv_tokens
    ar = None
    for draft, spec in CASES:
        start = time.time()
        engine = Engine.load(
            draft=draft,
            spec=spec,
            device=args.device,
            dtype=getattr(torch, args.dtype),
            kv_tokens=kv_tokens,
            layerskip_layers=8,
            eagle_head=head if draft == "eagle" else None,
        )
        ops = fast_ops(args.fast)
        if ops is not None:
            from speccycle.engine.fast.path import accelerate

            accelerate(engine, ops=ops, max_requests=max(args.max_requests, len(prompts)))
        ids = [engine.chat_prompt(p["text"]) for p in prompts]
        if ar is None:
            ar = engine.generate_autoregressive(ids, args.max_new_tokens)
            record["ar_seconds"] = round(time.time() - start, 1)
            start = time.time()
        results, stats = engine.generate(ids, args.max_new_tokens)
        same = [list(r.output) == a for r, a in zip(results, ar)]
        row = {
            "draft": draft,
            "S": spec.num_steps,
            "K": spec.topk,
            "N": spec.num_draft_tokens,
            "P": spec.page_size,
            "identical_to_ar": sum(same),
            "prompts": len(same),
            "tau": round(stats.tau, 3),
            "first_mismatches": [prompts[i]["id"] for i, s in enumerate(same) if not s][:10],
            "seconds": round(time.time() - start, 1),
        }
        record["configs"].append(row)
        print(row, flush=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
