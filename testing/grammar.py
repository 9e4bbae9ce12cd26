"""A tokenizer over a handful of tokens, for grammar-constrained tests on the tiny models' small vocabularies.

`SmallVocab` gives the engine's grammar compiler (`engine.grammar.LlguidanceCompiler`) what it reads of a
tokenizer: each id's bytes, the special ids and an ``encode`` (greedy longest match). With single-character
tokens and a regex over them, the grammar's mask after any prefix is known by hand, so a test can state the
masked target distribution exactly.
"""

from __future__ import annotations

from collections.abc import Sequence


class SmallVocab:
    """Tokens ``pieces`` (bytes or str), then one end token (special) at id ``len(pieces)``."""

    def __init__(self, pieces: Sequence[str | bytes], end: str = "<end>"):
        self._token_bytes = [p.encode() if isinstance(p, str) else bytes(p) for p in pieces] + [end.encode()]
        self.eos_token_id = len(pieces)
        self.bos_token_id = None
        self.special_ids = {self.eos_token_id}

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        data, ids = text.encode(), []
        while data:
            best = max(
                (i for i, p in enumerate(self._token_bytes[: self.eos_token_id]) if p and data.startswith(p)),
                key=lambda i: len(self._token_bytes[i]),
                default=None,
            )
            if best is None:
                raise ValueError(f"{data[:8]!r} has no token in this vocabulary")
            ids.append(best)
            data = data[len(self._token_bytes[best]) :]
        return ids
