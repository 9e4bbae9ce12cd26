"""`speccycle.engine.LLM` on the embedded model (CPU, float32, its EAGLE head): text in, text out, lossless.

Greedy replies equal the engine's autoregressive output decoded; a batch gives each prompt's own reply; `stream`'s
pieces join to `generate`'s text; chat messages go through the template; a seeded sample repeats; strings never
pass where token ids belong (the engine refuses them too)."""

from __future__ import annotations

import pytest
from speccycle.engine import LLM, Engine
from speccycle.engine.errors import UsageError

NEW = 12


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, draft="eagle", device="cpu", kv_tokens=4096)


def test_a_reply_is_the_autoregressive_output_decoded(llm):
    engine = llm.engine
    for text in ("Name three colors.", "What is 2 + 2?"):
        expected = engine.generate_autoregressive([engine.chat_prompt(text)], NEW)[0]
        assert llm.generate(text, max_new_tokens=NEW) == engine.tokenizer.decode(expected, skip_special_tokens=True)
    batch = llm.generate(["Name three colors.", "What is 2 + 2?"], max_new_tokens=NEW)
    assert batch == [llm.generate(t, max_new_tokens=NEW) for t in ("Name three colors.", "What is 2 + 2?")]


def test_stream_chat_and_sampling(llm):
    text = "Write a haiku about KV caches."
    assert "".join(llm.stream(text, max_new_tokens=NEW)) == llm.generate(text, max_new_tokens=NEW)
    messages = [{"role": "user", "content": text}]
    assert llm.chat(messages, max_new_tokens=NEW) == llm.generate(text, max_new_tokens=NEW)
    first = llm.generate(text, max_new_tokens=NEW, temperature=0.8, seed=3)
    assert first == llm.generate(text, max_new_tokens=NEW, temperature=0.8, seed=3)


def test_strings_never_pass_as_token_ids(llm):
    with pytest.raises(UsageError, match="generate_ids"):
        llm.generate([[1, 2, 3]])
    with pytest.raises(UsageError, match="token ids"):
        llm.generate_ids(["Name three colors."])
    with pytest.raises(UsageError, match="list of messages"):
        llm.chat("Name three colors.")
    with pytest.raises(ValueError, match="sequence of token ids"):
        llm.engine.generate(["Name three colors."])
    assert isinstance(llm.engine, Engine)


@pytest.mark.slow
def test_every_sampling_parameter_decodes_the_same_with_and_without_speculation(llm):
    """Penalties, bias, bad words, logprobs and top logprobs on the real model, greedy: the speculative output and
    its logprobs equal those of one token a cycle (speculate=False, no draft work)."""
    ids = [llm.engine.chat_prompt("List five fruits, then five more.")]
    options = dict(repetition_penalty=1.3, frequency_penalty=0.2, logit_bias={13: -2.0}, bad_words=[(28,), (30, 31)],
                   logprobs=True, top_logprobs=3)  # fmt: skip
    fast = llm.generate_requests(ids, NEW, **options)[0]
    slow = llm.generate_requests(ids, NEW, **options, speculate=False)[0]
    assert fast.output == slow.output and 28 not in fast.output
    assert fast.logprobs == pytest.approx(slow.logprobs, abs=1e-4) and len(fast.logprobs) == len(fast.output)
    assert [[t for t, _ in top] for top in fast.top_logprobs] == [[t for t, _ in top] for top in slow.top_logprobs]
    assert all(len(top) == 3 for top in fast.top_logprobs)


def test_bad_sampling_options_are_one_line_usage_errors():
    from speccycle.engine.llm import sampling_params

    with pytest.raises(UsageError, match="unknown sampling option 'temprature'"):
        sampling_params({"temprature": 0.5})
    with pytest.raises(UsageError, match="min_p=2"):
        sampling_params({"min_p": 2})
    with pytest.raises(UsageError, match="logit_bias"):
        sampling_params({"logit_bias": {"a": 1}})
    assert sampling_params({"speculate": False}).speculate is False
