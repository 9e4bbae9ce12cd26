"""A chain cut where its draft's confidence runs out (`SpecConfig.draft_floor`): validation, the widths rule, and the
real model's greedy output unchanged by any floor, on the table's eager rows and on the static executor."""

from __future__ import annotations

import attrs
import pytest
import torch
from speccycle.core import SpecConfig
from speccycle.engine.bench import load_prompts
from speccycle.statemachine import transitions
from speccycle.statemachine.transitions import floor_widths


@pytest.mark.parametrize("floor", [-0.1, 1.0, 2, True, "0.3", float("nan")])
def test_a_floor_outside_zero_one_is_refused(floor):
    with pytest.raises(ValueError, match="draft_floor must be a number in \\[0, 1\\)"):
        SpecConfig(num_steps=4, draft_floor=floor)


def test_a_floor_is_a_chains_and_stored_as_a_float():
    with pytest.raises(ValueError, match="needs topk \\(K\\)=1"):
        SpecConfig(num_steps=4, topk=2, draft_floor=0.2)
    assert SpecConfig(num_steps=4, draft_floor=0).draft_floor == 0.0
    assert SpecConfig(num_steps=4, draft_floor=0.25) == SpecConfig(num_steps=4, draft_floor=0.25)
    assert SpecConfig(num_steps=4, topk=3, num_draft_tokens=8).draft_floor == 0.0


def test_widths_count_the_depths_whose_products_reach_the_floor():
    confidence = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.2, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.9, 0.9]])
    # products: .9 .81 .729 .656 / .2 .2 .2 .2 / 1 1 1 1 / .5 .25 .225 .2025
    assert floor_widths(confidence, 0.3)[0].tolist() == [5, 1, 5, 2]
    assert floor_widths(confidence, 0.2)[0].tolist() == [5, 5, 5, 5]
    assert floor_widths(confidence, 0.7)[0].tolist() == [4, 1, 5, 1]
    keep = torch.tensor([False, True, False, True])  # sampled requests verify every row
    assert floor_widths(confidence, 0.7, keep)[0].tolist() == [4, 5, 5, 5]


@pytest.fixture(scope="module")
def engine(model_path):
    from speccycle.engine import Engine

    return Engine.load(model_path, draft="eagle", spec=SpecConfig(num_steps=4, page_size=16), dtype=torch.float32,
                       fast=True, kv_tokens=2048)  # fmt: skip


@pytest.mark.parametrize("fused", [False, True])
def test_greedy_output_is_the_same_at_any_floor_and_rows_are_cut(engine, fused, monkeypatch):
    """The eager table (the verify compacts each request's rows to its width) and the static executor (the rows past
    the width attend nothing): the autoregressive output at floors 0.3 and 0.9, checked mode, with rows cut."""
    prompts = [engine.chat_prompt(p["text"]) for p in load_prompts(None)[:2]]
    reference = engine.generate_autoregressive(prompts, 16)
    seen: list[list[int]] = []
    real = transitions.floor_widths

    def counted(*args, **kwargs):
        cut = real(*args, **kwargs)
        seen.append(cut[0].tolist())
        return cut

    monkeypatch.setattr(transitions, "floor_widths", counted)
    monkeypatch.setattr("speccycle.statemachine.static_rows.floor_widths", counted)
    from speccycle.engine.fast.fused_cycle import FusedCycles

    fused_cycles = engine.fused_cycles
    try:
        for floor in (0.3, 0.9):
            engine.spec = SpecConfig(num_steps=4, page_size=16, draft_floor=floor)
            # the fused cycles run the config they are built with (`Engine.load(spec=...)` builds them so)
            engine.fused_cycles = (FusedCycles(engine.target, engine.draft, engine.pool, engine.spec,
                                               fused_cycles.options) if fused else None)  # fmt: skip
            outputs, _ = engine.generate(prompts, max_new_tokens=16, checked=True)
            assert [list(o.output) for o in outputs] == [list(r) for r in reference], floor
    finally:
        engine.fused_cycles = fused_cycles
        engine.spec = SpecConfig(num_steps=4, page_size=16)
    assert seen and any(w < 5 for widths in seen for w in widths)  # the floors cut rows


def test_a_floor_beside_a_request_that_does_not_speculate(engine):
    """`SamplingParams(speculate=False)` keeps width 1 while the others are cut by the floor (the eager table, checked
    mode holds the cut to the scores of the requests that speculate); every output is the autoregressive one."""
    from speccycle.core.config import SamplingParams

    prompts = [engine.chat_prompt(p["text"]) for p in load_prompts(None)[:3]]
    reference = engine.generate_autoregressive(prompts, 12)
    fused_cycles = engine.fused_cycles
    try:
        engine.fused_cycles = None
        engine.spec = SpecConfig(num_steps=4, page_size=16, draft_floor=0.3)
        sampling = [SamplingParams(), SamplingParams(speculate=False), SamplingParams()]
        outputs, _ = engine.generate(prompts, max_new_tokens=12, sampling=sampling, checked=True)
    finally:
        engine.fused_cycles = fused_cycles
        engine.spec = SpecConfig(num_steps=4, page_size=16)
    assert [list(o.output) for o in outputs] == [list(r) for r in reference]


class _Reducing:
    """A target port that hands its greedy and finite reductions over with its logits (`ModelOutput.greedy`,
    ``finite``), as the fast path's host plane does."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, batch):
        out = self.inner.forward(batch)
        return attrs.evolve(out, greedy=out.logits.argmax(-1), finite=torch.isfinite(out.logits).all(-1))


def test_a_cut_verify_keeps_the_ports_reductions():
    """The eager verify runs only the rows a request's width keeps (a ragged forward) and puts them back at their
    flat rows: the port's greedy and finite reductions come back with them (a skipped row finite), so a target that
    computes them where its records live keeps every prediction there; the outputs match a run of the same target
    without the reductions."""
    from speccycle.backends.torch import TorchBackend
    from speccycle.core import Admitted, Ports, Request, SamplingParams
    from speccycle.statemachine import select, step
    from speccycle.testing import FingerprintPool, HashedNgramTarget, NoisyDraft

    config = SpecConfig(num_steps=4, page_size=2, draft_floor=0.5)
    outputs, cut = [], False
    for reducing in (False, True):
        pool = FingerprintPool(num_pages=256, page_size=2)
        target = HashedNgramTarget(pool, vocab_size=32, n=3)
        ports = Ports(target=_Reducing(target) if reducing else target, draft=NoisyDraft(target, 0.7, "shifted"),
                      kv_pool=pool)  # fmt: skip
        requests = tuple(
            Request(i, tuple(range(1 + i, 6 + 2 * i)), SamplingParams(max_new_tokens=16)) for i in range(3)
        )
        record, done = Admitted(config=config, requests=requests), {}
        for _ in range(200):
            if not record.requests:
                break
            if reducing and select(record, ports).event == "verify" and record.tree.widths is not None:
                widths = record.tree.widths
                cut |= bool((widths < config.num_draft_tokens).any())
                mask = torch.ones(5, 5, dtype=torch.bool).tril().expand(len(record.requests), 5, 5)
                out, _ = transitions.target_verify_forward(record, ports, mask)
                live = (torch.arange(5)[None, :] < widths[:, None]).reshape(-1)
                assert out.greedy is not None and out.finite is not None
                assert torch.equal(out.greedy[live], out.logits[live].argmax(-1)) and bool(out.finite[~live].all())
            record = step(record, ports, TorchBackend(), checked=True)
            done.update({r.request_id: r.output for r in getattr(record, "retired", ())})
        outputs.append(done)
    assert cut and outputs[0] == outputs[1] and len(outputs[0]) == 3
