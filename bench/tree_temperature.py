"""Tree scores from the draft's probabilities at a temperature: does a calibrated draft build better trees?

EAGLE-2's tree (`core.tree.expand_frontier`, `rerank_tree`) keeps the nodes of highest cumulative draft
probability, comparing nodes across depths. Where the head's probabilities are over- or under-confident
against its real acceptance, another temperature ranks the nodes differently (a node's own top-K never
changes: the order within a softmax is the logits' order). This runs the shipped EAGLE head with its draft
logits divided by ``T`` (every draft forward: the extend and each level), greedy, float32, on the CPU or a
GPU, and reports tau per temperature beside ``T = 1`` (the engine's tree) with the same prompts. Greedy
verification keeps the output the target's own whatever the tree, which the run checks against the
autoregressive output.

    .venv/bin/python -m bench.tree_temperature --temperatures 0.7,1,1.5 --trees 7x6x32 --per-category 3

Writes ``tree_temperature-<date>.json`` into ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import time

import attrs
import torch

from .common import write_result


def tempered(draft_cls, temperature: float):
    """An EAGLE draft class whose every forward returns its logits divided by ``temperature``."""

    class Tempered(draft_cls):
        def extend(self, batch, target_hidden):
            return self._cool(super().extend(batch, target_hidden))

        def step(self, batch, parent_hidden):
            return self._cool(super().step(batch, parent_hidden))

        @staticmethod
        def _cool(out):
            return out if temperature == 1.0 else attrs.evolve(out, logits=out.logits / temperature)

    return Tempered


def main() -> None:
    from speccycle.core import SpecConfig
    from speccycle.engine.bench import load_prompts
    from speccycle.engine.drafters.eagle import EagleDraft, EagleHead
    from speccycle.engine.drafters.eagle_heads import shipped_eagle_head
    from speccycle.engine.engine import Engine, load_model
    from speccycle.engine.kv_pool import PagedKVPool
    from speccycle.engine.llama import LlamaModel
    from speccycle.engine.tokenizer import Tokenizer
    from speccycle.engine.weights_gguf import default_model_path
    from speccycle.train.evaluate import MT_BENCH, accept_lengths, summarize
    from speccycle.train.pipeline import per_category

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    parser.add_argument("--prompts", default=None, help="Spec-Bench JSONL (default: the shipped 13-prompt sample)")
    parser.add_argument("--categories", default=",".join(MT_BENCH), help="comma-separated; 'all' for every one")
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--temperatures", default="0.7,1,1.5")
    parser.add_argument("--trees", default="7x6x32", help="SxKxN, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--eagle-head", default=None, help="default: the head shipped for the model")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    items = load_prompts(args.prompts)
    if args.categories != "all":
        wanted = set(args.categories.split(","))
        items = [item for item in items if item["category"] in wanted]
    picked = per_category(items, args.per_category)
    config, weights, path = load_model(None, torch.float32)
    tokenizer = Tokenizer.from_gguf(path if path.suffix == ".gguf" else default_model_path())
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}]) for p in picked]
    categories = [p["category"] for p in picked]
    head_path = args.eagle_head or shipped_eagle_head(path)
    head = EagleHead.load(head_path, torch.float32, args.device)
    model = LlamaModel(config, weights, device=args.device, feature_layers=head.config.feature_layers)
    kv_tokens = sum(len(p) for p in ids) + len(ids) * (args.max_new_tokens + 256)
    pool = PagedKVPool(num_pages=-(-kv_tokens // 16), page_size=16, device=args.device)
    reference = Engine(model, pool, None, SpecConfig(page_size=16), tokenizer).generate_autoregressive(
        ids, args.max_new_tokens
    )
    rows = []
    for tree in args.trees.split(","):
        s, k, n = (int(v) for v in tree.split("x"))
        spec = SpecConfig(num_steps=s, topk=k, num_draft_tokens=n, page_size=16)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            draft_cls = tempered(EagleDraft, temperature)
            pool = PagedKVPool(num_pages=-(-kv_tokens // 16), page_size=16, device=args.device)
            engine = Engine(model, pool, lambda e, cls=draft_cls: cls(head, e.model, e.pool), spec, tokenizer)
            start = time.perf_counter()
            outputs, lengths = accept_lengths(engine, ids, args.max_new_tokens)
            row = {"S": s, "K": k, "N": n, "temperature": temperature, "seconds": round(time.perf_counter() - start, 1)}
            row.update(summarize(categories, lengths, s))
            row["identical_to_ar"] = sum(list(o) == list(r) for o, r in zip(outputs, reference))
            rows.append(row)
            print(
                f"[tree-T] S{s}K{k}N{n} T={temperature}: tau {row['tau']} (MT-bench {row['tau_mt_bench']}), "
                f"identical {row['identical_to_ar']}/{len(ids)}, {row['seconds']} s",
                flush=True,
            )
    payload = {
        "head": str(head_path),
        "prompts": len(ids),
        "categories": sorted(set(categories)),
        "new_tokens": args.max_new_tokens,
        "dtype": "float32",
        "rows": rows,
    }
    print(f"wrote {write_result('tree_temperature', payload, device=args.device, directory=args.out)}")


if __name__ == "__main__":
    main()
