"""Load (and save) a Llama or Gemma 3 model in Hugging Face layout: ``config.json`` plus ``*.safetensors``.

The tensor names are Hugging Face's own, the same names `weights_gguf.load_gguf` produces, so both
loaders feed `LlamaModel` the same dict. `save_hf` writes a directory that `load_hf` and
`transformers.AutoModelForCausalLM.from_pretrained` both read; `export_gguf_to_hf` adds a GGUF's tokenizer
files (`tokenizer.save_tokenizer_files`), so the folder runs end to end. EOS ids come from
``generation_config.json`` when it has them (as in transformers), else from ``config.json``.

    config, weights = load_hf("path/to/SmolLM2-135M-Instruct", dtype=torch.float32)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import torch

from ..errors import ModelLoadError
from ..models.rope import rope_base_from_hf, rope_scaling
from .weights_gguf import LlamaConfig, check_weights, expected_shapes

SUPPORTED_MODEL_TYPES = ("llama", "gemma3_text")
_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of the tanh GELU
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
GENERATION_CONFIG_FILE = "generation_config.json"


def _gemma3_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The Gemma 3 settings of a ``gemma3_text`` config.json (transformers 4 or 5 layout)."""
    for flag in ("attn_logit_softcapping", "use_bidirectional_attention", "attention_bias"):
        if raw.get(flag):
            raise ModelLoadError(f"{source}: {flag}={raw[flag]!r} is not supported for Gemma 3")
    if raw.get("hidden_activation", "gelu_pytorch_tanh") not in _GEMMA_ACTIVATIONS:
        raise ModelLoadError(f"{source}: hidden_activation {raw['hidden_activation']!r} is not supported for Gemma 3")
    parameters = raw.get("rope_parameters") or {}  # transformers >= 5: one entry per layer type
    full, local = parameters.get("full_attention") or {}, parameters.get("sliding_attention") or {}
    scaled = [p.get("rope_type", p.get("type")) for p in (full, local, raw.get("rope_scaling") or {})]
    if any(kind not in (None, "default") for kind in scaled):
        raise ModelLoadError(f"{source}: RoPE scaling {scaled} is not supported; supported: default (none)")
    layers = int(raw["num_hidden_layers"])
    layer_types = raw.get("layer_types")
    if not layer_types:
        pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    softcap = raw.get("final_logit_softcapping")
    return {
        "rope_theta": float(full.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
        "sliding_window": int(raw.get("sliding_window", 4096)),
        "layer_types": tuple(layer_types),
        "rope_local_theta": float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
        "final_logit_softcapping": float(softcap) if softcap else None,
    }


def config_from_hf(raw: dict[str, Any], source: str = "config.json") -> LlamaConfig:
    """A `LlamaConfig` from the dict of a Hugging Face ``config.json`` (``llama`` or ``gemma3_text``)."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = (
            " (the multimodal Gemma 3: save its text model, model_type gemma3_text)" if model_type == "gemma3" else ""
        )
        raise ModelLoadError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}{hint}"
        )
    if model_type == "gemma3_text":
        return _config(raw, source, "gemma3")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ModelLoadError(f"{source}: {flag}=true is not supported (the engine's Llama has no biases)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported; supported: silu")
    return _config(raw, source, "llama")


def _config(raw: dict[str, Any], source: str, architecture: str) -> LlamaConfig:
    try:
        if architecture == "gemma3":
            extra = _gemma3_fields(raw, source)
            rope_theta = extra.pop("rope_theta")
        else:
            extra, rope_theta = {}, rope_base_from_hf(raw, source)
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        return LlamaConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=rope_theta,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **extra,
        )
    except ModelLoadError:  # a ValueError too: said already
        raise
    except KeyError as error:
        raise ModelLoadError(f"{source}: config.json has no {error.args[0]!r}, which the model needs") from error
    except (TypeError, ValueError) as error:
        raise ModelLoadError(f"{source}: inconsistent config.json: {error}") from error


def config_to_hf(config: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` dict transformers reads back as the same `LlamaConfig`."""
    c = config
    eos: Any = list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_id
    if c.architecture == "gemma3":
        return _gemma3_to_hf(c, eos)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": c.architecture,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rope_theta": float(c.rope_theta),
        "rope_scaling": scaling.to_hf() if (scaling := rope_scaling(c.rope_theta)) else None,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def _gemma3_to_hf(c: LlamaConfig, eos: Any) -> dict[str, Any]:
    """A ``gemma3_text`` config.json (``Gemma3ForCausalLM``); RoPE in both transformers 4 and 5 spellings."""
    local_theta = c.rope_local_theta or c.rope_theta
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": False,
        "query_pre_attn_scalar": _int_if_whole(c.query_pre_attn_scalar or c.head_dim),  # transformers 5 wants int
        "sliding_window": c.sliding_window,
        "layer_types": list(c.layer_types) or ["full_attention"] * c.num_layers,
        "rope_theta": c.rope_theta,
        "rope_local_base_freq": local_theta,
        "rope_scaling": None,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "final_logit_softcapping": c.final_logit_softcapping,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def _int_if_whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as error:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({error})") from error
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{directory} has no *.safetensors files; the engine reads safetensors weights (convert "
            f"pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def load_hf(
    directory: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Load a Hugging Face Llama or Gemma 3 directory: its config and weights in ``dtype`` on ``device``."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import safe_open
    except ImportError as error:
        raise ModelLoadError("loading a Hugging Face directory needs `safetensors`: pip install safetensors") from error
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelLoadError(f"{directory} is not a directory; pass a directory with config.json and *.safetensors")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory} has no config.json; it is not a Hugging Face model directory")
    try:
        config = config_from_hf(json.loads(config_path.read_text()), str(config_path))
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{config_path} is not valid JSON ({error})") from error
    eos_ids = generation_eos_ids(directory)
    if eos_ids is not None:
        config = attrs.evolve(config, eos_token_ids=eos_ids)

    wanted = expected_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(directory):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
                        continue
                    if name not in wanted:
                        raise ModelLoadError(
                            f"{file}: tensor {name!r} is not part of a plain {config.architecture} model (biases "
                            f"and extra modules are not supported)"
                        )
                    weights[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{file} is not a readable safetensors file ({error})") from error
    check_weights(config, weights, str(directory))
    return config, weights


def generation_eos_ids(directory: str | os.PathLike) -> tuple[int, ...] | None:
    """The ``eos_token_id`` (an int or a list) of a folder's ``generation_config.json``: the ids generation stops
    at, which transformers takes over ``config.json``'s; None when the file or the entry is absent."""
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is None:
            return None
        return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as error:
        raise ModelLoadError(f"{path}: eos_token_id must be an int or a list of ints ({error})") from error


def save_hf(directory: str | os.PathLike, config: LlamaConfig, weights: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json``, ``generation_config.json`` (BOS and EOS ids) and ``model.safetensors`` (tied LM head
    left out, as transformers does)."""
    from safetensors.torch import save_file

    check_weights(config, weights, "save_hf weights")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config_to_hf(config)["eos_token_id"]}
    (directory / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    tensors = {name: weights[name].detach().cpu().contiguous() for name in expected_shapes(config)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def export_gguf_to_hf(
    path: str | os.PathLike, directory: str | os.PathLike, dtype: torch.dtype = torch.float32
) -> Path:
    """A GGUF model as a Hugging Face folder: `save_hf`'s files (weights dequantized to ``dtype``) plus its
    tokenizer's (`tokenizer.save_tokenizer_files`: ``tokenizer.json``, ``tokenizer_config.json`` with the
    chat template). `load_hf`, the engine's ``--model`` and transformers read the folder."""
    from ..tokenizers.tokenizer import save_tokenizer_files
    from .weights_gguf import load_gguf

    config, weights = load_gguf(path, dtype=dtype)
    save_hf(directory, config, weights)
    return save_tokenizer_files(path, directory)
