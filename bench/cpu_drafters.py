"""Drafters side by side on a CPU: autoregressive, ngram and EAGLE settings, interleaved prompt by prompt.

SmolLM2-135M in float32 (the embedded GGUF), batch 1, greedy, the 13-prompt Spec-Bench sample shipped in
``speccycle.engine/data`` (or ``--prompts``). Every prompt runs autoregressively and then through each
``--configs`` entry, one after the other, so that clock and load drift hit every way alike (separate
``speccycle bench`` runs each time their own autoregressive pass, minutes apart). Entries: ``ngram``
(the CPU default, a chain of 16), ``layerskip`` (S=4), and EAGLE shapes with the head's dtype,
``S3K2N6:bf16``, ``S4:f32`` (the shipped head; pages of 16). Per entry: tokens/s, speedup over the
autoregressive pass, tau, identical_to_ar.

    .venv/bin/python -m bench.cpu_drafters --configs ngram,S3K2N6:bf16,S4K2N8:bf16,S4K2N8:f32
"""

from __future__ import annotations

import argparse
import json
import re
import time
from importlib import resources

import torch

from .common import write_result

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _engine(entry: str):
    from speccycle.core import SpecConfig
    from speccycle.engine import engine as E
    from speccycle.engine.drafters.eagle import EagleHead
    from speccycle.engine.drafters.eagle_heads import shipped_eagle_head

    if entry in ("ngram", "layerskip"):
        return E.Engine.load(draft=entry)
    shape, _, dtype = entry.partition(":")
    match = re.fullmatch(r"S(\d+)(?:K(\d+)N(\d+))?", shape)
    if not match or dtype not in DTYPES:
        raise SystemExit(f"config {entry!r}: expected ngram, layerskip or S<steps>[K<topk>N<nodes>]:f32|bf16")
    steps, topk, nodes = match.groups()
    spec = SpecConfig(num_steps=int(steps), topk=int(topk or 1), num_draft_tokens=int(nodes) if nodes else None,
                      page_size=16)  # fmt: skip
    head = EagleHead.load(shipped_eagle_head(E.default_model_path()), DTYPES[dtype], "cpu")
    return E.Engine.load(draft="eagle", spec=spec, eagle_head=head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="ngram,S3K2N6:bf16,S4K2N8:bf16")
    ap.add_argument("--prompts", default=None, help="JSONL (default: the shipped 13-prompt sample)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    source = open(args.prompts) if args.prompts else resources.files("speccycle.engine").joinpath(
        "data/spec_bench_sample.jsonl").open()  # fmt: skip
    prompts = [json.loads(line) for line in source]
    configs = args.configs.split(",")
    engines = {c: _engine(c) for c in configs}
    first = engines[configs[0]]
    ways = ["ar", *configs]
    seconds = dict.fromkeys(ways, 0.0)
    tokens = dict.fromkeys(ways, 0)
    counts = {c: [0, 0, 0] for c in configs}  # committed, verifies, identical
    for i, p in enumerate(prompts):
        ids = first.chat_prompt(p.get("prompt") or p["turns"][0])
        start = time.perf_counter()
        ref = first.generate_autoregressive([ids], args.max_new_tokens)[0]
        seconds["ar"] += time.perf_counter() - start
        tokens["ar"] += len(ref)
        for c in configs:
            start = time.perf_counter()
            results, stats = engines[c].generate([ids], args.max_new_tokens)
            seconds[c] += time.perf_counter() - start
            out = list(results[0].output)
            tokens[c] += len(out)
            counts[c][0] += stats.committed
            counts[c][1] += stats.verifies
            counts[c][2] += out == list(ref)
        print(f"{i + 1}/{len(prompts)}", {w: round(tokens[w] / seconds[w], 2) for w in ways}, flush=True)
    ar = tokens["ar"] / seconds["ar"]
    rows = {"ar": {"tokens_per_s": round(ar, 2)}}
    for c in configs:
        speed = tokens[c] / seconds[c]
        rows[c] = {"tokens_per_s": round(speed, 2), "speedup": round(speed / ar, 3),
                   "tau": round(counts[c][0] / max(counts[c][1], 1), 3), "identical_to_ar": counts[c][2]}  # fmt: skip
    payload = {
        "config": {
            "model": "SmolLM2-135M-Instruct (float32)",
            "threads": args.threads,
            "batch": 1,
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "configs": configs,
        },  # fmt: skip
        "rows": rows,
    }
    print(json.dumps(rows))
    print("wrote", write_result(f"cpu_drafters{args.tag}", payload, device="cpu", directory=args.out))


if __name__ == "__main__":
    main()
