"""The ports over a transformers causal LM (`speccycle.integrations.transformers`): the cycle run on transformers'
model equals transformers' own greedy ``generate`` token for token, chain and tree, in checked mode.

Fast tests run a tiny random Llama written by `weights_hf.save_hf` and loaded by transformers (float32), whose
greedy output repeats itself, so the ngram draft proposes long chains and trees that are partly accepted; the same
model as its own assistant (`TransformersDraft`) exercises the aligned draft port. The slow tests run the embedded
SmolLM2 exported to a Hugging Face folder, with the ngram draft and the shipped EAGLE-3 head.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers (the dev extra) is not installed")

from speccycle.cli import main  # noqa: E402
from speccycle.core import SpecConfig  # noqa: E402
from speccycle.core.ports import ForwardBatch  # noqa: E402
from speccycle.engine.errors import ModelLoadError  # noqa: E402
from speccycle.engine.greedy import extend_batch  # noqa: E402
from speccycle.engine.memory.kv_pool import PagedKVPool  # noqa: E402
from speccycle.engine.models.llama import random_llama_weights  # noqa: E402
from speccycle.engine.models.target import LlamaTarget  # noqa: E402
from speccycle.engine.weights.weights_gguf import LlamaConfig  # noqa: E402
from speccycle.engine.weights.weights_hf import export_gguf_to_hf, save_hf  # noqa: E402
from speccycle.integrations.transformers.bench import chat_ids, load_transformers_model  # noqa: E402
from speccycle.integrations.transformers.ports import TransformersTarget  # noqa: E402
from speccycle.integrations.transformers.speculator import (  # noqa: E402
    TransformersSpeculator,
    transformers_greedy,
)
from speccycle.testing.prompts import one_prompt_of  # noqa: E402

CHAIN = SpecConfig(num_steps=4, topk=1, page_size=4)
TREE = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=4)
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
NEW = 24


def tiny_config(vocab_size: int = 96) -> LlamaConfig:
    return LlamaConfig(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama: (the library's config, its weights, transformers' model of the same folder)."""
    config = tiny_config()
    weights = random_llama_weights(config, seed=3, scale=0.3)
    folder = save_hf(tmp_path_factory.mktemp("tiny") / "llama", config, weights)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return config, weights, model


def test_forward_attends_as_the_engine_model(tiny):
    """A ragged prefill of two requests, then a tree verify whose rows attend their prefix and their ancestors
    (`extra_slots`): transformers' model through the adapter gives the engine's own model's logits."""
    config, weights, model = tiny
    logits = []
    for build in ("engine", "transformers"):
        pool = PagedKVPool(num_pages=32, page_size=4)
        if build == "engine":
            target = LlamaTarget.from_weights(config, weights, pool)
        else:
            target = TransformersTarget(model, pool)
        prefill = target.forward(extend_batch(pool, [0, 1], [PROMPTS[0], PROMPTS[1]], [0, 0], last_logits_only=False))
        # a tree of 4 rows per request at L, L+1, L+1, L+2 (rows 1 and 2 children of row 0, row 3 of row 2)
        lens = [len(PROMPTS[0]), len(PROMPTS[1])]
        for rid, length in zip([0, 1], lens):
            pool.allocate(rid, length + 4)
        table = pool.page_table([0, 1])
        depth, parents = [0, 1, 1, 2], [[], [0], [0], [0, 2]]
        slots = [
            pool.slots_for([rid], torch.tensor([length + i for i in range(4)])) for rid, length in zip([0, 1], lens)
        ]
        extra = torch.full((8, 3), -1, dtype=torch.long)
        for b in range(2):
            for i in range(4):
                chain = [*parents[i], i]
                extra[4 * b + i, : len(chain)] = slots[b][chain]
        batch = extend_batch(pool, [0, 1], [[7, 8, 9, 10], [11, 12, 13, 14]], lens, last_logits_only=False)
        verify = ForwardBatch(
            input_ids=batch.input_ids,
            positions=torch.tensor([lens[b] + depth[i] for b in range(2) for i in range(4)]),
            row_request=batch.row_request,
            out_slots=torch.cat(slots),
            prefix_lens=torch.tensor([lens[b] for b in range(2) for _ in range(4)]),
            extra_slots=extra,
            page_table=table,
            page_size=4,
            request_ids=(0, 1),
            logits_rows=torch.tensor([0, 3, 5, 6]),
        )
        logits.append((prefill.logits, target.forward(verify).logits))
    for ours, theirs in zip(logits[0], logits[1]):
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", [CHAIN, TREE], ids=["chain", "tree"])
def test_ngram_cycle_is_lossless_on_a_tiny_model(tiny, config):
    _, _, model = tiny
    speculator = TransformersSpeculator(model, "ngram", config, kv_tokens=1024)
    outputs, stats = speculator.generate(PROMPTS, NEW, checked=True)
    assert outputs == [transformers_greedy(model, p, NEW) for p in PROMPTS]
    assert stats.verifies and stats.tau > 1.0  # drafts were accepted: the verify rows past the root counted
    assert speculator.pool.num_free_pages == speculator.pool.num_pages


@pytest.mark.parametrize("config", [CHAIN, TREE], ids=["chain", "tree"])
def test_an_assistant_model_drafts_through_the_aligned_port(tiny, config):
    """The model as its own assistant: every draft is the target's own greedy token, so nearly every verify
    accepts all ``S + 1`` rows."""
    _, _, model = tiny
    speculator = TransformersSpeculator(model, "model", config, draft_model=model, kv_tokens=1024)
    outputs, stats = speculator.generate(PROMPTS[:2], NEW, checked=True)
    assert outputs == [transformers_greedy(model, p, NEW) for p in PROMPTS[:2]]
    assert stats.tau > config.num_steps


def test_a_batch_past_the_pool_is_refused_before_it_runs(tiny):
    _, _, model = tiny
    speculator = TransformersSpeculator(model, "ngram", CHAIN, kv_tokens=64)
    with pytest.raises(ValueError, match="may need 17 KV pages and the pool has 16: build the speculator"):
        speculator.generate([PROMPTS[0]], 48)
    assert speculator.pool.num_free_pages == speculator.pool.num_pages


def test_a_sliding_window_model_is_refused():
    config = transformers.MistralConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=16,
    )  # fmt: skip
    model = transformers.MistralForCausalLM(config)
    with pytest.raises(ModelLoadError, match="sliding window of 16 tokens"):
        TransformersTarget(model, PagedKVPool(num_pages=4, page_size=4))


def test_bench_refuses_what_it_cannot_run(tmp_path, capsys, model_path):
    assert main(["bench", "--backend", "transformers", "--model", str(model_path), "--draft", "ngram"]) == 2
    assert "loads a Hugging Face folder" in capsys.readouterr().err
    assert main(["bench", "--backend", "transformers", "--model", str(tmp_path), "--draft", "layerskip"]) == 2
    assert "runs --draft ngram, eagle or model" in capsys.readouterr().err


# ---- the embedded SmolLM2, exported to a Hugging Face folder ----------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(model_path, tmp_path_factory):
    folder = export_gguf_to_hf(model_path, tmp_path_factory.mktemp("hf") / "SmolLM2-135M-Instruct")
    model, tokenizer = load_transformers_model(folder, torch.float32, "cpu")
    return folder, model, tokenizer


@pytest.mark.slow
def test_smollm2_is_lossless_with_ngram_and_eagle(smollm2, model_path):
    from speccycle.engine.drafters.eagle_heads import shipped_eagle_head

    _, model, tokenizer = smollm2
    prompts = [chat_ids(tokenizer, text) for text in one_prompt_of(("writing", "math"))]
    references = [transformers_greedy(model, ids, 16) for ids in prompts]
    runs = [("ngram", CHAIN), ("ngram", TREE), ("eagle", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6))]
    for draft, config in runs:
        head = shipped_eagle_head(model_path) if draft == "eagle" else None
        speculator = TransformersSpeculator(model, draft, config, eagle_head=head, kv_tokens=2048)
        outputs, stats = speculator.generate(prompts, 16, checked=True)
        assert outputs == references, (draft, config)
    assert stats.tau > 1.5  # the EAGLE-3 head reads the adapter's features: it drafts as on the engine's model


@pytest.mark.slow
def test_bench_prints_and_records_every_side(smollm2, tmp_path, capsys):
    folder, _, _ = smollm2
    out = tmp_path / "bench.json"
    argv = ["bench", "--backend", "transformers", "--model", str(folder), "--limit", "1", "--max-new-tokens", "8"]
    assert main([*argv, "--quiet", "--draft", "ngram", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    sides = record["sides"]
    assert set(sides) == {
        "transformers",
        "transformers prompt lookup",
        "transformers assisted (early exit 7)",
        "speccycle chain",
        "speccycle tree",
    }
    assert all(side["identical"] == 1 and side["new_tokens"] == 8 for side in sides.values()), sides
    assert sides["speccycle tree"]["tau"] >= 1.0 and "speccycle tree" in printed
