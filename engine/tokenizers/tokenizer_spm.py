"""A SentencePiece BPE tokenizer from a GGUF file's metadata (``tokenizer.ggml.model = llama``), e.g. Gemma 3.

The GGUF's pieces and scores become a Hugging Face `tokenizers` BPE model that encodes as SentencePiece's BPE
model does (and llama.cpp's ``llm_tokenizer_spm``):

1. USER_DEFINED tokens (Gemma: runs of spaces and newlines, HTML tags) are cut out of the text whole,
   and CONTROL tokens too when ``parse_special``; at each position the longest one wins (added tokens);
2. in each remaining piece spaces become ``▁`` (U+2581); with ``add_space_prefix`` (not Gemma) the
   text's first piece gets a leading ``▁`` (``Metaspace``, prepended to the first piece only, no split);
3. BPE over the characters: merge the adjacent pair whose concatenation is the NORMAL token of the highest
   score. The merges list holds, for each NORMAL token from the best score down, each way to cut it into two
   symbols BPE can hold (NORMAL tokens or single characters); a merge's rank is its token's place;
4. a symbol left that is no token (a character outside the vocabulary) becomes its UTF-8 bytes, as
   the ``<0xXX>`` BYTE tokens (byte fallback).

SentencePiece takes the leftmost of equally good merges; the ranks order them instead where two NORMAL tokens
share a score (none do in Gemma 3's vocabulary) or where two cuts of one token meet in one piece. On Gemma 3
270M's vocabulary the ids equal the hand-written SentencePiece encoder this replaced on the 240 Spec-Bench dev
prompts and the 20,692 training prompts (every turn, with and without special-token parsing).

Decoding turns ``▁`` back into spaces and BYTE tokens into their byte; `tokenizer_base.BaseTokenizer`
does the rest (streaming, chat templates). A GGUF without a chat template (the base Gemma 3 270M) gets
Gemma's turn format, `GEMMA_CHAT_TEMPLATE`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..errors import TokenizerError
from ..weights.gguf_file import GGUFFile
from .tokenizer_hf import HFTokenizer, tokenizers_library

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


class SentencePieceTokenizer(HFTokenizer):
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
        self.add_space_prefix = add_space_prefix
        backend = sentencepiece_backend(
            tokens, scores, token_types, bos_token_id if add_bos_token else None, add_space_prefix
        )
        token_bytes, control = [], set()
        for index, (token, kind) in enumerate(zip(tokens, token_types)):
            if kind == BYTE and _is_byte_piece(token):
                token_bytes.append(bytes([int(token[3:5], 16)]))
                continue
            if kind == CONTROL and token:
                control.add(index)
            token_bytes.append((token if kind == CONTROL else token.replace(SPACE, " ")).encode("utf-8"))
        super().__init__(backend, bos_token_id, eos_token_id, chat_template, token_bytes, control)

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


def _is_byte_piece(token: str) -> bool:
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">")


def sentencepiece_backend(
    tokens: Sequence[str],
    scores: Sequence[float],
    token_types: Sequence[int],
    bos_token_id: int | None = None,
    add_space_prefix: bool = False,
) -> Any:
    """The `tokenizers.Tokenizer` that encodes a SentencePiece BPE vocabulary as SentencePiece does (module
    docstring); ``bos_token_id`` (if not None) prepended by the post-processor."""
    tokenizers_library()
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token:
            vocab.setdefault(token, index)
    normal = {token for token, kind in zip(tokens, token_types) if kind == NORMAL and token}

    def holdable(symbol: str) -> bool:  # a symbol BPE can hold: a NORMAL token, or a character it starts from
        return symbol in normal or (len(symbol) == 1 and symbol in vocab)

    ranked = sorted(
        (i for i, (token, kind) in enumerate(zip(tokens, token_types)) if kind == NORMAL and len(token) > 1),
        key=lambda i: (-scores[i], i),
    )
    merges = []
    for index in ranked:
        token = tokens[index]
        if vocab[token] != index:
            continue  # a duplicate piece: its first id is the one SentencePiece gives
        merges.extend((token[:cut], token[cut:]) for cut in range(1, len(token)) if holdable(token[:cut])
                      and holdable(token[cut:]))  # fmt: skip
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    added = [(token, kind == CONTROL) for token, kind in zip(tokens, token_types) if kind in (CONTROL, USER_DEFINED)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, control in added if t and control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, control in added if t and not control])
    if bos_token_id is not None:
        text = tokens[bos_token_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{text} $A", pair=f"{text} $A {text}:1 $B:1", special_tokens=[(text, int(bos_token_id))]
        )
    return backend
