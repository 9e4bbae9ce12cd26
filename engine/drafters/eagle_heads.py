"""EAGLE heads shipped with speccycle: ``--draft eagle`` without ``--eagle-head`` loads the target's own.

A shipped head lives in ``speccycle.engine/data/eagle/`` as ``<model>.eagle.safetensors`` with a
README beside it recording how it was trained (``speccycle train-draft``: command, data, steps,
measured tau) and how it is stored. Heads are looked up by the target's model name, the file or
directory name up to its first dot (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``),
so any quantization of the same model finds the same head. The lookup is driven by the files alone:
replacing a head is replacing its file (``python -m speccycle.engine.drafters.eagle_pack NEW --ship``
writes it there, int8-packed) and its README. A head stored in ``int8-rowwise`` form (`eagle_storage`)
is dequantized on load.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SUFFIX = ".eagle.safetensors"
# model name -> head file in HEADS_DIR, for a file not named ``<model>.eagle.safetensors``
SHIPPED: dict[str, str] = {}
HEADS_DIR: Path = Path(str(resources.files("speccycle.engine").joinpath("data", "eagle")))


def model_name(model_path: str | Path) -> str:
    return Path(model_path).name.split(".")[0]


def shipped_models() -> list[str]:
    """The model names speccycle ships a head for."""
    found = {p.name[: -len(SUFFIX)] for p in HEADS_DIR.glob(f"*{SUFFIX}")} if HEADS_DIR.is_dir() else set()
    return sorted(found | {name for name, file in SHIPPED.items() if (HEADS_DIR / file).is_file()})


def shipped_eagle_head(model_path: str | Path) -> Path | None:
    """The shipped head file for the model at ``model_path``, or None when speccycle has none for it."""
    name = model_name(model_path)
    path = HEADS_DIR / SHIPPED.get(name, name + SUFFIX)
    return path if path.is_file() else None
