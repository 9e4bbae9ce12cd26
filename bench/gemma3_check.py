"""Gemma 3 270M on the reference engine: equality with transformers, and lossless speculation with tau.

Three checks, each a count, none a timing (so any machine, any load):

1. ``loader``: transformers' own GGUF loader (``from_pretrained(gguf_file=...)``, independent of
   speccycle's dequantization, norm shift and tensor names) against ``load_gguf``: the largest absolute
   difference over all tensors, and the prefill logits of one chat prompt. Slow: transformers reads
   the 262k-token metadata with ``gguf.GGUFReader`` (~40 s on a small CPU). ``--skip-loader`` leaves it out.
2. ``greedy``: the engine's autoregressive greedy output against transformers ``generate`` (weights
   exported with ``save_hf``), float32, per prompt: tokens compared and tokens equal.
3. ``speculative``: ngram and layerskip drafts, chain and tree, page size 1 and 16: tokens identical to
   the engine's autoregressive output, and tau.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.gemma3_check --prompts 6 --new-tokens 32
    # on the GPU machine (no PyPI): SPECCYCLE_GEMMA3_MODEL=/path/gemma-3-270m-q4_k_m.gguf ... --device cuda
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from speccycle.core import SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.engine.drafters.layerskip import LlamaDraft
from speccycle.engine.drafters.ngram import NgramDraft
from speccycle.engine.engine import Engine
from speccycle.engine.greedy import extend_batch
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.catalog import build_model, gemma3_270m_path
from speccycle.engine.models.target import LlamaTarget
from speccycle.engine.tokenizers.tokenizer import Tokenizer
from speccycle.engine.weights.weights_gguf import load_gguf
from speccycle.engine.weights.weights_hf import save_hf

from .common import write_result

CONFIGS = [
    ("ngram", SpecConfig(num_steps=4, topk=1, page_size=1)),
    ("ngram", SpecConfig(num_steps=3, topk=4, num_draft_tokens=8, page_size=16)),
    ("layerskip", SpecConfig(num_steps=3, topk=1, page_size=16)),
    ("layerskip", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=1)),
]


def check_loader(path, config, weights, prompt, device) -> dict:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    state = hf.state_dict()
    diffs = {name: float((weights[name] - state[name]).abs().max()) for name in weights}
    pool = PagedKVPool(num_pages=64, page_size=16, device=device)
    target = LlamaTarget.from_weights(config, weights, pool)
    with torch.inference_mode():
        ours = target.forward(extend_batch(pool, [0], [prompt], [0], last_logits_only=False)).logits.cpu()
        theirs = hf(torch.tensor([prompt])).logits[0]
    return {
        "tensors": len(diffs),
        "max_weight_abs_diff": max(diffs.values()),
        "tensors_transformers_has_that_we_lack": sorted(set(state) - set(weights) - {"lm_head.weight"}),
        "prefill_rows": len(prompt),
        "max_logit_abs_diff": float((ours - theirs).abs().max()),
        "argmax_equal_rows": int((ours.argmax(-1) == theirs.argmax(-1)).sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6, help="prompts from the 13-prompt sample")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layerskip-layers", type=int, default=12)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-loader", action="store_true")
    args = parser.parse_args()

    path = gemma3_270m_path()
    config, weights = load_gguf(path, dtype=torch.float32)
    tokenizer = Tokenizer.from_gguf(path)
    items = load_prompts(None)[: args.prompts]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": item["text"]}]) for item in items]
    record: dict = {"model": path.name, "dtype": "float32", "prompts": len(prompts), "new_tokens": args.new_tokens}
    if not args.skip_loader:
        record["loader"] = check_loader(path, config, weights, prompts[0], args.device)

    model = build_model(config, weights, device=args.device)
    reference = Engine(model, PagedKVPool(num_pages=1024, page_size=16, device=args.device), None, SpecConfig())
    autoregressive = reference.generate_autoregressive(prompts, args.new_tokens)

    import transformers

    with tempfile.TemporaryDirectory() as directory:
        save_hf(directory, config, weights)
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(args.device).eval()
    greedy = []
    with torch.inference_mode():
        for item, prompt, ours in zip(items, prompts, autoregressive):
            ids = torch.tensor([prompt], device=args.device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False)
            theirs = out[0, len(prompt) :].tolist()
            same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            greedy.append(
                {"category": item["category"], "tokens": len(ours), "equal_prefix": same, "equal": ours == theirs}
            )
    record["greedy"] = greedy

    speculative = []
    for draft, spec in CONFIGS:
        pool = PagedKVPool(num_pages=-(-16384 // spec.page_size), page_size=spec.page_size, device=args.device)
        build = (
            (lambda e, pool=pool: LlamaDraft(model, pool, num_layers=args.layerskip_layers))
            if draft == "layerskip"
            else NgramDraft(config.vocab_size)
        )
        engine = Engine(model, pool, build, spec)
        results, stats = engine.generate(prompts, args.new_tokens)
        outputs = [list(r.output) for r in results]
        speculative.append(
            {
                "draft": draft,
                "layers": args.layerskip_layers if draft == "layerskip" else None,
                "S": spec.num_steps,
                "K": spec.topk,
                "N": spec.num_draft_tokens,
                "P": spec.page_size,
                "identical_prompts": sum(o == a for o, a in zip(outputs, autoregressive)),
                "tokens": sum(len(o) for o in outputs),
                "tau": round(stats.tau, 3),
            }
        )
    record["speculative"] = speculative
    print(write_result("gemma3_check", record, device=args.device))


if __name__ == "__main__":
    main()
