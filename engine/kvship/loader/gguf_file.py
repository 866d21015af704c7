"""GGUF files: header, metadata, tensor table, memory-mapped data (ggml's gguf.md).

All integers little-endian. Layout:
  magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count | kv pairs | tensor infos |
  padding to `general.alignment` (default 32) | tensor data (each at its aligned offset).
Tensor dims are stored innermost-first (ne[0] = row length), so the torch shape is reversed.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import ModelSourceError
from .gguf_blocks import TYPE_INFO, dequantize

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value types
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, \
    _FLOAT64 = range(13)
_SCALAR_DTYPES = {
    _UINT8: np.dtype("<u1"), _INT8: np.dtype("<i1"), _UINT16: np.dtype("<u2"), _INT16: np.dtype("<i2"),
    _UINT32: np.dtype("<u4"), _INT32: np.dtype("<i4"), _FLOAT32: np.dtype("<f4"), _BOOL: np.dtype("u1"),
    _UINT64: np.dtype("<u8"), _INT64: np.dtype("<i8"), _FLOAT64: np.dtype("<f8"),
}



@dataclass
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int
    file: "GGUFFile"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        return TYPE_INFO.get(self.ggml_type, (str(self.ggml_type),))[0]

    def raw(self) -> np.ndarray:
        return self.file.data[self.offset:self.offset + self.nbytes]

    def row_bytes(self) -> int:
        _, bs, ts = TYPE_INFO[self.ggml_type]
        return self.dims[0] // bs * ts

    def load(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The whole tensor, or only rows [start, stop) of its first torch dimension."""
        if rows is None:
            return dequantize(self.raw(), self.ggml_type, self.shape)
        if len(self.shape) < 2:
            return dequantize(self.raw(), self.ggml_type, self.shape)[rows[0]:rows[1]]
        start, stop = rows
        per_row = int(np.prod(self.shape[1:])) // self.dims[0] * self.row_bytes()
        a = self.offset + start * per_row
        raw = self.file.data[a:a + (stop - start) * per_row]
        return dequantize(raw, self.ggml_type, (stop - start, *self.shape[1:]))


class GGUFFile:
    """One memory-mapped GGUF file: `metadata` (dict), `tensors` (name -> GGUFTensorInfo)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.data = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ModelSourceError(f"cannot read GGUF file {path!r}: {e}") from None
        self._buf = memoryview(self.data)
        self._pos = 0
        try:
            self._parse()
        except ModelSourceError:
            raise
        except (struct.error, ValueError, IndexError, UnicodeDecodeError, OverflowError, MemoryError) as e:
            raise ModelSourceError(
                f"{path!r} is not a valid GGUF file (corrupt or truncated: {e}); "
                "download it again or pass another model.") from None

    # -- primitive reads
    def _read(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return v[0]

    def _read_str(self) -> str:
        n = self._read("<Q")
        if n > len(self.data) - self._pos:
            raise ValueError("string runs past the end of the file")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _read_value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._read_str()
        if vtype == _ARRAY:
            itype = self._read("<I")
            count = self._read("<Q")
            if itype in _SCALAR_DTYPES:
                dt = _SCALAR_DTYPES[itype]
                if count * dt.itemsize > len(self.data) - self._pos:
                    raise ValueError("array runs past the end of the file")
                arr = np.frombuffer(self._buf, dtype=dt, count=count, offset=self._pos)
                self._pos += count * dt.itemsize
                out = arr.tolist()
                return [bool(x) for x in out] if itype == _BOOL else out
            if count > len(self.data) - self._pos:
                raise ValueError("array runs past the end of the file")
            return [self._read_value(itype) for _ in range(count)]
        if vtype in _SCALAR_DTYPES:
            dt = _SCALAR_DTYPES[vtype]
            v = np.frombuffer(self._buf, dtype=dt, count=1, offset=self._pos)[0].item()
            self._pos += dt.itemsize
            return bool(v) if vtype == _BOOL else v
        raise ValueError(f"unknown metadata value type {vtype}")

    def _parse(self) -> None:
        if len(self.data) < 24 or bytes(self._buf[0:4]) != GGUF_MAGIC:
            raise ModelSourceError(
                f"{self.path!r} is not a GGUF file (bad magic); pass a .gguf model file, "
                "a model folder or a hub id.")
        self._pos = 4
        self.version = self._read("<I")
        if self.version not in (2, 3):
            raise ModelSourceError(
                f"{self.path!r} uses GGUF version {self.version}; only versions 2 and 3 "
                "(little-endian) are supported. Re-convert it with a current llama.cpp.")
        n_tensors = self._read("<Q")
        n_kv = self._read("<Q")
        if n_tensors > len(self.data) or n_kv > len(self.data):
            raise ValueError("implausible tensor or key count")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._read_str()
            vtype = self._read("<I")
            self.metadata[key] = self._read_value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._read_str()
            n_dims = self._read("<I")
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = tuple(self._read("<Q") for _ in range(n_dims))
            ggml_type = self._read("<I")
            offset = self._read("<Q")
            infos.append((name, dims, ggml_type, offset))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
        data_start = (self._pos + align - 1) // align * align
        self.data_offset = data_start
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            if ggml_type not in TYPE_INFO:
                raise ModelSourceError(
                    f"tensor {name!r} in {self.path!r} has ggml type {ggml_type}, which this "
                    "loader does not support.")
            _, bs, ts = TYPE_INFO[ggml_type]
            n = int(np.prod(dims)) if dims else 1
            if dims and dims[0] % bs:
                raise ValueError(f"tensor {name!r}: row length {dims[0]} not a multiple of {bs}")
            nbytes = n // bs * ts
            start = data_start + offset
            if start + nbytes > len(self.data):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            self.tensors[name] = GGUFTensorInfo(name, dims, ggml_type, start, nbytes, self)

