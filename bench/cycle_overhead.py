"""CPU cost of the state machine per cycle, checked and unchecked, with the models' time taken out.

The models are constant test models (every draft accepted, tau = S + 1); their forward time is
measured and subtracted, so what remains is the runner, the records, the backend ops and (checked)
the invariant checks: the host cost of a cycle, what `engine.fast.host_control` pays on a GPU host.

    .venv/bin/python -m bench.cycle_overhead [--cycles 300] [--baseline DIR]

Per draft family (``forward``: a model draft, EAGLE-like; ``lookup``: an n-gram-like draft), config,
batch size and backend (``torch``: the reference ops, the CPU engine's; ``host``:
`engine.fast.host_control.HostBackend`, the GPU host plane's), unchecked and checked: the median and p90
per cycle, and unchecked the median per transition (``phases``: the row's ``run`` only, models out,
from as many cycles with a trace, interleaved; ``runner``: the untraced median less theirs, row selection
and the runner). ``--baseline DIR`` first runs this
same file against another checkout (``DIR/speccycle`` a copy of the package, e.g.
``git archive <commit> | tar -x -C DIR/speccycle``) in a subprocess, so both are measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from speccycle.backends.torch import TorchBackend
from speccycle.bench.common import write_result
from speccycle.core import Admitted, ModelOutput, Ports, Request, SamplingParams, SpecConfig
from speccycle.statemachine import run_cycle

CONFIGS = {  # name -> (draft kind, config)
    "chain S4": ("forward", dict(num_steps=4, topk=1)),
    "tree S4K4N16": ("forward", dict(num_steps=4, topk=4, num_draft_tokens=16)),
    "lookup S5": ("lookup", dict(num_steps=5, topk=1)),
}


class Clock:
    """Seconds spent inside the models, subtracted from the cycle."""

    seconds = 0.0


class ConstantTarget:
    """Fixed logits and features: the cheapest model that satisfies `TargetModel`."""

    def __init__(self, clock: Clock, vocab_size: int = 128, features: int = 8):
        self.vocab_size, self.features, self.clock = vocab_size, features, clock
        self.device = torch.device("cpu")

    def forward(self, batch):
        start = time.perf_counter()
        rows = batch.num_rows if batch.logits_rows is None else batch.logits_rows.shape[0]
        # Token 1 everywhere: the draft below proposes 1, so every draft is accepted (tau = S + 1).
        logits = torch.zeros(rows, self.vocab_size)
        logits[:, 1] = 1.0
        out = ModelOutput(logits=logits, hidden=torch.zeros(batch.num_rows, self.features))
        self.clock.seconds += time.perf_counter() - start
        return out


class ConstantDraft(ConstantTarget):
    kind = "forward"
    pairing = "shifted"

    def extend(self, batch, target_hidden):
        return self.forward(batch)

    def step(self, batch, parent_hidden):
        return self.forward(batch)


class ConstantLookup:
    """A lookup draft that proposes the chain ``1, 1, ...`` of ``S`` tokens (an n-gram draft that always matches)."""

    kind = "lookup"

    def __init__(self, clock: Clock):
        self.clock = clock

    def propose(self, request_ids, histories, num_steps, max_nodes, topk):
        start = time.perf_counter()
        n = min(num_steps, max_nodes)
        tokens = torch.ones((len(request_ids), n), dtype=torch.long)
        parents = torch.arange(n).expand(len(request_ids), n).contiguous()  # verify rows: the root is row 0
        self.clock.seconds += time.perf_counter() - start
        return tokens, parents


PAGE_SIZE = 16  # P, as the GPU benchmarks and the CLI run


def make_pool():
    """The engine's pool (`engine.memory.kv_pool.PagedKVPool`) with room for every request and a one-number KV."""
    from speccycle.engine.memory.kv_pool import PagedKVPool

    pool = PagedKVPool(num_pages=1 << 14, page_size=PAGE_SIZE)
    pool.add_cache("target", num_layers=1, num_kv_heads=1, head_dim=1)
    return pool


def make_backend(name: str):
    if name == "host":
        from speccycle.engine.fast.host_control import HostBackend

        return HostBackend("cpu")
    return TorchBackend()


def measure(name: str, batch: int, backend_name: str, cycles: int, checked: bool) -> dict:
    kind, options = CONFIGS[name]
    config = SpecConfig(**options, page_size=PAGE_SIZE)
    clock = Clock()
    draft = ConstantDraft(clock) if kind == "forward" else ConstantLookup(clock)
    ports = Ports(target=ConstantTarget(clock), draft=draft, kv_pool=make_pool())
    backend = make_backend(backend_name)
    requests = tuple(Request(i, (2, 3, 4, 5), SamplingParams(max_new_tokens=10**7)) for i in range(batch))
    ready = run_cycle(Admitted(config=config, requests=requests), ports, backend)
    phases: dict[str, list[float]] = {}
    seen = [0.0]  # model seconds at the last trace event

    def trace(event) -> None:  # the row's run time, the models' share taken out
        models, seen[0] = clock.seconds - seen[0], clock.seconds
        phases.setdefault(event.event, []).append(event.duration_s - models)

    for _ in range(min(20, cycles)):  # warm up
        ready = run_cycle(ready, ports, backend, checked=checked)
    per_cycle = []
    for _ in range(cycles):
        clock.seconds = 0.0
        start = time.perf_counter()
        ready = run_cycle(ready, ports, backend, checked=checked)  # the figure: no trace
        per_cycle.append(time.perf_counter() - start - clock.seconds)
        if not checked:  # the breakdown: every other cycle traced (the batch grows as it runs)
            clock.seconds = seen[0] = 0.0
            ready = run_cycle(ready, ports, backend, trace=trace)
    row = {
        "config": name,
        "draft": kind,
        "S": config.num_steps,
        "K": config.topk,
        "N": config.num_draft_tokens,
        "P": config.page_size,
        "batch_size": batch,
        "backend": backend_name,
        "checked": checked,
        "cycles": cycles,
        "overhead_us_median": statistics.median(per_cycle) * 1e6,
        "overhead_us_p90": sorted(per_cycle)[int(0.9 * len(per_cycle))] * 1e6,
    }
    if not checked:  # runner: the untraced median less the transitions' medians (selection, runner, records)
        medians = {e: statistics.median(v) * 1e6 for e, v in phases.items()}
        medians["runner"] = row["overhead_us_median"] - sum(medians.values())
        row["phases_us_median"] = {e: round(v, 1) for e, v in medians.items()}
    return row


def measure_all(cycles: int, configs, batches, backends) -> list[dict]:
    rows = []
    for name in configs:
        for batch in batches:
            for backend in backends:
                for checked in (False, True):
                    rows.append(measure(name, batch, backend, cycles, checked))
    return rows


def line(r: dict, label: str = "") -> str:
    phases = r.get("phases_us_median")
    tail = "" if not phases else "  " + " ".join(f"{k} {v:.0f}" for k, v in phases.items())
    return (
        f"{label}{r['config']:<13} bs={r['batch_size']:<2} {r['backend']:<5} checked={r['checked']!s:<5} "
        f"median {r['overhead_us_median']:8.1f} us  p90 {r['overhead_us_p90']:8.1f} us{tail}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--backends", default="torch,host")
    parser.add_argument("--baseline", default=None, help="a directory holding another copy of the package, speccycle/")
    parser.add_argument("--baseline-commit", default=None, help="the commit the baseline copy was taken from")
    parser.add_argument("--emit-json", action="store_true", help="print the rows as JSON and write nothing")
    parser.add_argument("--no-write", action="store_true", help="print the rows, write no result file")
    parser.add_argument("--note", default="", help="appended to the result's note (the machine, its load)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    configs = args.configs.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    backends = args.backends.split(",")
    baseline = None
    if args.baseline:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.baseline))
        command = [sys.executable, os.path.abspath(__file__), "--emit-json", "--cycles", str(args.cycles)]
        command += ["--configs", args.configs, "--batches", args.batches, "--backends", args.backends]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd="/")
        baseline = json.loads(done.stdout.strip().splitlines()[-1])
        for r in baseline:
            print(line(r, "before "))
    rows = measure_all(args.cycles, configs, batches, backends)
    if args.emit_json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(line(r, "after  " if baseline else ""))
    if args.no_write:
        return
    payload = {
        "rows": rows,
        "note": "CPU, models excluded (constant test models, every draft accepted); median and p90 over cycles"
        + (f"; {args.note}" if args.note else ""),
    }
    if baseline is not None:
        payload["baseline"] = {"commit": args.baseline_commit, "rows": baseline}
    path = write_result("cycle_overhead", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
