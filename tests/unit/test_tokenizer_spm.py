"""The SentencePiece (``tokenizer.ggml.model = llama``) tokenizer: BPE rules on a tiny vocabulary, Gemma's chat
format, and Gemma 3 270M's real vocabulary against transformers' tokenizer built from the same GGUF.

About the reference. transformers rebuilds Gemma's BPE merges from the vocabulary order and re-spells the
space-run tokens ("  " -> "▁▁") as ordinary BPE pieces, where SentencePiece (and llama.cpp) match these
USER_DEFINED pieces whole, longest first. The two agree except on runs of more than 31 spaces (the longest
such token): 40 spaces are 31 + 9 here, 16 + 24 there. That case is asserted separately.
"""

from __future__ import annotations

import os

import pytest
from speccycle.engine.errors import ModelLoadError, TokenizerError
from speccycle.engine.tokenizers.tokenizer import Tokenizer
from speccycle.engine.tokenizers.tokenizer_spm import GEMMA_CHAT_TEMPLATE, SentencePieceTokenizer
from speccycle.testing.prompts import spec_bench_prompts

TRICKY = [
    "hello world 123",
    "a  1",
    "x\n\n  y  ",
    "  leading",
    "trailing   ",
    "ünïcödé 中文字符 😀🎉 ½ ² ١٢٣",
    "<start_of_turn>user\nhi<end_of_turn>",
    "don't I'M we'll",
    "tab\tsep\r\nCRLF",
    "a<end_of_turn><start_of_turn>b",
    "Thé quïck\u00a0brown\u2009fox",
    "=" * 200,
    "\n" * 40,
    "<table><tr>x</tr></table>",
    "<0x41> is not a byte",
    "<unused5>z [multimodal]",
]


def tiny(add_space_prefix: bool = False, normal_order: tuple[str, ...] = ("bc", "ab")) -> SentencePieceTokenizer:
    """Control 0-3, user-defined 4-5, 256 byte tokens, then NORMAL pieces best first (scores 0, -1, ...)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<end_of_turn>", "\n", "  "] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 3, 4, 4] + [6] * 256
    normal = ["▁", "a", "b", "c", *normal_order, "aa", "▁a"]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(normal))]
    return SentencePieceTokenizer(
        tokens + normal,
        scores,
        types + [1] * len(normal),
        bos_token_id=2,
        eos_token_id=1,
        chat_template=GEMMA_CHAT_TEMPLATE,
        add_space_prefix=add_space_prefix,
    )


def pieces(tokenizer: SentencePieceTokenizer, text: str, **kwargs) -> list[str]:
    return [tokenizer.decode([i]) for i in tokenizer.encode(text, add_special_tokens=False, **kwargs)]


def test_bpe_merges_the_best_scored_pair_first_then_the_leftmost():
    assert pieces(tiny(normal_order=("bc", "ab")), "abc") == ["a", "bc"]
    assert pieces(tiny(normal_order=("ab", "bc")), "abc") == ["ab", "c"]
    assert pieces(tiny(), "aaa") == ["aa", "a"]  # equal scores: leftmost
    assert pieces(tiny(), "a a") == ["a", " a"]  # spaces are ▁ and merge like any character


def test_byte_fallback_user_defined_and_control_pieces():
    t = tiny()
    ids = t.encode("é", add_special_tokens=False)
    assert ids == [6 + 0xC3, 6 + 0xA9] and t.decode(ids) == "é"
    assert pieces(t, "a  b\nc") == ["a", "  ", "b", "\n", "c"]  # user-defined pieces stay whole
    assert t.encode("a<end_of_turn>", add_special_tokens=False)[-1] == 3
    assert 3 not in t.encode("a<end_of_turn>", add_special_tokens=False, parse_special=False)
    assert t.encode("a")[0] == 2  # add_bos_token
    assert t.decode(t.encode("ab<end_of_turn>c"), skip_special_tokens=True) == "abc"
    assert pieces(tiny(add_space_prefix=True), "a a") == [" a", " a"]


def test_gemma_chat_format():
    t = tiny()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi \n"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert t.render_chat(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert t.render_chat(messages[1:2], add_generation_prompt=False) == "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    with pytest.raises(TokenizerError, match="must alternate"):
        t.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    ids = t.apply_chat_template([{"role": "user", "content": "a"}])
    assert ids[0] == 2 and ids.count(2) == 1  # the template writes BOS; encoding adds none


# ---- Gemma 3 270M's vocabulary ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_path():
    from speccycle.engine.models.catalog import gemma3_270m_path

    try:
        return gemma3_270m_path()
    except ModelLoadError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return Tokenizer.from_gguf(gemma_path)


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    """transformers' tokenizer from the same GGUF (its builder directly: AutoTokenizer's GGUF reader takes ~30 s)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pytest.importorskip("transformers")
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:  # older transformers: the public, slower path
        import transformers

        loaded = transformers.AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
        return loaded.backend_tokenizer
    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(gemma_path))
    return convert_gguf_tokenizer(architecture, tokenizer_dict)[0]


def test_gemma_vocabulary_metadata(gemma):
    assert isinstance(gemma, SentencePieceTokenizer) and gemma.vocab_size == 262144
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.add_bos_token) == (2, 1, True)
    assert gemma.chat_template == GEMMA_CHAT_TEMPLATE  # the base model's GGUF carries none
    assert gemma.encode("<start_of_turn>user\n", add_special_tokens=False) == [105, 2364, 107]


def test_gemma_encode_and_decode_match_transformers(gemma, hf_gemma):
    texts = TRICKY + spec_bench_prompts()
    for text in texts:
        ids = gemma.encode(text, add_special_tokens=False)
        assert ids == hf_gemma.encode(text, add_special_tokens=False).ids, text[:80]
        assert gemma.decode(ids) == text == hf_gemma.decode(ids, skip_special_tokens=False), text[:80]
    assert len(texts) >= len(TRICKY) + 13  # a prompt of every category at least (all 240 with $SPEC_BENCH_DEV)


def test_space_runs_past_the_longest_space_token(gemma, hf_gemma):
    text = " " * 40 + "x"
    ids = gemma.encode(text, add_special_tokens=False)
    assert [len(gemma.decode([i])) for i in ids] == [31, 9, 1]  # longest user-defined piece first
    assert [len(hf_gemma.decode([i])) for i in hf_gemma.encode(text, add_special_tokens=False).ids] == [16, 24, 1]
    assert gemma.decode(ids) == text


def test_gemma_chat_prompt_tokens(gemma, hf_gemma):
    ids = gemma.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids == [2, 105, 2364, 107] + gemma.encode("Hi", add_special_tokens=False) + [106, 107, 105, 4368, 107]
    stream = gemma.stream_decoder()
    assert "".join(stream.push([i]) for i in ids) + stream.flush() == gemma.decode(ids)
    # transformers renders the same template to the same text and ids
    transformers = pytest.importorskip("transformers")
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=hf_gemma, bos_token="<bos>", eos_token="<eos>")
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Where is the Louvre?"},
        {"role": "assistant", "content": "À Paris."},
        {"role": "user", "content": "  And the Prado?  "},
    ]
    text = wrapped.apply_chat_template(
        messages, chat_template=GEMMA_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert gemma.render_chat(messages) == text
    assert gemma.apply_chat_template(messages) == wrapped(text, add_special_tokens=False)["input_ids"]
