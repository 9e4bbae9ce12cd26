"""A small, fast GGUF reader: metadata as Python values, tensors as memory-mapped numpy arrays.

`gguf.GGUFReader` keeps a numpy array per metadata element, which costs ~5 s on a vocabulary of 49k
tokens and 49k merges on a small CPU; this reader parses the same header with `struct` in ~0.2 s and
leaves the dequantization to `gguf.quants.dequantize`. Format (little-endian, versions 2 and 3):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims] fastest-first, u32 ggml_type, u64 offset)
    padding to `general.alignment` (32), then the tensor data
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ..errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

# value type id -> (struct format, numpy dtype) for the fixed-size scalar types
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


@attrs.frozen
class GGUFTensorInfo:
    """One tensor of a GGUF file: ``shape`` in torch order (slowest dim first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    n_bytes: int


class _Cursor:
    """Reads little-endian values from a bytes-like buffer, with a clear error past its end."""

    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.pos, self.path = buffer, 0, path

    def take(self, size: int) -> memoryview:
        if self.pos + size > len(self.buffer):
            raise ModelLoadError(
                f"{self.path} is truncated: the GGUF header needs byte {self.pos + size} but the file "
                f"has {len(self.buffer)} bytes; download or convert it again"
            )
        view = self.buffer[self.pos : self.pos + size]
        self.pos += size
        return view

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.scalar("<Q")
        return bytes(self.take(length)).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type][0])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(item_type) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: unknown GGUF value type {value_type}; the file is corrupt")


class GGUFFile:
    """An open GGUF file: ``metadata`` (dict of Python values) and ``tensors`` (list of infos)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ModelLoadError(f"model file {self.path} does not exist; pass the path of a .gguf file")
        if not self.path.is_file():
            raise ModelLoadError(f"model path {self.path} is not a file; pass the path of a .gguf file")
        size = self.path.stat().st_size
        if size < 4:
            raise ModelLoadError(f"{self.path} is not a GGUF file: it has only {size} bytes")
        try:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except OSError as error:
            raise ModelLoadError(f"cannot read the model file {self.path}: {error.strerror or error}") from error
        magic = bytes(self._data[:4])
        if magic != GGUF_MAGIC:
            raise ModelLoadError(
                f"{self.path} is not a GGUF file: it starts with {magic!r}, a GGUF file starts with "
                f"{GGUF_MAGIC!r}; pass a .gguf file, or the directory of a Hugging Face model (config.json and "
                "safetensors)"
            )
        cursor = _Cursor(memoryview(self._data), self.path)
        cursor.take(4)
        self.version = cursor.scalar("<I")
        if self.version not in (2, 3):
            raise ModelLoadError(
                f"{self.path}: GGUF version {self.version} is not supported (supported: 2, 3; a big-endian "
                f"file also shows up here); convert it again with a current llama.cpp"
            )
        tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar("<I"))
        raw_infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            raw_infos.append((name, tuple(reversed(dims)), cursor.scalar("<I"), cursor.scalar("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cursor.pos // alignment) * alignment
        self.tensors = [self._tensor_info(*info, data_start, size) for info in raw_infos]

    def _tensor_info(
        self, name: str, shape: tuple[int, ...], ggml_type: int, offset: int, data_start: int, size: int
    ) -> GGUFTensorInfo:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError) as error:
            raise ModelLoadError(
                f"{self.path}: tensor {name} has GGML type {ggml_type}, unknown to the installed gguf "
                f"package; upgrade it with `pip install -U gguf`"
            ) from error
        n_elements = int(np.prod(shape, dtype=np.int64))
        info = GGUFTensorInfo(name, shape, ggml_type, data_start + offset, n_elements // block_size * type_size)
        if info.offset + info.n_bytes > size:
            raise ModelLoadError(
                f"{self.path} is truncated: tensor {name} ends at byte {info.offset + info.n_bytes} but "
                f"the file has {size} bytes; download or convert it again"
            )
        return info

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value of ``key``, else ``default``."""
        return self.metadata.get(key, default)

    def tensor_names(self) -> set[str]:
        return {info.name for info in self.tensors}

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor as float32, shaped ``info.shape`` (a fresh array, safe to hand to torch)."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(info.ggml_type)
        raw = self._data[info.offset : info.offset + info.n_bytes]
        if qtype == GGMLQuantizationType.F32:
            return np.array(raw.view(np.float32)).reshape(info.shape)
        if qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).astype(np.float32).reshape(info.shape)
        rows = raw.reshape(-1, info.n_bytes // max(1, int(np.prod(info.shape[:-1], dtype=np.int64))))
        try:
            values = dequantize(rows, qtype)
        except NotImplementedError as error:
            raise ModelLoadError(
                f"{self.path}: tensor {info.name} has GGML type {qtype.name}, which the gguf package "
                f"cannot dequantize; upgrade `gguf` or use a file quantized as F16, Q8_0 or Q4_K"
            ) from error
        return np.asarray(values, dtype=np.float32).reshape(info.shape)
