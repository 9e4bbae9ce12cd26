"""Train EAGLE draft heads for a Llama-family target by self-distillation (``speccycle train-draft``).

Stages (``--stage``):

* ``generate``: the target answers training prompts (chat template, greedy by default), batched on
  the GPU with transformers (or the engine); token ids only -> ``OUT/data.npz`` (a few MB), or ``--data``.
  ``--prompts`` takes several files (e.g. the training prompts and ``speccycle.train.augment``'s output);
  ``--self-prompts N`` first has the target sample N user turns of its own and answers the well-formed ones.
* ``train``: EAGLE-1 and/or EAGLE-3 heads (``--versions 1,3,3full``; ``3full`` is EAGLE-3 over the
  target's own final norm and LM head, full vocabulary); target features are recomputed per batch by a
  frozen target forward, never stored -> ``OUT/eagle1.safetensors``, ``OUT/eagle3.safetensors``,
  ``OUT/eagle3full.safetensors`` (bfloat16, the engine's `EagleHead` format, training record in the
  file's metadata). It needs only ``OUT/data.npz`` (or ``--data``, several files concatenated) and the target.
* ``eval``: tau per Spec-Bench category and acceptance per draft position, chains and trees, with the
  engine -> ``OUT/eval.json``, ``OUT/eval.png``, ``OUT/HEAD_README.md`` (for the best head) and the
  benchmark record ``OUT/train_draft_eval-DATE.json`` (device, commit; it belongs in bench/results/).
* ``all``: the three in a row. ``plot``: redraw ``eval.png`` from ``--eval-json``.

Every stage prints progress with timings (flushed, also appended to ``OUT/pipeline.log``) and writes
its output periodically, so a run cut short keeps what it did; ``--resume`` carries on from it.
Never pass Spec-Bench prompts as training prompts: they are the evaluation set (refused).

Time on one H100 (bf16, measured 2026-11-22, before the fused cross-entropy): generate: 327 s for 19,615 prompts x
<= 256 new tokens (batch 512); train: ~70k tokens/s, EAGLE-3 1,069 steps in ~6.5 min, EAGLE-1 155 steps in ~3 min (set
--train-minutes per head, and keep each call under the machine's 10-minute limit: training stops within it); eval:
17-37 s per config on the 240 Spec-Bench prompts x 128 tokens in float32 (82 s for a 64-node tree; --eval-per-category
shortens it).

    python -m speccycle.train.pipeline --stage all --prompts train_prompts.jsonl.gz \\
        --eval-prompts spec_bench_dev.jsonl --out out/
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

STAGES = ("generate", "train", "eval", "all", "plot")
HEADS = ("1", "3", "3full")  # --versions items
V3_INTERMEDIATE = 384  # EAGLE-3 with its own 3,072-token LM head: 4.87M parameters, 9.74 MB in bf16
V3FULL_INTERMEDIATE = 1408  # EAGLE-3 over the target's LM head: 4.87M parameters, 9.74 MB in bf16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage", choices=STAGES, default="all")
    p.add_argument("--out", required=True, help="output folder (data.npz, eagle*.safetensors, eval.json, log)")
    p.add_argument("--model", default=None, help="target: GGUF file or HF directory (default: embedded SmolLM2)")
    p.add_argument("--tokenizer", default=None, help="GGUF file whose tokenizer to use (default: the model's)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--work-dir", default="/tmp/speccycle-train", help="scratch: HF export, full checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from what OUT (and --work-dir) already hold")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("generate")
    g.add_argument(
        "--prompts",
        default=None,
        help="training prompts JSONL ({'prompt': ...}), .gz accepted; several comma-separated (concatenated)",
    )
    g.add_argument("--num-prompts", type=int, default=None, help="use at most this many (shuffled) prompts")
    g.add_argument("--max-prompt-tokens", type=int, default=384, help="longer chat-templated prompts are skipped")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--gen-batch", type=int, default=512)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers (what greedy verify sees)")
    g.add_argument("--generator", choices=["hf", "engine"], default="hf")
    g.add_argument("--gen-minutes", type=float, default=None, help="stop generating after this long, keep the rest")
    g.add_argument(
        "--data",
        default=None,
        help="generated data file (default: OUT/data.npz); the train stage takes several, comma-separated "
        "(concatenated)",
    )
    g.add_argument(
        "--self-prompts",
        type=int,
        default=0,
        help="the target first samples this many user turns from its chat template's opening of one, keeps the "
        "well-formed ones and answers them too (saved beside the data as DATA.self_prompts.jsonl)",
    )
    g.add_argument("--self-prompt-tokens", type=int, default=128, help="a sampled user turn's length, at most")
    g.add_argument("--self-prompt-temperature", type=float, default=1.0)
    g.add_argument("--self-prompt-top-p", type=float, default=0.95)
    g.add_argument(
        "--exclude",
        action="append",
        default=[],
        help="Spec-Bench JSONL that self-prompts must not overlap (repeatable; --eval-prompts is added)",
    )
    t = p.add_argument_group("train")
    t.add_argument(
        "--versions",
        default="1,3",
        help="heads to train (and evaluate): 1 (EAGLE-1), 3 (EAGLE-3, own --draft-vocab LM head), 3full (EAGLE-3 "
        "over the target's final norm and LM head: full vocabulary, nothing of it stored); e.g. 1,3 or 3full",
    )
    t.add_argument("--steps", type=int, default=3000, help="optimizer steps per head (upper bound)")
    t.add_argument(
        "--train-minutes",
        type=float,
        default=None,
        help="time budget per head: the schedule is fitted to it and training stops in time (lowers --steps)",
    )
    t.add_argument("--batch-tokens", type=int, default=32768, help="padded tokens per batch (B x T)")
    t.add_argument("--max-len", type=int, default=640, help="sequences are cut to this many tokens")
    t.add_argument("--ttt-steps", type=int, default=6, help="draft steps unrolled in training (>= the S you run)")
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument(
        "--draft-vocab", type=int, default=3072, help="EAGLE-3 draft vocabulary size (0: version 3 means 3full)"
    )
    t.add_argument(
        "--v3-intermediate",
        type=int,
        default=None,
        help=f"EAGLE-3 MLP width (default {V3_INTERMEDIATE} with its own 3,072-token LM head, "
        f"{V3FULL_INTERMEDIATE} for 3full: either keeps the bf16 head under 10 MB); with --resume, a wider value "
        "grows the trained head's MLP (new units start with zero output: the same head until trained)",
    )
    t.add_argument("--v1-intermediate", type=int, default=None, help="EAGLE-1 MLP width (default: the target's)")
    t.add_argument(
        "--head-layers",
        type=int,
        default=1,
        help="decoder layers of the head (default 1, as EAGLE's); with --resume, more layers than the trained head's "
        "are added after its own with zero output (the same head until trained). A layer adds ~3.5 MB in int8 at "
        "SmolLM2's width and MLP 1,536 (the shipped file is under 10 MB with one)",
    )
    t.add_argument("--save-every", type=float, default=60.0, help="seconds between checkpoints")
    e = p.add_argument_group("eval")
    e.add_argument("--eval-prompts", default=None, help="Spec-Bench JSONL (e.g. spec_bench_dev.jsonl)")
    e.add_argument("--eval-limit", type=int, default=None, help="the first N prompts")
    e.add_argument(
        "--eval-per-category", type=int, default=None, help="the first N prompts of each category (a shorter eval)"
    )
    e.add_argument("--eval-new-tokens", type=int, default=128)
    e.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32")
    e.add_argument(
        "--heads",
        default=None,
        help="comma-separated head files (default: OUT/eagle{v}.safetensors for each of --versions)",
    )
    e.add_argument("--chains", default="3,4,5,6", help="chain depths S")
    e.add_argument(
        "--trees",
        default="4x2x8,5x4x16,6x4x32,7x6x32,6x8x64",
        help="trees SxKxN ('' for none); 7x6x32: the best 32-node shape for the shipped head",
    )
    e.add_argument("--no-lossless-check", action="store_true", help="skip the autoregressive reference run")
    e.add_argument("--eval-json", default=None, help="for --stage plot: the eval.json to draw")
    e.add_argument(
        "--bench-dir", default=None, help="where the benchmark record train_draft_eval-DATE.json goes (default: OUT)"
    )
    e.add_argument("--no-bench-result", action="store_true", help="write no train_draft_eval-DATE.json")


class Log:
    """Print (flushed) and append to ``OUT/pipeline.log``, so a killed run still shows where it was."""

    def __init__(self, out: Path) -> None:
        self.path = out / "pipeline.log"
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        line = f"[{time.perf_counter() - self.start:7.1f}s] {message}"
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def _device(args) -> str:
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _tokenizer(args, model_path: Path):
    from ..engine.tokenizers.tokenizer import Tokenizer
    from ..engine.weights.weights_gguf import default_model_path

    source = args.tokenizer or (model_path if model_path.suffix == ".gguf" else default_model_path())
    return Tokenizer.from_gguf(source)


def _data_path(args) -> Path:
    """Where the generate stage writes (one file)."""
    if args.data and "," in args.data:
        raise ValueError(f"--data {args.data}: the generate stage writes one file; several are for --stage train")
    return Path(args.data) if args.data else Path(args.out) / "data.npz"


def _load_data(args):
    """The train stage's data: ``--data`` (several comma-separated files concatenated), else OUT/data.npz."""
    from .data import SelfDistilledData

    return SelfDistilledData.load_many(args.data) if args.data else SelfDistilledData.load(Path(args.out) / "data.npz")


def _self_prompts(args, tokenizer, generator, stop_ids, prompts, path: Path, source: str, log: Log):
    """``--self-prompts``: sampled user turns as prompt rows, ``(rows, stats)``; reloaded on resume."""
    from .augment import OverlapFilter, excluded_texts, write_jsonl
    from .data import load_train_prompts
    from .self_prompts import sample_user_turns, user_turn_prefix

    saved = path.with_name(path.stem + ".self_prompts.jsonl")
    if args.resume and saved.is_file():
        rows = load_train_prompts(saved)
        log(f"[self-prompts] resuming: {len(rows)} self-prompts from {saved}")
        return rows, {"kept": len(rows), "file": saved.name, "resumed": True}
    exclude = OverlapFilter(excluded_texts([*args.exclude, *([args.eval_prompts] if args.eval_prompts else [])]))
    prefix = user_turn_prefix(tokenizer)
    log(f"[self-prompts] sampling {args.self_prompts} user turns from {prefix.text!r}")
    start = time.perf_counter()
    texts, stats = sample_user_turns(
        generator,
        tokenizer,
        prefix,
        args.self_prompts,
        args.gen_batch,
        args.self_prompt_tokens,
        args.self_prompt_temperature,
        args.self_prompt_top_p,
        args.seed,
        stop_ids,
        exclude,
        seen=[p["prompt"] for p in prompts],
        log=log,
    )
    rows = [{"source": source, "prompt": text} for text in texts]
    write_jsonl(rows, saved)
    stats["file"] = saved.name
    log(
        f"[self-prompts] {stats['kept']} of {stats['sampled']} kept (refused: {stats['refused']}) in "
        f"{time.perf_counter() - start:.0f}s -> {saved}"
    )
    return rows, stats


def stage_generate(args, log: Log) -> None:
    import torch

    from ..engine.engine import load_model
    from .data import (
        EngineGenerator,
        HFGenerator,
        SelfDistilledData,
        encode_prompts,
        generate_responses,
        load_prompt_files,
    )

    if not args.prompts and not args.self_prompts:
        raise ValueError(
            "the generate stage needs --prompts (a training prompts JSONL, not Spec-Bench) or --self-prompts"
        )
    device = _device(args)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    start = time.perf_counter()
    config, weights, model_path = load_model(args.model, torch.float32)
    tokenizer = _tokenizer(args, model_path)
    prompts = load_prompt_files(args.prompts) if args.prompts else []
    prompts_file = ",".join(Path(p.strip()).name for p in args.prompts.split(",")) if args.prompts else ""
    path = _data_path(args)
    done = SelfDistilledData.load(path) if args.resume and path.is_file() else None
    if done is not None and done.meta.get("prompts_file", prompts_file) != prompts_file:
        raise ValueError(
            f"{path} was generated from --prompts {done.meta['prompts_file']}, not {prompts_file}: resuming would "
            "mix up prompt indices; pass the same --prompts, or another --data"
        )
    stop_ids = tuple(config.eos_token_ids) or (tokenizer.eos_token_id,)
    if args.self_prompts:
        from .self_prompts import user_turn_prefix

        stop_ids = tuple(dict.fromkeys([*stop_ids, *user_turn_prefix(tokenizer).end_ids]))
    if args.generator == "hf":
        from ..engine.weights.weights_hf import save_hf

        hf_dir = model_path if model_path.is_dir() else save_hf(Path(args.work_dir) / "hf-model", config, weights)
        generator = HFGenerator(hf_dir, device, dtype, stop_ids)
    else:
        generator = EngineGenerator(config, weights, device, dtype, stop_ids)
    del weights
    self_stats = None
    if args.self_prompts:
        source = f"self:{model_path.name}"
        rows, self_stats = _self_prompts(args, tokenizer, generator, stop_ids, prompts, path, source, log)
        prompts = prompts + rows  # after the files' prompts: their indices stay those of the files
    encoded = encode_prompts(tokenizer, prompts, args.max_prompt_tokens, args.num_prompts, args.seed)
    too_big = max((max(ids) for _, ids in encoded), default=0)
    if too_big >= config.vocab_size:
        raise ValueError(f"the tokenizer produced id {too_big}, past the model's vocabulary of {config.vocab_size}")
    log(
        f"[generate] {len(prompts)} prompts, {len(encoded)} kept (<= {args.max_prompt_tokens} tokens), "
        f"{sum(len(i) for _, i in encoded)} prompt tokens; model {model_path.name} on {device} "
        f"({time.perf_counter() - start:.1f}s)"
    )
    if done is not None:
        log(f"[generate] resuming: {len(done)} sequences already in {path}")
    meta = {
        "prompts_file": prompts_file,
        "prompts": len(prompts),
        "model": model_path.name,
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "generator": args.generator,
        "seed": args.seed,
    }
    if self_stats is not None:  # a resumed run keeps the first run's record of its sampling
        resumed = self_stats.get("resumed") and done is not None and "self_prompts" in done.meta
        meta["self_prompts"] = done.meta["self_prompts"] if resumed else self_stats
    budget = args.gen_minutes * 60 - (time.perf_counter() - start) if args.gen_minutes else None
    data = generate_responses(
        generator,
        encoded,
        config.vocab_size,
        args.gen_batch,
        args.max_new_tokens,
        args.temperature,
        done=done,
        time_budget_s=budget,
        on_save=lambda d: d.save(path),
        save_every_s=args.save_every,
        meta=meta,
        log=log,
    )
    log(
        f"[generate] done: {len(data)} sequences, {int(data.lengths.sum())} tokens ({data.response_tokens} "
        f"generated), {path.stat().st_size / 2**20:.1f} MiB at {path}, {time.perf_counter() - start:.0f}s"
    )


def _command_line(args) -> str:
    """The command that ran this (recorded beside the head), as `main` or the ``speccycle`` CLI got it."""
    if getattr(args, "command_line", None):
        return args.command_line
    return " ".join(["speccycle", *sys.argv[1:]])


def _versions(args) -> list[str]:
    """The heads ``--versions`` names: ``1``, ``3``, ``3full`` (``3`` with ``--draft-vocab 0`` is ``3full``)."""
    items = [v.strip() for v in args.versions.split(",") if v.strip()]
    if not items or any(v not in HEADS for v in items):
        raise ValueError(f"--versions {args.versions!r}: choose from {', '.join(HEADS)}, e.g. 1,3 or 3full")
    if args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab {args.draft_vocab}: a vocabulary size, or 0 for the target's LM head")
    names = ["3full" if v == "3" and args.draft_vocab == 0 else v for v in items]
    return list(dict.fromkeys(names))


def _train_config(args, name: str):
    """The `TrainConfig` of head ``name`` (an item of `_versions`)."""
    from .trainer import TrainConfig

    version = int(name[0])
    intermediate = args.v1_intermediate
    if version == 3:
        default = V3FULL_INTERMEDIATE if name == "3full" else V3_INTERMEDIATE
        intermediate = args.v3_intermediate or default
    return TrainConfig(
        version=version,
        ttt_steps=args.ttt_steps,
        draft_vocab_size=0 if name == "3full" else args.draft_vocab,
        intermediate_size=intermediate,
        num_layers=args.head_layers,
        batch_tokens=args.batch_tokens,
        max_len=args.max_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        steps=args.steps,
        time_budget_s=args.train_minutes * 60 if args.train_minutes else None,
        seed=args.seed,
        save_every_s=args.save_every,
    )


def stage_train(args, log: Log) -> None:
    import torch

    from ..engine.engine import load_model
    from ..engine.models.llama import LlamaModel
    from .trainer import train_head

    device = _device(args)
    data = _load_data(args)
    config, weights, model_path = load_model(args.model, torch.float32)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target = LlamaModel(config, weights, dtype=dtype, device=device)
    del weights
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for name in _versions(args):
        start = time.perf_counter()
        info = {
            "command": _command_line(args),
            "data": {**data.meta, "sequences": len(data), "tokens": int(data.lengths.sum())},
            "target": model_path.name,
        }
        train_head(
            _train_config(args, name),
            data,
            target,
            Path(args.out) / f"eagle{name}.safetensors",
            checkpoint_path=work / f"eagle{name}-ckpt.pt",
            resume=args.resume,
            info=info,
            log=log,
        )
        log(f"[train] eagle{name} done in {time.perf_counter() - start:.0f}s")


def _trees(text: str) -> list[tuple[int, int, int]]:
    trees = []
    for item in filter(None, text.split(",")):
        try:
            s, k, n = (int(x) for x in item.lower().split("x"))
        except ValueError as err:
            raise ValueError(f"--trees item {item!r}: write SxKxN, e.g. 6x4x32") from err
        trees.append((s, k, n))
    return trees


def stage_eval(args, log: Log) -> None:
    import torch

    from ..engine.bench import load_prompts
    from .evaluate import eval_configs, evaluate_heads, plot

    if not args.eval_prompts:
        raise ValueError("the eval stage needs --eval-prompts (e.g. spec_bench_dev.jsonl)")
    out = Path(args.out)
    if args.heads:
        heads = {Path(h).stem: Path(h) for h in args.heads.split(",")}
    else:
        heads = {f"eagle{v}": out / f"eagle{v}.safetensors" for v in _versions(args)}
    missing = [str(p) for p in heads.values() if not p.is_file()]
    if missing:
        raise ValueError(f"no head at {', '.join(missing)}: train first or pass --heads")
    device = _device(args)
    prompts = per_category(load_prompts(args.eval_prompts, args.eval_limit), args.eval_per_category)
    configs = eval_configs([int(s) for s in args.chains.split(",") if s], _trees(args.trees))
    start = time.perf_counter()
    result = evaluate_heads(
        heads,
        prompts,
        args.model,
        device,
        getattr(torch, args.eval_dtype),
        args.eval_new_tokens,
        configs,
        log=log,
        check_lossless=not args.no_lossless_check,
    )
    result["prompts_file"] = Path(args.eval_prompts).name
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_bench_result:
        try:
            from ..bench.common import write_result

            path = write_result("train_draft_eval", result, device, directory=args.bench_dir or out)
            log(f"[eval] wrote {path} (commit it under bench/results/)")
        except ImportError:  # installed without the bench folder: OUT/eval.json is the record
            pass
    png = plot(result, out / "eval.png") or "no plot (matplotlib is not installed: --stage plot elsewhere)"
    if result.get("best"):
        (out / "HEAD_README.md").write_text(head_readme(result, heads[result["best"]]))
    log(
        f"[eval] done in {time.perf_counter() - start:.0f}s: best head {result.get('best')}; {out / 'eval.json'}, {png}"
    )


def per_category(prompts: list[dict], count: int | None) -> list[dict]:
    """The first ``count`` prompts of each category, in file order (all where ``count`` is None)."""
    if count is None:
        return prompts
    if count < 1:
        raise ValueError(f"--eval-per-category {count}: pass a positive number of prompts")
    seen: dict[str, int] = {}
    kept = []
    for p in prompts:
        seen[p["category"]] = seen.get(p["category"], 0) + 1
        if seen[p["category"]] <= count:
            kept.append(p)
    return kept


def head_readme(result: dict, head_path: Path) -> str:
    """What ships beside a head: how it was trained (from its file's metadata) and what it measured."""
    from safetensors import safe_open

    from ..engine.drafters.eagle_storage import STORAGE_KEY

    with safe_open(str(head_path), framework="pt") as f:
        meta = f.metadata() or {}
        weight = next(k for k in f.keys() if k.endswith(".weight"))
        storage = meta.get(STORAGE_KEY) or str(f.get_tensor(weight).dtype).removeprefix("torch.")  # int8 or as saved
    train = json.loads(meta.get("speccycle.train", "{}"))
    entry = next(e for e in result["heads"].values() if Path(e["head"]) == head_path)
    lines = [
        f"# EAGLE-{entry['version']} head for {train.get('target', 'the target')}"
        + (" (logits from the target's final norm and LM head)" if entry.get("lm_head") == "target" else ""),
        "",
        f"File: `{head_path.name}` ({entry['file_mb']} MiB, {storage}; config in the safetensors metadata "
        "`speccycle.eagle`, training record in `speccycle.train`).",
        "",
        "## How it was trained",
        "",
        f"    {train.get('command', '(not recorded)')}",
        "",
        f"- data: {json.dumps(train.get('data', {}))}",
        f"- optimizer steps: {train.get('step')} of {train.get('total_steps')}; final loss {train.get('loss')}; "
        f"teacher-forced accuracy per draft step {train.get('acc')}",
        f"- training config: {json.dumps(train.get('config', {}))}",
        "",
        f"## Measured tau (greedy, {result['prompts']} prompts of {result.get('prompts_file', '?')}, "
        f"{result['new_tokens']} new tokens, {result['dtype']})",
        "",
        "| S | K | N | tau | tau MT-bench | acceptance by position | identical to AR |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in entry["configs"]:
        lines.append(
            f"| {c['S']} | {c['K']} | {c['N']} | {c['tau']} | {c['tau_mt_bench']} | "
            f"{c['accept_rate_by_position']} | {c.get('identical_to_ar', '-')}/{result['prompts']} |"
        )
    cats = sorted({cat for c in entry["configs"] for cat in c["tau_by_category"]})
    lines += ["", "tau by category:", "", "| S | K | N | " + " | ".join(cats) + " |"]
    lines.append("| --- " * (3 + len(cats)) + "|")
    for c in entry["configs"]:
        values = " | ".join(str(c["tau_by_category"].get(cat)) for cat in cats)
        lines.append(f"| {c['S']} | {c['K']} | {c['N']} | {values} |")
    return "\n".join(lines) + "\n"


def stage_plot(args, log: Log) -> None:
    from .evaluate import plot

    if not args.eval_json:
        raise ValueError("--stage plot needs --eval-json (an eval.json of the eval stage)")
    result = json.loads(Path(args.eval_json).read_text())
    png = plot(result, Path(args.out) / "eval.png")
    log(f"[plot] {png or 'no plot: matplotlib is not installed'}")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out)
    stages = ("generate", "train", "eval") if args.stage == "all" else (args.stage,)
    funcs = {"generate": stage_generate, "train": stage_train, "eval": stage_eval, "plot": stage_plot}
    for stage in stages:
        start = time.perf_counter()
        log(f"[{stage}] start")
        funcs[stage](args, log)
        log(f"[{stage}] finished in {time.perf_counter() - start:.0f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m speccycle.train.pipeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = " ".join(["python -m speccycle.train.pipeline", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except ValueError as err:
        print(f"train-draft: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
