"""A byte-level BPE tokenizer built from a GGUF file's tokenizer metadata (``tokenizer.ggml.model = gpt2``).

(SentencePiece vocabularies, ``tokenizer.ggml.model = llama`` as in Gemma 3, live in `tokenizer_spm`;
`Tokenizer.from_gguf` builds either.)

The GGUF's tokens and merges become a Hugging Face `tokenizers` BPE model, run by that library (the one
transformers uses), so ids match `transformers` exactly:

1. special tokens (GGUF token types CONTROL, and USER_DEFINED ones, which are cut whatever ``parse_special``
   says, as llama.cpp and transformers do) are cut out of the text whole, the longest at a position first;
2. pre-tokenization splits the rest (``tokenizer.ggml.pre`` picks the rules, see `PRE_TOKENIZERS`);
3. each piece is spelled in GPT-2's byte alphabet (`bytes_to_unicode`) and merged by BPE rank (Llama 3's
   pre-type also takes a piece that is a whole token as it is, ``ignore_merges``, as its tokenizer.json does).

Decoding maps ids back to bytes and UTF-8 decodes them; `tokenizer_base.StreamDecoder` does that
incrementally so a character split across tokens is emitted once it is whole. `apply_chat_template`
(`tokenizer_base.BaseTokenizer`) renders the GGUF's Jinja chat template the way `transformers` does and
encodes the result. The same tokenizer, written as a ``tokenizer.json``, is what a Hugging Face folder
exported from the GGUF carries (`save_tokenizer_files`). `load_tokenizer` gives a model path's tokenizer: a
GGUF file's, or a Hugging Face folder's (`tokenizer_hf.HFTokenizer`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import TokenizerError
from ..weights.gguf_file import GGUFFile
from .tokenizer_base import BaseTokenizer
from .tokenizer_hf import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, HFTokenizer, bytes_to_unicode, tokenizers_library
from .tokenizer_spm import SentencePieceTokenizer

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (split every digit off first, the byte-level split regex). The digit split is
# Hugging Face's `Digits(individual_digits=True)` ahead of `ByteLevel`, as in SmolLM2's tokenizer.json.
PRE_TOKENIZERS: dict[str, tuple[bool, str]] = {
    "gpt2": (False, _GPT2_SPLIT),
    "default": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "starcoder": (True, _GPT2_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
}

_CONTROL, _USER_DEFINED = 3, 4


class Tokenizer(HFTokenizer):
    """Byte-level BPE: ``encode(text) -> ids``, ``decode(ids) -> text``, ``apply_chat_template(messages)``."""

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        pre_tokenizer: str = "gpt2",
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        types = list(token_types) if token_types is not None else [1] * len(tokens)
        backend = byte_level_backend(tokens, merges, types, pre_tokenizer, bos_token_id if add_bos_token else None)
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        token_bytes = [
            bytes(byte_of[char] for char in token) if all(char in byte_of for char in token) else token.encode("utf-8")
            for token in tokens
        ]
        control = {i for i, t in enumerate(types) if t == _CONTROL and tokens[i]}
        super().__init__(backend, bos_token_id, eos_token_id, chat_template, token_bytes, control)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike | GGUFFile, pre_tokenizer: str | None = None) -> BaseTokenizer:
        """Build the tokenizer a GGUF file describes; raises `TokenizerError` for unsupported kinds.

        ``tokenizer.ggml.model`` ``gpt2`` gives this class; ``llama`` (SentencePiece, e.g. Gemma 3) a
        `tokenizer_spm.SentencePieceTokenizer`, which shares the decoding and chat-template methods.

        ``pre_tokenizer`` overrides ``tokenizer.ggml.pre``. Note: transformers' GGUF loader ignores
        ``smollm`` and splits with plain GPT-2 rules (no digit split), so it differs from SmolLM2's own
        tokenizer.json and from llama.cpp on whitespace runs before a digit (``"a  1"``);
        ``pre_tokenizer="gpt2"`` reproduces that loader.
        """
        gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
        model = gguf.get("tokenizer.ggml.model")
        if model == "llama":
            return SentencePieceTokenizer.from_gguf(gguf)
        if model != "gpt2":
            raise TokenizerError(
                f"{gguf.path}: tokenizer model {model!r} (tokenizer.ggml.model) is not supported; supported: "
                f"'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
            )
        tokens, merges = gguf.get("tokenizer.ggml.tokens"), gguf.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise TokenizerError(f"{gguf.path}: the GGUF has no tokenizer.ggml.tokens or tokenizer.ggml.merges")
        return cls(
            tokens=tokens,
            merges=merges,
            token_types=gguf.get("tokenizer.ggml.token_type"),
            pre_tokenizer=pre_tokenizer or gguf.get("tokenizer.ggml.pre", "gpt2"),
            bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=gguf.get("tokenizer.ggml.eos_token_id"),
            chat_template=gguf.get("tokenizer.chat_template"),
            add_bos_token=bool(gguf.get("tokenizer.ggml.add_bos_token", False)),
        )


def byte_level_backend(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    pre_tokenizer: str = "gpt2",
    bos_token_id: int | None = None,
) -> Any:
    """The `tokenizers.Tokenizer` of a byte-level BPE vocabulary: ``tokens`` (their GGUF spelling), ``merges``
    (``"left right"``, best first), CONTROL tokens as special added tokens and USER_DEFINED ones as plain
    added tokens, the pre-tokenizer ``pre_tokenizer`` names (`PRE_TOKENIZERS`), ``bos_token_id`` (if not None)
    prepended by the post-processor."""
    if pre_tokenizer not in PRE_TOKENIZERS:
        raise TokenizerError(
            f"pre-tokenizer {pre_tokenizer!r} (tokenizer.ggml.pre) is not supported; supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokenizers = tokenizers_library()
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

    split_digits, pattern = PRE_TOKENIZERS[pre_tokenizer]
    alphabet = bytes_to_unicode()
    byte_of = {char: byte for byte, char in alphabet.items()}
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not all(char in byte_of for char in token):  # not byte-level spelled (some added tokens): spell its bytes
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    llama3 = pattern == _LLAMA3_SPLIT
    try:
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=llama3))
    except Exception as error:  # the library raises plain Exception, e.g. for a merge of unknown tokens
        raise TokenizerError(f"the byte-level BPE vocabulary does not build: {error}") from error
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
    added = [(t, kind == _CONTROL) for t, kind in zip(tokens, token_types) if kind in (_CONTROL, _USER_DEFINED) and t]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, control in added if control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, control in added if not control])
    if bos_token_id is not None:
        text = tokens[bos_token_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{text} $A", pair=f"{text} $A {text}:1 $B:1", special_tokens=[(text, int(bos_token_id))]
        )
    return backend


def save_tokenizer_files(path: str | os.PathLike | GGUFFile, directory: str | os.PathLike) -> Path:
    """Write a GGUF's tokenizer as a Hugging Face folder's ``tokenizer.json`` (`Tokenizer.from_gguf`'s backend)
    and ``tokenizer_config.json`` (its chat template, BOS/EOS/unknown/padding tokens): what
    `tokenizer_hf.HFTokenizer.from_folder` and transformers' ``AutoTokenizer`` read."""
    gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    tokenizer = Tokenizer.from_gguf(gguf)
    tokens = gguf.get("tokenizer.ggml.tokens")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(directory / TOKENIZER_FILE))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = gguf.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{name}_token"] = tokens[int(token_id)]
    config["add_bos_token"] = tokenizer.add_bos_token
    context = gguf.get(f"{gguf.get('general.architecture')}.context_length")
    if context:
        config["model_max_length"] = int(context)
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return directory


def load_tokenizer(path: str | os.PathLike) -> BaseTokenizer | None:
    """The tokenizer of a model path: a GGUF file's own (`Tokenizer.from_gguf`), a Hugging Face folder's
    (`tokenizer_hf.HFTokenizer.from_folder`); None for a folder without ``tokenizer.json`` or a file that is
    not GGUF."""
    path = Path(path)
    if path.is_dir():
        return HFTokenizer.from_folder(path) if (path / TOKENIZER_FILE).is_file() else None
    if path.suffix != ".gguf":
        return None
    return Tokenizer.from_gguf(path)
