"""The engine on a GPU, eager (no CUDA graphs, no Triton kernels yet): losslessness and a first speed.

1. float32: speculative output equals autoregressive for each drafter, chain and tree, 3 prompts x 32.
2. bf16: autoregressive vs speculative tokens/s and identical share on the 13 sample prompts x 128.

    SPECCYCLE_DEFAULT_MODEL=/path/to.gguf python -m bench.gpu_smoke --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from speccycle.core import SpecConfig
from speccycle.engine.bench import device_label, load_prompts, run_bench
from speccycle.engine.engine import Engine, eagle_head_for


def lossless(device: str) -> list[dict]:
    prompts = load_prompts(None)[:3]
    rows = []
    cases = [
        ("ngram", SpecConfig(num_steps=5, topk=1)),
        ("ngram", SpecConfig(num_steps=4, topk=4, num_draft_tokens=16)),
        ("layerskip", SpecConfig(num_steps=3, topk=1)),
        ("layerskip", SpecConfig(num_steps=3, topk=2, num_draft_tokens=8, page_size=1)),
        ("eagle", SpecConfig(num_steps=3, topk=3, num_draft_tokens=10)),
    ]
    for draft, spec in cases:
        kwargs = {"layerskip_layers": 8} if draft == "layerskip" else {}
        if draft == "eagle":
            from speccycle.engine.weights_gguf import default_model_path, load_gguf_config

            kwargs["eagle_head"] = eagle_head_for(load_gguf_config(default_model_path()), version=1, seed=1)
            kwargs["eagle_head"] = kwargs["eagle_head"].to(device)
        engine = Engine.load(draft=draft, spec=spec, device=device, dtype=torch.float32, **kwargs)
        ids = [engine.chat_prompt(p["text"]) for p in prompts]
        ar = [engine.generate_autoregressive([x], 32)[0] for x in ids]
        results, stats = engine.generate(ids, 32, checked=True)
        same = sum(list(r.output) == a for r, a in zip(results, ar))
        rows.append(
            {"draft": draft, "config": str(spec), "identical": same, "prompts": len(ids), "tau": round(stats.tau, 3)}
        )
        print(rows[-1], flush=True)
    return rows


def speed(device: str, new_tokens: int) -> dict:
    out = {}
    for draft, spec in [
        ("ngram", SpecConfig(num_steps=5, topk=1, page_size=16)),
        ("layerskip", SpecConfig(num_steps=3, topk=1, page_size=16)),
    ]:
        engine = Engine.load(draft=draft, spec=spec, device=device, dtype=torch.bfloat16, layerskip_layers=8)
        engine.generate_autoregressive([engine.chat_prompt("warm up")], 8)
        summary = run_bench(engine, load_prompts(None), new_tokens, progress=False)
        out[draft] = {k: v for k, v in summary.items() if k != "categories"}
        print(draft, out[draft], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    device = "cuda"
    start = time.time()
    record = {"device": device_label(device), "torch": torch.__version__, "lossless_float32": lossless(device)}
    record["bf16_speed"] = speed(device, args.new_tokens)
    record["seconds"] = round(time.time() - start, 1)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
