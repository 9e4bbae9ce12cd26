"""A SentencePiece BPE tokenizer from a GGUF file's metadata (``tokenizer.ggml.model = llama``), e.g. Gemma 3.

Encoding follows SentencePiece's BPE model, as llama.cpp's ``llm_tokenizer_spm`` does:

1. USER_DEFINED tokens (Gemma: runs of spaces and newlines, HTML tags) are cut out of the text whole,
   and CONTROL tokens too when ``parse_special``; at each position the longest one wins;
2. in each remaining piece spaces become ``▁`` (U+2581); with ``add_space_prefix`` (not Gemma) the
   text's first piece gets a leading ``▁``;
3. BPE over the characters: merge the adjacent pair whose concatenation is a NORMAL token of the
   highest score, the leftmost on a tie, until no pair forms a token;
4. a symbol left that is no token (a character outside the vocabulary) becomes its UTF-8 bytes, as
   the ``<0xXX>`` BYTE tokens (byte fallback).

Decoding turns ``▁`` back into spaces and BYTE tokens into their byte; `tokenizer_base.BaseTokenizer`
does the rest (streaming, chat templates). A GGUF without a chat template (the base Gemma 3 270M) gets
Gemma's turn format, `GEMMA_CHAT_TEMPLATE`.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence

from .errors import TokenizerError
from .gguf_file import GGUFFile
from .tokenizer_base import BaseTokenizer

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Gemma's turn format: <bos>, then per message "<start_of_turn>{user|model}\n{content}<end_of_turn>\n"; a system
# message is folded into the first user turn, followed by a blank line. Written for speccycle, not copied.
GEMMA_CHAT_TEMPLATE = """{{- bos_token -}}
{%- set system_prefix = '' -%}
{%- set turns = messages -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set system_prefix = messages[0]['content'] | trim ~ '\\n\\n' -%}
{%- set turns = messages[1:] -%}
{%- endif -%}
{%- for message in turns -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Gemma turns must alternate user, assistant, user, ... after an optional system message') -}}
{%- endif -%}
{{- '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else message['role']) ~ '\\n' -}}
{{- (system_prefix if loop.first else '') ~ message['content'] | trim ~ '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""
_DEFAULT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE}


class SentencePieceTokenizer(BaseTokenizer):
    """SentencePiece BPE with byte fallback: ``encode(text) -> ids``, ``decode(ids) -> text``, chat templates."""

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        token_types: Sequence[int],
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = True,
        add_space_prefix: bool = False,
    ) -> None:
        if not (len(tokens) == len(scores) == len(token_types)):
            raise TokenizerError(
                f"tokenizer metadata disagrees: {len(tokens)} tokens, {len(scores)} scores, {len(token_types)} types"
            )
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.chat_template, self.add_bos_token, self.add_space_prefix = chat_template, add_bos_token, add_space_prefix
        self._score: dict[str, float] = {}  # NORMAL tokens: the pieces BPE may form
        self._id: dict[str, int] = {}
        self._byte_ids: dict[int, int] = {}
        self._token_bytes = []
        self.special_ids: set[int] = set()
        user_defined: dict[str, int] = {}
        control: dict[str, int] = {}
        for index, (token, score, kind) in enumerate(zip(tokens, scores, token_types)):
            if kind == BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                value = int(token[3:5], 16)
                self._byte_ids.setdefault(value, index)
                self._token_bytes.append(bytes([value]))
                continue
            if kind == NORMAL:
                self._score.setdefault(token, float(score))
                self._id.setdefault(token, index)
            elif kind == USER_DEFINED and token:
                user_defined.setdefault(token, index)
            elif kind == CONTROL and token:
                control.setdefault(token, index)
                self.special_ids.add(index)
            text = token if kind == CONTROL else token.replace(SPACE, " ")
            self._token_bytes.append(text.encode("utf-8"))
        self.special_tokens = {**user_defined, **control}
        self._cut_plain = _PieceCutter(user_defined)
        self._cut_special = _PieceCutter({**user_defined, **control})
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_gguf(cls, path: str | os.PathLike | GGUFFile) -> SentencePieceTokenizer:
        """The tokenizer of a GGUF file with ``tokenizer.ggml.model = llama``; Gemma 3 gets its chat format
        when the file has no ``tokenizer.chat_template``."""
        gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
        tokens, scores = gguf.get("tokenizer.ggml.tokens"), gguf.get("tokenizer.ggml.scores")
        token_types = gguf.get("tokenizer.ggml.token_type")
        if not tokens or scores is None or token_types is None:
            raise TokenizerError(
                f"{gguf.path}: a SentencePiece GGUF needs tokenizer.ggml.tokens, .scores and .token_type"
            )
        template = gguf.get("tokenizer.chat_template") or _DEFAULT_TEMPLATES.get(gguf.get("general.architecture"))
        return cls(
            tokens=tokens,
            scores=scores,
            token_types=token_types,
            bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=gguf.get("tokenizer.ggml.eos_token_id"),
            chat_template=template,
            add_bos_token=bool(gguf.get("tokenizer.ggml.add_bos_token", True)),
            add_space_prefix=bool(gguf.get("tokenizer.ggml.add_space_prefix", False)),
        )

    # ---- encode --------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``. ``parse_special``: CONTROL token strings in the text become their ids
        (USER_DEFINED ones always do). ``add_special_tokens`` prepends BOS when the model asks for it."""
        ids: list[int] = []
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        cutter = self._cut_special if parse_special else self._cut_plain
        for index, (piece, token_id) in enumerate(cutter.split(text)):
            if token_id is not None:
                ids.append(token_id)
                continue
            spelled = piece.replace(" ", SPACE)
            if self.add_space_prefix and index == 0:
                spelled = SPACE + spelled
            ids.extend(self._bpe(spelled))
        return ids

    def _bpe(self, text: str) -> tuple[int, ...]:
        """BPE over the characters of ``text`` (already ``▁``-spelled), then byte fallback."""
        cached = self._cache.get(text)
        if cached is not None:
            return cached
        symbols = list(text)
        following = list(range(1, len(symbols))) + [-1]
        preceding = list(range(-1, len(symbols) - 1))
        alive = [True] * len(symbols)
        agenda: list[tuple[float, int, str]] = []  # (-score, left index, merged text): best score, then leftmost

        def propose(left: int) -> None:
            right = following[left]
            if right >= 0:
                merged = symbols[left] + symbols[right]
                score = self._score.get(merged)
                if score is not None:
                    heapq.heappush(agenda, (-score, left, merged))

        for left in range(len(symbols) - 1):
            propose(left)
        while agenda:
            _, left, merged = heapq.heappop(agenda)
            right = following[left]
            if not alive[left] or right < 0 or symbols[left] + symbols[right] != merged:
                continue  # stale: one side has merged since
            symbols[left], alive[right] = merged, False
            following[left] = following[right]
            if following[right] >= 0:
                preceding[following[right]] = left
            if preceding[left] >= 0:
                propose(preceding[left])
            propose(left)
        ids: list[int] = []
        for symbol, live in zip(symbols, alive):
            if not live:
                continue
            token_id = self._id.get(symbol)
            if token_id is not None:
                ids.append(token_id)
                continue
            for byte in symbol.encode("utf-8"):
                if byte not in self._byte_ids:
                    raise TokenizerError(f"{symbol!r} is not in the vocabulary and byte <0x{byte:02X}> has no token")
                ids.append(self._byte_ids[byte])
        result = tuple(ids)
        if len(text) <= 256 and len(self._cache) < 200_000:
            self._cache[text] = result
        return result


class _PieceCutter:
    """Splits text into plain pieces and whole tokens (leftmost, then longest), like SentencePiece's prefix matcher."""

    def __init__(self, pieces: dict[str, int]) -> None:
        self.pieces = pieces
        lengths: dict[str, set[int]] = {}
        for piece in pieces:
            lengths.setdefault(piece[0], set()).add(len(piece))
        self.lengths = {first: sorted(found, reverse=True) for first, found in lengths.items()}

    def split(self, text: str) -> list[tuple[str, int | None]]:
        """``[(plain text, None) | (token text, token id)]`` in order, covering ``text``."""
        out: list[tuple[str, int | None]] = []
        start = position = 0
        while position < len(text):
            match = None
            for length in self.lengths.get(text[position], ()):
                candidate = text[position : position + length]
                if candidate in self.pieces:
                    match = candidate
                    break
            if match is None:
                position += 1
                continue
            if start < position:
                out.append((text[start:position], None))
            out.append((match, self.pieces[match]))
            position = start = position + len(match)
        if start < len(text):
            out.append((text[start:], None))
        return out
