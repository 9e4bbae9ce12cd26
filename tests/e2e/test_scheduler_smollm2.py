"""The scheduler on SmolLM2: staggered arrivals, a stop string, a pool too small for every request.

Three chat prompts x 16 new tokens, float32 on CPU, n-gram and layer-skip drafts. Each output must
equal the engine's autoregressive greedy output cut by the same stop rules (EOS, the stop string on
the decoded text, `max_new_tokens`), whether the request joined a running batch, was retracted
under KV pressure and resumed, or both.
"""

from __future__ import annotations

import math

import pytest
import torch
from speccycle.core import SamplingParams, SpecConfig
from speccycle.engine.drafters.layerskip import LlamaDraft
from speccycle.engine.drafters.ngram import NgramDraft
from speccycle.engine.engine import Engine
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel
from speccycle.engine.serving.scheduler import Scheduler
from speccycle.statemachine.stops import stop_text_reference

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
MESSAGES = (
    "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "List three primary colors, one per line.",
    "What is the capital of France? Answer in one sentence.",
)


@pytest.fixture(scope="module")
def smollm2():
    from speccycle.engine.tokenizers.tokenizer import Tokenizer
    from speccycle.engine.weights.weights_gguf import default_model_path, load_gguf

    path = default_model_path()
    config, weights = load_gguf(path, dtype=torch.float32)
    return config, weights, Tokenizer.from_gguf(path)


def _engine(smollm2, draft: str, spec: SpecConfig, kv_tokens: int) -> Engine:
    config, weights, tokenizer = smollm2
    model = LlamaModel(config, weights)
    pool = PagedKVPool(num_pages=math.ceil(kv_tokens / spec.page_size), page_size=spec.page_size)

    def build(engine: Engine):
        return NgramDraft(config.vocab_size) if draft == "ngram" else LlamaDraft(model, pool, num_layers=8)

    return Engine(model, pool, build, spec, tokenizer)


@pytest.fixture(scope="module")
def reference(smollm2):
    """Prompts, their autoregressive outputs, and a stop string taken from the middle of the second."""
    engine = _engine(smollm2, "ngram", SpecConfig(), 4096)
    prompts = [engine.chat_prompt(m) for m in MESSAGES]
    outputs = [engine.generate_autoregressive([p], NEW_TOKENS)[0] for p in prompts]
    middle = engine.tokenizer.decode(outputs[1][6:8]).strip()
    stop = middle if len(middle) >= 2 else engine.tokenizer.decode(outputs[1][6:8])
    return prompts, outputs, stop


def _expected(output: list[int], stop: str | None, tokenizer) -> list[int]:
    if stop is None:
        return output
    hit = stop_text_reference(output, (stop,), tokenizer)
    return output if hit is None else output[: hit + 1]


@pytest.mark.parametrize("draft", ["ngram", "layerskip"])
def test_staggered_arrivals_with_a_stop_string_equal_autoregressive(smollm2, reference, draft):
    prompts, outputs, stop = reference
    engine = _engine(smollm2, draft, SpecConfig(num_steps=4, topk=1, page_size=16), 4096)
    scheduler = Scheduler.from_engine(engine, checked=True)
    streamed: dict[int, list[int]] = {}
    scheduler.on_tokens = lambda rid, tokens: streamed.setdefault(rid, []).extend(tokens)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, stop_strings=(stop,))
    ids = [scheduler.submit(prompts[0], params)]
    scheduler.step()
    ids.append(scheduler.submit(prompts[1], params))  # joins a running batch
    scheduler.step()
    scheduler.step()
    ids.append(scheduler.submit(prompts[2], params))
    scheduler.run()
    for rid, output in zip(ids, outputs):
        request = scheduler.finished[rid]
        assert list(request.output) == _expected(output, stop, engine.tokenizer), f"request {rid} diverged"
        assert streamed[rid] == list(request.output)
    assert scheduler.finished[ids[1]].finish_reason == "stop", "the stop string was taken from this answer"
    assert len(scheduler.finished[ids[1]].output) < NEW_TOKENS
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_retracted_requests_resume_with_identical_output(smollm2, reference):
    prompts, outputs, _ = reference
    spec = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)
    # Room to admit all three (prompt + one cycle each, one page spare), not to run them to the end.
    pages = sum(math.ceil((len(p) + spec.reserve_len()) / spec.page_size) for p in prompts) + 1
    engine = _engine(smollm2, "ngram", spec, pages * spec.page_size)
    scheduler = Scheduler.from_engine(engine, checked=True)
    ids = [scheduler.submit(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    scheduler.run()
    assert scheduler.stats.retractions > 0, "the pool was meant to be too small for all three"
    for rid, output in zip(ids, outputs):
        assert list(scheduler.finished[rid].output) == output
    assert engine.pool.num_free_pages == engine.pool.num_pages
