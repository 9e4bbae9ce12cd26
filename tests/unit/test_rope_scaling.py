"""RoPE scaling (``llama3``, ``linear``) on a tiny random Llama 3.1-shaped model, against transformers.

The prompt's positions run past ``original_max_position_embeddings`` and the head dimension spans all three
llama3 bands (frequencies kept, interpolated, divided by ``factor``), so each part of the scaling counts.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
from speccycle.engine.drafters.eagle import EagleConfig
from speccycle.engine.errors import ModelLoadError
from speccycle.engine.greedy import extend_batch
from speccycle.engine.memory.kv_pool import PagedKVPool
from speccycle.engine.models.llama import random_llama_weights, rope_cos_sin
from speccycle.engine.models.rope import RopeScaling, ScaledRopeBase, rope_inv_freq, rope_scaling
from speccycle.engine.models.target import LlamaTarget
from speccycle.engine.weights.weights_gguf import LlamaConfig
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
