"""The compact storage of EAGLE head files: int8 weights with one float32 scale per output row.

A head file saved by `EagleHead.save` keeps its weights in the dtype they were saved in (bfloat16 from
the trainer: 9.76 MB for SmolLM2's EAGLE-3 head). The ``int8-rowwise`` storage keeps every 2-D weight
``W [out, in]`` (``fc``, Q/K/V/O, gate/up/down, the head's own LM head) as

    W.q  = round(W / scale[:, None]) in [-127, 127]   (int8, stored under the weight's own name)
    scale = max_j |W[:, j]| / 127                    (float32 ``[out]``, stored as ``<name>.scale``)

so ``W ~= W.q * scale[:, None]`` with an error of at most ``scale / 2`` per entry. The norms stay as
they were (a few KB), ``draft_to_target`` becomes int32 (49,152 ids do not fit int16). The file's
metadata says so under ``speccycle.eagle.storage``; `EagleHead.load` dequantizes to the compute
dtype (`unpack_state`), and a file without the key loads as before. ``speccycle.eagle.pack`` records the
conversion (`pack_state`'s record). `eagle_pack` packs a head file and checks it loads back.
"""

from __future__ import annotations

import os

import torch

from ..errors import ModelLoadError

STORAGE_KEY = "speccycle.eagle.storage"  # absent: tensors as saved; INT8_ROWWISE: this module's packing
PACK_KEY = "speccycle.eagle.pack"  # the conversion record
INT8_ROWWISE = "int8-rowwise"
STORAGES = (INT8_ROWWISE,)
SCALE_SUFFIX = ".scale"
ID_MAP = "draft_to_target"


def quantize_rowwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row. Shapes: ``weight [out, in]`` -> ``(q [out, in] int8, scale [out] float32)``.

    A row of zeros gets scale 1 (its int8 values are 0 either way)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"int8 row-wise quantization takes a 2-D float weight, not {weight.dtype} {list(weight.shape)}"
        )
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_rowwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q [out, in] int8``, ``scale [out]`` -> ``[out, in]`` float32."""
    return q.float() * scale.float()[:, None]


def pack_state(state: dict[str, torch.Tensor], keep: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict]:
    """A head's file tensors in ``int8-rowwise`` storage, and what happened to each.

    Every 2-D float tensor except those named in ``keep`` is quantized; 1-D tensors (norms) are kept;
    ``draft_to_target`` becomes int32. Returns ``(tensors, record)``: ``record`` lists the quantized and
    kept names and, per quantized weight, the largest and the mean absolute error relative to the row's
    largest entry (``max_abs_err / rms_weight`` too, for comparison between tensors)."""
    unknown = sorted(set(keep) - set(state))
    if unknown:
        raise ValueError(f"--keep names no tensor of this head: {unknown}; its tensors are {sorted(state)}")
    out: dict[str, torch.Tensor] = {}
    quantized, kept, errors = [], [], {}
    for name, tensor in state.items():
        if name.endswith(SCALE_SUFFIX) or tensor.dtype == torch.int8:
            raise ValueError(f"{name} is already packed ({tensor.dtype}): pack the original head file")
        if name == ID_MAP:
            if int(tensor.max()) > torch.iinfo(torch.int32).max:
                raise ValueError(f"{ID_MAP} holds ids past int32")
            out[name] = tensor.to(torch.int32).contiguous()
        elif tensor.dim() == 2 and tensor.is_floating_point() and name not in keep:
            q, scale = quantize_rowwise(tensor)
            out[name], out[name + SCALE_SUFFIX] = q, scale
            err = (dequantize_rowwise(q, scale) - tensor.float()).abs()
            errors[name] = {
                "rel_to_row_max_mean": round(float((err / scale[:, None] / 127).mean()), 6),
                "rel_rms": round(float(err.pow(2).mean().sqrt() / tensor.float().pow(2).mean().sqrt()), 6),
            }
            quantized.append(name)
        else:
            out[name] = tensor.contiguous()
            kept.append(name)
    return out, {"storage": INT8_ROWWISE, "scales": "float32", "quantized": quantized, "kept": kept, "error": errors}


def unpack_state(tensors: dict[str, torch.Tensor], storage: str | None, path: str | os.PathLike = "") -> dict:
    """The head's weights from a file's tensors: dequantized (float32) where ``storage`` packed them.

    ``storage`` None (no ``speccycle.eagle.storage`` metadata) returns ``tensors`` unchanged."""
    if storage is None:
        return tensors
    if storage not in STORAGES:
        raise ModelLoadError(
            f"{path}: EAGLE head storage {storage!r} is not one this speccycle reads ({', '.join(STORAGES)}): "
            "upgrade speccycle or repack the head"
        )
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if tensor.dtype == torch.int8:
            if scale is None or scale.shape != tensor.shape[:1]:
                raise ModelLoadError(f"{path}: int8 tensor {name} has no matching {name}{SCALE_SUFFIX} [out] scales")
            tensor = dequantize_rowwise(tensor, scale)
        out[name] = tensor
    return out
