"""A detokenizer for the synthetic vocabularies, so stop strings can be tested without a real tokenizer."""

from __future__ import annotations

# Single letters, multi-letter pieces, and the bytes of multi-byte UTF-8 characters split across
# tokens ("é" = c3 a9, "€" = e2 82 ac): a stop string can end inside a token, span tokens, or need
# the token that completes a character.
PIECES: tuple[bytes, ...] = (
    b"a",
    b"b",
    b"c",
    b" ",
    b"ab",
    b"ba",
    b"\xc3",
    b"\xa9",
    b"\xe2\x82",
    b"\xac",
    b"x",
    b"yz",
    b"\n",
    b"a b",
    b"\xc3\xa9",
    b"",
)


class ToyDetokenizer:
    """`Detokenizer` (core.ports): token ``t`` decodes to ``PIECES[t % len(PIECES)]``."""

    def token_bytes(self, token_id: int) -> bytes:
        return PIECES[int(token_id) % len(PIECES)]

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", errors="replace")
