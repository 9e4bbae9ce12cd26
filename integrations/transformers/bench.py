"""`speccycle bench --backend transformers`: the library's cycle over a transformers model (`speculator`), chain
and tree, next to transformers' own decoding of the same model on the same prompts, batch 1, greedy:

* ``transformers``: ``generate(do_sample=False)``, the baseline every speedup is against and the output every
  other side must equal token for token (``identical``);
* ``transformers prompt lookup``: ``generate(prompt_lookup_num_tokens=...)``;
* ``transformers assisted``: ``generate(assistant_model=...)`` with the ``--draft-model`` folder, or without one
  ``generate(assistant_early_exit=k)`` (the model's first ``k`` layers and its LM head as the assistant:
  transformers' self-speculative assisted generation);
* ``speccycle chain`` and ``speccycle tree``: `TransformersSpeculator` with the draft (``ngram``, ``eagle``,
  ``model``) as a chain (``K = 1``) and as a tree.

Each side decodes the first prompt once untimed before the clock starts; then every prompt runs on every side, the
order of the sides rotated by one from each prompt to the next, so no side always runs first or last.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from ...core import SpecConfig
from ...engine.errors import ModelLoadError, UsageError
from .speculator import TransformersSpeculator, transformers_greedy

BASELINE = "transformers"
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value for prompt_lookup_num_tokens
WARMUP_TOKENS = 8
NGRAM_TREE = SpecConfig(num_steps=8, topk=2, num_draft_tokens=16)
EAGLE_TREE = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)  # the engine's EAGLE default on a CPU


def load_transformers_model(path: str | Path, dtype: torch.dtype, device: str):
    """``AutoModelForCausalLM`` and ``AutoTokenizer`` of a Hugging Face folder; one-line errors otherwise."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise UsageError(
            "--backend transformers needs the transformers package: pip install 'speccycle-sd[transformers]'"
        ) from err
    folder = Path(path)
    if not (folder.is_dir() and (folder / "config.json").is_file()):
        raise UsageError(
            f"--backend transformers loads a Hugging Face folder (config.json and weights); {path} is not one: "
            "export a GGUF file with speccycle.engine.weights.weights_hf.export_gguf_to_hf"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"transformers cannot load {folder}: {' '.join(str(err).split())}") from err
    return model, tokenizer


def chat_ids(tokenizer, text: str) -> list[int]:
    """``text`` as one user turn in the tokenizer's chat template, ready to answer (the template's own special
    tokens, none added)."""
    messages = [{"role": "user", "content": text}]
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def spec_configs(draft: str, steps: int | None, topk: int | None, draft_tokens: int | None, page: int):
    """``(chain, tree)`` of the bench: the tree of ``--steps/--topk/--draft-tokens`` where ``--topk`` > 1 is
    given, else `NGRAM_TREE` or `EAGLE_TREE` (an assistant model: the ngram one); the chain of the tree's depth
    (``--steps`` where given)."""
    default = EAGLE_TREE if draft == "eagle" else NGRAM_TREE
    if topk is not None and topk > 1:
        tree = SpecConfig(num_steps=steps or default.num_steps, topk=topk, num_draft_tokens=draft_tokens)
    else:
        tree = default
    tree = attrs.evolve(tree, page_size=page)
    chain = SpecConfig(num_steps=steps or tree.num_steps, topk=1, page_size=page)
    return chain, tree


def run_transformers_bench(
    model,
    tokenizer,
    prompts: Sequence[dict],
    max_new_tokens: int,
    draft: str = "ngram",
    chain: SpecConfig | None = None,
    tree: SpecConfig | None = None,
    draft_model=None,
    eagle_head=None,
    assistant_early_exit: int | None = None,
    progress: bool = True,
    warmup_tokens: int = WARMUP_TOKENS,
) -> dict:
    """Run every side (module docstring) on every prompt; return the summary: per side its tokens/s, speedup over
    ``transformers``, prompts identical to it, tau (the library's sides), per category the same."""
    if not prompts:
        raise UsageError("no prompts to bench: pass a prompts file with at least one prompt")
    chain = chain or SpecConfig(num_steps=NGRAM_TREE.num_steps, topk=1)
    tree = tree or NGRAM_TREE
    layers = int(getattr(model.config, "num_hidden_layers", 4))
    early_exit = assistant_early_exit or max(1, layers // 4)
    sides: dict[str, Callable] = {
        BASELINE: lambda ids: (transformers_greedy(model, ids, max_new_tokens), None),
        "transformers prompt lookup": lambda ids: (
            transformers_greedy(model, ids, max_new_tokens, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS),
            None,
        ),
    }
    if draft_model is not None:
        sides["transformers assisted"] = lambda ids: (
            transformers_greedy(model, ids, max_new_tokens, assistant_model=draft_model),
            None,
        )
    else:
        sides[f"transformers assisted (early exit {early_exit})"] = lambda ids: (
            transformers_greedy(model, ids, max_new_tokens, assistant_early_exit=early_exit),
            None,
        )
    for name, config in (("speccycle chain", chain), ("speccycle tree", tree)):
        speculator = TransformersSpeculator(
            model, draft, config, draft_model=draft_model, eagle_head=eagle_head, kv_tokens=8192
        )

        def run(ids, speculator=speculator):
            outputs, stats = speculator.generate([ids], max_new_tokens)
            return outputs[0], stats

        sides[name] = run
    names = list(sides)
    rows = defaultdict(lambda: defaultdict(lambda: {"tokens": 0, "seconds": 0.0, "identical": 0, "prompts": 0}))
    taus = defaultdict(lambda: [0, 0])  # side -> [verifies, committed]
    first = chat_ids(tokenizer, prompts[0]["text"])
    for name in names if warmup_tokens > 0 else ():
        sides[name](first[:])  # untimed: first allocations and lazy imports of every side
    try:
        from tqdm import tqdm
    except ImportError:  # a progress bar is a nicety

        def tqdm(x, **_):
            return x

    per_prompt = []
    for i, item in enumerate(tqdm(prompts, desc="bench transformers", disable=not progress)):
        ids = chat_ids(tokenizer, item["text"])
        order = names[i % len(names) :] + names[: i % len(names)]
        outputs, seconds = {}, {}
        for name in order:
            start = time.perf_counter()
            out, stats = sides[name](ids)
            seconds[name] = time.perf_counter() - start
            outputs[name] = out
            if stats is not None:
                taus[name][0] += stats.verifies
                taus[name][1] += stats.committed
        reference = outputs[BASELINE]
        for name in names:
            for key in (item["category"], "all"):
                row = rows[name][key]
                row["tokens"] += len(outputs[name])
                row["seconds"] += seconds[name]
                row["identical"] += int(outputs[name] == reference)
                row["prompts"] += 1
        per_prompt.append(
            {"line": item["line"], "tokens": len(reference), "identical": [n for n in names if outputs[n] == reference]}
        )
    return _summary(names, rows, taus, per_prompt)


def _summary(names: list[str], rows, taus, per_prompt: list[dict]) -> dict:
    def figures(name: str, key: str) -> dict:
        row, base = rows[name][key], rows[BASELINE][key]
        tps = row["tokens"] / row["seconds"] if row["seconds"] else 0.0
        base_tps = base["tokens"] / base["seconds"] if base["seconds"] else 0.0
        verifies, committed = taus.get(name, (0, 0))
        return {
            "prompts": row["prompts"],
            "tokens_per_s": round(tps, 2),
            "speedup": round(tps / base_tps, 3) if base_tps else None,
            "identical": row["identical"],
            "new_tokens": row["tokens"],
            "seconds": round(row["seconds"], 3),
            **({"tau": round(committed / verifies, 3) if verifies else None} if name in taus else {}),
        }

    categories = [k for k in rows[BASELINE] if k != "all"]
    return {
        "sides": {name: figures(name, "all") for name in names},
        "categories": {cat: {name: figures(name, cat)["tokens_per_s"] for name in names} for cat in categories},
        "prompts": rows[BASELINE]["all"]["prompts"],
        "not_identical": [p["line"] for p in per_prompt if len(p["identical"]) < len(names)],
        "order": "the sides' order rotated by one from each prompt to the next",
    }


def format_transformers_report(record: dict) -> str:
    """What ran, then one line a side: tokens/s, speedup over transformers' greedy generate, tau, identical."""
    c = record["config"]
    lines = [
        f"model {record['model']} (transformers {record['transformers']}), draft {record['draft']}, chain "
        f"S{c['chain']['S']}, tree S{c['tree']['S']} K{c['tree']['K']} N{c['tree']['N']}, {c['dtype']}, "
        f"{record['device']}, {record['max_new_tokens']} new tokens a prompt, {record['prompts']} prompts",
        f"{'side':<40}{'tok/s':>9}{'speedup':>9}{'tau':>7}{'identical':>11}",
    ]
    for name, r in record["sides"].items():
        tau = f"{r['tau']:.2f}" if r.get("tau") is not None else "-"
        speedup = f"{r['speedup']:.2f}" if r["speedup"] is not None else "-"
        lines.append(f"{name:<40}{r['tokens_per_s']:>9.1f}{speedup:>9}{tau:>7}{r['identical']:>6}/{r['prompts']:<4}")
    lines.append(
        "identical: prompts whose output equals transformers' greedy generate token for token; tau: mean tokens "
        "committed per verify; speedup: over transformers' greedy generate"
    )
    return "\n".join(lines)
