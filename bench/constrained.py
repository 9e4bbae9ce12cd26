"""Constrained speculative decoding against constrained autoregressive decoding, and the grammar's cost per cycle.

Two parts, one JSON record (``bench/results/constrained-<date>.json``):

* **speed**: the extraction and JSON prompts of ``bench/constrained_prompts.py``, each under its JSON schema or
  regex, one at a time, greedy: constrained autoregressive decoding (one target forward per token, the logits
  masked) and constrained speculative decoding (``--draft``, its default shape on the device); tokens per second
  of each, the speedup, tau, whether the outputs are identical, and the host time the grammar took per cycle
  (every `statemachine.grammar` step the rows run: masks after the committed tokens, the draft levels' frontier
  masks, the verify rows' masks, the cut and the matchers' advance), against the cycle's wall time; and the
  ablation: the same speculative run with the draft's own masks off (the verify still masks), its tau.
* **lossless check** (``--check``): Spec-Bench prompts (``--prompts``, default the 13 the package ships), each
  under a JSON schema or a regex in turn, decoded in one batch both ways; the count of identical outputs.

    python -m speccycle.bench.constrained [--draft eagle] [--max-new-tokens 48] [--check] [--check-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from ..core import SamplingParams, SpecConfig
from ..core.records import Verified
from ..statemachine import grammar as grammar_steps
from .common import commit, write_result
from .constrained_prompts import PROMPTS

ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
SENTENCE = r"[A-Z][A-Za-z0-9 ,.;:'()-]{20,400}"
TIMED = ("next_masks", "draft_masks", "row_masks", "cut", "advance", "compile_request")


class GrammarClock:
    """Host seconds spent in each grammar step of the cycle (the module's functions, wrapped while it runs)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._saved = {}

    def _wrap(self, owner, name: str, label: str):
        original = getattr(owner, name)
        self._saved[(owner, name)] = original

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)

    def __enter__(self):
        for name in TIMED:
            self._wrap(grammar_steps, name, name)
        self._wrap(grammar_steps.FrontierMasks, "level", "frontier_masks")
        return self

    def __exit__(self, *exc):
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)


class NoDraftMasks:
    """The ablation: the draft proposes from its unmasked distribution (its extend's and levels' masks all ones);
    the verify still masks the target, so the output stays the constrained one and only acceptance changes."""

    def __enter__(self):
        self._saved = grammar_steps.draft_masks, grammar_steps.FrontierMasks.level

        def ones(requests, words, device):
            return torch.full((len(requests), words), -1, dtype=torch.int32, device=device)

        def level_ones(masker, cand_tokens, cand_parents, frontier_cand):
            rows = cand_tokens[0].shape[0] * masker.topk
            return torch.full((rows, masker.words), -1, dtype=torch.int32, device=cand_tokens[0].device)

        grammar_steps.draft_masks, grammar_steps.FrontierMasks.level = ones, level_ones
        return self

    def __exit__(self, *exc):
        grammar_steps.draft_masks, grammar_steps.FrontierMasks.level = self._saved


def _params(item: dict) -> SamplingParams:
    return SamplingParams(**{k: item[k] for k in ("json_schema", "regex") if k in item})


def speed(engine, max_new_tokens: int) -> dict:
    rows = []
    totals = defaultdict(float)
    for item in PROMPTS:
        prompt, params = engine.chat_prompt(item["text"]), _params(item)
        start = time.perf_counter()
        reference = engine.generate_autoregressive([prompt], max_new_tokens, sampling=[params])[0]
        ar_s = time.perf_counter() - start
        cycles = []
        with GrammarClock() as clock:
            start = time.perf_counter()
            results, stats = engine.generate(
                [prompt], max_new_tokens, sampling=[params],
                on_step=lambda record, seen=cycles: seen.append(1) if isinstance(record, Verified) else None,
            )  # fmt: skip
            spec_s = time.perf_counter() - start
        output = list(results[0].output)
        grammar_s = sum(clock.seconds.values())
        with NoDraftMasks():
            start = time.perf_counter()
            unmasked, unmasked_stats = engine.generate([prompt], max_new_tokens, sampling=[params])
            unmasked_s = time.perf_counter() - start
        rows.append(
            {
                "category": item["category"],
                "grammar": "json_schema" if "json_schema" in item else "regex",
                "tokens": len(output),
                "identical": output == reference,
                "finish_reason": results[0].finish_reason,
                "autoregressive_s": round(ar_s, 4),
                "speculative_s": round(spec_s, 4),
                "speedup": round(ar_s / spec_s, 3),
                "tau": round(stats.tau, 3) if stats.verifies else None,
                "tau_draft_unmasked": round(unmasked_stats.tau, 3) if unmasked_stats.verifies else None,
                "speculative_draft_unmasked_s": round(unmasked_s, 4),
                "identical_draft_unmasked": list(unmasked[0].output) == reference,
                "cycles": len(cycles),
                "grammar_ms_per_cycle": round(1e3 * grammar_s / max(len(cycles), 1), 3),
                "cycle_ms": round(1e3 * spec_s / max(len(cycles), 1), 3),
                "grammar_ms_by_step": {k: round(1e3 * v, 3) for k, v in sorted(clock.seconds.items())},
                "text": engine.tokenizer.decode(output, skip_special_tokens=True),
            }
        )
        totals["tokens"] += len(output)
        totals["reference_tokens"] += len(reference)
        totals["autoregressive_s"] += ar_s
        totals["speculative_s"] += spec_s
        totals["grammar_s"] += grammar_s
        totals["cycles"] += len(cycles)
        totals["unmasked_s"] += unmasked_s
        totals["unmasked_tokens"] += len(unmasked[0].output)
        totals["verifies"] += stats.verifies
        totals["committed"] += stats.committed
        totals["unmasked_verifies"] += unmasked_stats.verifies
        totals["unmasked_committed"] += unmasked_stats.committed
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "text"}), flush=True)
    errors = [r for r in rows if r.get("finish_reason") == "error"]
    if not totals["tokens"] or not totals["reference_tokens"]:
        raise SystemExit(f"no constrained output to time: {len(errors)} of {len(rows)} requests errored (is llguidance "
                         "installed? pip install 'speccycle[grammar]')")  # fmt: skip
    return {
        "prompts": rows,
        "identical": sum(r["identical"] for r in rows),
        "autoregressive_tok_s": round(totals["reference_tokens"] / totals["autoregressive_s"], 3),
        "speculative_tok_s": round(totals["tokens"] / totals["speculative_s"], 3),
        "speedup": round(
            (totals["tokens"] / totals["speculative_s"]) / (totals["reference_tokens"] / totals["autoregressive_s"]), 3
        ),
        "grammar_ms_per_cycle": round(1e3 * totals["grammar_s"] / max(totals["cycles"], 1), 3),
        "cycle_ms": round(1e3 * totals["speculative_s"] / max(totals["cycles"], 1), 3),
        "grammar_share_of_cycle": round(totals["grammar_s"] / totals["speculative_s"], 4),
        "tau": round(totals["committed"] / max(totals["verifies"], 1), 3),
        "draft_unmasked": {
            "tau": round(totals["unmasked_committed"] / max(totals["unmasked_verifies"], 1), 3),
            "speculative_tok_s": round(totals["unmasked_tokens"] / totals["unmasked_s"], 3),
            "identical": sum(r["identical_draft_unmasked"] for r in rows),
        },
    }


CHECK_BATCH = 16  # prompts a check batch runs together


def check(engine, prompts_path: str | None, tokens: int) -> dict:
    from ..engine.bench import load_prompts

    items = load_prompts(prompts_path)
    prompts = [engine.chat_prompt(item["text"]) for item in items]
    params = [
        SamplingParams(json_schema=ANSWER) if i % 2 == 0 else SamplingParams(regex=SENTENCE) for i in range(len(items))
    ]
    reference, results, verifies, committed, ar_s, spec_s = [], [], 0, 0, 0.0, 0.0
    for lo in range(0, len(prompts), CHECK_BATCH):  # batches the KV pool holds (a file may have hundreds)
        part, part_params = prompts[lo : lo + CHECK_BATCH], params[lo : lo + CHECK_BATCH]
        start = time.perf_counter()
        reference += engine.generate_autoregressive(part, tokens, sampling=part_params)
        ar_s += time.perf_counter() - start
        start = time.perf_counter()
        done, stats = engine.generate(part, tokens, sampling=part_params)
        spec_s += time.perf_counter() - start
        results += done
        verifies, committed = verifies + stats.verifies, committed + stats.committed
    identical = [list(r.output) == ref for r, ref in zip(results, reference)]
    return {
        "prompts": len(items),
        "source": prompts_path or "speccycle.engine/data (the 13 shipped prompts)",
        "max_new_tokens": tokens,
        "identical": sum(identical),
        "differing": [i for i, same in enumerate(identical) if not same],
        "errors": [r.error for r in results if r.error],
        "tau": round(committed / verifies, 3) if verifies else None,
        "batch_autoregressive_s": round(ar_s, 3),
        "batch_speculative_s": round(spec_s, 3),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="eagle", choices=["eagle", "ngram", "layerskip"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--topk", type=int, default=None)
    parser.add_argument("--draft-tokens", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--check", action="store_true", help="also the lossless check over Spec-Bench prompts")
    parser.add_argument("--check-only", action="store_true", help="only the lossless check")
    parser.add_argument("--prompts", default=None, help="Spec-Bench JSONL for the check (default: the shipped 13)")
    parser.add_argument("--check-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    from ..engine.engine import Engine, default_spec

    spec = default_spec(args.draft, args.device)
    if args.steps or args.topk or args.draft_tokens:
        spec = SpecConfig(
            num_steps=args.steps or spec.num_steps,
            topk=args.topk or spec.topk,
            num_draft_tokens=args.draft_tokens,
            page_size=spec.page_size,
        )
    engine = Engine.load(draft=args.draft, spec=spec, device=args.device, dtype=torch.float32, kv_tokens=65536)
    payload = {
        "config": {
            "draft": args.draft,
            "spec": {"S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens, "P": spec.page_size},
            "max_new_tokens": args.max_new_tokens,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "grammar_engine": "llguidance",
            "measured_commit": commit(),
        }
    }
    if args.check or args.check_only:
        payload["check"] = check(engine, args.prompts, args.check_tokens)
        print(json.dumps(payload["check"]), flush=True)
    if not args.check_only:
        payload["speed"] = speed(engine, args.max_new_tokens)
    print(write_result("constrained", payload, args.device))


if __name__ == "__main__":
    main()
