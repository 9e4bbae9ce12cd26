"""The reference engine on real models. `LLM` is text in, text out; `Engine` is the engine under it
(``from speccycle.engine import LLM, Engine``: loaded on first use, so importing a submodule stays light)."""

from __future__ import annotations

__all__ = ["Engine", "LLM"]


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(f"module 'speccycle.engine' has no attribute {name!r}")
