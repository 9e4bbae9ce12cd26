"""A byte-level BPE tokenizer built from a GGUF file's tokenizer metadata (``tokenizer.ggml.model = gpt2``).

(SentencePiece vocabularies, ``tokenizer.ggml.model = llama`` as in Gemma 3, live in `tokenizer_spm`;
`Tokenizer.from_gguf` builds either.)

Encoding follows Hugging Face `tokenizers` step by step, so ids match `transformers` exactly:

1. special tokens (GGUF token types CONTROL and USER_DEFINED) are cut out of the text whole;
2. pre-tokenization splits the rest (``tokenizer.ggml.pre`` picks the rules, see `PRE_TOKENIZERS`);
3. each piece is spelled in GPT-2's byte alphabet (`bytes_to_unicode`) and merged by BPE rank.

Decoding maps ids back to bytes and UTF-8 decodes them; `tokenizer_base.StreamDecoder` does that
incrementally so a character split across tokens is emitted once it is whole. `apply_chat_template`
(`tokenizer_base.BaseTokenizer`) renders the GGUF's Jinja chat template the way `transformers` does and
encodes the result.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from .errors import TokenizerError
from .gguf_file import GGUFFile
from .tokenizer_base import BaseTokenizer
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


class Tokenizer(BaseTokenizer):
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
        import regex

        if pre_tokenizer not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"pre-tokenizer {pre_tokenizer!r} (tokenizer.ggml.pre) is not supported; supported: "
                f"{', '.join(sorted(PRE_TOKENIZERS))}"
            )
        split_digits, pattern = PRE_TOKENIZERS[pre_tokenizer]
        self._split = regex.compile(pattern)
        self._digits = regex.compile(r"(\p{N})") if split_digits else None
        alphabet = bytes_to_unicode()
        byte_of = {char: byte for byte, char in alphabet.items()}
        self._alphabet = alphabet
        self.vocab: dict[str, int] = {}
        self._token_bytes: list[bytes] = []
        for index, token in enumerate(tokens):
            if all(char in byte_of for char in token):
                spelled, raw = token, bytes(byte_of[char] for char in token)
            else:  # not byte-level spelled (some added tokens): spell its UTF-8 bytes, as transformers does
                raw = token.encode("utf-8")
                spelled = "".join(alphabet[b] for b in raw)
            self.vocab.setdefault(spelled, index)
            self._token_bytes.append(raw)
        self.merge_ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            left, _, right = merge.partition(" ")
            self.merge_ranks.setdefault((left, right), rank)
        types = list(token_types) if token_types is not None else [1] * len(tokens)
        self.special_ids = {i for i, t in enumerate(types) if t == _CONTROL and tokens[i]}
        specials = {tokens[i]: i for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED) and tokens[i]}
        self.special_tokens = specials
        # Longest first: at one start position the longest special token wins (leftmost-longest).
        alternatives = sorted(specials, key=len, reverse=True)
        self._special_split = (
            regex.compile("(" + "|".join(regex.escape(t) for t in alternatives) + ")") if specials else None
        )
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._cache: dict[str, tuple[int, ...]] = {}

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

    # ---- encode --------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``. ``parse_special``: special-token strings in the text become their ids.

        ``add_special_tokens`` prepends BOS when the model asks for it (``add_bos_token``), like transformers.
        """
        ids: list[int] = []
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        pieces = self._special_split.split(text) if (parse_special and self._special_split) else [text]
        for i, piece in enumerate(pieces):
            if i % 2 == 1:  # a captured special token
                ids.append(self.special_tokens[piece])
            elif piece:
                for word in self.pre_tokenize(piece):
                    ids.extend(self._bpe(word))
        return ids

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces BPE runs on (plain text, not yet byte-spelled)."""
        segments = self._digits.split(text) if self._digits is not None else [text]
        words: list[str] = []
        for i, segment in enumerate(segments):
            if self._digits is not None and i % 2 == 1:
                words.append(segment)
            elif segment:
                words.extend(self._split.findall(segment))
        return words

    def _bpe(self, word: str) -> tuple[int, ...]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        symbols = [self._alphabet[b] for b in word.encode("utf-8")]
        ranks = self.merge_ranks
        while len(symbols) > 1:
            best_rank, best = None, None
            for pair in zip(symbols, symbols[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best = rank, pair
            if best is None:
                break
            merged, i = [], 0
            while i < len(symbols):  # merge every occurrence of the best pair, left to right
                if i + 1 < len(symbols) and symbols[i] == best[0] and symbols[i + 1] == best[1]:
                    merged.append(best[0] + best[1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        try:
            ids = tuple(self.vocab[s] for s in symbols)
        except KeyError as error:
            raise TokenizerError(f"BPE produced {error.args[0]!r}, which is not in the vocabulary") from error
        if len(self._cache) < 200_000:
            self._cache[word] = ids
        return ids
