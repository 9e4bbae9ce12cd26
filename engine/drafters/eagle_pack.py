"""Packing an EAGLE head file into compact storage: int8 weights with one float32 scale per output row.

The storage itself (``int8-rowwise``: the quantization, the file's keys, packing and unpacking a head's
tensors) is `eagle_storage`'s; this writes a packed copy of a plain head file and checks that it loads
back through `EagleHead.load` within the quantization bound. ``speccycle.eagle.pack`` records the
conversion (source file and checksum, which tensors were quantized and the error each took); every other
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
from . import eagle_heads
from .eagle import METADATA_KEY, EagleHead
from .eagle_storage import (
    ID_MAP,
    INT8_ROWWISE,
    PACK_KEY,
    SCALE_SUFFIX,
    STORAGE_KEY,
    STORAGES,
    dequantize_rowwise,
    pack_state,
    quantize_rowwise,
    unpack_state,
)

# the storage's names stay importable from here, beside the tool that writes it
__all__ = [
    "ID_MAP",
    "INT8_ROWWISE",
    "PACK_KEY",
    "SCALE_SUFFIX",
    "STORAGE_KEY",
    "STORAGES",
    "dequantize_rowwise",
    "main",
    "pack_file",
    "pack_state",
    "quantize_rowwise",
    "unpack_state",
]


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
        dst = eagle_heads.HEADS_DIR / f"{eagle_heads.model_name(target)}.eagle.safetensors"
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
