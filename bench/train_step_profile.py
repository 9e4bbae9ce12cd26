"""Where a draft-head training step's time goes: per head and cross-entropy path, phase by phase (for a GPU).

Runs the trainer's own `train.trainer.train_step` on the same batches of a generated ``data.npz`` for
each head (``1``, ``3``, ``3full``: EAGLE-3 over the target's LM head) and cross-entropy path
(``fused``: `train.losses.linear_cross_entropy`, the trainer's; ``reference``: the former checkpointed
float32 path), ``--warmup`` steps untimed, then ``--steps`` timed. Reported per configuration: mean ms
per step of each phase (target forward, head unroll, loss, backward, optimizer; CUDA events), wall ms
per step, tokens and cross-entropy rows per step, peak memory and the caching allocator's retries
(each retry frees its cache and synchronizes). Heads use `speccycle train-draft`'s default sizes.

    python -m bench.train_step_profile --data out/data.npz --heads 1,3,3full --ce fused,reference

On a CPU it runs too (float32, wall-clock phases), which checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from speccycle.engine.engine import load_model
from speccycle.engine.models.llama import LlamaModel
from speccycle.train.data import SelfDistilledData
from speccycle.train.head import TrainableEagleHead
from speccycle.train.pipeline import HEADS, V3_INTERMEDIATE, V3FULL_INTERMEDIATE
from speccycle.train.trainer import (
    PhaseTimer,
    TrainConfig,
    collate,
    draft_ids,
    draft_vocabulary,
    head_config,
    make_batches,
    make_optimizer,
    train_step,
)

from .common import write_result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile(target, data, name: str, ce: str, args, device: torch.device) -> dict:
    version = int(name[0])
    intermediate = {"1": None, "3": V3_INTERMEDIATE, "3full": V3FULL_INTERMEDIATE}[name]
    cfg = TrainConfig(
        version=version,
        ttt_steps=args.ttt_steps,
        draft_vocab_size=0 if name == "3full" else args.draft_vocab,
        intermediate_size=intermediate,
        batch_tokens=args.batch_tokens,
        max_len=args.max_len,
        ce=ce,
    )
    hcfg = head_config(target.config, cfg)
    d2t = None if hcfg.target_lm_head else draft_vocabulary(data, cfg.draft_vocab_size, target.config.vocab_size)
    head = TrainableEagleHead.init(hcfg, d2t).to(device)
    optimizer = make_optimizer(head, cfg)
    target_to_draft = draft_ids(head, target.config.vocab_size)
    rng, batches = np.random.default_rng(args.seed), []
    while len(batches) < args.warmup + args.steps:  # the same batches for every configuration
        batches += make_batches(data, cfg, rng)
    batches = batches[: args.warmup + args.steps]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    timer = PhaseTimer(device)
    tokens = rows = 0
    start = None
    for i, indices in enumerate(batches):
        timed = i >= args.warmup
        if i == args.warmup:
            _sync(device)
            start = time.perf_counter()
        if timed:
            timer.start()
        batch = collate(data, indices, cfg.max_len, device)
        loss, metrics = train_step(
            head, target, optimizer, batch, cfg, cfg.lr, target_to_draft, timer if timed else None
        )
        float(loss.detach())  # the trainer reads the loss every step
        if timed:
            tokens += int(batch[1].sum())
            rows += sum(metrics["rows"])
    _sync(device)
    steps = len(batches) - args.warmup
    wall = (time.perf_counter() - start) / steps * 1000
    result = {
        "head": f"eagle{name}",
        "ce": ce,
        "params": sum(p.numel() for p in head.parameters()),
        "intermediate": hcfg.intermediate_size,
        "steps": steps,
        "ms_per_step": round(wall, 1),
        "phases_ms": {k: round(v, 1) for k, v in timer.phases().items()},
        "tokens_per_step": tokens // steps,
        "ce_rows_per_step": rows // steps,
        "tokens_per_s": round(tokens / (wall * steps / 1000)),
    }
    if device.type == "cuda":
        result["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        result["alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a data.npz of `speccycle train-draft --stage generate`")
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    p.add_argument("--heads", default="1,3,3full", help=f"comma-separated, from {', '.join(HEADS)}")
    p.add_argument("--ce", default="fused,reference", help="cross-entropy paths: fused, reference")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--max-len", type=int, default=640)
    p.add_argument("--ttt-steps", type=int, default=6)
    p.add_argument("--draft-vocab", type=int, default=3072)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="result directory (default bench/results)")
    args = p.parse_args(argv)
    heads = [h for h in args.heads.split(",") if h]
    paths = [c for c in args.ce.split(",") if c]
    if any(h not in HEADS for h in heads) or any(c not in ("fused", "reference") for c in paths):
        raise SystemExit(f"--heads from {HEADS}, --ce from fused, reference")
    device = torch.device(args.device)
    config, weights, path = load_model(args.model, torch.float32)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = LlamaModel(config, weights, dtype=dtype, device=device)
    del weights
    data = SelfDistilledData.load(args.data)
    runs = []
    for name in heads:
        for ce in paths:
            try:
                row = profile(target, data, name, ce, args, device)
            except torch.cuda.OutOfMemoryError as err:
                row = {"head": f"eagle{name}", "ce": ce, "error": f"out of memory: {err}"}
            runs.append(row)
            print(row, flush=True)
    payload = {"model": path.name, "data": args.data, "batch_tokens": args.batch_tokens, "runs": runs}
    print(f"wrote {write_result('train_step_profile', payload, args.device, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
