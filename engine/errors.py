"""Errors the reference engine raises: each says what was wrong and what to do about it.

The ones about a caller's input are `ValueError` subclasses (`UsageError`, `ModelLoadError`,
`TokenizerError`): the ``speccycle`` command prints their message as one line and exits 2; the ones
about the engine's own bookkeeping (`KVPoolError`, `ForwardBatchError`) are not.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the reference engine raises on purpose."""


class UsageError(ValueError):
    """A bad input to a command or an entry point: an option out of range, a prompts file that is not
    Spec-Bench JSONL, an output path that cannot be written, a prompt past the model's context."""


class ModelLoadError(EngineError, ValueError):
    """A model could not be loaded: missing file, corrupt GGUF, unknown architecture, bad config."""


class TokenizerError(EngineError, ValueError):
    """A tokenizer could not be built from the model's metadata, or was used on bad input."""


class KVPoolError(EngineError):
    """A KV pool call broke the pool's bookkeeping: unknown request, double free, bad sizes."""


class ForwardBatchError(EngineError):
    """A `ForwardBatch` cannot be run: inconsistent shapes, or a row that would attend no key."""
