"""The GPU benchmark of issue 4: the fast engine against its reference, its drafters, and transformers.

Parts (``--parts``, comma separated; each fits a few minutes, progress printed as it goes):

* ``real``: SmolLM2-135M (``$SPECCYCLE_DEFAULT_MODEL`` or the embedded GGUF), Spec-Bench prompts
  (``--prompts``, ``--prompts-per-category``), batch 1, greedy, bfloat16, ``--max-new-tokens``:
  engine autoregressive (reference path on ``--reference-prompts`` prompts, fast path on all),
  speculative on the fast path for each ``--configs`` entry (``ngram``, ``layerskip``, ``eagle`` with
  ``--eagle-head`` or the shipped head): tokens/s, tau, speedup over the fast autoregressive,
  identical_to_ar (speculative output == fast autoregressive output, token for token).
* ``hf``: transformers ``generate`` and its prompt lookup on the same GPU and prompts, the model
  built from the same GGUF (`weights_hf.save_hf`); ``--hf-prompts-per-category``.
* ``scale``: a Llama-3-8B-shaped model with random bfloat16 weights. Bandwidth measured here (a
  device copy and a device read of 2 GiB); autoregressive tokens/s against the limit
  ``bandwidth / weight bytes``; speculative with an EAGLE-3-shaped random head (32k draft vocabulary)
  and acceptance forced to ``--tau-chain`` (chain of 4) and ``--tau-tree`` (a 32-node tree): the
  overhead factor ``tau / speedup``. Forcing: the verify's greedy walk is fed target predictions
  rewritten so that the first-child path of the draft tree matches for exactly ``a`` rows, ``a``
  following the Beatty sequence ``floor(i tau) - floor((i - 1) tau)`` (mean ``tau``); every forward,
  the draft's included, runs for real, only the acceptance decision is forced (what SGLang's
  simulated acceptance does; `bench.forced`). The committed tokens are then not the target's greedy output. The
  ``tokens_per_s`` and ``overhead_factor`` fields time whole calls (the 512-token prefill included: ~2% of
  the autoregressive call, ~5% of the speculative one); ``decode_tokens_per_s`` and
  ``decode_overhead_factor`` leave out the median time of a 1-token call (prefill and first token), the
  decode phase the EAGLE papers' factor describes.
* ``batch``: SmolLM2, batch sizes ``--batch-sizes`` (1, 4, 16, 64): throughput (new tokens / s over
  the batch) of the fast autoregressive decode and of speculative decoding (``--batch-configs``).
* ``cpu``: per speculative cycle on the fast path (SmolLM2, layer skip chain): wall time, GPU time of
  the forwards (CUDA events), the rest (the state machine's host work and small ops: an upper bound
  on its CPU cost), and each transition's host time.
* ``lossless``: bfloat16, batch 1, every prompt of ``--prompts``: speculative output == fast
  autoregressive output, per ``--lossless-configs`` entry (the issue's 240-prompt goal).
* ``attention``: the paged attention kernels timed alone: Triton, the reference (plan + SDPA), and
  FlexAttention over gathered keys, decode and tree-verify rows, SmolLM2 and 8B shapes.

    python -m bench.gpu_bench --out $OUT --prompts spec_bench_dev.jsonl --parts real \\
        --prompts-per-category 2 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from .common import transformers_model, write_result
from .forced import force_fused_acceptance, force_plane_acceptance

RECORD: dict = {}


def say(*parts) -> None:
    print(*parts, flush=True)


def sync() -> None:
    torch.cuda.synchronize()


def timed(fn):
    """``(fn(), seconds)``, the GPU synced before and after."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def parse_config(text: str):
    """``draft:S4`` (chain) or ``draft:S4K4N16`` (tree) -> (draft, SpecConfig) with page size 16."""
    from speccycle.core import SpecConfig

    draft, _, shape = text.partition(":")
    match = re.fullmatch(r"S(\d+)(?:K(\d+)N(\d+))?", shape or "S4")
    if not match:
        raise ValueError(f"config {text!r}: expected draft:S<steps> or draft:S<steps>K<topk>N<nodes>")
    steps, topk, nodes = match.groups()
    if topk is None:
        return draft, SpecConfig(num_steps=int(steps), topk=1, page_size=16)
    return draft, SpecConfig(num_steps=int(steps), topk=int(topk), num_draft_tokens=int(nodes), page_size=16)


def pick(prompts: list[dict], per_category: int) -> list[dict]:
    seen: dict[str, int] = defaultdict(int)
    out = []
    for p in prompts:
        if seen[p["category"]] < per_category:
            seen[p["category"]] += 1
            out.append(p)
    return out


def free(*objects) -> None:
    del objects
    torch.cuda.empty_cache()


# ---- real model --------------------------------------------------------------------------------
def eagle_head_path(arg: str | None):
    if arg:
        return arg
    from speccycle.engine.drafters.eagle_heads import shipped_eagle_head
    from speccycle.engine.weights.weights_gguf import default_model_path

    return shipped_eagle_head(default_model_path())


def timed_ar(engine, ids: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    outputs, seconds = [], 0.0
    for x in ids:
        sync()
        start = time.perf_counter()
        outputs.append(engine.generate_autoregressive([x], new_tokens)[0])
        sync()
        seconds += time.perf_counter() - start
    return outputs, seconds


def draft_weights(engine) -> dict:
    """``{"draft_weights": "int8" | "dtype"}`` for an EAGLE engine on the fast path (`fast.path.HeadGemms`), else {}."""
    gemms = getattr(engine.draft, "gemms", None)
    return {"draft_weights": gemms.kind} if gemms is not None else {}


def timed_spec(engine, ids: list[list[int]], new_tokens: int):
    outputs, seconds, verifies, committed = [], 0.0, 0, 0
    for x in ids:
        sync()
        start = time.perf_counter()
        results, stats = engine.generate([x], new_tokens)
        sync()
        seconds += time.perf_counter() - start
        outputs.append(list(results[0].output))
        verifies += stats.verifies
        committed += stats.committed
    return outputs, seconds, (committed / verifies if verifies else None)


def part_real(args, prompts: list[dict]) -> None:
    from speccycle.engine.engine import Engine

    dtype = torch.bfloat16
    probe = Engine.load(draft="none", device="cuda", dtype=dtype, kv_tokens=1024)
    ids = [probe.chat_prompt(p["text"]) for p in prompts]
    free(probe)
    kv_tokens = max(len(x) for x in ids) + args.max_new_tokens + 1024
    total_new = lambda outs: sum(len(o) for o in outs)  # noqa: E731
    rows = []

    ref = Engine.load(draft="none", device="cuda", dtype=dtype, kv_tokens=kv_tokens)
    n_ref = min(args.reference_prompts, len(ids))
    ref.generate_autoregressive([ids[0]], 4)
    ref_out, ref_s = timed_ar(ref, ids[:n_ref], args.max_new_tokens)
    rows.append({"system": "engine autoregressive, reference path", "prompts": n_ref,
                 "tokens_per_s": round(total_new(ref_out) / ref_s, 2)})  # fmt: skip
    say("[real]", rows[-1])
    free(ref)

    fast = Engine.load(draft="none", device="cuda", dtype=dtype, kv_tokens=kv_tokens, fast=True)
    for x in ids:  # warm-up: captures the prefill buckets and the decode graphs
        fast.generate_autoregressive([x], 4)
    ar_out, ar_s = timed_ar(fast, ids, args.max_new_tokens)
    ar_tps = total_new(ar_out) / ar_s
    rows.append({"system": "engine autoregressive, fast path", "prompts": len(ids), "tokens_per_s": round(ar_tps, 2),
                 "identical_to_reference_path": sum(a == b for a, b in zip(ar_out[:n_ref], ref_out)),
                 "compared_with_reference": n_ref})  # fmt: skip
    say("[real]", rows[-1])
    RECORD["real_ar_outputs"], RECORD["real_ids"] = ar_out, ids
    free(fast)
    # The engine without a draft pads its decode rows to its SpecConfig's N (`accelerate`'s min_target_rows: 5,
    # a bucket of 8), so that its outputs are bitwise those of a verify; the plain decode, one row a step, is
    # what a user without speculation would run: the speedups are also given against it.
    from speccycle.engine.fast.path import accelerate

    plain = Engine.load(draft="none", device="cuda", dtype=dtype, kv_tokens=kv_tokens)
    accelerate(plain, min_target_rows=1)
    for x in ids:
        plain.generate_autoregressive([x], 4)
    plain_out, plain_s = timed_ar(plain, ids, args.max_new_tokens)
    plain_tps = total_new(plain_out) / plain_s
    rows.append({"system": "engine autoregressive, fast path, 1 row per step", "prompts": len(ids),
                 "tokens_per_s": round(plain_tps, 2),
                 "identical_to_padded_ar": sum(a == b for a, b in zip(plain_out, ar_out))})  # fmt: skip
    say("[real]", rows[-1])
    free(plain)

    head = eagle_head_path(args.eagle_head)
    for text in args.configs.split(","):
        draft, spec = parse_config(text)
        if draft == "eagle" and head is None:
            say("[real] eagle skipped: no --eagle-head and no shipped head")
            continue
        kwargs = {"layerskip_layers": args.layerskip_layers} if draft == "layerskip" else {}
        if draft == "eagle":
            kwargs["eagle_head"] = head
        engine = Engine.load(draft=draft, spec=spec, device="cuda", dtype=dtype, kv_tokens=kv_tokens, fast=True,
                             **kwargs)  # fmt: skip
        for x in ids:  # warm-up: prefill buckets, draft and verify graphs
            engine.generate([x], 8)
        out, seconds, tau = timed_spec(engine, ids, args.max_new_tokens)
        tps = total_new(out) / seconds
        per_cat = defaultdict(lambda: [0, 0])
        for p, a, b in zip(prompts, ar_out, out):
            per_cat[p["category"]][0] += 1
            per_cat[p["category"]][1] += int(a == b)
        rows.append({"system": f"engine speculative {text}", "draft": draft, "S": spec.num_steps, "K": spec.topk,
                     "N": spec.num_draft_tokens, "prompts": len(ids), "tokens_per_s": round(tps, 2),
                     "tau": round(tau, 3) if tau else None, "speedup_vs_fast_ar": round(tps / ar_tps, 3),
                     "speedup_vs_1row_ar": round(tps / plain_tps, 3),
                     "identical_to_ar": sum(a == b for a, b in zip(ar_out, out)),
                     "target_graphs": engine.target.graphs.num_graphs, **draft_weights(engine)})  # fmt: skip
        say("[real]", rows[-1])
        free(engine)
    RECORD["real"] = {"dtype": "bfloat16", "batch": 1, "max_new_tokens": args.max_new_tokens, "rows": rows}


def part_hf(args, prompts: list[dict]) -> None:
    from speccycle.engine.engine import Engine

    prompts = pick(prompts, args.hf_prompts_per_category)
    probe = Engine.load(draft="none", device="cuda", dtype=torch.bfloat16, kv_tokens=1024)
    ids = [probe.chat_prompt(p["text"]) for p in prompts]
    eos = probe.stop_token_ids
    free(probe)
    model = transformers_model(torch.bfloat16, "cuda")
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0])
    ar_out = RECORD.get("real_ar_outputs")
    ar_by_prompt = {}
    if ar_out is not None:
        ar_by_prompt = {tuple(x): o for x, o in zip(RECORD.get("real_ids", []), ar_out)}
    rows = []
    for name, extra in (
        ("transformers generate", {}),
        ("transformers prompt lookup", {"prompt_lookup_num_tokens": 10}),
    ):
        x = torch.tensor([ids[0]], device="cuda")
        model.generate(x, **{**kwargs, "max_new_tokens": 8}, **extra)  # warm-up
        tokens, seconds, outs = 0, 0.0, []
        for prompt in ids:
            x = torch.tensor([prompt], device="cuda")
            sync()
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(x, **kwargs, **extra)[0, len(prompt) :].tolist()
            sync()
            seconds += time.perf_counter() - start
            tokens += len(out)
            outs.append(out)
        rows.append({"system": name, "prompts": len(ids), "tokens_per_s": round(tokens / seconds, 2),
                     "identical_to_engine_ar": sum(ar_by_prompt.get(tuple(p)) == o for p, o in zip(ids, outs))
                     if ar_by_prompt else None})  # fmt: skip
        say("[hf]", rows[-1])
    RECORD["hf"] = {"dtype": "bfloat16", "batch": 1, "max_new_tokens": args.max_new_tokens, "rows": rows}
    free(model)


# ---- scale: an 8B-shaped model, forced acceptance ------------------------------------------------
LLAMA3_8B = dict(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position=8192,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_ids=(),  # random weights: decode the full length
)


def random_weights_on_device(config, device, dtype, scale=0.02) -> dict:
    from speccycle.engine.weights.weights_gguf import expected_shapes

    gen = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            weights[name] = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)
    return weights


def random_eagle3_head(target_config, device, dtype, draft_vocab: int = 32000):
    from speccycle.engine.drafters.eagle import EagleConfig, EagleHead, _shapes

    config = EagleConfig.for_target(target_config, version=3, draft_vocab_size=draft_vocab)
    gen = torch.Generator(device=device).manual_seed(1)
    weights = {}
    for name, shape in _shapes(config).items():
        if name == "draft_to_target":
            weights[name] = torch.randperm(target_config.vocab_size, device=device)[:draft_vocab].sort().values
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, device=device)
        else:
            weights[name] = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
    return EagleHead(config, weights, dtype=dtype, device=device)


def bandwidth() -> dict:
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    out = {}
    for name, fn, traffic in (("copy", lambda: y.copy_(x), 2 * 2 * n), ("read", lambda: x.amax(), 2 * n)):
        fn()
        sync()
        times = []
        for _ in range(10):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            sync()
            times.append(start.elapsed_time(end) / 1e3)
        out[f"{name}_GBps"] = round(traffic / statistics.median(times) / 1e9, 1)
    free(x, y)
    return out


def part_scale(args) -> None:
    from speccycle.core import SpecConfig
    from speccycle.engine.drafters.eagle import EagleDraft
    from speccycle.engine.engine import Engine
    from speccycle.engine.fast.path import FastGreedyDecoder, FastOptions
    from speccycle.engine.memory.kv_pool import PagedKVPool
    from speccycle.engine.models.llama import LlamaModel
    from speccycle.engine.weights.weights_gguf import LlamaConfig

    dtype = torch.bfloat16
    bw = bandwidth()
    say("[scale] bandwidth", bw)
    config = LlamaConfig(**LLAMA3_8B)
    head = random_eagle3_head(config, "cuda", dtype)
    weights = random_weights_on_device(config, "cuda", dtype)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    model = LlamaModel(config, weights, dtype=dtype, device="cuda", feature_layers=head.config.feature_layers)
    del weights
    torch.cuda.empty_cache()
    limit = max(bw.values()) * 1e9 / weight_bytes
    prompt = torch.randint(0, config.vocab_size, (args.scale_prompt_len,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    new = args.scale_new_tokens
    kv_tokens = args.scale_prompt_len + new + 512
    out = {"bandwidth": bw, "weight_bytes": weight_bytes, "ar_limit_tokens_per_s": round(limit, 1), "runs": []}

    def engine_for(spec):
        pool = PagedKVPool(num_pages=-(-kv_tokens // spec.page_size), page_size=spec.page_size, device="cuda")
        return Engine(model, pool, lambda e: EagleDraft(head, model, pool), spec, fast=True)

    def first_token_s(call) -> float:
        """Median seconds of a 1-token call (the prefill and its first token): the decode rates leave it out."""
        times = []
        for _ in range(3):
            sync()
            start = time.perf_counter()
            call(1)
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def run_ar(engine, decoder=None, label=""):
        engine.generate_autoregressive([prompt], 8)
        if decoder is not None:
            decoder.decode([prompt], 8)
        sync()

        def call(n):
            return engine.generate_autoregressive([prompt], n) if decoder is None else decoder.decode([prompt], n)

        start = time.perf_counter()
        tokens = call(new)[0]
        sync()
        seconds = time.perf_counter() - start
        tps = len(tokens) / seconds
        decode_tps = (len(tokens) - 1) / (seconds - first_token_s(call))
        row = {
            "system": f"autoregressive {label}",
            "tokens_per_s": round(tps, 2),
            "share_of_limit": round(tps / limit, 3),
            "decode_tokens_per_s": round(decode_tps, 2),
        }
        out["runs"].append(row)
        say("[scale]", row)
        return tps, decode_tps

    plain_tps = None
    for label, spec, tau in (
        ("chain of 4", SpecConfig(num_steps=4, topk=1, page_size=16), args.tau_chain),
        ("32-node tree", SpecConfig(num_steps=5, topk=4, num_draft_tokens=32, page_size=16), args.tau_tree),
    ):
        engine = engine_for(spec)
        if plain_tps is None:  # the plain autoregressive decode: one row per step (no padding to N)
            opts = FastOptions("cuda", min_target_rows=1)
            plain_tps, plain_decode_tps = run_ar(engine, FastGreedyDecoder(engine.target, engine.pool, opts),
                                                 "(1 row per step)")  # fmt: skip
        ar_tps, _ = run_ar(engine, None, f"(rows padded to N={spec.num_draft_tokens}, as the speculative engine's)")
        planes = force_plane_acceptance(engine, tau)  # the host or device plane's backend, wrapped
        # the fused cycles force it inside their graph
        fused = None if engine.fused_cycles is None else force_fused_acceptance(engine, tau)
        for way in ("fused", "plane") if fused is not None else ("plane",):
            engine.fused_cycles = fused if way == "fused" else None
            engine.generate([prompt], 16)  # warm-up: captures every graph
            sync()
            start = time.perf_counter()
            results, stats = engine.generate([prompt], new)
            sync()
            seconds = time.perf_counter() - start
            tps = len(results[0].output) / seconds
            first = first_token_s(lambda n, engine=engine: engine.generate([prompt], n))
            decode_tps = (len(results[0].output) - 1) / (seconds - first)
            # against the plain decode (1 row a step: the fastest autoregressive decode, what a user compares
            # with); the padded decode (the verify's row count, bitwise the verify's numerics) flatters the
            # ratio by what padding costs (5% at N=5, 12% at N=32 at this shape). Until 2e31a5b the
            # speedup and overhead_factor fields were against the padded decode.
            speedup, padded_speedup = tps / plain_tps, tps / ar_tps
            row = {"system": f"speculative EAGLE-3-shaped head, {label}", "S": spec.num_steps, "K": spec.topk,
                   "N": spec.num_draft_tokens, "forced_tau": tau, "measured_tau": round(stats.tau, 3),
                   "tokens_per_s": round(tps, 2), "speedup": round(speedup, 3),
                   "overhead_factor": round(stats.tau / speedup, 3),
                   "speedup_vs_padded_ar": round(padded_speedup, 3),
                   "overhead_factor_vs_padded_ar": round(stats.tau / padded_speedup, 3),
                   "decode_tokens_per_s": round(decode_tps, 2),
                   "decode_overhead_factor": round(stats.tau * plain_decode_tps / decode_tps, 3),
                   "control_plane": "fused cycles (engine.fused_cycle)" if way == "fused" else planes[-1]}  # fmt: skip
            out["runs"].append(row)
            say("[scale]", row)
        free(engine)
    RECORD["scale"] = out
    free(model, head)


# ---- batch sizes ------------------------------------------------------------------------------------
def part_batch(args, prompts: list[dict]) -> None:
    from speccycle.engine.engine import Engine
    from speccycle.engine.fast.path import accelerate

    dtype = torch.bfloat16
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    probe = Engine.load(draft="none", device="cuda", dtype=dtype, kv_tokens=1024)
    ids_all = [probe.chat_prompt(p["text"]) for p in prompts]
    free(probe)
    new = args.batch_new_tokens
    rows = []
    for text in ["none", *args.batch_configs.split(",")]:
        draft, spec = ("none", None) if text == "none" else parse_config(text)
        for bs in sizes:
            ids = [ids_all[i % len(ids_all)] for i in range(bs)]
            n = spec.num_draft_tokens if spec else 1
            kv_tokens = sum(len(x) for x in ids) + bs * (new + 2 * max(n, 8) + 64)
            kwargs = {"layerskip_layers": args.layerskip_layers} if draft == "layerskip" else {}
            engine = Engine.load(draft=draft, spec=spec, device="cuda", dtype=dtype, kv_tokens=kv_tokens, **kwargs)
            accelerate(engine, max_rows=512, max_requests=max(64, bs))
            warm = ids[: min(bs, 4)]
            if draft == "none":
                engine.generate_autoregressive(ids, 4)
                sync()
                start = time.perf_counter()
                outs = engine.generate_autoregressive(ids, new)
                tau = None
            else:
                engine.generate(warm, 8)
                engine.generate(ids, 8)
                sync()
                start = time.perf_counter()
                results, stats = engine.generate(ids, new)
                outs, tau = [list(r.output) for r in results], stats.tau
            sync()
            seconds = time.perf_counter() - start
            row = {"system": "autoregressive" if draft == "none" else f"speculative {text}", "batch": bs,
                   "tokens_per_s": round(sum(len(o) for o in outs) / seconds, 1),
                   "tau": round(tau, 3) if tau else None}  # fmt: skip
            rows.append(row)
            say("[batch]", row)
            free(engine)
    ar = {r["batch"]: r["tokens_per_s"] for r in rows if r["system"] == "autoregressive"}
    for r in rows:
        r["speedup_vs_ar"] = round(r["tokens_per_s"] / ar[r["batch"]], 3) if r["batch"] in ar else None
    RECORD["batch"] = {"dtype": "bfloat16", "max_new_tokens": new, "rows": rows}


# ---- lossless at batch 1, every prompt ------------------------------------------------------------
def part_lossless(args) -> None:
    from speccycle.engine.bench import load_prompts
    from speccycle.engine.engine import Engine

    dtype = torch.bfloat16
    prompts = load_prompts(args.prompts, args.lossless_prompts or None)
    new = args.lossless_new_tokens
    probe = Engine.load(draft="none", device="cuda", dtype=dtype, kv_tokens=1024)
    ids = [probe.chat_prompt(p["text"]) for p in prompts]
    free(probe)
    kv_tokens = max(len(x) for x in ids) + new + 1024
    fast = Engine.load(draft="none", device="cuda", dtype=dtype, kv_tokens=kv_tokens, fast=True)
    start = time.time()
    ar = [fast.generate_autoregressive([x], new)[0] for x in ids]
    say(f"[lossless] fast autoregressive over {len(ids)} prompts: {time.time() - start:.0f} s")
    free(fast)
    head = eagle_head_path(args.eagle_head)
    rows = []
    for text in args.lossless_configs.split(","):
        draft, spec = parse_config(text)
        if draft == "eagle" and head is None:
            say("[lossless] eagle skipped: no --eagle-head and no shipped head")
            continue
        kwargs = {"layerskip_layers": args.layerskip_layers} if draft == "layerskip" else {}
        if draft == "eagle":
            kwargs["eagle_head"] = head
        engine = Engine.load(draft=draft, spec=spec, device="cuda", dtype=dtype, kv_tokens=kv_tokens, fast=True,
                             **kwargs)  # fmt: skip
        start = time.time()
        same, mismatched, verifies, committed = 0, [], 0, 0
        for item, x, want in zip(prompts, ids, ar):
            results, stats = engine.generate([x], new)
            verifies, committed = verifies + stats.verifies, committed + stats.committed
            if list(results[0].output) == want:
                same += 1
            else:
                mismatched.append(item["id"])
        row = {"config": text, "identical_to_ar": same, "prompts": len(ids), "first_mismatches": mismatched[:10],
               "tau": round(committed / verifies, 3) if verifies else None, "seconds": round(time.time() - start, 1),
               **draft_weights(engine)}  # fmt: skip
        rows.append(row)
        say("[lossless]", row)
        free(engine)
    RECORD["lossless"] = {"dtype": "bfloat16", "batch": 1, "max_new_tokens": new, "rows": rows}


# ---- CPU cost per cycle -----------------------------------------------------------------------------
def part_cpu(args, prompts: list[dict]) -> None:
    from speccycle.core import Admitted, Ports, Request, SamplingParams
    from speccycle.core.records import Ready
    from speccycle.engine.engine import Engine
    from speccycle.statemachine import step

    draft, spec = parse_config(args.cpu_config)
    kwargs = {"layerskip_layers": args.layerskip_layers} if draft == "layerskip" else {}
    engine = Engine.load(draft=draft, spec=spec, device="cuda", dtype=torch.bfloat16, kv_tokens=8192, fast=True,
                         **kwargs)  # fmt: skip
    ids = engine.chat_prompt(prompts[0]["text"])
    engine.generate([ids], 16)  # warm-up
    forward_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    depth = [0]  # only the outermost call is timed (the draft loop calls step inside)

    def timed(fn):
        def wrapper(*a, **k):
            if depth[0]:
                return fn(*a, **k)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            depth[0] += 1
            try:
                start.record()
                result = fn(*a, **k)
                end.record()
            finally:
                depth[0] -= 1
            forward_events.append((start, end))
            return result

        return wrapper

    engine.target.forward = timed(engine.target.forward)
    for name in ("step", "extend", "run_draft_levels"):  # the captured draft loop replays in the last
        if hasattr(engine.draft, name):
            setattr(engine.draft, name, timed(getattr(engine.draft, name)))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=())
    record = Admitted(config=engine.spec, requests=(Request(10**6, tuple(ids), params),))
    ports = Ports(target=engine.target, draft=engine.draft, kv_pool=engine.pool)
    transition_s: dict[str, list[float]] = defaultdict(list)
    cycles = []
    trace = lambda e: transition_s[e.event].append(e.duration_s)  # noqa: E731
    record = step(record, ports, engine.backend, trace=trace)
    while record.requests:
        forward_events.clear()
        sync()
        start = time.perf_counter()
        while True:
            record = step(record, ports, engine.backend, trace=trace)
            if isinstance(record, Ready) or not record.requests:
                break
        sync()
        wall = time.perf_counter() - start
        gpu = sum(s.elapsed_time(e) for s, e in forward_events) / 1e3
        cycles.append((wall, gpu))
    for rid in list(getattr(engine.pool, "_pages", {})):
        engine.pool.free(rid)
    cycles = cycles[2:-1] or cycles  # steady state
    wall = statistics.median(c[0] for c in cycles)
    gpu = statistics.median(c[1] for c in cycles)
    per_transition = {k: round(statistics.median(v) * 1e6, 1) for k, v in transition_s.items()}
    out = {"config": args.cpu_config, "cycles": len(cycles), "wall_us_per_cycle": round(wall * 1e6, 1),
           "forward_gpu_us_per_cycle": round(gpu * 1e6, 1), "rest_us_per_cycle": round((wall - gpu) * 1e6, 1),
           "transition_host_us_median": per_transition}  # fmt: skip
    say("[cpu]", out)
    RECORD["cpu"] = out
    free(engine)


# ---- attention kernels ------------------------------------------------------------------------------
def attention_case(heads: int, kv_heads: int, dim: int, rows: int, length: int) -> dict:
    """The kernels to time on one request: ``rows == 1`` a decode row, else a binary tree of verify rows."""
    from speccycle.core.ports import ForwardBatch
    from speccycle.core.tree import ancestor_mask, tree_depths
    from speccycle.engine.kernels.attention import paged_attention, plan_attention
    from speccycle.engine.kernels.attention_triton import paged_attention_rows_triton

    dtype, page_size, device = torch.bfloat16, 16, "cuda"
    pages = math.ceil((length + rows) / page_size)
    table = torch.randperm(pages + 8, device=device)[:pages][None]
    slots = (pages + 8) * page_size
    k = torch.randn(slots, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(rows, heads, dim, device=device, dtype=dtype)
    positions = length + torch.arange(rows, device=device)
    verify_slots = table[0, positions // page_size] * page_size + positions % page_size
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, rows)], device=device)
    if rows > 1:
        extra = torch.where(ancestor_mask(parents[None])[0], verify_slots[None, :], -1)
    else:
        extra = torch.empty((1, 0), dtype=torch.long, device=device)
    batch = ForwardBatch(
        input_ids=torch.zeros(rows, dtype=torch.long, device=device),
        positions=length + tree_depths(parents[None])[0],
        row_request=torch.zeros(rows, dtype=torch.long, device=device),
        out_slots=verify_slots,
        prefix_lens=torch.full((rows,), length + (1 if rows == 1 else 0), device=device),
        extra_slots=extra,
        page_table=table,
        page_size=page_size,
        request_ids=(0,),
    )
    row_args = (batch.row_request, batch.prefix_lens, batch.extra_slots, batch.page_table, page_size)
    plan = plan_attention(batch)
    fns = {
        "triton": lambda: paged_attention_rows_triton(q, k, v, *row_args),
        "reference (plan + SDPA)": lambda: paged_attention(plan_attention(batch), q, k, v),
        "reference SDPA, plan reused": lambda: paged_attention(plan, q, k, v),
    }
    flex = flex_fn(plan, q, k, v)
    if flex is not None:
        fns["flex_attention (gathered keys, compiled)"] = flex
    return fns


def part_attention(args) -> None:
    rows_out = []
    for heads, kv_heads, dim in ((9, 3, 64), (32, 8, 128)):
        for kind, rows in (("decode", 1), ("tree verify", 16)):
            for length in (256, 2048):
                for name, fn in attention_case(heads, kv_heads, dim, rows, length).items():
                    try:
                        us = time_us(fn)
                    except Exception as err:  # flex may not compile on every build
                        us = f"failed: {type(err).__name__}: {err}"[:200]
                    row = {
                        "shape": f"{heads}/{kv_heads}x{dim}",
                        "rows": kind,
                        "prefix": length,
                        "kernel": name,
                        "us": us,
                    }
                    rows_out.append(row)
                    say("[attention]", row)
    RECORD["attention"] = rows_out


def time_us(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        sync()
        times.append(start.elapsed_time(end) * 1e3)
    return round(statistics.median(times), 1)


def flex_fn(plan, q, k_cache, v_cache):
    """FlexAttention over the plan's gathered keys with its mask as a block mask, compiled once."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    bs, tq, skv = plan.bs, plan.tq, plan.key_slots.shape[1]
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    mask = plan.mask[:, 0]  # [bs, Tq, Skv]
    compiled = torch.compile(flex_attention)

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[b, q_idx, kv_idx]

    try:
        block = create_block_mask(mask_mod, bs, None, tq, skv, device="cuda")
    except Exception:
        return None

    def run():
        flat = plan.key_slots.reshape(-1)
        keys = k_cache.index_select(0, flat).view(bs, skv, kv_heads, dim).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(bs, skv, kv_heads, dim).transpose(1, 2)
        query = q.view(bs, tq, heads, dim).transpose(1, 2)
        return compiled(query, keys, values, block_mask=block, enable_gqa=heads != kv_heads)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the JSON result")
    parser.add_argument("--prompts", default=None, help="Spec-Bench JSONL (default: the shipped 13-prompt sample)")
    parser.add_argument("--parts", default="real,scale,batch,cpu")
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--reference-prompts", type=int, default=2, help="prompts for the slow reference path")
    parser.add_argument(
        "--configs", default="ngram:S5,ngram:S4K4N16,layerskip:S4,layerskip:S3K4N12,eagle:S4,eagle:S5K4N24"
    )
    parser.add_argument("--layerskip-layers", type=int, default=8)
    parser.add_argument("--eagle-head", default=None, help="EAGLE head .safetensors (default: the shipped head)")
    parser.add_argument("--hf-prompts-per-category", type=int, default=1)
    parser.add_argument("--tau-chain", type=float, default=3.0)
    parser.add_argument("--tau-tree", type=float, default=4.0)
    parser.add_argument("--scale-prompt-len", type=int, default=512)
    parser.add_argument("--scale-new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--batch-configs", default="layerskip:S4")
    parser.add_argument("--batch-new-tokens", type=int, default=128)
    parser.add_argument("--cpu-config", default="layerskip:S4")
    parser.add_argument("--lossless-configs", default="ngram:S5,layerskip:S4,layerskip:S3K4N12,eagle:S4")
    parser.add_argument("--lossless-prompts", type=int, default=0, help="0: every prompt of --prompts")
    parser.add_argument("--lossless-new-tokens", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_bench needs a CUDA device")
    from speccycle.engine.bench import load_prompts

    prompts = pick(load_prompts(args.prompts), args.prompts_per_category)
    RECORD["args"] = vars(args)
    start = time.time()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    runners = {
        "real": lambda: part_real(args, prompts),
        "hf": lambda: part_hf(args, prompts),
        "scale": lambda: part_scale(args),
        "batch": lambda: part_batch(args, prompts),
        "cpu": lambda: part_cpu(args, prompts),
        "attention": lambda: part_attention(args),
        "lossless": lambda: part_lossless(args),
    }
    for part in parts:
        if part not in runners:
            raise SystemExit(f"unknown part {part!r}: choose from {', '.join(runners)}")
    for part in parts:
        t0 = time.time()
        say(f"== {part} ==")
        try:
            runners[part]()
        except Exception as err:  # keep the other parts' results
            import traceback

            traceback.print_exc()
            RECORD.setdefault("errors", {})[part] = f"{type(err).__name__}: {err}"
        say(f"== {part}: {time.time() - t0:.0f} s ==")
        RECORD["seconds"] = round(time.time() - start, 1)
        partial = Path(args.out) / "gpu_bench-partial.json"  # what finished so far, if a later part dies
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(public(), indent=2) + "\n")
    path = write_result("gpu_bench", public(), "cuda", directory=args.out)
    say(f"wrote {path}")


def public() -> dict:
    return {k: v for k, v in RECORD.items() if k not in ("real_ar_outputs", "real_ids")}


if __name__ == "__main__":
    main()
