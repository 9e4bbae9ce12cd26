"""A Hugging Face folder end to end: the embedded SmolLM2 GGUF exported (`weights_hf.export_gguf_to_hf`: weights,
``tokenizer.json``, ``tokenizer_config.json`` with the chat template, ``generation_config.json``) runs as
``--model <folder>`` and through `LLM`, giving the GGUF path's tokens; the folder readers on small files.
"""

from __future__ import annotations

import json

import pytest
from speccycle.cli import main
from speccycle.engine import LLM
from speccycle.engine.errors import ModelLoadError, TokenizerError
from speccycle.engine.tokenizers.tokenizer import Tokenizer, load_tokenizer, save_tokenizer_files
from speccycle.engine.tokenizers.tokenizer_hf import HFTokenizer
from speccycle.engine.weights.weights_hf import export_gguf_to_hf, generation_eos_ids, load_hf
from speccycle.testing.prompts import one_prompt_of, spec_bench_prompts

NEW = 12
CATEGORIES = ("writing", "math", "qa")


@pytest.fixture(scope="module")
def folder(model_path, tmp_path_factory):
    return export_gguf_to_hf(model_path, tmp_path_factory.mktemp("hf") / "smollm2")


@pytest.mark.slow
def test_exported_folder_tokenizes_as_the_gguf(folder, model_path):
    gguf, hf = Tokenizer.from_gguf(model_path), load_tokenizer(folder)
    assert isinstance(hf, HFTokenizer) and hf.chat_template == gguf.chat_template
    for name in ("bos_token_id", "eos_token_id", "special_ids", "add_bos_token"):
        assert getattr(hf, name) == getattr(gguf, name), name
    texts = [*spec_bench_prompts(), "a  1 22 333", "<|im_start|>user\n  x\t\n<|im_end|>", "é中文🙂"]
    for text in texts:
        for parse_special in (True, False):
            assert hf.encode(text, parse_special=parse_special) == gguf.encode(text, parse_special=parse_special)
        ids = gguf.encode(text)
        assert hf.decode(ids) == gguf.decode(ids)
        messages = [{"role": "user", "content": text}]
        assert hf.apply_chat_template(messages) == gguf.apply_chat_template(messages)
    config, _ = load_hf(folder)
    assert config.eos_token_ids == generation_eos_ids(folder) == (2,)


@pytest.mark.slow
def test_transformers_reads_the_exported_tokenizer_alike(folder):
    transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")
    theirs, ours = transformers.AutoTokenizer.from_pretrained(str(folder)), HFTokenizer.from_folder(folder)
    for text in one_prompt_of(CATEGORIES):
        messages = [{"role": "user", "content": text}]
        rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == ours.render_chat(messages)
        assert theirs(rendered, add_special_tokens=False)["input_ids"] == ours.apply_chat_template(messages)


@pytest.mark.slow
def test_folder_generates_the_gguf_tokens(folder, model_path, capsys):
    prompts = one_prompt_of(CATEGORIES)
    from_gguf = LLM(model_path, draft="ngram", device="cpu", kv_tokens=4096)
    from_folder = LLM(folder, draft="ngram", device="cpu", kv_tokens=4096)
    assert from_folder.engine.stop_token_ids == from_gguf.engine.stop_token_ids
    for text in prompts:
        ids = from_folder.engine.chat_prompt(text)
        assert ids == from_gguf.engine.chat_prompt(text)
        assert from_folder.generate_ids([ids], NEW) == from_gguf.generate_ids([ids], NEW)
    capsys.readouterr()
    argv = ["generate", prompts[0], "--model", str(folder), "--draft", "ngram", "--device", "cpu"]
    assert main([*argv, "--max-new-tokens", str(NEW)]) == 0
    assert capsys.readouterr().out == from_gguf.generate(prompts[0], max_new_tokens=NEW) + "\n"


@pytest.mark.slow
def test_a_sentencepiece_gguf_exports_its_tokenizer(tmp_path):
    """Gemma 3's SentencePiece vocabulary written as tokenizer.json reads back to the same ids, bytes and chat."""
    from speccycle.engine.models.catalog import gemma3_270m_path

    try:
        path = gemma3_270m_path()
    except ModelLoadError as error:
        pytest.skip(str(error))
    gguf, hf = Tokenizer.from_gguf(path), HFTokenizer.from_folder(save_tokenizer_files(path, tmp_path))
    assert hf._token_bytes == gguf._token_bytes and hf.special_ids == gguf.special_ids
    assert (hf.bos_token_id, hf.eos_token_id, hf.add_bos_token) == (gguf.bos_token_id, gguf.eos_token_id, True)
    for text in [*one_prompt_of(CATEGORIES), " " * 40 + "x", "<start_of_turn>user\n  x\t<end_of_turn>", "é中文🙂"]:
        for parse_special in (True, False):
            assert hf.encode(text, parse_special=parse_special) == gguf.encode(text, parse_special=parse_special)
        messages = [{"role": "user", "content": text}]
        assert hf.apply_chat_template(messages) == gguf.apply_chat_template(messages)


# ---- the folder readers, on small files -----------------------------------------------------------------------
def _tiny_backend(sentencepiece: bool = False):
    """A byte-level BPE over a few tokens (or a SentencePiece-style one with byte fallback) and two specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if sentencepiece:
        vocab = {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "▁a": 4, **{f"<0x{b:02X}>": 5 + b for b in range(256)}}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        vocab = {"a": 0, "b": 1, "Ġ": 2, "Ġa": 3, "ab": 4}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "a"), ("a", "b")]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    size = backend.get_vocab_size()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")])
    assert backend.token_to_id("<s>") == size
    return backend


def _folder(path, config: dict | None = None, sentencepiece: bool = False, template_file: str | None = None):
    path.mkdir(parents=True, exist_ok=True)
    _tiny_backend(sentencepiece).save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (path / "chat_template.jinja").write_text(template_file)
    return path


def test_folder_tokenizer_reads_specials_templates_and_decodes_bytes(tmp_path):
    template = "{% for m in messages %}{{ bos_token }}{{ m['content'] | tojson }}{{ eos_token }}{% endfor %}"
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": template}
    tok = HFTokenizer.from_folder(_folder(tmp_path / "plain", config))
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert (bos, eos, tok.special_ids, tok.add_bos_token) == (5, 6, {5, 6}, False)
    assert tok.encode("ab a<s>") == [4, 3, bos] and tok.encode("<s>", parse_special=False) == []
    assert tok.decode([4, 3, bos]) == "ab a<s>" and tok.decode([4, 3, bos], skip_special_tokens=True) == "ab a"
    # transformers' tojson: no HTML escaping
    assert tok.render_chat([{"role": "user", "content": "a<b>&'"}]) == '<s>"a<b>&\'"</s>'
    # a chat_template.jinja wins over the config's entry; named templates use "default"
    jinja = HFTokenizer.from_folder(_folder(tmp_path / "jinja", config, template_file="{{ messages[0]['role'] }}"))
    assert jinja.render_chat([{"role": "user", "content": "x"}]) == "user"
    named = {**config, "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    assert HFTokenizer.from_folder(_folder(tmp_path / "named", named)).chat_template == "D"
    failing = {**config, "chat_template": "{{ raise_exception('roles must alternate') }}"}
    with pytest.raises(TokenizerError, match="chat template: roles must alternate"):
        HFTokenizer.from_folder(_folder(tmp_path / "raise", failing)).render_chat([])
    # SentencePiece style: ▁ is a space, <0xXX> pieces are bytes (a character split over pieces streams whole)
    spm = HFTokenizer.from_folder(_folder(tmp_path / "spm", {"eos_token": "</s>"}, sentencepiece=True))
    ids = spm.encode("a b€")
    assert spm.decode(ids) == spm.backend.decode(ids) == "a b€" and len(ids) == 6  # a ▁ b and three byte pieces
    decoder = spm.stream_decoder()
    assert [decoder.push(i) for i in ids][-3:] == ["", "", "€"]


def test_folder_refusals_and_absences(tmp_path):
    assert load_tokenizer(tmp_path) is None and load_tokenizer(tmp_path / "weights.bin") is None
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        HFTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a tokenizer file the tokenizers library reads"):
        HFTokenizer.from_folder(tmp_path)
    with pytest.raises(TokenizerError, match=r"bos_token '<bos>' is not a token of tokenizer.json"):
        HFTokenizer.from_folder(_folder(tmp_path / "bos", {"bos_token": "<bos>"}))
    with pytest.raises(TokenizerError, match="none named default"):
        HFTokenizer.from_folder(_folder(tmp_path / "named", {"chat_template": [{"name": "x", "template": "y"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert generation_eos_ids(tmp_path) == (7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert generation_eos_ids(tmp_path) == (4,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert generation_eos_ids(tmp_path) is None
