"""The drafts' default settings per device, as `Engine.load` and the CLI pick them.

Without ``--steps/--topk/--draft-tokens`` a draft takes `engine.default_spec` (an EAGLE tree S3 K2 N6 on
a CPU, S5 K4 N16 on a GPU; ngram a chain of 16 on a CPU); any of the three given keeps the old rule (a
chain of the default depth, a tree of depth 4). An EAGLE head loaded from a file over a float32 target
on a CPU with bfloat16 instructions runs in bfloat16; the default EAGLE engine on this CPU stays lossless.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from speccycle import cli
from speccycle.core import SpecConfig
from speccycle.engine import engine as engine_module
from speccycle.engine.cli_options import resolve_draft, spec_from_args
from speccycle.engine.engine import EAGLE_CPU_SPEC, EAGLE_GPU_SPEC, Engine, default_spec, eagle_head_dtype


def _args(draft, steps=None, topk=None, draft_tokens=None, page_size=16):
    return argparse.Namespace(draft=draft, steps=steps, topk=topk, draft_tokens=draft_tokens, page_size=page_size)


def test_default_spec_per_draft_and_device():
    assert default_spec("eagle", "cpu") == EAGLE_CPU_SPEC == SpecConfig(3, 2, 6, 16)
    assert default_spec("eagle", "cuda") == EAGLE_GPU_SPEC == SpecConfig(5, 4, 16, 16)
    assert default_spec("ngram", "cpu").num_steps == 16 and default_spec("ngram", "cpu").topk == 1
    assert default_spec("ngram", "cuda") == SpecConfig() == default_spec("layerskip", "cpu")


def test_cli_spec_takes_the_default_unless_a_shape_option_is_given():
    assert spec_from_args(_args("eagle"), "cpu") == EAGLE_CPU_SPEC
    assert spec_from_args(_args("eagle", page_size=1), "cuda") == SpecConfig(5, 4, 16, 1)
    assert spec_from_args(_args("ngram"), "cpu") == SpecConfig(num_steps=16, page_size=16)
    # a shape option given: the old rule (a chain of the default chain's depth, or S=4 under a tree)
    assert spec_from_args(_args("eagle", topk=1), "cpu") == SpecConfig(num_steps=4, page_size=16)
    assert spec_from_args(_args("ngram", topk=1), "cpu") == SpecConfig(num_steps=16, page_size=16)
    assert spec_from_args(_args("eagle", steps=6), "cpu") == SpecConfig(num_steps=6, page_size=16)
    assert spec_from_args(_args("ngram", topk=2, draft_tokens=8), "cpu") == SpecConfig(4, 2, 8, 16)
    parsed = cli.build_parser().parse_args(["bench", "--draft", "eagle"])
    assert parsed.topk is None and parsed.steps is None and parsed.draft_tokens is None
    # --draft auto (the default): the shipped EAGLE head on the embedded model, ngram on a model given by path
    parsed = cli.build_parser().parse_args(["bench"])
    assert parsed.draft == "auto"
    resolve_draft(parsed)
    assert parsed.draft == "eagle"
    parsed = cli.build_parser().parse_args(["generate", "hi", "--model", "other.gguf"])
    resolve_draft(parsed)
    assert parsed.draft == "ngram"


def test_eagle_head_dtype(monkeypatch):
    monkeypatch.setattr(engine_module, "cpu_has_bf16", lambda: True)
    assert eagle_head_dtype("cpu", torch.float32) == torch.bfloat16
    assert eagle_head_dtype("cuda", torch.float32) == torch.float32
    assert eagle_head_dtype("cuda", torch.bfloat16) == torch.bfloat16
    monkeypatch.setattr(engine_module, "cpu_has_bf16", lambda: False)
    assert eagle_head_dtype("cpu", torch.float32) == torch.float32


@pytest.mark.parametrize("head_dtype", [None, torch.float32])
def test_default_eagle_engine_on_cpu_is_lossless(model_path, head_dtype):
    engine = Engine.load(model_path, draft="eagle", dtype=torch.float32, kv_tokens=2048, eagle_dtype=head_dtype)
    assert engine.spec == EAGLE_CPU_SPEC
    expected = head_dtype or eagle_head_dtype("cpu", torch.float32)
    assert engine.draft.head.dtype == expected
    prompt = engine.chat_prompt("List three prime numbers and explain why each one is prime.")
    results, stats = engine.generate([prompt], 24)
    assert list(results[0].output) == engine.generate_autoregressive([prompt], 24)[0]
    assert stats.verifies < 24  # it speculated: fewer verifies than tokens
