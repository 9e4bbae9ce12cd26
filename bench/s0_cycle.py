"""A cycle of S == 0 (no draft) with the draft's top-K deferred against the full draft extend, and against `ZeroDraft`.

The adaptive scheduler's floor shape runs the target's plain decode step and then the draft extend, so that a later
deeper cycle finds the draft's state current. The deferred extend runs the head's layers alone; the full one also
runs its final norm, LM head and top-K. Both are timed as the scheduler runs them, one cycle at a time over a batch
of ``--batch`` requests, beside the autoregressive baseline (`ZeroDraft`: no draft forward at all):

* ``deferred``: S == 0 with the deferred extend (the default);
* ``full``: S == 0 with the full extend (the draft's ``extend_hidden`` capabilities withdrawn on this engine);
* ``ar``: S == 0 over `ZeroDraft`, the scheduler's ``speculation="off"``;
* ``first_level``: the table's ``first_level`` row over the batch (what a move from S == 0 to a deeper shape pays).

Executors: ``fused`` (`FusedCycles.step`, the graphed executor's cycle: eagerly on a CPU, captured on a GPU) and
``table`` (the eager table, `run_cycle`). Ways are interleaved cycle by cycle; medians reported, and the ratios
``ar / deferred`` and ``ar / full`` (the share of the autoregressive step's throughput a cycle of S == 0 keeps).

    python -m bench.s0_cycle --batch 64 --cycles 8                       # CPU, float32
    python -m bench.s0_cycle --device cuda --dtype bfloat16 --batch 64,256 --cycles 50
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .common import sync, write_result
from .gpu_bench import eagle_head_path


def main() -> None:
    from speccycle.core import Admitted, Ports, Request, SamplingParams
    from speccycle.core.ports import defers_first_level
    from speccycle.engine.engine import Engine
    from speccycle.engine.serving.adaptive import ZeroDraft, no_draft_shape
    from speccycle.statemachine import run_cycle, step
    from speccycle.statemachine.batching import reshape

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", default="64", help="comma list of batch sizes")
    ap.add_argument("--cycles", type=int, default=8, help="timed cycles per way (after one untimed)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--executors", default="fused,table")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on a CPU (0: torch's default)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    spec_text = "S4"
    from speccycle.core import SpecConfig

    spec = SpecConfig(num_steps=4)
    zero = no_draft_shape(spec)
    batches = [int(b) for b in args.batch.split(",")]
    kv = sum(batches) * (args.prompt_len + args.cycles + 8) * 3 + 4096
    engines = {
        way: Engine.load(
            draft="eagle",
            spec=spec,
            device=args.device,
            dtype=dtype,
            fast=True,
            kv_tokens=kv,
            eagle_head=eagle_head_path(None),
        )  # fmt: skip
        for way in ("deferred", "full", "ar")
    }
    full = engines["full"].draft
    full.extend_hidden = full.logits_from_hidden = full.extend_hidden_static = None  # the capabilities withdrawn
    ports = {}
    for way, engine in engines.items():
        draft = ZeroDraft(engine.target.vocab_size) if way == "ar" else engine.draft
        ports[way] = Ports(target=engine.target, draft=draft, kv_pool=engine.pool)
    assert defers_first_level(ports["deferred"]) and not defers_first_level(ports["full"])
    vocab = engines["ar"].target.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for executor in args.executors.split(","):
        for bs in batches:
            prompts = [tuple(torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()) for _ in range(bs)]
            params = SamplingParams(max_new_tokens=args.cycles + 4)
            ready = {}
            for way in engines:
                requests = tuple(
                    Request(request_id=10_000 + i, prompt=p, sampling=params) for i, p in enumerate(prompts)
                )
                with torch.no_grad():
                    ready[way] = run_cycle(Admitted(config=zero, requests=requests), ports[way])
            times = {way: [] for way in engines}
            outputs = {}
            for cycle in range(args.cycles + 1):
                for way, engine in engines.items():
                    sync(args.device)
                    start = time.perf_counter()
                    with torch.no_grad():
                        if executor == "fused":
                            assert engine.fused_cycles.covers(ready[way], ports[way])
                            ready[way], _ = engine.fused_cycles.step(ready[way], ports=ports[way])
                        else:
                            ready[way] = run_cycle(ready[way], ports[way])
                    sync(args.device)
                    if cycle:  # the first: graphs, buffers, compilation
                        times[way].append(time.perf_counter() - start)
                    outputs[way] = [r.output for r in ready[way].requests]
            pending = ready["deferred"]
            assert pending.topk_pending and not ready["full"].topk_pending
            deep = reshape(pending, spec, engines["deferred"].pool)
            first = []
            for _ in range(max(3, args.cycles // 2)):
                sync(args.device)
                start = time.perf_counter()
                with torch.no_grad():
                    step(deep, ports["deferred"], event="first_level")
                sync(args.device)
                first.append(time.perf_counter() - start)
            ms = {way: statistics.median(t) * 1e3 for way, t in times.items()}
            row = {
                "executor": executor,
                "batch": bs,
                "ms_per_cycle": {way: round(v, 3) for way, v in ms.items()},
                "first_level_ms": round(statistics.median(first) * 1e3, 3),
                "ar_over_deferred": round(ms["ar"] / ms["deferred"], 3),
                "ar_over_full": round(ms["ar"] / ms["full"], 3),
                "full_over_deferred": round(ms["full"] / ms["deferred"], 3),
                "identical": outputs["deferred"] == outputs["full"] == outputs["ar"],
            }
            print(row, flush=True)
            rows.append(row)
            for way, engine in engines.items():
                for r in ready[way].requests:
                    engine.pool.free(r.request_id)
    payload = {
        "config": {
            "model": "SmolLM2-135M",
            "draft": f"eagle {spec_text} (the shipped EAGLE-3 head)",
            "dtype": args.dtype,
            "prompt_len": args.prompt_len,
            "cycles": args.cycles,
            "threads": torch.get_num_threads(),
        },  # fmt: skip
        "rows": rows,
    }
    print(write_result("s0_cycle", payload, args.device, args.out))


if __name__ == "__main__":
    main()
