"""RoPE scaling (``llama3``, ``linear``) on a tiny random Llama 3.1-shaped model, against transformers; and the
same scaling read from a GGUF file's per-frequency factors (``rope_freqs.weight``).

The prompt's positions run past ``original_max_position_embeddings`` and the head dimension spans all three
llama3 bands (frequencies kept, interpolated, divided by ``factor``), so each part of the scaling counts.
"""

from __future__ import annotations

import copy
import json
import math
import pickle

import gguf
import numpy as np
import pytest
import torch
from speccycle.engine.drafters.eagle import EagleConfig
from speccycle.engine.errors import ModelLoadError
from speccycle.engine.greedy import extend_batch
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import random_llama_weights, rope_cos_sin
from speccycle.engine.models.rope import RopeScaling, ScaledRopeBase, rope_inv_freq, rope_scaling
from speccycle.engine.models.target import LlamaTarget
from speccycle.engine.weights.weights_gguf import _GLOBAL_NAMES, _LAYER_NAMES, LlamaConfig, load_gguf, load_gguf_config
from speccycle.engine.weights.weights_hf import config_from_hf, load_hf, save_hf

ORIGINAL_CONTEXT = 32
LLAMA3 = RopeScaling("llama3", 8.0, 1.0, 4.0, ORIGINAL_CONTEXT)  # Llama 3.1's factors, a tiny pretraining context
LINEAR = RopeScaling("linear", 4.0)
HEAD_DIM = 32
TOKENS = [(7 * i + 3) % 96 for i in range(80)]  # positions 0..79 cross the original context of 32


def tiny_config(scaling: RopeScaling | None) -> LlamaConfig:
    theta = 10000.0 if scaling is None else ScaledRopeBase(10000.0, scaling)
    return LlamaConfig(
        architecture="llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=HEAD_DIM,
        rope_theta=theta,
        rms_norm_eps=1e-5,
        max_position=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2, 3),
    )


def engine_logits(config: LlamaConfig, weights, split: int | None = None) -> torch.Tensor:
    """Logits of every row of ``TOKENS`` through the paged engine; ``split``: prefill in two extends."""
    pool = PagedKVPool(num_pages=64, page_size=4)
    target = LlamaTarget.from_weights(config, weights, pool)
    if split is None:
        return target.forward(extend_batch(pool, [0], [TOKENS], [0], last_logits_only=False)).logits
    first = target.forward(extend_batch(pool, [0], [TOKENS[:split]], [0], last_logits_only=False)).logits
    rest = target.forward(extend_batch(pool, [0], [TOKENS[split:]], [split], last_logits_only=False)).logits
    return torch.cat([first, rest])


def test_llama3_bands_cover_kept_interpolated_and_divided_frequencies():
    plain = rope_inv_freq(HEAD_DIM, 10000.0)
    scaled = rope_inv_freq(HEAD_DIM, ScaledRopeBase(10000.0, LLAMA3))
    wavelength = 2 * torch.pi / plain
    kept, divided = wavelength < ORIGINAL_CONTEXT / 4.0, wavelength > ORIGINAL_CONTEXT / 1.0
    between = ~kept & ~divided
    assert kept.any() and divided.any() and between.any()
    assert torch.equal(scaled[kept], plain[kept])
    torch.testing.assert_close(scaled[divided], plain[divided] / 8.0, rtol=0, atol=0)
    assert ((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8.0)).all()
    torch.testing.assert_close(rope_inv_freq(HEAD_DIM, ScaledRopeBase(10000.0, LINEAR)), plain / 4.0, rtol=0, atol=0)


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_scaled_model_matches_transformers(tmp_path, scaling):
    transformers = pytest.importorskip("transformers", reason="transformers (the test extra) is not installed")
    config, weights = tiny_config(scaling), random_llama_weights(tiny_config(scaling), seed=5, scale=0.2)
    directory = save_hf(tmp_path / "tiny", config, weights)
    assert json.loads((directory / "config.json").read_text())["rope_scaling"]["rope_type"] == scaling.rope_type
    loaded_config, loaded = load_hf(directory)
    assert loaded_config == config and rope_scaling(loaded_config.rope_theta) == scaling
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    # the frequencies are transformers' own, bit for bit
    assert torch.equal(rope_inv_freq(HEAD_DIM, loaded_config.rope_theta), model.model.rotary_emb.inv_freq)
    with torch.inference_mode():
        reference = model(torch.tensor([TOKENS])).logits[0]
    logits = engine_logits(loaded_config, loaded)
    torch.testing.assert_close(logits, reference, atol=2e-5, rtol=0)
    torch.testing.assert_close(engine_logits(loaded_config, loaded, split=50), reference, atol=2e-5, rtol=0)
    # the scaling matters at these positions: unscaled RoPE gives other logits
    unscaled = engine_logits(tiny_config(None), loaded)
    assert (unscaled[1:] - reference[1:]).abs().max() > 1e-3


def test_scaled_base_is_a_float_that_keeps_its_scaling():
    theta = ScaledRopeBase(500000.0, LLAMA3)
    assert float(theta) == 500000.0 and theta != 500000.0 and theta != ScaledRopeBase(500000.0, LINEAR)
    assert pickle.loads(pickle.dumps(theta)) == theta and copy.deepcopy(theta) == theta
    assert len({theta, ScaledRopeBase(500000.0, LLAMA3)}) == 1
    assert json.loads(json.dumps({"rope_theta": theta})) == {"rope_theta": 500000.0}
    # a draft head built for the target rotates as the target does
    config = tiny_config(LLAMA3)
    head = EagleConfig.for_target(config, version=1)
    assert rope_scaling(head.rope_theta) == LLAMA3
    positions = torch.arange(70)
    for table, expected in zip(
        rope_cos_sin(positions, HEAD_DIM, head.rope_theta, torch.float32),
        rope_cos_sin(positions, HEAD_DIM, config.rope_theta, torch.float32),
    ):
        assert torch.equal(table, expected)


def test_config_refusals_name_the_setting():
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "vocab_size": 96}  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"RoPE scaling 'dynamic' is not supported; .*batch of requests"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match=r"RoPE scaling 'yarn' is not supported; supported: default, linear"):
        config_from_hf({**base, "rope_scaling": {"type": "yarn", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match="llama3 RoPE scaling has no 'original_max_position_embeddings'"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0}})  # fmt: skip
    with pytest.raises(ModelLoadError, match="low_freq_factor < high_freq_factor"):
        config_from_hf({**base, "rope_scaling": {**LLAMA3.to_hf(), "low_freq_factor": 4.0}})
    # transformers 5's spelling: base and scaling together in rope_parameters
    config = config_from_hf({**base, "rope_parameters": {"rope_theta": 500000.0, **LLAMA3.to_hf()}})
    assert config.rope_theta == ScaledRopeBase(500000.0, LLAMA3)
    assert type(config_from_hf({**base, "rope_scaling": {"rope_type": "default"}}).rope_theta) is float


# ---- a GGUF file's per-frequency factors (rope_freqs.weight, as llama.cpp's converter writes Llama 3.1) ----------
def llama_cpp_rope_factors(s: RopeScaling, head_dim: int, base: float) -> np.ndarray:
    """The divisor of each frequency under ``llama3`` scaling ``s``: 1 kept, ``factor`` divided, between them the
    ratio of the default frequency to the interpolated one."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * base ** (i / head_dim)
        if wavelength < s.original_max_position / s.high_freq_factor:
            factors.append(1.0)
        elif wavelength > s.original_max_position / s.low_freq_factor:
            factors.append(s.factor)
        else:
            smooth = (s.original_max_position / wavelength - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            factors.append(1.0 / ((1 - smooth) / s.factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path, config: LlamaConfig, weights, rope_freqs: np.ndarray | None, original: int | None = None):
    """A float32 GGUF file of ``weights`` with llama.cpp's names and Q/K row order, and ``rope_freqs.weight``."""
    names = {hf: name for name, hf in _GLOBAL_NAMES.items()}
    layer_names = {hf: name for name, hf in _LAYER_NAMES.items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if original is not None:
        writer.add_rope_scaling_orig_ctx_len(original)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for name, tensor in weights.items():
        array = tensor.numpy().astype(np.float32)
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name.split(".")[-2])
        if heads is not None:  # llama.cpp's row order: each head's halves interleaved in pairs
            rows = array.shape[0]
            array = array.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(array.shape)
        if name in names:
            writer.add_tensor(names[name], array)
        else:
            parts = name.split(".")
            writer.add_tensor(f"blk.{parts[2]}.{layer_names['.'.join(parts[3:])]}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("original", [None, ORIGINAL_CONTEXT], ids=["factors-alone", "with-original-context"])
def test_a_gguf_with_rope_freqs_runs_its_llama3_scaling(tmp_path, original):
    """Llama 3.1 as a GGUF file: the factors give back the llama3 parameters, and the model the logits of the
    same weights with the scaling of its config.json (which `test_scaled_model_matches_transformers` holds equal to
    transformers')."""
    config = tiny_config(LLAMA3)
    weights = random_llama_weights(config, seed=5, scale=0.2)
    factors = llama_cpp_rope_factors(LLAMA3, HEAD_DIM, 10000.0)
    assert ((factors > 1) & (factors < LLAMA3.factor)).sum() >= 2  # the tiny config interpolates some frequencies
    path = write_gguf(tmp_path / "llama31.gguf", tiny_config(None), weights, factors, original)
    loaded_config, loaded = load_gguf(path)
    assert rope_scaling(loaded_config.rope_theta) == LLAMA3 and float(loaded_config.rope_theta) == 10000.0
    assert "rope_freqs.weight" not in loaded and set(loaded) == set(weights)
    torch.testing.assert_close(engine_logits(loaded_config, loaded), engine_logits(config, weights), atol=1e-6, rtol=0)
    # factors of 1 everywhere are the default frequencies; one factor everywhere is linear scaling
    assert (
        type(load_gguf_config(write_gguf(tmp_path / "ones.gguf", config, weights, np.ones(16, np.float32))).rope_theta)
        is float
    )
    linear = load_gguf_config(write_gguf(tmp_path / "linear.gguf", config, weights, np.full(16, 4.0, np.float32)))
    assert rope_scaling(linear.rope_theta) == LINEAR


def test_rope_freqs_no_llama3_scaling_gives_are_refused(tmp_path):
    config, weights = tiny_config(None), random_llama_weights(tiny_config(None), seed=5, scale=0.2)
    factors = llama_cpp_rope_factors(LLAMA3, HEAD_DIM, 10000.0)
    factors[[1, 2, 3]] = [1.5, 5.0, 2.0]  # no longer monotone in the wavelength
    with pytest.raises(ModelLoadError, match="per-frequency factors that no llama3 RoPE scaling gives"):
        load_gguf_config(write_gguf(tmp_path / "odd.gguf", config, weights, factors))
    with pytest.raises(ModelLoadError, match="holds 8 values for a head dimension of 32"):
        load_gguf_config(write_gguf(tmp_path / "short.gguf", config, weights, factors[:8]))
