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
