"""The GGUF byte-level BPE tokenizer against transformers and llama.cpp on SmolLM2's vocabulary.

About the reference. SmolLM2's own ``tokenizer.json`` pre-tokenizes with ``Digits(individual_digits)``
then ``ByteLevel`` (llama.cpp's ``smollm`` pre-type does the same). transformers' GGUF loader does not
know ``smollm`` and uses plain GPT-2 splitting, which differs on whitespace runs before a digit
(``"a  1"``: ``[a, ĠĠ, 1]`` vs ``[a, Ġ, Ġ, 1]``; 1 of the 240 Spec-Bench prompts). We follow SmolLM2's
tokenizer.json; the transformers reference gets that pre-tokenizer put back, and
``pre_tokenizer="gpt2"`` reproduces transformers' GGUF loader as it is.
"""

from __future__ import annotations

import os

import pytest
import torch
from speccycle.engine.errors import TokenizerError
from speccycle.engine.tokenizers.tokenizer import Tokenizer
from speccycle.testing.prompts import spec_bench_prompts

TRICKY = [
    "hello world 123",
    "a  1",
    "x\n\n  y  ",
    "  leading",
    "trailing   ",
    "ünïcödé 中文字符 😀🎉 ½ ² ١٢٣",
    "<|im_start|>user\nhi<|im_end|>",
    "don't I'M we'll",
    "tab\tsep\r\nCRLF",
    "a<|im_end|><|im_start|>b",
    "Thé quïck\u00a0brown\u2009fox",
    "=" * 200,
]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def hf_tokenizer(model_path):
    """transformers' tokenizer from the same GGUF, stock (GPT-2 splitting)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)


@pytest.fixture(scope="module")
def hf_smollm2_tokenizer(hf_tokenizer):
    """The same, with SmolLM2 tokenizer.json's pre-tokenizer (Digits then ByteLevel)."""
    import copy

    from tokenizers import pre_tokenizers

    fixed = copy.deepcopy(hf_tokenizer)
    fixed.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return fixed


def test_special_tokens_and_metadata(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_start|>", parse_special=False) != [1]
    assert tokenizer.encode("a  1") == [81, 256, 33]  # SmolLM2: digits split off first
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""


def test_decode_inverts_encode(tokenizer):
    for text in TRICKY + spec_bench_prompts()[:40]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_stream_decoder_never_splits_a_character(tokenizer):
    text = "Emoji 😀🎉 and 中文字符 mixed"
    ids = tokenizer.encode(text)
    stream = tokenizer.stream_decoder()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces[:-1]  # some token ended mid-character and waited for the next


def test_chat_template_renders_chatml_with_default_system(tokenizer):
    text = tokenizer.render_chat([{"role": "user", "content": "Hi!"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert ids[0] == 1 and ids[-4:] == tokenizer.encode("<|im_start|>assistant\n")


def test_unsupported_pre_tokenizer_is_named():
    with pytest.raises(TokenizerError, match="pre-tokenizer 'klingon' .* not supported"):
        Tokenizer(tokens=["a"], merges=[], pre_tokenizer="klingon")


def test_encode_matches_llama_cpp(tokenizer, model_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    vocab = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    for text in TRICKY + spec_bench_prompts():
        assert tokenizer.encode(text) == vocab.tokenize(text.encode(), add_bos=False, special=True), text


@pytest.mark.slow
def test_encode_matches_transformers_on_spec_bench(tokenizer, model_path, hf_tokenizer, hf_smollm2_tokenizer):
    prompts = spec_bench_prompts()[::12][:20] + TRICKY
    for text in prompts:
        assert tokenizer.encode(text) == hf_smollm2_tokenizer.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == hf_tokenizer.decode(hf_tokenizer.encode(text))
    as_transformers = Tokenizer.from_gguf(model_path, pre_tokenizer="gpt2")
    for text in prompts:
        assert as_transformers.encode(text) == hf_tokenizer.encode(text), text


@pytest.mark.slow
def test_chat_template_matches_transformers(tokenizer, hf_smollm2_tokenizer):
    conversations = [
        [{"role": "user", "content": spec_bench_prompts()[0]}],
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "And of Italy, 2 answers?"},
        ],
    ]
    for messages in conversations:
        expected = hf_smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert tokenizer.apply_chat_template(messages) == list(expected)
        text = hf_smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        assert tokenizer.render_chat(messages, add_generation_prompt=False) == text
    assert torch.tensor(tokenizer.apply_chat_template(conversations[1])).max() < tokenizer.vocab_size
