"""Gemma 3 on a tiny random model: the sliding window under tree verify, against transformers; loading; refusals.

The tiny config differs from Llama in every way Gemma 3 does and in a few the 270M model does not
exercise (head_dim != hidden / heads, query_pre_attn_scalar != head_dim, logit softcapping), and its
window (4) is shorter than the prefix, so the local layers really drop keys.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
from speccycle.core import SpecConfig
from speccycle.core.ports import ForwardBatch
from speccycle.engine.drafters.eagle import EagleConfig
from speccycle.engine.engine import Engine
from speccycle.engine.errors import ForwardBatchError, ModelLoadError
from speccycle.engine.greedy import extend_batch
from speccycle.engine.kernels.attention import plan_attention, restrict_to_window
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.gemma3 import Gemma3Model, random_gemma3_weights
from speccycle.engine.models.llama import LlamaModel
from speccycle.engine.models.target import LlamaTarget
from speccycle.engine.weights.weights_gguf import LlamaConfig, load_gguf
from speccycle.engine.weights.weights_hf import config_from_hf, config_to_hf, load_hf, save_hf

SLIDING, FULL = "sliding_attention", "full_attention"
WINDOW = 4
TINY = LlamaConfig(
    architecture="gemma3",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,  # not hidden / heads
    rope_theta=1_000_000.0,
    rms_norm_eps=2.0**-20,  # a float32 value: GGUF stores eps as float32
    max_position=128,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_ids=(1, 5),
    sliding_window=WINDOW,
    layer_types=(SLIDING, SLIDING, FULL, SLIDING),
    rope_local_theta=10_000.0,
    query_pre_attn_scalar=24.0,  # not head_dim
    final_logit_softcapping=5.0,
)
PREFIX = [2, 7, 11, 13, 17, 19, 23, 29, 31, 37]  # longer than the window
TREE_TOKENS = [41, 43, 47, 53, 59, 61]
PARENTS = [-1, 0, 0, 1, 1, 3]  # depth up to 3 < WINDOW


@pytest.fixture(scope="module")
def weights():
    return random_gemma3_weights(TINY, seed=4, scale=0.3)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory, weights):
    transformers = pytest.importorskip("transformers")
    directory = save_hf(tmp_path_factory.mktemp("tiny_gemma3"), TINY, weights)
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def _paths() -> list[list[int]]:
    paths = [[0]]
    for i in range(1, len(PARENTS)):
        paths.append([*paths[PARENTS[i]], i])
    return paths


def _tree_batch(pool: PagedKVPool, request_id: int, length: int) -> ForwardBatch:
    """Verify rows of ``PARENTS`` after a prefix of ``length`` tokens: prefix_len L, ancestors as extra slots."""
    paths, n = _paths(), len(PARENTS)
    pool.allocate(request_id, length + n)
    slots = pool.slots_for([request_id], torch.arange(length, length + n)[None])[0]
    extra = torch.full((n, 4), -1, dtype=torch.long)
    for i, path in enumerate(paths):
        extra[i, : len(path)] = slots[torch.tensor(path)]
    return ForwardBatch(
        input_ids=torch.tensor(TREE_TOKENS),
        positions=torch.tensor([length + len(path) - 1 for path in paths]),
        row_request=torch.zeros(n, dtype=torch.long),
        out_slots=slots,
        prefix_lens=torch.full((n,), length),
        extra_slots=extra,
        page_table=pool.page_table([request_id]),
        page_size=pool.page_size,
        request_ids=(request_id,),
    )


def test_window_mask_of_a_tree_verify_batch_keeps_prefix_keys_inside_the_window():
    pool = PagedKVPool(num_pages=16, page_size=3)
    pool.allocate(0, len(PREFIX))
    batch = _tree_batch(pool, 0, len(PREFIX))
    plan = plan_attention(batch)
    local = restrict_to_window(plan, batch, WINDOW)
    prefix_slots = pool.slots_for([0], torch.arange(len(PREFIX))[None])[0].tolist()
    row_flat = plan.row_flat if plan.row_flat is not None else torch.arange(batch.num_rows)
    for row in range(batch.num_rows):
        flat = int(row_flat[row])
        attended = plan.key_slots[flat // plan.tq][local.mask.view(plan.bs * plan.tq, -1)[flat]].tolist()
        position = int(batch.positions[row])
        ancestors = [s for s in batch.extra_slots[row].tolist() if s >= 0]
        in_window = [slot for j, slot in enumerate(prefix_slots) if j > position - WINDOW]
        assert sorted(attended) == sorted(in_window + ancestors), f"row {row} at position {position}"
        assert len(in_window) == WINDOW - len(ancestors)  # the window is full: it counts ancestors too
    # the full-attention plan still sees the whole prefix
    full = plan.key_slots[0][plan.mask.view(plan.bs * plan.tq, -1)[int(row_flat[0])]].tolist()
    assert sorted(full) == sorted(prefix_slots + [int(batch.extra_slots[0, 0])])


def test_tree_deeper_than_the_window_is_refused():
    pool = PagedKVPool(num_pages=16, page_size=4)
    pool.allocate(0, len(PREFIX))
    batch = _tree_batch(pool, 0, len(PREFIX))
    with pytest.raises(ForwardBatchError, match="keep tree depth below the window"):
        restrict_to_window(plan_attention(batch), batch, 3)  # depth 3 rows reach prefix_len + 3


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefill_logits_equal_transformers(weights, hf_model, page_size):
    pool = PagedKVPool(num_pages=64, page_size=page_size)
    target = LlamaTarget.from_weights(TINY, weights, pool)
    assert isinstance(target.model, Gemma3Model)
    tokens = PREFIX + TREE_TOKENS
    logits = target.forward(extend_batch(pool, [0], [tokens], [0], last_logits_only=False)).logits
    with torch.inference_mode():
        reference = hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, reference, atol=2e-5, rtol=0)
    # the window matters here: a window past the sequence gives other logits from position WINDOW on
    full = attrs.evolve(TINY, sliding_window=len(tokens))
    pool_full = PagedKVPool(num_pages=64, page_size=page_size)
    unwindowed = LlamaTarget.from_weights(full, weights, pool_full)
    other = unwindowed.forward(extend_batch(pool_full, [0], [tokens], [0], last_logits_only=False)).logits
    torch.testing.assert_close(other[:WINDOW], logits[:WINDOW], atol=2e-5, rtol=0)
    assert (other[WINDOW:] - logits[WINDOW:]).abs().max() > 1e-3


def test_tree_verify_rows_equal_transformers_on_their_paths(weights, hf_model):
    """Each verify row sees its prefix inside the window plus its ancestors: its logits equal the causal path's."""
    pool = PagedKVPool(num_pages=64, page_size=3)
    target = LlamaTarget.from_weights(TINY, weights, pool)
    target.forward(extend_batch(pool, [0], [PREFIX], [0]))
    logits = target.forward(_tree_batch(pool, 0, len(PREFIX))).logits
    for row, path in enumerate(_paths()):
        tokens = PREFIX + [TREE_TOKENS[i] for i in path]
        with torch.inference_mode():
            reference = hf_model(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(logits[row], reference, atol=2e-5, rtol=0, msg=f"row {row}")


def test_layer_skip_and_tree_speculation_are_lossless():
    """Prompts past the window: drafts and verify rows of the local layers drop keys. An untied LM head
    (a tied random tiny model only repeats its input token)."""
    from speccycle.engine.drafters.layerskip import LlamaDraft
    from speccycle.engine.drafters.ngram import NgramDraft

    untied = attrs.evolve(TINY, tie_word_embeddings=False)
    prompts = [PREFIX + [7, 11, 13, 17], [2, 9, 8, 7, 9, 8, 7, 9, 8]]
    model = Gemma3Model(untied, random_gemma3_weights(untied, seed=4, scale=0.3))
    reference = Engine(model, PagedKVPool(num_pages=256, page_size=4), None, SpecConfig())
    expected = reference.generate_autoregressive(prompts, 12)
    assert all(len(set(out)) > 4 for out in expected), expected  # not a degenerate repeat
    for draft, spec in [
        ("layerskip", SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, page_size=1)),
        ("ngram", SpecConfig(num_steps=3, topk=1, page_size=4)),
    ]:
        pool = PagedKVPool(num_pages=-(-1024 // spec.page_size), page_size=spec.page_size)
        build = (lambda e: LlamaDraft(model, e.pool, num_layers=2)) if draft == "layerskip" else NgramDraft(64)
        engine = Engine(model, pool, build, spec)
        results, _ = engine.generate(prompts, 12, checked=True)
        assert [list(r.output) for r in results] == expected, draft
        assert pool.num_free_pages == pool.num_pages


def test_hf_config_round_trip_and_weights(tmp_path, weights):
    assert config_from_hf(config_to_hf(TINY)) == TINY
    save_hf(tmp_path, TINY, weights)
    config, loaded = load_hf(tmp_path)
    assert config == TINY and set(loaded) == set(weights)
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    with pytest.raises(ModelLoadError, match="RoPE scaling"):
        config_from_hf({**config_to_hf(TINY), "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    with pytest.raises(ModelLoadError, match="model_type 'gemma3' is not supported.*gemma3_text"):
        config_from_hf({"model_type": "gemma3"})


def test_config_validation_and_refusals(weights):
    with pytest.raises(ValueError, match="layer_types has 3 entries for 4 layers"):
        attrs.evolve(TINY, layer_types=(SLIDING,) * 3)
    with pytest.raises(ValueError, match="need a positive sliding_window"):
        attrs.evolve(TINY, sliding_window=None)
    with pytest.raises(ValueError, match="sliding_window, rope_local_theta, .* are Gemma 3 settings"):
        attrs.evolve(TINY, architecture="llama")
    with pytest.raises(ModelLoadError, match="LlamaModel runs llama models, not 'gemma3'.*build_model"):
        LlamaModel(TINY, weights)
    with pytest.raises(ValueError, match="EAGLE heads are built for Llama-architecture targets"):
        EagleConfig.for_target(TINY)
    from speccycle.engine.fast.path import accelerate

    engine = Engine(Gemma3Model(TINY, weights), PagedKVPool(num_pages=8, page_size=4), None, SpecConfig())
    with pytest.raises(ValueError, match="fast path .* runs Llama-architecture models; gemma3 needs QK-norm"):
        accelerate(engine)


# ---- GGUF: a tiny file written the way llama.cpp's converter writes Gemma 3 --------------------------------
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens, types = list(control), [3, 3, 3, 2, 3, 3]
    tokens += ["\n", "  "]
    types += [4, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    normal = ["▁", "a", "b", "c", "h", "i", "e", "l", "o", "bc", "ab", "aa", "hi", "▁hi", "he", "ll", "hell", "hello"]
    tokens += normal
    types += [1] * len(normal)
    scores = [0.0] * (len(tokens) - len(normal)) + [-float(i) for i in range(len(normal))]
    return tokens, scores, types


def write_tiny_gemma3_gguf(path, config: LlamaConfig, weights: dict[str, torch.Tensor]):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    tokens, scores, types = _tiny_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    for name, tensor in weights.items():
        array = tensor.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # the converter stores Gemma's norm factor 1 + w
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            parts = name.split(".")
            gguf_name = f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:-1])]}.weight"
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    config = attrs.evolve(TINY, vocab_size=len(_tiny_vocab()[0]))
    weights = random_gemma3_weights(config, seed=5, scale=0.3)
    path = write_tiny_gemma3_gguf(tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf", config, weights)
    return path, config, weights


def test_gguf_loads_gemma3_names_norms_and_defaults(tiny_gguf):
    path, config, weights = tiny_gguf
    loaded_config, loaded = load_gguf(path)
    # llama.cpp fixes these in code: every 6th layer global, local base 10k, scale from head_dim; EOS and <end_of_turn>
    assert loaded_config == attrs.evolve(
        config, layer_types=(SLIDING,) * 4, query_pre_attn_scalar=32.0, final_logit_softcapping=None
    )
    assert set(loaded) == set(weights)
    for name, tensor in weights.items():  # Q/K rows stay as written (no llama.cpp permutation for Gemma)
        torch.testing.assert_close(loaded[name], tensor, atol=1e-7, rtol=0, msg=name)


def test_engine_loads_a_gemma3_gguf_and_refuses_eagle(tiny_gguf):
    path, config, _ = tiny_gguf
    engine = Engine.load(str(path), draft="ngram", spec=SpecConfig(num_steps=3, page_size=4), kv_tokens=512)
    assert isinstance(engine.model, Gemma3Model) and engine.stop_token_ids == (1, 5)
    ids = engine.chat_prompt("hello")
    assert engine.tokenizer.decode(ids) == "<bos><start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n"
    results, _ = engine.generate([ids], 6)
    assert list(results[0].output) == engine.generate_autoregressive([ids], 6)[0]
    with pytest.raises(ValueError, match="--draft eagle runs on Llama-architecture targets"):
        Engine.load(str(path), draft="eagle")
