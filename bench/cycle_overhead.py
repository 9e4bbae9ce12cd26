"""CPU cost of the state machine per cycle, checked and unchecked, with the models' time taken out.

The models are the deterministic test models; their forward time is measured and subtracted, so
what remains is the runner, the records, the reference ops and (checked) the invariant checks.

    .venv/bin/python -m bench.cycle_overhead [--cycles 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from speccycle.backends.torch import TorchBackend
from speccycle.core import Admitted, ModelOutput, Ports, Request, SamplingParams, SpecConfig
from speccycle.statemachine import run_cycle

from .common import write_result


class ConstantTarget:
    """Fixed logits and features: the cheapest model that satisfies `TargetModel`."""

    def __init__(self, vocab_size: int = 128, features: int = 8):
        self.vocab_size, self.features = vocab_size, features
        self.device = torch.device("cpu")
        self.seconds = 0.0

    def forward(self, batch):
        start = time.perf_counter()
        rows = batch.num_rows if batch.logits_rows is None else batch.logits_rows.shape[0]
        # Token 1 everywhere: the draft below proposes 1, so every draft is accepted (tau = S + 1).
        logits = torch.zeros(rows, self.vocab_size)
        logits[:, 1] = 1.0
        out = ModelOutput(logits=logits, hidden=torch.zeros(batch.num_rows, self.features))
        self.seconds += time.perf_counter() - start
        return out


class ConstantDraft(ConstantTarget):
    kind = "forward"
    pairing = "shifted"

    def extend(self, batch, target_hidden):
        return self.forward(batch)

    def step(self, batch, parent_hidden):
        return self.forward(batch)


class UnboundedPool:
    """A pool with P = 1 and room for every request; the accounting is real, the KV a small tensor."""

    def __init__(self, num_pages: int = 1 << 16):
        from speccycle.testing import FingerprintPool

        self._pool = FingerprintPool(num_pages=num_pages, page_size=1)

    def __getattr__(self, name):
        return getattr(self._pool, name)


def measure(config: SpecConfig, batch: int, cycles: int, checked: bool) -> dict:
    target, draft = ConstantTarget(), ConstantDraft()
    ports = Ports(target=target, draft=draft, kv_pool=UnboundedPool())
    backend = TorchBackend()
    requests = tuple(Request(i, (2, 3, 4, 5), SamplingParams(max_new_tokens=10**6)) for i in range(batch))
    ready = run_cycle(Admitted(config=config, requests=requests), ports, backend)
    per_cycle = []
    for _ in range(cycles):
        target.seconds = draft.seconds = 0.0
        start = time.perf_counter()
        ready = run_cycle(ready, ports, backend, checked=checked)
        per_cycle.append(time.perf_counter() - start - target.seconds - draft.seconds)
    return {
        "config": {"S": config.num_steps, "K": config.topk, "N": config.num_draft_tokens, "P": config.page_size},
        "batch_size": batch,
        "checked": checked,
        "cycles": cycles,
        "overhead_us_median": statistics.median(per_cycle) * 1e6,
        "overhead_us_p90": sorted(per_cycle)[int(0.9 * len(per_cycle))] * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for config in (SpecConfig(num_steps=4, topk=1), SpecConfig(num_steps=4, topk=4, num_draft_tokens=16)):
        for batch in (1, 8):
            for checked in (False, True):
                rows.append(measure(config, batch, args.cycles, checked))
                r = rows[-1]
                print(
                    f"S={config.num_steps} K={config.topk} N={config.num_draft_tokens} bs={batch:<2} "
                    f"checked={checked!s:<5} overhead per cycle: median {r['overhead_us_median']:8.1f} us, "
                    f"p90 {r['overhead_us_p90']:8.1f} us"
                )
    path = write_result("cycle_overhead", {"rows": rows, "note": "CPU, torch reference backend, models excluded"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
