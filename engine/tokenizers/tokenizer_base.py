"""What every tokenizer of the engine shares: decoding, streaming and chat templates (`BaseTokenizer`).

`tokenizer.Tokenizer` (byte-level BPE) and `tokenizer_spm.SentencePieceTokenizer` (SentencePiece BPE)
add their own ``encode`` and vocabulary; `StreamDecoder` decodes a growing id sequence, and a GGUF's
Jinja chat template is compiled once (`_compile_template`) in a sandbox, with the variables, the
``raise_exception`` and ``strftime_now`` globals and the ``tojson`` filter `transformers` gives it.
"""

from __future__ import annotations

import codecs
import datetime
import functools
import json
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import TokenizerError


class BaseTokenizer:
    """What every tokenizer offers on top of ``encode``: decoding, streaming, chat templates.

    A subclass fills ``_token_bytes`` (the bytes each id decodes to), ``special_ids`` (CONTROL ids,
    dropped by ``skip_special_tokens``), ``bos_token_id``, ``eos_token_id``, ``chat_template`` and
    ``add_bos_token``, and implements ``encode``.
    """

    _token_bytes: list[bytes]
    special_ids: set[int]
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    add_bos_token: bool

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    # ---- decode --------------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < len(self._token_bytes):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary [0, {len(self._token_bytes)})")
        return self._token_bytes[token_id]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (a character cut by the end of ``ids``) becomes U+FFFD."""
        chunks = [self.token_bytes(i) for i in ids if not (skip_special_tokens and i in self.special_ids)]
        return b"".join(chunks).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """An incremental decoder: ``push(ids) -> new text``; multi-byte characters are never split."""
        return StreamDecoder(self, skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The chat template rendered to text, with the variables transformers passes."""
        if not self.chat_template:
            raise TokenizerError("the model has no chat template (tokenizer.chat_template); encode plain text instead")
        template = _compile_template(self.chat_template)
        special = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id),
        }
        return template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **special, **kwargs
        )

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat (special tokens parsed, no BOS added: the template writes its own)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.token_bytes(token_id).decode("utf-8", errors="replace")


class StreamDecoder:
    """Decodes a growing id sequence piece by piece: ``"".join(push(ids) ...) + flush() == decode(all ids)``."""

    def __init__(self, tokenizer: BaseTokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        """Text completed by these ids; bytes of an unfinished character wait for the next push."""
        ids = [ids] if isinstance(ids, int) else ids
        special = self._tokenizer.special_ids
        data = b"".join(self._tokenizer.token_bytes(i) for i in ids if not (self._skip and i in special))
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is left (an unfinished character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    try:
        import jinja2
        import jinja2.ext  # not imported by `import jinja2` itself
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as error:
        raise TokenizerError("chat templates need the `jinja2` package: pip install jinja2") from error

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
        # transformers' filter: plain JSON (Jinja's own escapes <, >, & and ' for HTML), its options exposed
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)  # Llama 3.1's date line
    env.filters["tojson"] = tojson
    try:
        return env.from_string(source)
    except jinja2.TemplateError as error:
        raise TokenizerError(f"the chat template does not compile: {error}") from error
