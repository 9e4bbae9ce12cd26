"""Weight loading: GGUF (SmolLM2 and small files written here), errors, Hugging Face layout round trip."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from speccycle.engine.errors import ModelLoadError
from speccycle.engine.models.llama import random_llama_weights
from speccycle.engine.weights.weights_gguf import (
    LlamaConfig,
    default_model_path,
    load_gguf,
    load_gguf_config,
    unpermute_rope_rows,
)
from speccycle.engine.weights.weights_hf import config_from_hf, load_hf, save_hf

gguf = pytest.importorskip("gguf")

TINY = LlamaConfig(
    architecture="llama",
    vocab_size=40,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=50000.0,
    rms_norm_eps=2.0**-20,  # a float32 value: GGUF stores eps as float32
    max_position=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        return default_model_path()
    except ModelLoadError as error:
        pytest.skip(str(error))


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows (Hugging Face halves -> adjacent pairs)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}

GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_tiny_gguf(path, config, weights, qtype, architecture="llama"):
    """A GGUF file the way llama.cpp writes one: permuted Q/K, 2-D tensors in ``qtype``, norms in F32."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    for name, tensor in weights.items():
        array = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config.num_heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config.num_kv_heads)
        gguf_name = GLOBAL_NAMES.get(name)
        if gguf_name is None:  # model.layers.{i}.{module}.weight
            parts = name.split(".")
            gguf_name = f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.weight"
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unpermute_inverts_llama_cpp_permute():
    weight = torch.randn(4 * 16, 24)
    permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), 4))
    assert not torch.equal(permuted, weight)
    torch.testing.assert_close(unpermute_rope_rows(permuted, 4), weight, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("qtype_name", "atol"), [("F32", 0.0), ("F16", 1e-3), ("Q8_0", 0.01), ("BF16", 0.01), ("Q4_0", 0.1)]
)
def test_tiny_gguf_round_trip(tmp_path, qtype_name, atol):
    weights = random_llama_weights(TINY, seed=1, scale=0.1)
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", TINY, weights, qtype)
    config, loaded = load_gguf(path)
    assert config == TINY
    assert set(loaded) == set(weights)
    for name, tensor in weights.items():
        torch.testing.assert_close(loaded[name], tensor, atol=atol, rtol=0, msg=name)
    config16, loaded16 = load_gguf(path, dtype=torch.bfloat16)
    assert loaded16["model.norm.weight"].dtype == torch.bfloat16


def test_smollm2_config(smollm2_path):
    config = load_gguf_config(smollm2_path)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.vocab_size, config.head_dim, config.intermediate_size) == (49152, 64, 1536)
    assert config.tie_word_embeddings and config.architecture == "llama"
    assert config.rope_theta == 100000.0 and config.max_position == 8192
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


def test_missing_and_non_gguf_files_raise(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="is not a file"):
        load_gguf(tmp_path)
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file: it starts with b'hell'"):
        load_gguf(text)
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"GG")
    with pytest.raises(ModelLoadError, match="only 2 bytes"):
        load_gguf(tiny)


def test_truncated_files_raise(tmp_path, smollm2_path):
    data = smollm2_path.read_bytes()
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:100_000])  # cut inside the vocabulary
    with pytest.raises(ModelLoadError, match="truncated"):
        load_gguf(header)
    tensors = tmp_path / "tensors.gguf"
    tensors.write_bytes(data[: len(data) // 2])  # header whole, tensor data cut
    with pytest.raises(ModelLoadError, match=r"truncated: tensor .* ends at byte"):
        load_gguf(tensors)


def test_unsupported_architecture_is_named(tmp_path):
    weights = random_llama_weights(TINY, seed=2)
    path = write_tiny_gguf(tmp_path / "mamba.gguf", TINY, weights, gguf.GGMLQuantizationType.F32, "mamba")
    with pytest.raises(ModelLoadError, match=r"architecture 'mamba' is not supported; supported: llama"):
        load_gguf(path)


def test_hf_config_errors():
    with pytest.raises(ModelLoadError, match="model_type 'gemma3' is not supported"):
        config_from_hf({"model_type": "gemma3"})
    with pytest.raises(ModelLoadError, match="has no 'hidden_size'"):
        config_from_hf({"model_type": "llama"})
    with pytest.raises(ModelLoadError, match="RoPE scaling 'yarn' is not supported"):
        config_from_hf({"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}})


def test_hf_directory_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_hf(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf(tmp_path)
    save_hf(tmp_path, TINY, random_llama_weights(TINY))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_hf(tmp_path)


def test_hf_round_trip_tiny(tmp_path):
    weights = random_llama_weights(TINY, seed=3)
    save_hf(tmp_path, TINY, weights)
    config, loaded = load_hf(tmp_path)
    assert config == TINY
    assert all(torch.equal(loaded[k], weights[k]) for k in weights) and set(loaded) == set(weights)


@pytest.mark.slow
def test_smollm2_gguf_to_hf_layout_and_back(tmp_path, smollm2_path):
    config, weights = load_gguf(smollm2_path)
    save_hf(tmp_path / "smollm2", config, weights)
    hf_config = json.loads((tmp_path / "smollm2" / "config.json").read_text())
    assert hf_config["tie_word_embeddings"] and hf_config["num_key_value_heads"] == 3
    loaded_config, loaded = load_hf(tmp_path / "smollm2")
    assert loaded_config == config
    assert set(loaded) == set(weights) and "lm_head.weight" not in loaded  # tied
    assert all(torch.equal(loaded[name], weights[name]) for name in weights)
    shutil.rmtree(tmp_path / "smollm2")
