"""EAGLE heads shipped with speccycle: ``--draft eagle`` without ``--eagle-head`` loads the target's own.

A shipped head lives in ``speccycle.engine/data/eagle/`` with a README recording how it was trained
(``speccycle train-draft``: command, data, steps, measured tau). Heads are looked up by the target's
model name, the file or directory name up to its first dot (``SmolLM2-135M-Instruct.Q4_1.gguf`` ->
``SmolLM2-135M-Instruct``), so any quantization of the same model finds the same head.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# model name -> head file in HEADS_DIR
SHIPPED: dict[str, str] = {"SmolLM2-135M-Instruct": "SmolLM2-135M-Instruct.eagle.safetensors"}
HEADS_DIR: Path = Path(str(resources.files("speccycle.engine").joinpath("data", "eagle")))


def model_name(model_path: str | Path) -> str:
    return Path(model_path).name.split(".")[0]


def shipped_eagle_head(model_path: str | Path) -> Path | None:
    """The shipped head file for the model at ``model_path``, or None when speccycle has none for it."""
    file = SHIPPED.get(model_name(model_path))
    if file is None:
        return None
    path = HEADS_DIR / file
    return path if path.is_file() else None
