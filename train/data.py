"""Self-distillation data: the target's own answers to training prompts, stored as token ids only.

    prompts = load_train_prompts("train_prompts.jsonl.gz")           # [{"source", "prompt"}, ...]
    encoded = encode_prompts(tokenizer, prompts, max_prompt_tokens=384)
    data = generate_responses(model_dir_or_engine, encoded, ...)      # a `SelfDistilledData`
    data.save("data.npz"); SelfDistilledData.load("data.npz")
    SelfDistilledData.load_many("data.npz,aug_data.npz")              # several files as one, in order

A sequence is ``prompt ids (chat template) + response ids`` (the response ends with an end-of-turn id
unless it hit ``max_new_tokens``). Target features are not stored: the trainer recomputes them with a
frozen target forward per batch, so the file stays a few MB (uint16 ids) and can leave a GPU machine.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np
import torch

SPEC_BENCH_KEYS = ("turns", "question_id")  # a Spec-Bench file must never be used as training data


def load_train_prompts(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file of ``{"source", "prompt"}`` objects (``.gz`` read transparently)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no training prompts at {path}: pass a JSONL file (or .jsonl.gz) of {{'prompt': ...}}")
    opener = gzip.open if path.suffix == ".gz" else open
    prompts = []
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {number}: not JSON ({err})") from err
            if any(key in item for key in SPEC_BENCH_KEYS):
                raise ValueError(
                    f"{path} line {number} looks like a Spec-Bench question ({SPEC_BENCH_KEYS}): those prompts "
                    f"are for evaluation; train on a prompts file with 'prompt' keys"
                )
            if not isinstance(item.get("prompt"), str):
                raise ValueError(f"{path} line {number}: expected an object with a string 'prompt'")
            prompts.append({"source": item.get("source", ""), "prompt": item["prompt"]})
    return prompts


def load_prompt_files(paths: str | Sequence[str | os.PathLike]) -> list[dict]:
    """The prompts of several files (a comma-separated string or a list), concatenated in order."""
    if isinstance(paths, str):
        paths = [p.strip() for p in paths.split(",") if p.strip()]
    if not paths:
        raise ValueError("no training prompts file given: pass --prompts FILE[,FILE...]")
    prompts = []
    for path in paths:
        prompts += load_train_prompts(path)
    return prompts


def encode_prompts(
    tokenizer, prompts: Sequence[dict], max_prompt_tokens: int, limit: int | None = None, seed: int = 0
) -> list[tuple[int, list[int]]]:
    """Chat-template each prompt; shuffle (seeded), drop those longer than ``max_prompt_tokens``.

    Returns ``(index into prompts, ids)`` pairs, at most ``limit``. Cutting a prompt would cut its
    chat template too, so long prompts are left out rather than truncated.
    """
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    encoded = []
    for index in order:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompts[index]["prompt"]}])
        if len(ids) <= max_prompt_tokens:
            encoded.append((index, ids))
            if limit is not None and len(encoded) >= limit:
                break
    return encoded


@attrs.frozen(eq=False)
class SelfDistilledData:
    """Ragged sequences, flat. Shapes: ``tokens [sum len]``, ``offsets [n + 1]``, ``prompt_lens [n]``."""

    tokens: np.ndarray  # [sum len] uint16 (int32 when the vocabulary does not fit 16 bits)
    offsets: np.ndarray  # [n + 1] int64: sequence i is tokens[offsets[i]:offsets[i + 1]]
    prompt_lens: np.ndarray  # [n] int32: chat-templated prompt tokens at the start of each sequence
    prompt_index: np.ndarray  # [n] int32: line of the prompt in the prompts file
    meta: dict = attrs.field(factory=dict)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def response_tokens(self) -> int:
        return int(self.lengths.sum() - self.prompt_lens.sum())

    @classmethod
    def from_sequences(
        cls, items: Sequence[tuple[int, Sequence[int], Sequence[int]]], vocab_size: int, meta: dict | None = None
    ) -> SelfDistilledData:
        """``items``: ``(prompt index, prompt ids, response ids)`` triples."""
        dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
        seqs = [np.asarray(list(p) + list(r), dtype=dtype) for _, p, r in items]
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        return cls(
            tokens=np.concatenate(seqs) if seqs else np.zeros(0, dtype=dtype),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            prompt_lens=np.array([len(p) for _, p, _ in items], dtype=np.int32),
            prompt_index=np.array([i for i, _, _ in items], dtype=np.int32),
            meta=dict(meta or {}),
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write a compressed ``.npz`` atomically (a run killed mid-write leaves the previous file)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(
            tmp,
            tokens=self.tokens,
            offsets=self.offsets,
            prompt_lens=self.prompt_lens,
            prompt_index=self.prompt_index,
            meta=np.frombuffer(json.dumps(self.meta).encode(), dtype=np.uint8),
        )
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> SelfDistilledData:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"no generated data at {path}: run the generate stage first (or pass --data)")
        with np.load(path) as f:
            return cls(
                tokens=f["tokens"],
                offsets=f["offsets"],
                prompt_lens=f["prompt_lens"],
                prompt_index=f["prompt_index"],
                meta=json.loads(bytes(f["meta"]).decode()) if "meta" in f else {},
            )

    @classmethod
    def concatenate(cls, parts: Sequence[SelfDistilledData], names: Sequence[str] | None = None) -> SelfDistilledData:
        """One dataset of several, in order. ``meta["parts"]`` keeps each part's meta, name and first sequence.

        ``prompt_index`` stays each part's own (an index into that part's prompts file).
        """
        if not parts:
            raise ValueError("nothing to concatenate: pass at least one data file")
        if len(parts) == 1:
            return parts[0]
        wide = any(p.tokens.dtype != np.uint16 for p in parts)
        tokens = np.concatenate([p.tokens.astype(np.int32) if wide else p.tokens for p in parts])
        starts = np.cumsum([0] + [len(p.tokens) for p in parts[:-1]])
        offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, starts)])
        names = list(names) if names is not None else [f"part{i}" for i in range(len(parts))]
        first = np.cumsum([0] + [len(p) for p in parts[:-1]])
        meta = {
            "parts": [
                {"file": name, "first_sequence": int(f), "sequences": len(p), **p.meta}
                for name, f, p in zip(names, first, parts)
            ]
        }
        return cls(
            tokens=tokens,
            offsets=offsets.astype(np.int64),
            prompt_lens=np.concatenate([p.prompt_lens for p in parts]).astype(np.int32),
            prompt_index=np.concatenate([p.prompt_index for p in parts]).astype(np.int32),
            meta=meta,
        )

    @classmethod
    def load_many(cls, paths: str | Sequence[str | os.PathLike]) -> SelfDistilledData:
        """Several ``.npz`` files (a comma-separated string or a list) as one, in the order given."""
        if isinstance(paths, str):
            paths = [p.strip() for p in paths.split(",") if p.strip()]
        return cls.concatenate([cls.load(p) for p in paths], [Path(p).name for p in paths])

    def subset(self, indices: Sequence[int]) -> SelfDistilledData:
        return SelfDistilledData.from_sequences(
            [self.items_at(int(i)) for i in indices], 1 << 16 if self.tokens.dtype == np.uint16 else 1 << 31, self.meta
        )

    def items_at(self, i: int) -> tuple[int, list[int], list[int]]:
        seq, n = self.sequence(i).tolist(), int(self.prompt_lens[i])
        return int(self.prompt_index[i]), seq[:n], seq[n:]

    def items(self) -> list[tuple[int, list[int], list[int]]]:
        out = []
        for i in range(len(self)):
            seq, n = self.sequence(i).tolist(), int(self.prompt_lens[i])
            out.append((int(self.prompt_index[i]), seq[:n], seq[n:]))
        return out


def cut_at_stop(tokens: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """The tokens up to and including the first stop id."""
    out = []
    for token in tokens:
        out.append(int(token))
        if token in stop_ids:
            break
    return out


class HFGenerator:
    """Batched generation with `transformers` (left padding), from a Hugging Face directory.

    The directory comes from `weights_hf.save_hf` of the GGUF weights, so the answers are the embedded
    model's own (up to bfloat16 numerics; the trainer's labels are recomputed by the target anyway).
    """

    def __init__(self, model_dir: str | os.PathLike, device: str, dtype: torch.dtype, stop_ids: Sequence[int]):
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as err:
            raise ValueError(
                "--generator hf needs transformers (pip install transformers); or use --generator engine"
            ) from err
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        self.device, self.stop_ids = device, tuple(stop_ids)

    @torch.inference_mode()
    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[list[int]]:
        """Greedy (``temperature`` 0) or sampled continuations; ``seed`` seeds the sampling (RNG state restored)."""
        width = max(len(p) for p in prompts)
        pad = self.stop_ids[0]
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        sampling = {"temperature": temperature, "top_k": 0, "top_p": top_p} if temperature else {}
        devices = [torch.device(self.device)] if torch.device(self.device).type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=max_new_tokens,
                do_sample=bool(temperature),
                pad_token_id=pad,
                eos_token_id=list(self.stop_ids),
                **sampling,
            )
        return [cut_at_stop(row, self.stop_ids) for row in out[:, width:].tolist()]


class EngineGenerator:
    """Batched generation with the project's own engine (`greedy_decode` over a paged pool): greedy, or
    sampled (temperature and top-p through `process_logits`, a seeded `torch.Generator`)."""

    def __init__(self, config, weights, device: str, dtype: torch.dtype, stop_ids: Sequence[int]):
        from ..engine.models.llama import LlamaModel
        from ..engine.models.target import LlamaTarget

        self.model = LlamaModel(config, weights, dtype=dtype, device=device)
        self.target_cls, self.device, self.stop_ids = LlamaTarget, device, tuple(stop_ids)
        self.dtype = dtype

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[list[int]]:
        from ..backends.torch.sampling import process_logits
        from ..engine.greedy import greedy_decode
        from ..engine.memory.kv_pool import PagedKVPool

        pick = None
        if temperature:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(0 if seed is None else seed)

            def pick(logits: torch.Tensor) -> torch.Tensor:  # [live, V] -> [live]
                probs = process_logits(logits, temperature, 0, top_p)
                return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

        c = self.model.config
        tokens = sum(len(p) for p in prompts) + len(prompts) * (max_new_tokens + 16)
        pool = PagedKVPool(num_pages=-(-tokens // 16) + len(prompts), page_size=16, device=self.device)
        kv = pool.add_cache("target", c.num_layers, c.num_kv_heads, c.head_dim, self.dtype)
        with torch.inference_mode():
            target = self.target_cls(self.model, kv)
            outputs = greedy_decode(target, pool, prompts, max_new_tokens, self.stop_ids, pick=pick)
        return [cut_at_stop(o, self.stop_ids) for o in outputs]


def generate_responses(
    generate: Callable[[Sequence[Sequence[int]], int, float], list[list[int]]],
    encoded: Sequence[tuple[int, list[int]]],
    vocab_size: int,
    batch_size: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    done: SelfDistilledData | None = None,
    time_budget_s: float | None = None,
    on_save: Callable[[SelfDistilledData], None] | None = None,
    save_every_s: float = 60.0,
    meta: dict | None = None,
    log: Callable[[str], None] = print,
) -> SelfDistilledData:
    """Answer every encoded prompt not yet in ``done``; batches of similar prompt length.

    Stops early (keeping what it has) when the next batch would overrun ``time_budget_s``; calls
    ``on_save`` with everything so far every ``save_every_s`` seconds and at the end.
    """
    items = done.items() if done is not None else []
    seen = {index for index, _, _ in items}
    todo = [(i, p) for i, p in encoded if i not in seen]
    # Sort within windows of 16 batches: little left padding, and a time-budget cut still keeps a random subset.
    window = 16 * batch_size
    batches = []
    for start in range(0, len(todo), window):
        chunk = sorted(todo[start : start + window], key=lambda item: len(item[1]))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    meta = {**(done.meta if done is not None else {}), **(meta or {})}
    start = last_save = time.perf_counter()
    slowest = 0.0
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc="generate", unit="prompt", mininterval=5.0)
    except ImportError:
        bar = None
    for number, batch in enumerate(batches, 1):
        elapsed = time.perf_counter() - start
        if time_budget_s is not None and elapsed + 1.2 * slowest > time_budget_s:
            log(f"[generate] time budget {time_budget_s:.0f}s reached after {elapsed:.0f}s: stopping with {len(items)}")
            break
        t0 = time.perf_counter()
        responses = generate([p for _, p in batch], max_new_tokens, temperature)
        slowest = max(slowest, time.perf_counter() - t0)
        items += [(i, p, r) for (i, p), r in zip(batch, responses)]
        if bar is not None:
            bar.update(len(batch))
        new_tokens = sum(len(r) for r in responses)
        log(
            f"[generate] batch {number}/{len(batches)}: {len(batch)} prompts, {new_tokens} new tokens in "
            f"{time.perf_counter() - t0:.1f}s; {len(items)} sequences, {time.perf_counter() - start:.0f}s elapsed"
        )
        if on_save is not None and time.perf_counter() - last_save > save_every_s:
            on_save(SelfDistilledData.from_sequences(items, vocab_size, meta))
            last_save = time.perf_counter()
    if bar is not None:
        bar.close()
    data = SelfDistilledData.from_sequences(items, vocab_size, meta)
    if on_save is not None:
        on_save(data)
    return data
