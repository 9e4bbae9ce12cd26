"""Broader self-distillation prompts, derived from the training prompts (``python -m speccycle.train.augment``).

The training prompts (GSM8K, T0 templates, Self-Instruct) teach a draft head the target's answers to
math and short classification tasks; eleven task kinds are rare or absent there. This module rewraps
the passages, questions, dialogues, sentences and topics found in those prompts (`augment_sources`)
as new tasks of each kind (`augment_kinds`), balanced across kinds:

    summarization, rag, qa, extraction, translation, writing, roleplay, coding, stem, humanities, reasoning

and, asked for by name (``--kinds``), two long-context kinds that stitch several passages into one prompt of
~500-1,400 tokens, as Spec-Bench's summarization and rag prompts are (`augment_kinds.LONG_KINDS`):

    longsummary, longrag

Rows are ``{"source": "aug:<kind>:<origin source>", "prompt": ...}`` (``origin`` ``builtin`` where the
material came from `augment_lists` or `augment_puzzles`). The output is deterministic for a seed, a
prompts file and a tokenizer. A prompt is refused when it repeats another (or a training prompt),
when its chat-templated length passes ``--max-tokens``, or when it shares a run of ``--ngram`` words
with any prompt of the ``--exclude`` files (Spec-Bench: the evaluation set never leaks into training).

    python -m speccycle.train.augment --prompts train_prompts.jsonl.gz --out aug_prompts.jsonl.gz \\
        --exclude spec_bench_dev.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from pathlib import Path

from .augment_kinds import KINDS, LONG_KINDS
from .augment_sources import parse_material
from .data import load_train_prompts

NGRAM = 8  # words in a row shared with an excluded prompt that refuse a new prompt
MAX_TOKENS = 300  # chat-templated tokens (the generate stage skips prompts over --max-prompt-tokens 384)
ATTEMPTS_PER_PROMPT = 40  # a kind gives up after this many tries per prompt it still lacks


def normalized_words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class OverlapFilter:
    """Does a text share ``n`` consecutive words (case and punctuation ignored) with any excluded text?"""

    def __init__(self, texts: Iterable[str], n: int = NGRAM) -> None:
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        self.texts = 0
        for text in texts:
            self.texts += 1
            tokens = normalized_words(text)
            self.grams.update(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))

    def overlaps(self, text: str) -> bool:
        tokens = normalized_words(text)
        return any(tuple(tokens[i : i + self.n]) in self.grams for i in range(len(tokens) - self.n + 1))


def excluded_texts(paths: Sequence[str | os.PathLike], bundled: bool = True) -> list[str]:
    """Every turn of every Spec-Bench-style file (``turns``; ``prompt`` or ``text`` keys read too).

    ``bundled`` adds the Spec-Bench sample shipped with speccycle (``engine/data``), so some exclusion
    always applies; pass the full evaluation file with ``--exclude``.
    """
    sources: list[tuple[str, str]] = []
    if bundled:
        sample = resources.files("speccycle.engine").joinpath("data", "spec_bench_sample.jsonl")
        sources.append(("speccycle.engine/data/spec_bench_sample.jsonl", sample.read_text(encoding="utf-8")))
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"--exclude {path}: no such file (pass the Spec-Bench JSONL, e.g. spec_bench_dev.jsonl)")
        sources.append((str(path), Path(path).read_text(encoding="utf-8")))
    texts = []
    for name, content in sources:
        for number, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{name} line {number}: not JSON ({err})") from err
            turns = item.get("turns") or [item.get("prompt") or item.get("text") or ""]
            texts += [t for t in turns if isinstance(t, str) and t]
    return texts


def estimate_tokens(text: str) -> int:
    """Chat-templated tokens without a tokenizer: ~3.2 characters a token plus SmolLM2's template."""
    return -(-len(text) * 10 // 32) + 24


def chat_token_counter(tokenizer) -> Callable[[str], int]:
    return lambda text: len(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _key(text: str) -> str:
    return " ".join(normalized_words(text))


def augment(
    prompts: Sequence[dict],
    count: int = 20000,
    seed: int = 0,
    exclude: OverlapFilter | None = None,
    token_count: Callable[[str], int] | None = None,
    max_tokens: int = MAX_TOKENS,
    kinds: Sequence[str] | None = None,
) -> tuple[list[dict], dict]:
    """``count`` new prompts, split evenly over ``kinds``; returns ``(rows, report)``.

    ``report``: ``kinds`` (prompts per kind), ``origins`` (per origin source), ``refused`` (counts for
    ``spec_bench_overlap``, ``too_long``, ``duplicate``, ``no_material``), ``short`` (kinds that found
    fewer prompts than their share: their material ran out) and ``material`` (pieces parsed).
    """
    kinds = list(kinds or KINDS)
    builders = {**KINDS, **LONG_KINDS}
    unknown = [k for k in kinds if k not in builders]
    if unknown:
        raise ValueError(f"unknown kinds {unknown}: choose from {', '.join(builders)}")
    token_count = token_count or estimate_tokens
    material = parse_material(prompts)
    seen = {_key(p["prompt"]): None for p in prompts}  # never repeat a training prompt either
    refused = Counter({"spec_bench_overlap": 0, "too_long": 0, "duplicate": 0, "no_material": 0})
    rows: list[dict] = []
    per_kind: dict[str, int] = {}
    for number, kind in enumerate(kinds):
        target = count // len(kinds) + (number < count % len(kinds))
        rng = random.Random(f"augment:{seed}:{kind}")
        made = 0
        for _ in range(target * ATTEMPTS_PER_PROMPT):
            if made >= target:
                break
            built = builders[kind](rng, material)
            if built is None:
                refused["no_material"] += 1
                continue
            prompt, origin = built
            prompt = prompt.strip()
            key = _key(prompt)
            if key in seen:
                refused["duplicate"] += 1
                continue
            seen[key] = None
            if exclude is not None and exclude.overlaps(prompt):
                refused["spec_bench_overlap"] += 1
                continue
            if token_count(prompt) > max_tokens:
                refused["too_long"] += 1
                continue
            rows.append({"source": f"aug:{kind}:{origin}", "prompt": prompt})
            made += 1
        per_kind[kind] = made
    random.Random(seed).shuffle(rows)
    origins = Counter(row["source"].split(":", 2)[2] for row in rows)
    report = {
        "kinds": per_kind,
        "origins": dict(origins.most_common()),
        "refused": dict(refused),
        "short": {k: n for k, n in per_kind.items() if n < count // len(kinds)},
        "material": material.counts(),
    }
    return rows, report


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> Path:
    """JSONL, gzipped when the name ends in ``.gz`` (no timestamp in the header: same rows, same bytes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    if path.suffix == ".gz":
        buffer = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
            f.write(text)
        text = buffer.getvalue()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(text)
    os.replace(tmp, path)
    return path


def _token_counter(args) -> tuple[Callable[[str], int], str]:
    if args.estimate_tokens:
        return estimate_tokens, "estimated (3.2 characters a token)"
    from ..engine.errors import ModelLoadError
    from ..engine.tokenizers.tokenizer import Tokenizer
    from ..engine.weights.weights_gguf import default_model_path

    try:
        source = args.tokenizer or default_model_path()
    except ModelLoadError as err:
        raise ValueError(
            f"no tokenizer to count prompt tokens ({err}): pass --tokenizer GGUF or --estimate-tokens"
        ) from err
    return chat_token_counter(Tokenizer.from_gguf(source)), f"chat-templated with {Path(source).name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m speccycle.train.augment",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prompts", required=True, help="training prompts JSONL (.gz read too); Spec-Bench refused")
    parser.add_argument("--out", required=True, help="output JSONL (.gz: gzipped)")
    parser.add_argument("--count", type=int, default=20000, help="new prompts, split evenly over the kinds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--exclude", action="append", default=[], help="Spec-Bench JSONL whose prompts must not leak (repeatable)"
    )
    parser.add_argument("--ngram", type=int, default=NGRAM, help="shared words in a row that refuse a prompt")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="chat-templated tokens per prompt, at most")
    parser.add_argument("--tokenizer", default=None, help="GGUF whose tokenizer counts tokens (default: SmolLM2's)")
    parser.add_argument("--estimate-tokens", action="store_true", help="estimate token counts (no tokenizer)")
    parser.add_argument("--kinds", default=None, help=f"comma-separated subset of: {', '.join(KINDS)} (the default), "
                        f"and the long-context kinds {', '.join(LONG_KINDS)} (prompts of ~500-1,400 tokens: raise "
                        "--max-tokens, and the generate stage's --max-prompt-tokens)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.count < 1:
            raise ValueError(f"--count {args.count}: ask for at least one prompt")
        prompts = load_train_prompts(args.prompts)
        exclude = OverlapFilter(excluded_texts(args.exclude), args.ngram)
        token_count, counted = _token_counter(args)
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
        rows, report = augment(prompts, args.count, args.seed, exclude, token_count, args.max_tokens, kinds)
        path = write_jsonl(rows, args.out)
    except ValueError as err:
        print(f"augment: error: {err}", file=sys.stderr)
        return 2
    leaked = sum(exclude.overlaps(p["prompt"]) for p in prompts)
    print(f"[augment] {len(prompts)} training prompts read from {args.prompts}")
    print(f"[augment] material: {', '.join(f'{k} {v}' for k, v in report['material'].items())}")
    print(
        f"[augment] excluded: {exclude.texts} prompts ({len(exclude.grams)} {args.ngram}-grams) from the bundled "
        f"Spec-Bench sample{''.join(', ' + e for e in args.exclude)}; {leaked} training prompts share one (kept: "
        "they are the input, not this file)"
    )
    print(f"[augment] tokens {counted}, at most {args.max_tokens}")
    print(f"[augment] prompts per kind: {', '.join(f'{k} {v}' for k, v in report['kinds'].items())}")
    refused = report["refused"]
    print(
        f"[augment] refused: {refused['spec_bench_overlap']} sharing {args.ngram} words in a row with an excluded "
        f"prompt, {refused['too_long']} too long, {refused['duplicate']} duplicates, {refused['no_material']} "
        "without material"
    )
    if report["short"]:
        print(f"[augment] short of their share (material ran out): {report['short']}")
    top = ", ".join(f"{k} {v}" for k, v in list(report["origins"].items())[:12])
    print(f"[augment] top origins: {top}")
    print(f"[augment] wrote {len(rows)} prompts to {path} ({path.stat().st_size / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
