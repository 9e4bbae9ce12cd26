"""A chain cut where its draft's confidence runs out (`SpecConfig.draft_floor`): validation, the widths rule, and the
real model's greedy output unchanged by any floor, on the table's eager rows and on the static executor."""

from __future__ import annotations

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
    assert floor_widths(confidence, 0.3).tolist() == [5, 1, 5, 2]
    assert floor_widths(confidence, 0.2).tolist() == [5, 5, 5, 5]
    assert floor_widths(confidence, 0.7).tolist() == [4, 1, 5, 1]
    keep = torch.tensor([False, True, False, True])  # sampled requests verify every row
    assert floor_widths(confidence, 0.7, keep).tolist() == [4, 5, 5, 5]


@pytest.fixture(scope="module")
def engine():
    from speccycle.engine import Engine
    from speccycle.engine.weights.weights_gguf import default_model_path

    try:
        path = default_model_path()
    except Exception as error:  # the model package is missing: the install command is in the message
        pytest.skip(str(error))
    return Engine.load(path, draft="eagle", spec=SpecConfig(num_steps=4, page_size=16), dtype=torch.float32,
                       fast=True, kv_tokens=2048)  # fmt: skip


@pytest.mark.parametrize("fused", [False, True])
def test_greedy_output_is_the_same_at_any_floor_and_rows_are_cut(engine, fused, monkeypatch):
    """The eager table (the verify compacts each request's rows to its width) and the static executor (the rows past
    the width attend nothing): the autoregressive output at floors 0, 0.3 and 0.9, checked mode, with rows cut."""
    prompts = [engine.chat_prompt(p["text"]) for p in load_prompts(None)[:2]]
    reference = engine.generate_autoregressive(prompts, 16)
    seen: list[list[int]] = []
    real = transitions.floor_widths

    def counted(*args, **kwargs):
        widths = real(*args, **kwargs)
        seen.append(widths.tolist())
        return widths

    monkeypatch.setattr(transitions, "floor_widths", counted)
    monkeypatch.setattr("speccycle.statemachine.static_rows.floor_widths", counted)
    from speccycle.engine.fast.fused_cycle import FusedCycles

    fused_cycles = engine.fused_cycles
    try:
        for floor in (0.0, 0.3, 0.9):
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
