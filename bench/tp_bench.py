"""Tensor parallelism: TP=1 vs TP=2 tokens/s, speedup and per-cycle communication time, batch 1, greedy.

    # 2 GPUs, NCCL (NVLink multicast off), from the repository root:
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m bench.tp_bench --out bench/results
    # CPU smoke test, gloo, a tiny shape:
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m bench.tp_bench --tiny --out /tmp/tp_bench

Models: ``llama3-8b``, a Llama-3-8B-shaped model (32 layers, 4096 hidden, 32/8 heads, 128256 vocab)
with random bf16 weights generated on the GPU, and ``smollm2`` (SmolLM2-135M-Instruct, the GGUF of
``$SPECCYCLE_DEFAULT_MODEL``); ``--tiny`` swaps the 8B shape for a small one.

Forced acceptance. A random model has no useful draft, so the speculative runs use `OracleDraft`:
each configuration first decodes every prompt autoregressively (the AR timing), then the draft
proposes that greedy continuation, each token right with probability ``--accept-prob`` (else a wrong
token), so ``tau = 1 + p + ... + p^S`` and the verify, the part tensor parallelism splits, does real
work. The coins come from one seeded generator, alike on every rank (`shared_generator`).

TP=1 runs on rank 0 alone while the other ranks wait: ``tp1`` is the single-GPU `Engine`
(`LlamaModel`), ``tp1_tpcode`` the tensor-parallel code at world size 1 (no collective), and ``tp2``
both ranks. Per configuration: AR tokens/s, chain and tree tokens/s and tau, output identical to the
same configuration's AR and to TP=1's AR (bf16: the numerics of a split matmul differ). For TP=2:
communication time per cycle (CUDA events around each collective, waiting for the peer included),
collectives per cycle, and the cost of the checked-mode rank comparison per cycle (the measure for
comparing once per cycle against broadcasting decisions from rank 0, a collective of the same size).
With the EAGLE comparison (on unless ``--no-eagle``): a random EAGLE-1 head of the model's shape,
replicated vs sharded, draft and verify time per cycle.

``--lossless PROMPTS.jsonl``: SmolLM2 in float32 on a prompts file, one ragged batch per case, every
TP=N output (autoregressive and speculative, each drafter, chain and tree) against TP=1 autoregressive.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial

import torch
import torch.distributed as dist
from speccycle.core import Drafted, Ready, SpecConfig, Verified
from speccycle.engine.drafters.eagle import EagleConfig, EagleDraft, EagleHead
from speccycle.engine.drafters.eagle_tp import ShardedEagleDraft, TPEagleDraft
from speccycle.engine.drafters.oracle import OracleDraft
from speccycle.engine.engine import Engine
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import LlamaModel
from speccycle.engine.tp.engine import TPEngine, init_tp, shared_generator
from speccycle.engine.tp.tp_group import CommTimer, TPGroup
from speccycle.engine.tp.tp_model import TPLlamaModel
from speccycle.engine.weights.weights_gguf import LlamaConfig, expected_shapes

from .common import write_result

LLAMA3_8B = LlamaConfig(
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
    eos_token_ids=(),  # never stops early: every run decodes the same number of tokens
)
TINY = LlamaConfig(
    architecture="llama",
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=176,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=1024,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_ids=(),
)


class RandomWeights(Mapping):
    """Random weights generated on ``device`` when read (one tensor at a time; nothing is kept).

    Tensor ``i`` comes from a generator seeded ``seed * 1_000_003 + i``: the same on every rank, so each
    rank's shard is a slice of the same model. Projections ``N(0, 1 / fan_in)``, norms near 1.
    """

    def __init__(self, config: LlamaConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.shapes = expected_shapes(config)
        self.index = {name: i for i, name in enumerate(self.shapes)}
        self.device, self.dtype, self.seed = device, dtype, seed

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + self.index[name])
        noise = torch.randn(shape, generator=generator, device=self.device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            return (1.0 + 0.02 * noise).to(self.dtype)
        return (noise * shape[-1] ** -0.5).to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


# ---- helpers --------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def new_engine(model, spec: SpecConfig, draft, kv_tokens: int) -> Engine:
    pool = PagedKVPool(num_pages=-(-kv_tokens // spec.page_size), page_size=spec.page_size, device=model.device)
    cls = TPEngine if isinstance(model, TPLlamaModel) else Engine
    return cls(model, pool, draft, spec)


def timed(device: torch.device, fn: Callable):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


class StepTimer:
    """``on_step`` hook: wall time of each transition, by the record it returned (synchronizes each step)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self.last = device, {}, None

    def start(self) -> None:
        sync(self.device)
        self.last = time.perf_counter()

    def __call__(self, record) -> None:
        sync(self.device)
        now = time.perf_counter()
        kind = type(record).__name__
        self.seconds[kind] = self.seconds.get(kind, 0.0) + now - self.last
        self.last = now


def speculate(engine: Engine, prompts, n_new: int, **kwargs) -> tuple[list[list[int]], int, int]:
    """Each prompt alone (batch 1): outputs, verifies, committed tokens."""
    outputs, verifies, committed = [], 0, 0
    for prompt in prompts:
        results, stats = engine.generate([prompt], n_new, **kwargs)
        outputs.append(list(results[0].output))
        verifies, committed = verifies + stats.verifies, committed + stats.committed
    return outputs, verifies, committed


# ---- one configuration (TP=1 on rank 0, or the whole group) --------------------------------------
def run_configuration(model, group: TPGroup | None, prompts, args, eagle_head: EagleHead | None) -> dict:
    device = model.device
    vocab = model.vocab_size
    n_new = args.new_tokens
    chain = SpecConfig(num_steps=args.steps, topk=1, page_size=16)
    tree = SpecConfig(num_steps=args.steps, topk=args.tree_topk, num_draft_tokens=args.tree_tokens, page_size=16)
    kv_tokens = max(len(p) for p in prompts) + n_new + 2 * tree.reserve_len("aligned") + 64
    out: dict = {}

    engine = new_engine(model, chain, None, kv_tokens)
    engine.generate_autoregressive([prompts[0]], 8)  # warm-up
    ar, seconds = [], 0.0
    for prompt in prompts:
        tokens, s = timed(device, lambda p=prompt: engine.generate_autoregressive([p], n_new)[0])
        ar.append(tokens)
        seconds += s
    out["autoregressive"] = {"tokens_per_s": round(sum(map(len, ar)) / seconds, 2), "outputs": ar}
    if group is not None and group.world_size > 1:
        group.timer = CommTimer(device)
        engine.generate_autoregressive([prompts[0]], n_new)
        comm = group.timer.collect()
        group.timer = None
        per_token = {
            k: {"calls": v["calls"] / n_new, "ms": round(1e3 * v["seconds"] / n_new, 4)} for k, v in comm.items()
        }
        out["autoregressive"]["comm_per_token"] = per_token
    references = [list(p) + list(o) for p, o in zip(prompts, ar)]

    for name, spec in (("chain", chain), ("tree", tree)):

        def oracle(engine, seed=args.seed):
            generator = shared_generator(group, seed) if group is not None else torch.Generator().manual_seed(seed)
            return OracleDraft(vocab, references, args.accept_prob, generator)

        engine = new_engine(model, spec, oracle, kv_tokens)
        engine.generate([prompts[0]], 8)  # warm-up
        (outputs, verifies, committed), seconds = timed(device, partial(speculate, engine, prompts, n_new))
        row = {
            "tokens_per_s": round(sum(map(len, outputs)) / seconds, 2),
            "tau": round(committed / max(verifies, 1), 3),
            "identical_to_own_ar": sum(o == a for o, a in zip(outputs, ar)),
            "outputs": outputs,
            "config": {"S": spec.num_steps, "K": spec.topk, "N": spec.num_draft_tokens},
        }
        if group is not None and group.world_size > 1:
            subset = prompts[: min(2, len(prompts))]
            group.timer = CommTimer(device)
            _, cycles, _ = speculate(engine, subset, n_new)
            comm = group.timer.collect()
            group.timer = None
            row["comm_per_cycle"] = {
                k: {"calls": round(v["calls"] / cycles, 2), "ms": round(1e3 * v["seconds"] / cycles, 4)}
                for k, v in comm.items()
            }
            row["comm_ms_per_cycle"] = round(sum(v["ms"] for v in row["comm_per_cycle"].values()), 4)
            (_, cycles, _), t_plain = timed(device, partial(speculate, engine, subset, n_new))
            _, t_checked = timed(device, partial(speculate, engine, subset, n_new, check_ranks=True))
            row["rank_check_ms_per_cycle"] = round(1e3 * (t_checked - t_plain) / max(cycles, 1), 4)
        out[name] = row

    if eagle_head is not None:
        kinds = ("replicated", "sharded") if group is not None and group.world_size > 1 else ("replicated",)
        for kind in kinds:

            def draft(engine, kind=kind):
                if not isinstance(model, TPLlamaModel):
                    return EagleDraft(eagle_head, model, engine.pool)
                return (ShardedEagleDraft if kind == "sharded" else TPEagleDraft)(eagle_head, model, engine.pool)

            engine = new_engine(model, tree, draft, kv_tokens)
            engine.generate([prompts[0]], 8)  # warm-up
            timer, verifies = StepTimer(device), 0
            for prompt in prompts[: min(2, len(prompts))]:
                timer.start()
                verifies += engine.generate([prompt], n_new, on_step=timer)[1].verifies
            draft_s = timer.seconds.get(Drafted.__name__, 0.0) + timer.seconds.get(Ready.__name__, 0.0)
            out[f"eagle_{kind}"] = {
                "draft_ms_per_cycle": round(1e3 * draft_s / max(verifies, 1), 3),
                "verify_ms_per_cycle": round(1e3 * timer.seconds.get(Verified.__name__, 0.0) / max(verifies, 1), 3),
                "cycles": verifies,
                "note": "random head: tau ~ 1; times per cycle with a device sync after every transition",
            }
        del engine
    free_memory()
    return out


def load(name: str, args, device: torch.device, dtype: torch.dtype):
    """``(config, weights, prompts)``: random prompts for the random shapes, chat prompts for SmolLM2."""
    if name in ("llama3-8b", "tiny"):
        config = LLAMA3_8B if name == "llama3-8b" else TINY
        generator = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(config.vocab_size, (args.prompts, args.prompt_len), generator=generator).tolist()
        return config, RandomWeights(config, device, dtype, seed=args.seed), prompts
    if name == "smollm2":
        from speccycle.engine.bench import load_prompts
        from speccycle.engine.tokenizers.tokenizer import Tokenizer
        from speccycle.engine.weights.weights_gguf import default_model_path, load_gguf

        path = default_model_path()
        config, weights = load_gguf(path, dtype=dtype)
        tokenizer = Tokenizer.from_gguf(path)
        texts = [p["text"] for p in load_prompts(None)[: args.prompts]]
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        return config, weights, prompts
    raise ValueError(f"unknown model {name!r}: choose llama3-8b, smollm2 or tiny")


def bench_model(name: str, tp: TPGroup, args, dtype: torch.dtype) -> dict:
    config, weights, prompts = load(name, args, tp.device, dtype)
    head = None
    if args.eagle:
        head = EagleHead.random(EagleConfig.for_target(config, 1), seed=args.seed, dtype=dtype, device=tp.device)
    entry: dict = {"config": {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "num_layers")}}
    entry["config"].update(heads=config.num_heads, kv_heads=config.num_kv_heads, prompts=len(prompts))
    if tp.rank == 0:
        model = LlamaModel(config, weights, dtype=dtype, device=tp.device)
        entry["tp1"] = run_configuration(model, None, prompts, args, head)
        del model
        free_memory()
        solo = TPGroup(0, 1, None, tp.device)
        model = TPLlamaModel(config, weights, solo, dtype=dtype)
        entry["tp1_tpcode"] = run_configuration(model, solo, prompts, args, head)
        del model
        free_memory()
        print(f"[{name}] TP=1 done", flush=True)
    dist.barrier()
    model = TPLlamaModel(config, weights, tp, dtype=dtype)
    entry[f"tp{tp.world_size}"] = run_configuration(model, tp, prompts, args, head)
    del model
    free_memory()
    dist.barrier()
    if tp.rank == 0:
        tp1, tpn = entry["tp1"], entry[f"tp{tp.world_size}"]
        entry["speedup_over_tp1"] = {
            mode: round(tpn[mode]["tokens_per_s"] / tp1[mode]["tokens_per_s"], 3)
            for mode in ("autoregressive", "chain", "tree")
        }
        reference = tp1["autoregressive"]["outputs"]
        entry["identical_to_tp1_ar"] = {
            mode: sum(o == r for o, r in zip(tpn[mode]["outputs"], reference))
            for mode in ("autoregressive", "chain", "tree")
        }
        for run in (entry["tp1"], entry["tp1_tpcode"], tpn):  # outputs are long; keep only the counts
            for mode in ("autoregressive", "chain", "tree"):
                run[mode].pop("outputs")
        print(f"[{name}] {entry['speedup_over_tp1']}", flush=True)
    return entry


LOSSLESS_CASES = [  # as bench/lossless_sweep.py, EAGLE (a random head) replicated and sharded
    ("ngram", SpecConfig(num_steps=5, topk=1, page_size=1)),
    ("ngram", SpecConfig(num_steps=4, topk=4, num_draft_tokens=32, page_size=16)),
    ("layerskip", SpecConfig(num_steps=3, topk=1, page_size=16)),
    ("layerskip", SpecConfig(num_steps=3, topk=4, num_draft_tokens=16, page_size=1)),
    ("eagle-replicated", SpecConfig(num_steps=3, topk=1, page_size=1)),
    ("eagle-sharded", SpecConfig(num_steps=4, topk=4, num_draft_tokens=32, page_size=16)),
]


def lossless(tp: TPGroup, args) -> dict:
    """SmolLM2 in float32 on a prompts file, one ragged batch per case: TP=N output vs TP=1 autoregressive."""
    from speccycle.engine.bench import load_prompts
    from speccycle.engine.drafters.layerskip import LlamaDraft
    from speccycle.engine.drafters.ngram import NgramDraft
    from speccycle.engine.tokenizers.tokenizer import Tokenizer
    from speccycle.engine.weights.weights_gguf import default_model_path, load_gguf

    path = default_model_path()
    config, weights = load_gguf(path, dtype=torch.float32)
    tokenizer = Tokenizer.from_gguf(path)
    items = load_prompts(args.lossless, args.lossless_limit)
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}]) for p in items]
    n_new = args.lossless_tokens
    kv_tokens = sum(map(len, ids)) + len(ids) * (n_new + 2 * 64 + 2 * 16)  # + reservations, partial pages
    head = EagleHead.random(EagleConfig.for_target(config, 1), seed=1, device=tp.device)
    record: dict = {"prompts": len(ids), "new_tokens": n_new, "dtype": "float32", "cases": []}
    reference = None
    if tp.rank == 0:
        model = LlamaModel(config, weights, device=tp.device)
        start = time.perf_counter()
        reference = new_engine(model, SpecConfig(), None, kv_tokens).generate_autoregressive(ids, n_new)
        record["tp1_ar_seconds"] = round(time.perf_counter() - start, 1)
        del model
        free_memory()
    dist.barrier()
    model = TPLlamaModel(config, weights, tp, dtype=torch.float32)
    start = time.perf_counter()
    outputs = new_engine(model, SpecConfig(), None, kv_tokens).generate_autoregressive(ids, n_new)
    cases = [("autoregressive", None, outputs, 0.0, time.perf_counter() - start)]
    for name, spec in LOSSLESS_CASES:

        def draft(engine, name=name):
            if name == "ngram":
                return NgramDraft(config.vocab_size)
            if name == "layerskip":
                return LlamaDraft(engine.model, engine.pool, num_layers=8)
            kind = ShardedEagleDraft if name == "eagle-sharded" else TPEagleDraft
            return kind(head, engine.model, engine.pool)

        engine = new_engine(model, spec, draft, kv_tokens)
        start = time.perf_counter()
        results, stats = engine.generate(ids, n_new, checked=args.lossless_checked)
        cases.append((name, spec, [list(r.output) for r in results], stats.tau, time.perf_counter() - start))
        del engine
        free_memory()
    if tp.rank == 0:
        for name, spec, got, tau, seconds in cases:
            same = [g == r for g, r in zip(got, reference)]
            row = {"case": name, "identical_to_tp1_ar": sum(same), "prompts": len(same), "tau": round(tau, 3)}
            if spec is not None:
                row.update(S=spec.num_steps, K=spec.topk, N=spec.num_draft_tokens, P=spec.page_size)
            row["first_mismatches"] = [items[i]["id"] for i, s in enumerate(same) if not s][:10]
            row["seconds"] = round(seconds, 1)
            record["cases"].append(row)
            print(row, flush=True)
    del model
    free_memory()
    dist.barrier()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the JSON result (rank 0 writes it)")
    parser.add_argument("--tiny", action="store_true", help="CPU, gloo, a tiny random shape: a smoke test")
    parser.add_argument("--models", default=None, help="comma-separated: llama3-8b, smollm2, tiny; none: skip")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per configuration (default 4; tiny 2)")
    parser.add_argument("--prompt-len", type=int, default=None, help="random prompts' length (default 128; tiny 12)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per prompt (default 128; tiny 12)")
    parser.add_argument("--accept-prob", type=float, default=0.8, help="forced acceptance: p of each draft token")
    parser.add_argument("--steps", type=int, default=4, help="S")
    parser.add_argument("--tree-topk", type=int, default=4, help="K of the tree runs")
    parser.add_argument("--tree-tokens", type=int, default=16, help="N of the tree runs")
    parser.add_argument("--no-eagle", dest="eagle", action="store_false", help="skip the EAGLE head comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lossless", default=None, help="prompts JSONL: SmolLM2 float32 TP=N vs TP=1 AR sweep")
    parser.add_argument("--lossless-limit", type=int, default=None, help="first N prompts of --lossless")
    parser.add_argument("--lossless-tokens", type=int, default=32, help="new tokens per prompt in the sweep")
    parser.add_argument("--lossless-checked", action="store_true", help="checked mode (rank checks) in the sweep")
    args = parser.parse_args()
    tiny = args.tiny
    args.models = args.models or ("tiny" if tiny else "llama3-8b,smollm2")
    args.prompts = args.prompts or (2 if tiny else 4)
    args.prompt_len = args.prompt_len or (12 if tiny else 128)
    args.new_tokens = args.new_tokens or (12 if tiny else 128)

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (read when NCCL starts)
    tp = init_tp(None, "cpu" if tiny else None, timeout_s=1800)
    dtype = torch.float32 if tp.device.type == "cpu" else torch.bfloat16
    payload = {
        "world_size": tp.world_size,
        "backend": dist.get_backend(),
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
        "dtype": str(dtype).replace("torch.", ""),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "forced_acceptance": "OracleDraft: each configuration's own AR greedy output, each token right with p",
        "models": {},
    }
    if args.lossless:
        payload["lossless"] = lossless(tp, args)
    for name in filter(None, (m.strip() for m in args.models.split(","))):
        if name != "none":
            payload["models"][name] = bench_model(name, tp, args, dtype)
    if tp.rank == 0:
        path = write_result("tp_bench", payload, str(tp.device), directory=args.out)
        print(f"wrote {path}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
