"""Compact storage for EAGLE head files: int8 weights with one float32 scale per output row.

A head file saved by `EagleHead.save` keeps its weights in the dtype they were saved in (bfloat16 from
the trainer: 9.76 MB for SmolLM2's EAGLE-3 head). The ``int8-rowwise`` storage keeps every 2-D weight
``W [out, in]`` (``fc``, Q/K/V/O, gate/up/down, the head's own LM head) as

    W.q  = round(W / scale[:, None]) in [-127, 127]   (int8, stored under the weight's own name)
    scale = max_j |W[:, j]| / 127                    (float32 ``[out]``, stored as ``<name>.scale``)

so ``W ~= W.q * scale[:, None]`` with an error of at most ``scale / 2`` per entry. The norms stay as
they were (a few KB), ``draft_to_target`` becomes int32 (49,152 ids do not fit int16). The file's
metadata says so under ``speccycle.eagle.storage``; `EagleHead.load` dequantizes to the compute
dtype, and a file without the key loads as before. ``speccycle.eagle.pack`` records the conversion
(source file and checksum, which tensors were quantized and the error each took); every other
metadata key (``speccycle.train``, the config) is copied.

    python -m speccycle.engine.drafters.eagle_pack eagle3.safetensors eagle3.int8.safetensors
    python -m speccycle.engine.drafters.eagle_pack eagle3.safetensors --ship   # into engine/data/eagle/
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pack_file(src: str | os.PathLike, dst: str | os.PathLike, keep: tuple[str, ...] = (), command: str = "") -> dict:
    """Write ``src`` (a plain EAGLE head file) to ``dst`` in ``int8-rowwise`` storage; returns the pack record.

    The metadata of ``src`` is copied (config, training record), plus ``speccycle.eagle.storage`` and
    ``speccycle.eagle.pack``. The packed head is loaded back and checked against the source."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .eagle import METADATA_KEY, EagleHead

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"{dst} is the input file: write the packed head to another path")
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata() or {})
        state = {k: f.get_tensor(k) for k in f.keys()}
    if METADATA_KEY not in meta:
        raise ModelLoadError(f"{src} has no '{METADATA_KEY}' metadata: it is not an EAGLE head file")
    if meta.get(STORAGE_KEY):
        raise ValueError(f"{src} is already stored as {meta[STORAGE_KEY]}: pack the original head file")
    tensors, record = pack_state(state, keep)
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for k, v in state.items() if k != ID_MAP})
    record = {
        **record,
        "source": {"file": src.name, "bytes": src.stat().st_size, "sha256": _sha256(src), "dtypes": dtypes},
        "command": command or f"python -m speccycle.engine.drafters.eagle_pack {src.name} {dst.name}",
    }
    meta.update({STORAGE_KEY: INT8_ROWWISE, PACK_KEY: json.dumps(record)})
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, dst)
    packed, plain = EagleHead.load(dst), EagleHead.load(src)  # the round trip must give the source's shapes
    bound = {k: tensors[k + SCALE_SUFFIX][:, None] / 2 * 1.0001 + 1e-12 for k in record["quantized"]}
    restored_state = packed.state()
    for name, value in plain.state().items():
        restored = restored_state[name]
        within = bool(((restored - value).abs() <= bound[name]).all()) if name in bound else None
        if not (torch.equal(restored, value) if within is None else within):
            raise RuntimeError(f"packed {name} does not load back within its quantization bound: not written")
    record["bytes"] = dst.stat().st_size
    return record


def main(argv: list[str] | None = None) -> int:
    from .eagle_heads import HEADS_DIR, model_name

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="an EAGLE head .safetensors file (as the trainer saves it)")
    p.add_argument("dst", nargs="?", help="the packed file to write")
    p.add_argument("--ship", action="store_true", help="write it where --draft eagle finds it (engine/data/eagle/)")
    p.add_argument("--keep", default="", help="comma-separated tensors to keep unquantized (e.g. lm_head.weight)")
    args = p.parse_args(argv)
    src = Path(args.src)
    if args.ship == bool(args.dst):
        p.error("pass either DST or --ship")
    if args.ship:
        from safetensors import safe_open

        with safe_open(str(src), framework="pt") as f:
            target = json.loads((f.metadata() or {}).get("speccycle.train", "{}")).get("target")
        if not target:
            p.error(f"{src} records no target model (speccycle.train 'target'): pass DST")
        dst = HEADS_DIR / f"{model_name(target)}.eagle.safetensors"
    else:
        dst = Path(args.dst)
    keep = tuple(k for k in args.keep.split(",") if k)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    record = pack_file(src, dst, keep, command=f"python -m speccycle.engine.drafters.eagle_pack {argv_text}")
    print(f"{src} ({record['source']['bytes']:,} bytes) -> {dst} ({record['bytes']:,} bytes, {INT8_ROWWISE})")
    for name, err in record["error"].items():
        print(f"  {name}: mean |err| / row max {err['rel_to_row_max_mean']}, rms err / rms weight {err['rel_rms']}")
    if record["kept"]:
        print(f"  kept as stored: {', '.join(record['kept'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
