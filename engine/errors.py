"""Errors the reference engine raises: each says what was wrong and what to do about it."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the reference engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model could not be loaded: missing file, corrupt GGUF, unknown architecture, bad config."""


class TokenizerError(EngineError):
    """A tokenizer could not be built from the model's metadata, or was used on bad input."""


class KVPoolError(EngineError):
    """A KV pool call broke the pool's bookkeeping: unknown request, double free, bad sizes."""


class ForwardBatchError(EngineError):
    """A `ForwardBatch` cannot be run: inconsistent shapes, or a row that would attend no key."""
