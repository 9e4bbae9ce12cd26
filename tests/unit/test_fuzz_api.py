"""Random and malformed input to the public API: every error is the library's own.

A tiny random Llama (2 layers, 64 tokens) behind the `Engine` and the `Scheduler`, fed garbage:
configs and sampling parameters of wrong types and ranges, prompts that are empty, out of the
vocabulary, not ints, not sequences, tensors of the wrong rank or dtype, drafts of another
vocabulary, models that return NaN. What may come out: a `ValueError` (the input could not be
taken), a request finished with ``finish_reason="error"`` and a message (it could not be run), a
`CycleError` from a broken draft; never an IndexError, TypeError or a torch RuntimeError. And
whatever happened, every KV page is back in the pool.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from speccycle.core import Ports, SamplingParams, SpecConfig
from speccycle.engine.drafters.layerskip import LlamaDraft
from speccycle.engine.drafters.ngram import NgramDraft
from speccycle.engine.engine import Engine
from speccycle.engine.errors import EngineError
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel, random_llama_weights
from speccycle.engine.serving.adaptive import AdaptiveSpeculation
from speccycle.engine.serving.scheduler import Scheduler
from speccycle.engine.weights.weights_gguf import LlamaConfig
from speccycle.statemachine import CycleError

VOCAB = 64
TINY = LlamaConfig(
    architecture="llama",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=512,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_ids=(2,),
)
LIBRARY_ERRORS = (ValueError, CycleError, EngineError)
SPEC = SpecConfig(num_steps=3, topk=2, num_draft_tokens=5, page_size=4)

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(-3, 3), max_size=2),
)
token_like = st.one_of(st.integers(-3, VOCAB + 3), st.integers(0, VOCAB - 1), anything)


@pytest.fixture(scope="module")
def model():
    return LlamaModel(TINY, random_llama_weights(TINY, seed=3, scale=0.5))


def _engine(model, draft: str = "ngram", kv_tokens: int = 256) -> Engine:
    pool = PagedKVPool(num_pages=kv_tokens // SPEC.page_size, page_size=SPEC.page_size)

    def build(engine: Engine):
        return NgramDraft(VOCAB) if draft == "ngram" else LlamaDraft(model, pool, num_layers=1)

    return Engine(model, pool, build, SPEC)


@settings(max_examples=60)
@given(num_steps=anything | st.integers(0, 70), topk=anything | st.integers(0, 20), n=anything, page=anything)
def test_spec_config_rejects_garbage_with_value_errors(num_steps, topk, n, page):
    try:
        config = SpecConfig(num_steps=num_steps, topk=topk, num_draft_tokens=n, page_size=page)
    except ValueError as error:
        assert str(error)
        return
    assert config.num_draft_tokens - 1 <= config.topk + (config.num_steps - 1) * config.topk**2


@settings(max_examples=60)
@given(
    kwargs=st.fixed_dictionaries(
        {},
        optional={
            "temperature": anything,
            "top_k": anything,
            "top_p": anything,
            "seed": anything,
            "max_new_tokens": anything | st.integers(-2, 5),
            "stop_token_ids": anything | st.lists(token_like, max_size=3),
            "stop_strings": anything | st.lists(st.text(max_size=3), max_size=3),
            "min_p": anything,
            "repetition_penalty": anything,
            "presence_penalty": anything,
            "frequency_penalty": anything,
            "logit_bias": anything | st.dictionaries(token_like, anything, max_size=2),
            "bad_words": anything | st.lists(st.lists(token_like, max_size=2), max_size=2),
            "logits_processor": anything,
            "speculate": anything,
            "top_logprobs": anything | st.integers(-1, 25),
        },
    )
)
def test_sampling_params_reject_garbage_with_value_errors(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError as error:
        assert str(error) and "\n" not in str(error)
        return
    assert params.max_new_tokens >= 1 and all(isinstance(s, str) and s for s in params.stop_strings)
    assert all(isinstance(t, int) and isinstance(b, float) for t, b in params.logit_bias)
    assert all(w and all(isinstance(t, int) and t >= 0 for t in w) for w in params.bad_words)
    assert 0 <= params.top_logprobs <= 20 and isinstance(params.speculate, bool)


@settings(max_examples=40)
@given(
    max_batch=anything | st.integers(-1, 4),
    speculation=st.one_of(anything, st.sampled_from(["on", "off", "adaptive", "sometimes"])),
    eos=anything | st.lists(token_like, max_size=2),
)
def test_scheduler_options_reject_garbage_with_value_errors(model, max_batch, speculation, eos):
    engine = _engine(model)
    try:
        Scheduler.from_engine(engine, max_batch_size=max_batch, speculation=speculation, eos_token_ids=eos)
    except ValueError as error:
        assert str(error)


def test_bad_policy_and_mismatched_vocabularies_are_value_errors(model):
    for bad in (dict(ema_weight=0), dict(probe_every=0), dict(cost=3.0), dict(shapes=())):
        with pytest.raises(ValueError, match="AdaptiveSpeculation"):
            AdaptiveSpeculation(**bad)
    engine = _engine(model)
    ports = Ports(target=engine.target, draft=NgramDraft(VOCAB - 14), kv_pool=engine.pool)
    with pytest.raises(ValueError, match="vocabulary"):
        Scheduler(ports, SPEC)
    with pytest.raises(ValueError, match="SpecConfig"):
        Scheduler(Ports(target=engine.target, draft=engine.draft, kv_pool=engine.pool), {"num_steps": 3})


prompts = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),  # valid
    st.lists(token_like, max_size=6),  # empty, out of range, not ints
    anything,  # not a sequence at all
    st.builds(lambda n: torch.arange(n) % VOCAB, st.integers(0, 8)),  # a valid (or empty) tensor
    st.builds(lambda n: torch.rand(n), st.integers(1, 4)),  # floats
    st.builds(lambda n: torch.zeros(2, n, dtype=torch.long), st.integers(1, 3)),  # 2-D
)


@settings(max_examples=30)
@given(
    batch=st.lists(st.tuples(prompts, st.integers(1, 10)), min_size=1, max_size=5),
    draft=st.sampled_from(["ngram", "layerskip"]),
    kv_tokens=st.sampled_from([24, 64, 256]),
    speculation=st.sampled_from(["on", "off", "adaptive"]),
)
def test_scheduler_takes_malformed_prompts_without_foreign_errors(model, batch, draft, kv_tokens, speculation):
    engine = _engine(model, draft, kv_tokens)
    scheduler = Scheduler.from_engine(engine, speculation=speculation, max_batch_size=3, checked=True)
    queued = []
    for prompt, max_new in batch:
        try:
            queued.append(scheduler.submit(prompt, SamplingParams(max_new_tokens=max_new)))
        except ValueError as error:
            assert str(error)
    scheduler.run()
    assert set(scheduler.finished) == set(queued)
    for rid in queued:
        request = scheduler.finished[rid]
        if request.finish_reason == "error":
            assert request.error and str(rid) in request.error
        else:
            assert 1 <= len(request.output) <= request.sampling.max_new_tokens
            assert all(0 <= t < VOCAB for t in request.output)
    assert engine.pool.num_free_pages == engine.pool.num_pages


@settings(max_examples=20)
@given(batch=st.lists(st.lists(token_like, max_size=5), min_size=1, max_size=3), max_new=anything | st.integers(1, 6))
def test_engine_generate_takes_malformed_prompts_without_foreign_errors(model, batch, max_new):
    engine = _engine(model)
    try:
        results, _ = engine.generate(batch, max_new)
    except LIBRARY_ERRORS as error:
        assert str(error)
    else:
        assert len(results) == len(batch)
        for request in results:
            assert request.finish_reason is not None
    assert engine.pool.num_free_pages == engine.pool.num_pages


class NaNTarget:
    """Wraps a target: NaN logits on every row of the chosen requests (a model gone bad)."""

    def __init__(self, target, bad_requests):
        self.target, self.bad, self.vocab_size, self.device = (
            target,
            set(bad_requests),
            target.vocab_size,
            target.device,
        )

    def forward(self, batch):
        out = self.target.forward(batch)
        rows = batch.logits_rows if batch.logits_rows is not None else torch.arange(batch.num_rows)
        owners = [batch.request_ids[int(batch.row_request[int(r)])] for r in rows]
        for i, owner in enumerate(owners):
            if owner in self.bad:
                out.logits[i] = math.nan
        return out


def test_nan_logits_stop_only_that_request(model):
    engine = _engine(model, "layerskip")
    reference = Scheduler.from_engine(engine, speculation="off").generate(
        [[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=8)
    )
    ids = iter(range(100, 200))
    ports = Ports(target=NaNTarget(engine.target, {101}), draft=engine.draft, kv_pool=engine.pool)
    scheduler = Scheduler(ports, SPEC, checked=True, request_ids=ids)
    good, bad = scheduler.generate([[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=8))
    assert bad.finish_reason == "error" and "non-finite logits" in bad.error
    assert good.output == reference[0].output
    assert engine.pool.num_free_pages == engine.pool.num_pages


class NaNDraft:
    """Wraps a forward draft: its logits are NaN. The target still decides, so nothing changes."""

    def __init__(self, draft):
        self.draft, self.kind, self.pairing, self.vocab_size = draft, "forward", draft.pairing, draft.vocab_size

    def extend(self, batch, target_hidden):
        out = self.draft.extend(batch, target_hidden)
        out.logits.fill_(math.nan)
        return out

    def step(self, batch, parent_hidden):
        out = self.draft.step(batch, parent_hidden)
        out.logits.fill_(math.nan)
        return out


class OutOfVocabLookup:
    kind, vocab_size = "lookup", VOCAB

    def propose(self, request_ids, histories, num_steps, num_nodes, topk):
        tokens = torch.full((len(request_ids), 1), VOCAB + 7)
        return tokens, torch.zeros_like(tokens)


def test_broken_drafts_give_library_errors_and_leak_nothing(model):
    engine = _engine(model, "layerskip")
    prompts, params = [[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=6)
    reference = Scheduler.from_engine(engine, speculation="off").generate(prompts, params)
    ports = Ports(target=engine.target, draft=NaNDraft(engine.draft), kv_pool=engine.pool)
    results = Scheduler(ports, SPEC, checked=True, request_ids=iter(range(10, 20))).generate(prompts, params)
    assert [r.output for r in results] == [r.output for r in reference]  # NaN drafts are only rejected

    ports = Ports(target=engine.target, draft=OutOfVocabLookup(), kv_pool=engine.pool)
    scheduler = Scheduler(ports, SPEC, request_ids=iter(range(20, 30)))
    for prompt in prompts:
        scheduler.submit(prompt, params)
    with pytest.raises(CycleError, match="outside"):
        scheduler.run()
    assert all(r.finish_reason == "error" and "CycleError" in r.error for r in scheduler.finished.values())
    assert len(scheduler.finished) == 2 and scheduler.idle
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_prompt_too_big_for_the_pool_is_refused_and_the_rest_runs(model):
    engine = _engine(model, "ngram", kv_tokens=32)
    scheduler = Scheduler.from_engine(engine)
    big, small = scheduler.submit(list(range(40))), scheduler.submit([5, 6, 7], SamplingParams(max_new_tokens=4))
    scheduler.run()
    assert scheduler.finished[big].finish_reason == "error"
    assert "pool" in scheduler.finished[big].error and scheduler.stats.refused == 1
    assert scheduler.finished[small].finish_reason in ("length", "stop")
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_a_scheduler_refuses_a_request_id_it_holds_already(model):
    """A caller's id iterator that repeats an id would let two requests share KV pages: `submit` refuses it."""
    engine = _engine(model, "layerskip")
    scheduler = Scheduler.from_engine(engine, request_ids=iter([7, 7, 7]))
    assert scheduler.submit([3, 4, 5]) == 7
    with pytest.raises(ValueError, match="request id 7 is already in use"):
        scheduler.submit([6, 7])
    scheduler.run()  # finished: its result stays under its id, which a new request may not take either
    assert scheduler.finished[7].finish_reason in ("length", "stop")
    with pytest.raises(ValueError, match="request id 7 is already in use"):
        scheduler.submit([6, 7])
