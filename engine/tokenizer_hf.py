"""Tokenizers run by the Hugging Face `tokenizers` library (the one transformers, vLLM and SGLang use).

A Hugging Face model folder brings its own files, read as transformers reads them:

* ``tokenizer.json``: the ids (normalizer, pre-tokenizer, model, added tokens, post-processor);
* ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates of
  which ``default`` is used): rendered by `tokenizer_base.BaseTokenizer.render_chat` with jinja2 as
  transformers renders it;
* ``tokenizer_config.json``'s (or ``special_tokens_map.json``'s) ``bos_token`` and ``eos_token``: the texts the
  template sees. The ids generation stops at come from ``generation_config.json`` (`weights_hf.load_hf`).

`gguf_tokenizer` builds the same kind of tokenizer from the byte-level BPE vocabulary and merges a GGUF file
carries, and `save_tokenizer_files` writes it, with the GGUF's chat template, as a folder's tokenizer files
(`weights_hf.export_gguf_to_hf` exports a whole GGUF model that way).

    tokenizer = load_tokenizer("path/to/model-folder")   # or a .gguf file; None: the folder has no tokenizer.json
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import TokenizerError
from .gguf_file import GGUFFile
from .tokenizer import _CONTROL, _USER_DEFINED, PRE_TOKENIZERS, Tokenizer, bytes_to_unicode
from .tokenizer_base import BaseTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
_BYTE_FALLBACK_PIECE = "<0x"
_METASPACE = "▁"
_INSTALL = "pip install tokenizers"


def _tokenizers():
    try:
        import tokenizers
    except ImportError as error:
        raise TokenizerError(f"a tokenizer.json needs the `tokenizers` package: {_INSTALL}") from error
    return tokenizers


class HFTokenizer(BaseTokenizer):
    """A `tokenizers.Tokenizer` behind the engine's tokenizer interface (encode, decode, stream, chat).

    Decoding goes through each token's bytes (`BaseTokenizer.token_bytes`), so streaming and stop strings work
    as for the GGUF tokenizers: a byte-level vocabulary (GPT-2, Llama 3, SmolLM2, Qwen) maps each character back
    to its byte; a SentencePiece-style one (``▁`` for a space, ``<0xXX>`` byte pieces) maps those; added tokens
    are their text. SentencePiece's decoder also strips the space it prefixed to the first word
    (``Strip``/``Metaspace``); that strip is not applied here, so such a text may start with one space more
    than transformers' ``decode``.
    """

    def __init__(
        self,
        tokenizer: Any,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = tokenizer  # a tokenizers.Tokenizer
        self._plain_backend: Any = None  # the same, with special tokens encoded as text (parse_special=False)
        spec = json.loads(tokenizer.to_str())
        added = tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        spell = _token_speller(spec)
        self._token_bytes = []
        for index in range(size):
            token = tokenizer.id_to_token(index)
            if index in added:
                self._token_bytes.append(added[index].content.encode("utf-8"))
            else:
                self._token_bytes.append(b"" if token is None else spell(token))
        self.special_ids = {index for index, token in added.items() if token.special}
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.chat_template = chat_template
        self.add_bos_token = bos_token_id is not None and tokenizer.encode("").ids[:1] == [bos_token_id]

    @classmethod
    def from_folder(cls, directory: str | os.PathLike) -> HFTokenizer:
        """The tokenizer of a Hugging Face model folder (module docstring); `TokenizerError` if it has none."""
        directory = Path(directory)
        file = directory / TOKENIZER_FILE
        if not file.is_file():
            raise TokenizerError(
                f"{directory} has no {TOKENIZER_FILE}; the engine reads a fast tokenizer's file (transformers writes "
                f"one with AutoTokenizer.from_pretrained(...).save_pretrained(folder))"
            )
        tokenizers = _tokenizers()
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as error:  # the library raises plain Exception for a file it cannot parse
            raise TokenizerError(f"{file} is not a tokenizer file the tokenizers library reads ({error})") from error
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        special_map = _read_json(directory / SPECIAL_TOKENS_FILE)

        def special_id(name: str) -> int | None:
            token = config.get(name, special_map.get(name))
            if isinstance(token, dict):  # {"content": "<s>", ...}, as transformers writes an AddedToken
                token = token.get("content")
            if not token:
                return None
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise TokenizerError(f"{directory}: {name} {token!r} is not a token of {TOKENIZER_FILE}")
            return token_id

        return cls(backend, special_id("bos_token"), special_id("eos_token"), _chat_template(directory, config))

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens``: what the post-processor adds (BOS where the model
        asks for it); ``parse_special``: special-token texts become their ids (else they are encoded as text)."""
        backend = self.backend if parse_special else self._plain()
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def _plain(self) -> Any:
        if self._plain_backend is None:
            self._plain_backend = _tokenizers().Tokenizer.from_str(self.backend.to_str())
            self._plain_backend.encode_special_tokens = True
        return self._plain_backend


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TokenizerError(f"{path} is not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} holds a {type(value).__name__}, not a JSON object")
    return value


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` first (transformers gives it priority), then the config's entry."""
    file = directory / CHAT_TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        if "default" not in named:
            raise TokenizerError(
                f"{directory / TOKENIZER_CONFIG_FILE}: chat templates {sorted(map(str, named))} and none named default"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{directory / TOKENIZER_CONFIG_FILE}: chat_template is not a string")
    return template


def _decoder_types(spec: dict[str, Any] | None) -> set[str]:
    if not spec:
        return set()
    types = {spec.get("type", "")}
    for child in spec.get("decoders") or ():
        types |= _decoder_types(child)
    return types


def _token_speller(spec: dict[str, Any]):
    """``token string -> bytes`` for the vocabulary's spelling (see `HFTokenizer`), from the decoder's kind."""
    types = _decoder_types(spec.get("decoder"))
    if "ByteLevel" in types:
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

        def byte_level(token: str) -> bytes:
            if all(char in byte_of for char in token):
                return bytes(byte_of[char] for char in token)
            return token.encode("utf-8")

        return byte_level
    if types & {"Metaspace", "Replace", "ByteFallback"}:
        byte_fallback = "ByteFallback" in types or bool((spec.get("model") or {}).get("byte_fallback"))

        def sentencepiece(token: str) -> bytes:
            if byte_fallback and len(token) == 6 and token.startswith(_BYTE_FALLBACK_PIECE) and token.endswith(">"):
                return bytes([int(token[3:5], 16)])
            return token.replace(_METASPACE, " ").encode("utf-8")

        return sentencepiece
    raise TokenizerError(
        f"tokenizer.json decoder {sorted(types) or 'none'} is not supported; supported: ByteLevel (byte-level BPE), "
        f"Metaspace/Replace/ByteFallback (SentencePiece style)"
    )


def gguf_tokenizer(path: str | os.PathLike | GGUFFile) -> Any:
    """A `tokenizers.Tokenizer` of the byte-level BPE vocabulary a GGUF file carries (``tokenizer.ggml.model``
    ``gpt2``): its tokens and merges, CONTROL tokens as special added tokens and USER_DEFINED ones as plain
    added tokens, the pre-tokenizer ``tokenizer.ggml.pre`` names (`tokenizer.PRE_TOKENIZERS`), BOS prepended
    when ``tokenizer.ggml.add_bos_token`` says so."""
    tokenizers = _tokenizers()
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

    gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    model = gguf.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise TokenizerError(
            f"{gguf.path}: a tokenizer.json is built from byte-level BPE vocabularies (tokenizer.ggml.model "
            f"'gpt2'), not {model!r}"
        )
    tokens, merges = gguf.get("tokenizer.ggml.tokens"), gguf.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise TokenizerError(f"{gguf.path}: the GGUF has no tokenizer.ggml.tokens or tokenizer.ggml.merges")
    pre = gguf.get("tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(
            f"{gguf.path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    split_digits, pattern = PRE_TOKENIZERS[pre]
    alphabet = bytes_to_unicode()
    byte_of = {char: byte for byte, char in alphabet.items()}
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not all(char in byte_of for char in token):  # an added token spelled in plain text: spell its bytes
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    llama3 = pattern == PRE_TOKENIZERS["llama3"][1]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=llama3))
    if llama3:  # Llama 3's own split, then the byte alphabet without GPT-2's regex
        steps = [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    else:
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if split_digits:
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    types = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = [(tokens[i], t == _CONTROL) for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED) and tokens[i]]
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text, control in added if control])
    backend.add_tokens([AddedToken(text, special=False, normalized=False) for text, control in added if not control])
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    if gguf.get("tokenizer.ggml.add_bos_token") and bos is not None:
        text = tokens[bos]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{text} $A", pair=f"{text} $A {text}:1 $B:1", special_tokens=[(text, int(bos))]
        )
    return backend


def save_tokenizer_files(path: str | os.PathLike | GGUFFile, directory: str | os.PathLike) -> Path:
    """Write a GGUF's tokenizer as a Hugging Face folder's ``tokenizer.json`` and ``tokenizer_config.json``
    (its chat template, BOS/EOS/unknown/padding tokens): what `HFTokenizer.from_folder` and transformers'
    ``AutoTokenizer`` read."""
    gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    backend = gguf_tokenizer(gguf)
    tokens = gguf.get("tokenizer.ggml.tokens")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / TOKENIZER_FILE))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = gguf.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{name}_token"] = tokens[int(token_id)]
    config["add_bos_token"] = bool(gguf.get("tokenizer.ggml.add_bos_token", False))
    context = gguf.get(f"{gguf.get('general.architecture')}.context_length")
    if context:
        config["model_max_length"] = int(context)
    template = gguf.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return directory


def load_tokenizer(path: str | os.PathLike) -> BaseTokenizer | None:
    """The tokenizer of a model path: a GGUF file's own (`Tokenizer.from_gguf`), a Hugging Face folder's
    (`HFTokenizer.from_folder`); None for a folder without ``tokenizer.json`` or a file that is not GGUF."""
    path = Path(path)
    if path.is_dir():
        return HFTokenizer.from_folder(path) if (path / TOKENIZER_FILE).is_file() else None
    if path.suffix != ".gguf":
        return None
    return Tokenizer.from_gguf(path)
