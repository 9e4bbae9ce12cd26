"""Where a committed run stops: stop token ids, stop strings on the decoded text, ``max_new_tokens``.

A cycle commits several tokens at once; autoregressive decoding would have looked at them one by
one and stopped at the first that ends the request. `cut_at_stops` finds that token, so the output
is the same token for token. For token ``i`` of the run, in this order:

1. ``i`` is in ``stop_token_ids`` (the engine puts its EOS ids there): keep it, finish ``"stop"``.
2. ``i`` completes a stop string: keep it, finish ``"stop"``.
3. ``i`` is the ``max_new_tokens``-th output token: keep it, finish ``"length"``.

**The stop-string rule.** The output text is the UTF-8 decoding of the output tokens' bytes
(``Detokenizer.token_bytes``; special tokens count with their text), prompt excluded, and holds only
complete characters: bytes of a character cut by the end of a token wait for the next token, as a
streaming detokenizer shows them. Token ``i`` completes a stop string when the string occurs in the
text after token ``i`` and in no shorter text; it is the last token kept. The tokens stay whole:
the text of the last token may run past the stop string (the caller trims text if it wants).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from ..core.ports import Detokenizer
from ..core.records import FinishReason, Request

# Bytes of earlier output decoded again to rebuild the text just before a run: enough for the
# longest stop string (4 bytes a character at most) plus a character cut at the window's start.
_BYTES_PER_CHAR = 4


def cut_at_stops(
    request: Request, committed: Sequence[int], detokenizer: Detokenizer | None = None
) -> tuple[int, FinishReason | None]:
    """How many of ``committed`` (tokens following ``request.output``) to keep, and why the request ends.

    Returns ``(len(committed), None)`` when nothing in the run ends the request.
    """
    params = request.sampling
    room = params.max_new_tokens - len(request.output)
    stops = params.stop_token_ids
    matcher = _StopStringMatcher(params.stop_strings, request.output, detokenizer) if params.stop_strings else None
    for i, token in enumerate(committed):
        if token in stops:
            return i + 1, "stop"
        if matcher is not None and matcher.push(token):
            return i + 1, "stop"
        if i + 1 >= room:
            return i + 1, "length"
    return len(committed), None


class _StopStringMatcher:
    """The output text so far (its tail) and an incremental UTF-8 decoder, fed one token at a time."""

    def __init__(self, stop_strings: Sequence[str], output: Sequence[int], detokenizer: Detokenizer | None):
        if detokenizer is None:
            raise ValueError("stop strings need a detokenizer (Ports.detokenizer): give the engine a tokenizer")
        self.stop_strings = tuple(stop_strings)
        self.detokenizer = detokenizer
        self.longest = max(len(s) for s in self.stop_strings)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Only the tail of the earlier output matters: decode enough of its last tokens again.
        window, size, budget = [], 0, _BYTES_PER_CHAR * self.longest + _BYTES_PER_CHAR
        for token in reversed(output):
            if size >= budget:
                break
            piece = detokenizer.token_bytes(int(token))
            window.append(piece)
            size += len(piece)
        text = self.decoder.decode(b"".join(reversed(window)))
        self.tail = text[-(self.longest - 1) :] if self.longest > 1 else ""

    def push(self, token: int) -> bool:
        """Feed one token; True when it completes a stop string."""
        new = self.decoder.decode(self.detokenizer.token_bytes(int(token)))
        if not new:
            return False
        text = self.tail + new
        for s in self.stop_strings:
            # Only an occurrence that ends inside the new characters is new.
            if text.find(s, max(0, len(self.tail) - len(s) + 1)) >= 0:
                return True
        self.tail = text[-(self.longest - 1) :] if self.longest > 1 else ""
        return False


def stop_text_reference(output: Sequence[int], stop_strings: Sequence[str], detokenizer: Detokenizer) -> int | None:
    """Index of the first output token that completes a stop string, by decoding every prefix afresh.

    Quadratic, for tests: the plain statement of the rule that `cut_at_stops` implements incrementally.
    """
    for i in range(len(output)):
        data = b"".join(detokenizer.token_bytes(int(t)) for t in output[: i + 1])
        text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data)
        if any(s in text for s in stop_strings):
            return i
    return None
