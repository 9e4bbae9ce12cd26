"""Tokenizers run by the Hugging Face `tokenizers` library (the one transformers, vLLM and SGLang use).

`HFTokenizer` puts a `tokenizers.Tokenizer` behind the engine's tokenizer interface. The GGUF tokenizers are
built on it (`tokenizer.Tokenizer`: byte-level BPE from the file's tokens and merges; `tokenizer_spm`:
SentencePiece BPE from its pieces and scores), and a Hugging Face model folder brings its own files, read as
transformers reads them:

* ``tokenizer.json``: the ids (normalizer, pre-tokenizer, model, added tokens, post-processor);
* ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates of
  which ``default`` is used): rendered by `tokenizer_base.BaseTokenizer.render_chat` with jinja2 as
  transformers renders it;
* ``tokenizer_config.json``'s (or ``special_tokens_map.json``'s) ``bos_token`` and ``eos_token``: the texts the
  template sees. The ids generation stops at come from ``generation_config.json`` (`weights_hf.load_hf`).

`tokenizer.save_tokenizer_files` writes a GGUF's tokenizer, with its chat template, as a folder's tokenizer files
(`weights_hf.export_gguf_to_hf` exports a whole GGUF model that way); `tokenizer.load_tokenizer` gives the
tokenizer of any model path.

    tokenizer = HFTokenizer.from_folder("path/to/model-folder")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import TokenizerError
from .tokenizer_base import BaseTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
_BYTE_FALLBACK_PIECE = "<0x"
_METASPACE = "▁"
_INSTALL = "pip install tokenizers"


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte as a printable character (printable Latin-1 bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tokenizers_library():
    try:
        import tokenizers
    except ImportError as error:
        raise TokenizerError(f"the tokenizers run on the `tokenizers` package: {_INSTALL}") from error
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
        token_bytes: Sequence[bytes] | None = None,
        special_ids: set[int] | None = None,
    ) -> None:
        """``tokenizer``: a `tokenizers.Tokenizer`. ``token_bytes`` and ``special_ids``: each id's bytes and the ids
        ``skip_special_tokens`` drops, where the caller knows them (a GGUF's metadata); by default read from
        ``tokenizer`` (its decoder's spelling; its special added tokens)."""
        self.backend = tokenizer
        self._lock = threading.Lock()  # encode flips the backend's encode_special_tokens for parse_special=False
        added = tokenizer.get_added_tokens_decoder()  # {id: AddedToken}
        if token_bytes is None:
            spell = _token_speller(tokenizer)
            token_bytes = []
            for index in range(tokenizer.get_vocab_size(with_added_tokens=True)):
                token = tokenizer.id_to_token(index)
                if index in added:
                    token_bytes.append(added[index].content.encode("utf-8"))
                else:
                    token_bytes.append(b"" if token is None else spell(token))
        self._token_bytes = list(token_bytes)
        self.special_ids = (
            {index for index, token in added.items() if token.special} if special_ids is None else set(special_ids)
        )
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
        tokenizers = tokenizers_library()
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
        asks for it); ``parse_special``: special-token texts become their ids (else they are encoded as text;
        added tokens that are not special are always cut out whole, as transformers and llama.cpp do)."""
        with self._lock:
            self.backend.encode_special_tokens = not parse_special
            try:
                return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
            finally:
                self.backend.encode_special_tokens = False


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


def _token_speller(tokenizer: Any):
    """``token string -> bytes`` for the vocabulary's spelling (see `HFTokenizer`), from the decoder's kind."""
    decoder = tokenizer.decoder
    types = _decoder_types(json.loads(decoder.__getstate__()) if decoder is not None else None)
    if "ByteLevel" in types:
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

        def byte_level(token: str) -> bytes:
            if all(char in byte_of for char in token):
                return bytes(byte_of[char] for char in token)
            return token.encode("utf-8")

        return byte_level
    if types & {"Metaspace", "Replace", "ByteFallback"}:
        byte_fallback = "ByteFallback" in types or bool(getattr(tokenizer.model, "byte_fallback", False))

        def sentencepiece(token: str) -> bytes:
            if byte_fallback and len(token) == 6 and token.startswith(_BYTE_FALLBACK_PIECE) and token.endswith(">"):
                return bytes([int(token[3:5], 16)])
            return token.replace(_METASPACE, " ").encode("utf-8")

        return sentencepiece
    raise TokenizerError(
        f"tokenizer.json decoder {sorted(types) or 'none'} is not supported; supported: ByteLevel (byte-level BPE), "
        f"Metaspace/Replace/ByteFallback (SentencePiece style)"
    )
