"""Where the host's time goes inside the scheduler's steps: per phase, exclusive wall time and the waits for the device.

`overlap_profile` says how long the GPU sits idle; this says what the host is doing meanwhile. One closed loop of
``--clients`` clients (the shipped prompts cycled, ``--max-new-tokens`` each, ``--requests-per-client`` each) runs
through the continuous-batching `Scheduler` on the fast path (every mode's graphs captured first by
`Scheduler.warm_up`), twice untimed, then once with the phases below
wrapped in a timer (each wrapper calls the real function; nothing else changes):

* the scheduler's own steps (`Scheduler.step`, ``_advance``, ``_launch``, ``_admit``, ``_collect``, ``_join``, ...);
  the table rows it runs (``run_step:<record>[:<event>]``), and `batching`'s merges and reshapes;
* the graphed executor's launches and collections (`FusedCycles._launch`, ``_launch_next``, ``collect``), the
  buffers' load, the log copy and the state snapshot, `materialize_ready` (which waits for the cycle's commits);
* the prefill transition (``_prefill_valid``; ``_check_logits`` is where it first reads the device: it waits for
  the cycle in flight and the prefill behind it), the draft extend, `validate_request`, the pool's page table;
* the device reads: `Tensor.tolist`, ``item``, ``cpu`` and `torch.cuda.synchronize`, timed as waits of the phase
  that called them.

Beside the host's phases, the device work an admission enqueues is timed per call (``device_work``): the prefill's
target forward, the draft extend after it, a deferred top-K. On CUDA a pair of events brackets each call's work on the
stream, so the figure is the work's own GPU time, not the cycle it queued behind; on a CPU it is the call's wall time.

Per phase: calls, inclusive and exclusive milliseconds over the run (exclusive: less the wrapped phases inside),
the waits inside it, and the exclusive microseconds per step. A phase's exclusive time holds the waits for the GPU
that no wrapped read accounts for (an event's ``synchronize`` in `materialize_ready`, the copies in
``_check_logits``): read it beside `overlap_profile`'s idle share.

    python -m bench.step_phases --device cuda --dtype bfloat16 --clients 64 --modes ar,spec
    python -m bench.step_phases --clients 2 --modes spec --max-new-tokens 6 --requests-per-client 1   # CPU
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import time

import torch

from .common import percentile, write_result


class Phases:
    """Exclusive and inclusive wall time per wrapped phase, and the device reads made inside each."""

    def __init__(self) -> None:
        self.on = False
        self.stack: list[list] = []
        self.incl, self.excl = collections.Counter(), collections.Counter()
        self.calls, self.wait = collections.Counter(), collections.Counter()
        self.device: dict[str, list] = collections.defaultdict(list)  # label -> the calls' device timings
        self._undo: list[tuple] = []

    def wrap(self, owner, name: str, label: str | None = None, read: bool = False) -> None:
        real = getattr(owner, name)
        label = label or name

        @functools.wraps(real)
        def timed(*args, **kwargs):
            if not self.on:
                return real(*args, **kwargs)
            start = time.perf_counter()
            if read:  # a device read: a wait of the phase on top
                try:
                    return real(*args, **kwargs)
                finally:
                    self.wait[self.stack[-1][0] if self.stack else "-"] += time.perf_counter() - start
            lab = label
            if label == "run_step":
                lab = f"run_step:{type(args[0]).__name__}" + (f":{kwargs['event']}" if "event" in kwargs else "")
            self.stack.append([lab, 0.0])
            try:
                return real(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                _, inner = self.stack.pop()
                self.incl[lab] += spent
                self.excl[lab] += spent - inner
                self.calls[lab] += 1
                if self.stack:
                    self.stack[-1][1] += spent

        self._undo.append((owner, name, real, name in vars(owner)))
        setattr(owner, name, timed)

    def wrap_device(self, owner, name: str, label: str, cuda: bool) -> None:
        """Time each call's device work: on CUDA a pair of events around the work it enqueues (the span from when
        the stream reaches the call's first kernel to its last: the work's own time, not the queue before it),
        elsewhere its wall time (the work runs as it is called)."""
        real = getattr(owner, name)

        @functools.wraps(real)
        def timed(*args, **kwargs):
            if not self.on:
                return real(*args, **kwargs)
            if not cuda:
                start = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    self.device[label].append(time.perf_counter() - start)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                return real(*args, **kwargs)
            finally:
                end.record()
                self.device[label].append((begin, end))

        self._undo.append((owner, name, real, name in vars(owner)))
        setattr(owner, name, timed)

    def device_rows(self) -> list[dict]:
        """Per device-timed label: calls, total, mean, p50 and p90 milliseconds (waits for the device first)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rows = []
        for label, timings in self.device.items():
            ms = sorted(t * 1e3 if isinstance(t, float) else t[0].elapsed_time(t[1]) for t in timings)
            rows.append({"work": label, "calls": len(ms), "total_ms": round(sum(ms), 1),
                         "mean_ms": round(sum(ms) / len(ms), 3), "p50_ms": round(percentile(ms, 50), 3),
                         "p90_ms": round(percentile(ms, 90), 3)})  # fmt: skip
        return rows

    def restore(self) -> None:
        """Every wrapped attribute as it was: set back where the owner held it, removed where it was inherited."""
        for owner, name, real, own in reversed(self._undo):
            if own:
                setattr(owner, name, real)
            else:
                delattr(owner, name)
        self._undo.clear()

    def clear(self) -> None:
        for counter in (self.incl, self.excl, self.calls, self.wait, self.device):
            counter.clear()

    def rows(self, steps: int) -> list[dict]:
        return [
            {
                "phase": lab,
                "calls": self.calls[lab],
                "incl_ms": round(self.incl[lab] * 1e3, 1),
                "excl_ms": round(self.excl[lab] * 1e3, 1),
                "wait_ms": round(self.wait[lab] * 1e3, 1),
                "excl_us_per_step": round(self.excl[lab] / max(steps, 1) * 1e6, 1),
            }
            for lab, _ in sorted(self.excl.items(), key=lambda kv: -kv[1])
        ]


def instrument(phases: Phases) -> None:
    from speccycle.engine.fast import fused_cycle
    from speccycle.engine.memory import kv_pool
    from speccycle.engine.serving import scheduler
    from speccycle.statemachine import static_rows, transitions

    for name in (
        "step",
        "_advance",
        "_launch",
        "_launch_fused",
        "_admit",
        "_collect",
        "_join",
        "_publish",
        "_cycle",
        "_stream",
        "_to_ready",
        "_reshape",
        "_make_room",
        "_drain",
        "_finish",
        "_apply_cancels",
        "submit",
    ):
        phases.wrap(scheduler.Scheduler, name, f"Scheduler.{name}")
    for name in ("run_step", "merge_ready", "reshape", "select_ready"):
        phases.wrap(scheduler, name)
    for name in ("_launch", "_launch_next", "collect"):
        phases.wrap(fused_cycle.FusedCycles, name, f"FusedCycles.{name}")
    for name in ("materialize_ready", "copy_log", "snapshot_state", "reserve"):
        phases.wrap(fused_cycle, name)
    phases.wrap(static_rows.CycleBuffers, "load", "CycleBuffers.load")
    phases.wrap(kv_pool.PagedKVPool, "page_table", "PagedKVPool.page_table")
    for name in ("_prefill_valid", "_check_logits", "validate_request", "_draft_extend", "reserve"):
        phases.wrap(transitions, name, f"transitions.{name}")
    for name in ("tolist", "item", "cpu"):
        phases.wrap(torch.Tensor, name, read=True)
    phases.wrap(torch.cuda, "synchronize", read=True)


def main(argv: list[str] | None = None) -> dict:
    from speccycle.core import SpecConfig
    from speccycle.engine.bench import load_prompts
    from speccycle.engine.engine import Engine
    from speccycle.engine.serving.adaptive import AdaptiveSpeculation, ShapeController
    from speccycle.engine.serving.scheduler import Scheduler
    from speccycle.engine.tokenizers.tokenizer import Tokenizer
    from speccycle.engine.weights.weights_gguf import default_model_path

    from .scheduler_throughput import run_mode

    parser = argparse.ArgumentParser(prog="python -m bench.step_phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--modes", default="ar,spec", help="of ar, spec, adaptive")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := set(modes) - {"ar", "spec", "adaptive"}:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; choose from ar, spec, adaptive")
    tokenizer = Tokenizer.from_gguf(default_model_path())
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}]) for p in load_prompts(None)]
    spec = SpecConfig(num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens, page_size=16)
    dtype = getattr(torch, args.dtype)
    # every client's request fits at once (as in `scheduler_throughput`): the steps, not retraction, are timed
    longest = max(len(p) for p in prompts)
    per_request = spec.page_size * math.ceil((longest + args.max_new_tokens + 2 * spec.reserve_len("aligned")) / 16)
    kv_tokens = (args.clients + 4) * per_request
    engine = Engine.load(draft="eagle", spec=spec, device=args.device, dtype=dtype, kv_tokens=kv_tokens, fast=True)
    controller = ShapeController(AdaptiveSpeculation(), spec)  # one for the adaptive runs, warm-up included
    # every shape's graphs at every bucket the runs pass through, before anything is timed (as
    # `scheduler_throughput` and a server do): an adaptive run would otherwise capture the shapes it probes
    buckets = sorted({1 << k for k in range(args.clients.bit_length())} | {args.clients})
    for mode in modes:
        speculation = {"ar": "off", "spec": "on", "adaptive": controller}[mode]
        scheduler = Scheduler.from_engine(engine, speculation=speculation, max_batch_size=args.clients)
        scheduler.warm_up(buckets, sampled=False)  # greedy runs: no sampled batch's buffers
    phases = Phases()
    results = {}
    try:
        instrument(phases)
        # the device work an admission puts on the stream: the prefill's target forward, the draft extend after
        # it (the layers alone in a cycle of S == 0), a deferred top-K (`first_level`)
        cuda = torch.device(args.device).type == "cuda"
        phases.wrap_device(engine.target, "forward", "target.forward (prefill)", cuda)
        if engine.draft is not None:
            for name in ("extend", "extend_hidden", "logits_from_hidden"):
                if hasattr(engine.draft, name):
                    phases.wrap_device(engine.draft, name, f"draft.{name}", cuda)
        for mode in modes:
            loop = functools.partial(
                run_mode, engine, mode, prompts, args.clients, args.max_new_tokens, args.device, None,
                args.requests_per_client, controller,
            )  # fmt: skip
            for _ in range(2):  # graphs captured, allocator warm
                loop()
            phases.clear()
            phases.on = True
            try:
                run = loop()
            finally:
                phases.on = False
            steps = phases.calls["Scheduler.step"]
            # captures: graphs captured inside the timed run (their time counts; 0 once the warm-up covered them)
            keys = ("tokens_per_s", "seconds", "prefills", "fused_cycles", "pipelined_cycles", "captures",
                    "step_seconds")  # fmt: skip
            results[mode] = {
                "steps": steps,
                **{k: run[k] for k in keys},
                "phases": phases.rows(steps),
                "waits_ms": round(sum(phases.wait.values()) * 1e3, 1),
                "device_work": phases.device_rows(),
            }
            print(
                f"== {mode} at {args.clients} clients: {run['tokens_per_s']} tokens/s, {steps} steps, "
                f"{run['prefills']} prefills, {run['fused_cycles']} cycles ({run['pipelined_cycles']} pipelined), "
                f"{run['captures']} graphs captured inside it"
            )
            print(f"{'phase':36s} {'calls':>6s} {'incl ms':>9s} {'excl ms':>9s} {'wait ms':>9s} {'us/step':>9s}")
            for row in results[mode]["phases"]:
                print(
                    f"{row['phase']:36s} {row['calls']:6d} {row['incl_ms']:9.1f} {row['excl_ms']:9.1f} "
                    f"{row['wait_ms']:9.1f} {row['excl_us_per_step']:9.1f}"
                )
            print(f"{'device work':36s} {'calls':>6s} {'total ms':>9s} {'mean ms':>9s} {'p50 ms':>9s} {'p90 ms':>9s}")
            for row in results[mode]["device_work"]:
                print(
                    f"{row['work']:36s} {row['calls']:6d} {row['total_ms']:9.1f} {row['mean_ms']:9.3f} "
                    f"{row['p50_ms']:9.3f} {row['p90_ms']:9.3f}"
                )
    finally:
        phases.restore()
    payload = {
        "config": {
            "clients": args.clients,
            "max_new_tokens": args.max_new_tokens,
            "dtype": args.dtype,
            "requests_per_client": args.requests_per_client,
            "S": spec.num_steps,
            "K": spec.topk,
            "N": spec.num_draft_tokens,
            "draft": "eagle",
        },
        "modes": results,
    }
    print("wrote", write_result("step_phases", payload, args.device))
    return payload


if __name__ == "__main__":
    main()
