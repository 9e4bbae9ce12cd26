"""``speccycle convert-draft IN OUT``: an EAGLE-3 head from one layout into another.

IN is any head `EagleHead.load` reads: a file `EagleHead.save` wrote, or a published head (`eagle_layouts`:
the EAGLE repository, SpecForge, SGLang, vLLM's speculators; its folder, or its weights file beside its
config.json). Without ``--export``, OUT is a ``.safetensors`` file in speccycle's own format (what
`EagleHead.save` writes; ``--storage int8-rowwise`` packs it); with ``--export eagle3`` or ``--export
speculators``, OUT is a folder (``config.json`` and ``model.safetensors``) that SGLang or vLLM load, so a head
trained here runs there.

``--model`` names the target the head drafts for (default: the embedded SmolLM2), of which only the config
is read: its layer count resolves the default feature layers of a published config that names none, the head
is checked against it (hidden size, vocabulary, layers) before anything is written, and an exported config
records its vocabulary (``t2d``'s length) and context.

    speccycle convert-draft sglang-head/ head.safetensors --model Llama-3.1-8B-Instruct/
    speccycle convert-draft head.safetensors out/ --export speculators
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..errors import UsageError
from .eagle_layouts import LAYOUTS, published_config

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="IN", help="the head: a speccycle .safetensors file, or a published head")
    p.add_argument("output", metavar="OUT", help="a .safetensors file (speccycle's format), or a folder (--export)")
    p.add_argument("--export", choices=LAYOUTS, default=None, help="write this published layout into the folder OUT")
    p.add_argument("--model", default=None, help="the target: GGUF file or HF folder (default: the embedded SmolLM2)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="the dtype of the written weights")
    p.add_argument("--storage", choices=("int8-rowwise",), default=None, help="pack speccycle's file (no --export)")


def layout_name(path: str | Path) -> str:
    """``speccycle`` (a file `EagleHead.save` wrote), ``eagle3`` or ``speculators``."""
    raw = published_config(path)
    if raw is None:
        return "speccycle"
    return "speculators" if raw.get("speculators_model_type") is not None else "eagle3"


def convert(args: argparse.Namespace) -> int:
    from ..models.catalog import model_config
    from ..weights.weights_gguf import default_model_path
    from .eagle import EagleHead, check_target
    from .eagle_heads import model_name
    from .eagle_layouts import write_layout

    src, out = Path(args.input), Path(args.output)
    if not src.exists():
        raise UsageError(f"convert-draft {src}: no such file or folder")
    if args.export is None:
        from ..cli_options import check_output_path

        if out.suffix != ".safetensors":
            raise UsageError(
                f"convert-draft {out}: speccycle's head file is a .safetensors file; pass --export "
                f"{'|'.join(LAYOUTS)} to write a published layout's folder"
            )
        check_output_path(str(out), "convert-draft OUT")
    else:
        if args.storage is not None:
            raise UsageError("--storage packs speccycle's own file: drop it with --export")
        if out.exists() and not out.is_dir():
            raise UsageError(f"convert-draft {out} is a file: --export {args.export} writes a folder")
    if src.resolve() == out.resolve():
        raise UsageError(f"convert-draft {out} is the input: write the head elsewhere")
    target = model_config(args.model)
    head = EagleHead.load(src, getattr(torch, args.dtype), "cpu", target_layers=target.num_layers)
    check_target(head.config, target, str(src))
    if args.export is None:
        head.save(out, storage=args.storage)
    else:
        try:
            write_layout(head, out, args.export, target, model_name(args.model or default_model_path()))
        except ValueError as err:  # a head the layout cannot hold (EAGLE-1, logits from the target's LM head)
            raise UsageError(str(err)) from None
    c = head.config
    print(
        f"{src} ({layout_name(src)}) -> {out} ({args.export or 'speccycle'}): EAGLE-{c.version}, {c.num_layers} "
        f"layer(s), feature layers {c.feature_layers}, draft vocabulary {c.draft_vocab_size}, {args.dtype}"
    )
    return 0
