"""Losslessness of the cycle over a transformers model (`integrations.transformers`) on a whole prompts file.

Every prompt's reference is transformers' own greedy ``generate`` (batch 1, float32); the library's cycle runs the
same chat-template ids through `TransformersSpeculator` with the ngram draft as a chain and as a tree, and with the
shipped EAGLE-3 head as a tree, in batches of ``--batch`` prompts (each request's output is its own whatever the
batch: the cycle is lossless per request). The record counts, per configuration, the prompts whose output equals
the reference token for token and lists those that differ; it is rewritten after every batch, so a run stopped
early still holds what finished.

    SPEC_BENCH_DEV=path/to/spec_bench_dev.jsonl python -m bench.transformers_lossless --max-new-tokens 32

The target is the embedded SmolLM2 GGUF exported to a Hugging Face folder (`weights_hf.export_gguf_to_hf`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from speccycle.core import SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.drafters.eagle_heads import shipped_eagle_head
from speccycle.engine.weights.weights_gguf import default_model_path
from speccycle.engine.weights.weights_hf import export_gguf_to_hf
from speccycle.integrations.transformers.bench import EAGLE_TREE, NGRAM_TREE, chat_ids, load_transformers_model
from speccycle.integrations.transformers.speculator import TransformersSpeculator, transformers_greedy

from bench.common import RESULTS, commit, result_record

CONFIGS = {
    "ngram chain S8": ("ngram", SpecConfig(num_steps=8, topk=1)),
    "ngram tree S8 K2 N16": ("ngram", NGRAM_TREE),
    "eagle tree S3 K2 N6": ("eagle", EAGLE_TREE),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default=os.environ.get("SPEC_BENCH_DEV") or None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--start", type=int, default=0, help="skip the first prompts (a run split in parts)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device-name", default="cpu-AMD-EPYC", help="the device's name in the result's file name")
    args = parser.parse_args()
    os.environ.setdefault("SPECCYCLE_COMMIT", commit())  # every rewrite of the record names the commit that runs
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts)[args.start :][: args.limit or None]
    folder = export_gguf_to_hf(default_model_path(), tempfile.mkdtemp() + "/SmolLM2-135M-Instruct")
    model, tokenizer = load_transformers_model(folder, torch.float32, "cpu")
    head = shipped_eagle_head(default_model_path())
    speculators = {
        name: TransformersSpeculator(model, draft, config, eagle_head=head if draft == "eagle" else None)
        for name, (draft, config) in CONFIGS.items()
    }
    ids = [chat_ids(tokenizer, p["text"]) for p in prompts]
    name = f"transformers_lossless-{args.device_name}-{commit()}"
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    results = {c: {"identical": 0, "differ": [], "verifies": 0, "committed": 0} for c in CONFIGS}
    start = time.perf_counter()
    done = 0
    for first in range(0, len(prompts), args.batch):
        chunk = list(range(first, min(first + args.batch, len(prompts))))
        references = [transformers_greedy(model, ids[i], args.max_new_tokens) for i in chunk]
        for config, speculator in speculators.items():
            outputs, stats = speculator.generate([ids[i] for i in chunk], args.max_new_tokens)
            row = results[config]
            row["verifies"] += stats.verifies
            row["committed"] += stats.committed
            for i, out, ref in zip(chunk, outputs, references):
                if out == ref:
                    row["identical"] += 1
                else:
                    row["differ"].append(prompts[i]["line"])
        done = chunk[-1] + 1
        payload = {
            "what": "greedy output of the cycle over transformers' model vs transformers' own greedy generate",
            "model": "SmolLM2-135M-Instruct (embedded GGUF exported to a Hugging Face folder), float32",
            "transformers": __import__("transformers").__version__,
            "prompts_file": "$SPEC_BENCH_DEV" if args.prompts == os.environ.get("SPEC_BENCH_DEV") else args.prompts,
            "prompts": len(prompts),
            "prompt_lines": [prompts[0]["line"], prompts[-1]["line"]],
            "prompts_done": done,
            "max_new_tokens": args.max_new_tokens,
            "batch": args.batch,
            "seconds": round(time.perf_counter() - start, 1),
            "configs": {
                c: {
                    "identical": r["identical"],
                    "of": done,
                    "differ_lines": r["differ"],
                    "tau": round(r["committed"] / r["verifies"], 3) if r["verifies"] else None,
                }
                for c, r in results.items()
            },
        }
        path.write_text(json.dumps(result_record("transformers_lossless", payload), indent=2) + "\n")
        print(done, {c: (r["identical"], r["differ"]) for c, r in results.items()}, flush=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
