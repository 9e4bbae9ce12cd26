"""The reference engine on real models. `LLM` is text in, text out; `Engine` is the engine under it
(``from speccycle.engine import LLM, Engine``: loaded on first use, so importing a submodule stays light).

The rooms: `models` (Llama, Gemma 3, hybrid, the target port), `weights` (GGUF and Hugging Face loaders),
`tokenizers`, `kernels` (attention, fused ops, GEMMs), `fast` (static buffers, CUDA graphs, the fused cycles),
`memory` (KV and recurrent pools), `serving` (scheduler, adaptive speculation), `tp` (tensor parallelism) and
`drafters`; the engine itself (`engine`, `llm`, `greedy`), its errors and command-line options stay here."""

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
