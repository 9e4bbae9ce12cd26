"""SmolLM2-135M-Instruct (GGUF, float32, CPU) through the paged engine against transformers.

transformers loads the same GGUF file (it dequantizes and un-permutes Q/K itself), so any difference
in outputs is the engine's: RoPE layout, attention, paging, batching.
"""

from __future__ import annotations

import os

import pytest
import torch
from speccycle.core.ports import ForwardBatch
from speccycle.engine.greedy import extend_batch, greedy_decode
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.target import LlamaTarget
from speccycle.engine.tokenizers.tokenizer import Tokenizer
from speccycle.engine.weights.weights_gguf import load_gguf

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
ATOL = 1e-4


@pytest.fixture(scope="module")
def smollm2(model_path):
    return load_gguf(model_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(model_path):
    from speccycle.testing.prompts import one_prompt_of

    tokenizer = Tokenizer.from_gguf(model_path)
    chosen = one_prompt_of(("writing", "math", "qa"))  # short prompts keep the test quick
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in chosen]


@pytest.fixture(scope="module")
def hf_model(model_path):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts):
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            mask = torch.ones_like(ids)
            out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def make_target(smollm2, page_size, num_pages_tokens=1024, feature_layers=None):
    config, weights = smollm2
    pool = PagedKVPool(num_pages=num_pages_tokens // page_size, page_size=page_size)
    return LlamaTarget.from_weights(config, weights, pool, feature_layers=feature_layers), pool


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_decode_equals_transformers_generate(smollm2, prompts, hf_greedy, page_size):
    """Three ragged requests in one batch: prefill, then one token per request per forward."""
    target, pool = make_target(smollm2, page_size=page_size)
    assert greedy_decode(target, pool, prompts, NEW_TOKENS, stop_token_ids=(2,)) == hf_greedy
    assert pool.num_free_pages == pool.num_pages


def test_prefill_logits_and_eagle3_features_match_transformers(smollm2, prompts, hf_model):
    features = (2, 15, 27)
    target, pool = make_target(smollm2, page_size=16, feature_layers=features)
    out = target.forward(extend_batch(pool, [0], [prompts[0]], [0], last_logits_only=False))
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompts[0]]), output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits[0], atol=5 * ATOL, rtol=0)
    hidden = smollm2[0].hidden_size
    for k, layer in enumerate(features):
        got = out.hidden[:, k * hidden : (k + 1) * hidden]
        torch.testing.assert_close(got, ref.hidden_states[layer][0], atol=1e-3, rtol=1e-4)


def test_ragged_batch_equals_each_request_alone(smollm2, prompts):
    a, b = prompts[0][:40], prompts[1][:23]
    target, pool = make_target(smollm2, page_size=16)
    both = target.forward(extend_batch(pool, [0, 1], [a, b], [0, 0], last_logits_only=False)).logits
    for rid, tokens, rows in ((2, a, both[: len(a)]), (3, b, both[len(a) :])):
        alone = target.forward(extend_batch(pool, [rid], [tokens], [0], last_logits_only=False)).logits
        torch.testing.assert_close(rows, alone, atol=ATOL, rtol=0)


# verify rows: root (row 0) and 5 draft nodes; parent row of each row
PARENTS = [-1, 0, 0, 1, 1, 3]


def test_tree_verify_rows_equal_their_causal_paths(smollm2, prompts):
    prefix, tree = prompts[2][:30], prompts[0][40:46]
    n = len(PARENTS)
    paths = [[0]]
    for i in range(1, n):
        paths.append([*paths[PARENTS[i]], i])
    target, pool = make_target(smollm2, page_size=4)
    target.forward(extend_batch(pool, [0], [prefix], [0]))
    length = len(prefix)
    pool.allocate(0, length + n)
    slots = pool.slots_for([0], torch.arange(length, length + n)[None])[0]
    extra = torch.full((n, 4), -1, dtype=torch.long)
    for i, path in enumerate(paths):
        extra[i, : len(path)] = slots[torch.tensor(path)]
    batch = ForwardBatch(
        input_ids=torch.tensor(tree),
        positions=torch.tensor([length + len(path) - 1 for path in paths]),
        row_request=torch.zeros(n, dtype=torch.long),
        out_slots=slots,
        prefix_lens=torch.full((n,), length),
        extra_slots=extra,
        page_table=pool.page_table([0]),
        page_size=pool.page_size,
        request_ids=(0,),
    )
    logits = target.forward(batch).logits
    for i, path in enumerate(paths):
        rid = 10 + i
        causal = prefix + [tree[j] for j in path]
        reference = target.forward(extend_batch(pool, [rid], [causal], [0])).logits[0]
        torch.testing.assert_close(logits[i], reference, atol=ATOL, rtol=0)
        pool.free(rid)
