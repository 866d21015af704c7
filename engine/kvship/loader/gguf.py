"""GGUF files: reader (header, metadata, tensor table, memory-mapped data), vectorised
dequantization of the common llama.cpp types, and the mapping to an HF-shaped ModelSource.

Format reference: ggml's gguf.md. All integers little-endian. Layout:
  magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count | kv pairs | tensor infos |
  padding to `general.alignment` (default 32) | tensor data (each at its aligned offset).
Tensor dims are stored innermost-first (ne[0] = row length), so the torch shape is reversed.
"""
from __future__ import annotations

import logging
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Iterator

import numpy as np
import torch

from kvship.quant import QuantizedTensor, QuantRef
from kvship.quant.tensor import code_centre

from .errors import ModelSourceError
from .gguf_names import gguf_to_hf_name
from .source import ModelSource, WeightRef, apply_slices
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

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


# ggml tensor types: id -> (name, elements per block, bytes per block)
class GGMLType:
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    BF16 = 30


TYPE_INFO: dict[int, tuple[str, int, int]] = {
    GGMLType.F32: ("F32", 1, 4),
    GGMLType.F16: ("F16", 1, 2),
    GGMLType.BF16: ("BF16", 1, 2),
    GGMLType.F64: ("F64", 1, 8),
    GGMLType.I8: ("I8", 1, 1),
    GGMLType.I16: ("I16", 1, 2),
    GGMLType.I32: ("I32", 1, 4),
    GGMLType.I64: ("I64", 1, 8),
    GGMLType.Q4_0: ("Q4_0", 32, 18),
    GGMLType.Q4_1: ("Q4_1", 32, 20),
    GGMLType.Q5_0: ("Q5_0", 32, 22),
    GGMLType.Q5_1: ("Q5_1", 32, 24),
    GGMLType.Q8_0: ("Q8_0", 32, 34),
    GGMLType.Q2_K: ("Q2_K", 256, 84),
    GGMLType.Q3_K: ("Q3_K", 256, 110),
    GGMLType.Q4_K: ("Q4_K", 256, 144),
    GGMLType.Q5_K: ("Q5_K", 256, 176),
    GGMLType.Q6_K: ("Q6_K", 256, 210),
}

_NATIVE_TORCH = {
    GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16,
    GGMLType.F64: torch.float64, GGMLType.I8: torch.int8, GGMLType.I16: torch.int16,
    GGMLType.I32: torch.int32, GGMLType.I64: torch.int64,
}


# --------------------------------------------------------------------------------------------
# dequantization: `raw` is a uint8 array holding whole blocks; the result is flat float32.

def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian f16 at byte `start` of every block, as float32 of shape (nb, 1)."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(nb, 16) packed bytes -> (nb, 32): low nibbles then high nibbles (ggml's 32-block order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


# The types kvship keeps quantized are read as (codes, scales, offsets) per group of a block
# (GGUFSplit); their dequantization is codes * scale + offset, the same float32 products as
# ggml's, so a layer built from the split and one built from dequantized floats hold equal values.

@dataclass
class GGUFSplit:
    codes: np.ndarray  # (nb, elements per block) uint8
    scales: np.ndarray  # (nb, groups per block) float32
    offsets: np.ndarray | None  # (nb, groups per block) float32; None: codes centred on 2**(bits-1)
    bits: int  # the container: 4, or 8 for 5-, 6- and 8-bit codes
    group: int


def _combine(sp: GGUFSplit) -> np.ndarray:
    nb, per = sp.codes.shape
    q = sp.codes.reshape(nb, -1, sp.group).astype(np.float32)
    if sp.offsets is None:
        q -= code_centre(sp.bits)
    y = sp.scales[:, :, None] * q
    if sp.offsets is not None:
        y += sp.offsets[:, :, None]
    return y.reshape(-1)


def _split_q8_0(raw: np.ndarray) -> GGUFSplit:
    b = raw.reshape(-1, 34)
    return GGUFSplit((b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), _f16(b, 0), None, 8, 32)


def _split_q4_0(raw: np.ndarray) -> GGUFSplit:
    b = raw.reshape(-1, 18)
    return GGUFSplit(_nibbles(b[:, 2:]), _f16(b, 0), None, 4, 32)  # d * (q - 8)


def _split_q4_1(raw: np.ndarray) -> GGUFSplit:
    b = raw.reshape(-1, 20)
    return GGUFSplit(_nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2), 4, 32)


def _q5_high_bits(b: np.ndarray, start: int) -> np.ndarray:
    qh = np.ascontiguousarray(b[:, start:start + 4]).view("<u4")  # (nb, 1)
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # (nb, 32)


def _split_q5_0(raw: np.ndarray) -> GGUFSplit:
    b = raw.reshape(-1, 22)
    q = _nibbles(b[:, 6:]) | _q5_high_bits(b, 2)
    return GGUFSplit(q + np.uint8(128 - 16), _f16(b, 0), None, 8, 32)  # d * (q - 16), re-centred on 128


def _split_q5_1(raw: np.ndarray) -> GGUFSplit:
    b = raw.reshape(-1, 24)
    return GGUFSplit(_nibbles(b[:, 8:]) | _q5_high_bits(b, 4), _f16(b, 0), _f16(b, 2), 8, 32)


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte block of eight 6-bit scales and eight 6-bit mins (Q4_K, Q5_K)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _split_q4_k(raw: np.ndarray) -> GGUFSplit:
    b = raw.reshape(-1, 144)
    nb = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    qs = b[:, 16:].reshape(nb, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 256)
    return GGUFSplit(q, d * sc, -(dmin * mn), 4, 32)


def _split_q5_k(raw: np.ndarray) -> GGUFSplit:
    b = raw.reshape(-1, 176)
    nb = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    qh = b[:, 16:48]
    qs = b[:, 48:].reshape(nb, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 8, 32)
    high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    return GGUFSplit((low | high).reshape(nb, 256), d * sc, -(dmin * mn), 8, 32)


def _split_q6_k(raw: np.ndarray) -> GGUFSplit:
    b = raw.reshape(-1, 210)
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 2, 32)  # half, first/second 32 bytes, l
    qh = b[:, 128:192].reshape(nb, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # (nb, 16)
    d = _f16(b, 208)
    q = np.stack([
        (ql[:, :, 0] & 0x0F) | ((qh & 3) << 4),
        (ql[:, :, 1] & 0x0F) | (((qh >> 2) & 3) << 4),
        (ql[:, :, 0] >> 4) | (((qh >> 4) & 3) << 4),
        (ql[:, :, 1] >> 4) | (((qh >> 6) & 3) << 4),
    ], axis=2).reshape(nb, 256)
    return GGUFSplit(q + np.uint8(128 - 32), d * sc, None, 8, 16)  # d * sc * (q - 32), re-centred on 128


_SPLIT = {
    GGMLType.Q8_0: _split_q8_0,
    GGMLType.Q4_0: _split_q4_0,
    GGMLType.Q4_1: _split_q4_1,
    GGMLType.Q5_0: _split_q5_0,
    GGMLType.Q5_1: _split_q5_1,
    GGMLType.Q4_K: _split_q4_k,
    GGMLType.Q5_K: _split_q5_k,
    GGMLType.Q6_K: _split_q6_k,
}


def _deq_q2_k(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 84)
    nb = b.shape[0]
    s = b[:, 0:16]
    qs = b[:, 16:80].reshape(nb, 2, 1, 32)  # half, -, l
    d, dmin = _f16(b, 80), _f16(b, 82)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    q = ((qs >> shifts) & 3).reshape(nb, 16, 16).astype(np.float32)  # half, shift, l(32) -> 16x16
    sc = (s & 0x0F).astype(np.float32)
    mn = (s >> 4).astype(np.float32)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(-1)


def _deq_q3_k(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 110)
    nb = b.shape[0]
    hmask = b[:, 0:32]
    qs = b[:, 32:96].reshape(nb, 2, 1, 32)
    s = b[:, 96:108]
    d = _f16(b, 108)
    # sixteen 6-bit signed scales: low 4 bits from s[0:8], high 2 bits from s[8:12]
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)  # (nb, 16)
    hi = s[:, 8:12]
    high = np.concatenate([(hi >> sh) & 3 for sh in (0, 2, 4, 6)], axis=1)  # (nb, 16)
    sc = (low | (high << 4)).astype(np.int16) - 32
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    q = ((qs >> shifts) & 3).reshape(nb, 8, 32).astype(np.int16)  # (half*4 + shift, l)
    hbit = ((hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).astype(np.int16)
    q = q - np.where(hbit == 1, 0, 4).astype(np.int16)
    q = q.reshape(nb, 16, 16).astype(np.float32)
    return (d[:, :, None] * sc.astype(np.float32)[:, :, None] * q).reshape(-1)


_DEQUANT = {
    GGMLType.Q2_K: _deq_q2_k,
    GGMLType.Q3_K: _deq_q3_k,
    **{t: (lambda raw, split=split: _combine(split(raw))) for t, split in _SPLIT.items()},
}


def split_tensor(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> QuantizedTensor:
    """A 2-D tensor of a type in _SPLIT as kvship's canonical quantized tensor (no dequantization)."""
    sp = _SPLIT[ggml_type](np.asarray(raw, dtype=np.uint8).reshape(-1))
    n = shape[0]
    scales = torch.from_numpy(np.ascontiguousarray(sp.scales)).reshape(n, -1)
    offsets = None if sp.offsets is None else torch.from_numpy(np.ascontiguousarray(sp.offsets)).reshape(n, -1)
    return QuantizedTensor(torch.from_numpy(np.ascontiguousarray(sp.codes)).reshape(shape), scales, offsets,
                           sp.bits, sp.group)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes of a tensor of `ggml_type` -> a CPU tensor of `shape` (torch order).

    Quantized types come back as float32; float and integer types keep their own dtype."""
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if ggml_type in _NATIVE_TORCH:
        if ggml_type == GGMLType.BF16:
            arr = raw.view("<u2").astype(np.int16, copy=True)
            return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)
        np_dtype = {GGMLType.F32: "<f4", GGMLType.F16: "<f2", GGMLType.F64: "<f8", GGMLType.I8: "i1",
                    GGMLType.I16: "<i2", GGMLType.I32: "<i4", GGMLType.I64: "<i8"}[ggml_type]
        arr = np.array(raw.view(np_dtype), copy=True)
        return torch.from_numpy(arr).reshape(shape)
    fn = _DEQUANT.get(ggml_type)
    if fn is None:
        name = TYPE_INFO.get(ggml_type, (f"type {ggml_type}",))[0]
        raise ModelSourceError(
            f"GGUF tensor type {name} is not supported; use a file quantized as F32, F16, BF16, "
            f"Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K.")
    return torch.from_numpy(fn(raw)).reshape(shape)


# --------------------------------------------------------------------------------------------
# reader

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


# --------------------------------------------------------------------------------------------
# GGUF -> ModelSource

_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# llama.cpp writes Mixtral as a "llama" file whose llama.expert_count is above zero
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# architectures whose Q/K rows llama.cpp's converter permuted (to its rope layout)
_PERMUTED_ARCHS = {"llama", "mistral"}
# llama.cpp stores no norm_topk_prob: its graphs renormalize the top-k router weights for
# Qwen3-MoE (and Mixtral) and not for Qwen2-MoE, and transformers' GGUF reader assumes the same.
_NORM_TOPK_PROB = {"qwen2moe": False, "qwen3moe": True}


def shard_paths(path: str) -> list[str]:
    """All shards of a split GGUF (given any one of them), else just [path]."""
    d, base = os.path.split(path)
    m = _SHARD_RE.match(base)
    if not m:
        return [path]
    count = int(m["count"])
    paths = [os.path.join(d, f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ModelSourceError(
            f"split GGUF {base!r} needs all {count} shards next to each other; missing: "
            + ", ".join(os.path.basename(p) for p in missing))
    return paths


def gguf_model_name(path: str) -> str:
    base = os.path.basename(path)
    m = _SHARD_RE.match(base)
    stem = m["stem"] if m else base[:-5] if base.endswith(".gguf") else base
    # "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct": drop a quantization suffix
    return re.sub(r"[.-](?:[IiQqFfBb][A-Za-z0-9_]*\d[A-Za-z0-9_]*)$", "", stem) or stem


def _f32(v: Any) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(v)))


def gguf_hf_config(meta: dict, tensor_names: set[str], tensor_types: list[int]) -> dict:
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ModelSourceError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)}).")
    p = arch + "."
    cls, model_type = _MIXTRAL if arch == "llama" and meta.get(p + "expert_count") else _ARCHS[arch]
    hidden = int(meta[p + "embedding_length"])
    heads = int(meta[p + "attention.head_count"])
    kv = meta.get(p + "attention.head_count_kv", heads)
    if isinstance(kv, list):  # per-layer list in some files; uniform for the families we serve
        kv = max(kv)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = int(meta.get(p + "vocab_size", len(tokens)) or len(tokens))
    if tokens:
        vocab = len(tokens)
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    rope_scaling = None
    stype = meta.get(p + "rope.scaling.type")
    if stype and stype != "none":
        rope_scaling = {"rope_type": stype, "factor": _f32(meta.get(p + "rope.scaling.factor", 1.0))}
        orig = meta.get(p + "rope.scaling.original_context_length")
        if orig:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    if any(t in (GGMLType.F32,) for t in tensor_types) and all(
            t in (GGMLType.F32,) for t in tensor_types):
        dtype = "float32"
    elif any(t == GGMLType.F16 for t in tensor_types) and not any(t == GGMLType.BF16 for t in tensor_types):
        dtype = "float16"
    else:
        dtype = "bfloat16"
    cfg = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": _f32(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(meta.get(p + "rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(meta.get(p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if arch in ("qwen2",):
        cfg["attention_bias"] = True
    elif any(n.endswith("attn_q.bias") for n in tensor_names):
        cfg["attention_bias"] = True
    cfg.update(_moe_config(meta, arch, tensor_names, cfg["num_hidden_layers"]))
    return cfg


def _moe_config(meta: dict, arch: str, tensor_names: set[str], layers: int) -> dict:
    """The mixture-of-experts keys of the HF config, named as its config.json names them ({} for
    a dense model). Mixtral's experts are feed_forward_length wide and route in every layer."""
    p = arch + "."
    experts = int(meta.get(p + "expert_count") or 0)
    if not experts:
        return {}
    top_k = int(meta[p + "expert_used_count"])
    if arch == "llama":
        return {"num_local_experts": experts, "num_experts_per_tok": top_k}
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(meta[p + "expert_feed_forward_length"]),
        "shared_expert_intermediate_size": int(meta.get(p + "expert_shared_feed_forward_length") or 0),
        # a file that states it (llama.cpp's key for the families that vary) is taken at its word
        "norm_topk_prob": bool(meta.get(p + "expert_weights_norm", _NORM_TOPK_PROB[arch])),
        # a layer without a router is dense (HF's mlp_only_layers); llama.cpp writes none such
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
    }


def _unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of Q/K rows: per head, rows were reordered from
    [first half | second half] to interleaved pairs; put them back."""
    rows = t.shape[0]
    head_dim = rows // n_head
    rest = t.shape[1:]
    return t.reshape(n_head, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def _make_ref(info: GGUFTensorInfo, permute_heads: int | None, hf_shape: tuple[int, ...] | None = None) -> WeightRef:
    """``hf_shape``: the HF tensor's shape where it differs from the file's by unit dimensions."""
    dtype = _NATIVE_TORCH.get(info.ggml_type, torch.float32)
    shape = info.shape

    def load(slices: tuple[slice, ...] | None) -> torch.Tensor:
        rows = None
        rest = slices
        if slices and isinstance(slices[0], slice) and slices[0].step in (None, 1) and len(shape) >= 2:
            start, stop, _ = slices[0].indices(shape[0])
            head_dim = shape[0] // permute_heads if permute_heads else 1
            if stop > start and start % head_dim == 0 and stop % head_dim == 0:
                rows = (start, stop)
                rest = (slice(None),) + tuple(slices[1:])
        t = info.load(rows)
        if permute_heads:
            n = permute_heads if rows is None else (rows[1] - rows[0]) // (shape[0] // permute_heads)
            t = _unpermute_rows(t, n)
        if hf_shape is not None:
            t = t.reshape(hf_shape)
        return apply_slices(t, rest)

    return WeightRef(hf_shape or shape, dtype, load)


# Linear layers' matrices, and the output matrix (layers/embedding.py ParallelLMHead): kept in
# their quantized blocks when their type is in _SPLIT.
_LINEARS = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                         "lm_head"))


def _make_quant_ref(info: GGUFTensorInfo, permute_heads: int | None) -> QuantRef:
    def read() -> QuantizedTensor:
        qt = split_tensor(info.raw(), info.ggml_type, info.shape)
        return qt.map_rows(lambda t: _unpermute_rows(t, permute_heads)) if permute_heads else qt

    return QuantRef(read, f"GGUF {info.type_name} {info.name}", info.shape)


def _kept_quantized(hf_name: str, info: GGUFTensorInfo) -> bool:
    """A linear matrix, or a stack of experts' matrices ([E, rows, cols], one per expert), in a
    type kvship serves in its blocks: dense layers with kernels/quant_linear.py, experts with
    kernels/fused_moe.py. The router (mlp.gate) is not among them: it stays 16-bit."""
    return hf_name.endswith(_LINEARS) and info.ggml_type in _SPLIT and len(info.shape) == (3 if "{}" in hf_name else 2)


# A mixture-of-experts layer's tensors (llama.cpp's name -> HF's below model.layers.N): the router,
# Qwen2-MoE's shared expert and its sigmoid gate, and the experts, stacked in one 3-D tensor each
# ("{}": the expert). Mixtral's block_sparse_moe is called mlp, as the model's loader calls it.
_MOE_PARTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
_MOE_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")
# Mixtral files converted before llama.cpp stacked the experts hold one matrix per expert
# ("blk.N.ffn_gate.E.weight"); llama.cpp still reads them.
_SPLIT_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


def _hf_name(gname: str) -> str | None:
    m = _SPLIT_EXPERT.match(gname)
    if m:
        return f"model.layers.{m[1]}.mlp.experts.{m[3]}.{m[2]}_proj.weight"
    m = _MOE_TENSOR.match(gname)
    part = _MOE_PARTS.get(m[2]) if m else None
    return f"model.layers.{m[1]}.{part}.weight" if part else gguf_to_hf_name(gname)


def _expert(info: GGUFTensorInfo, e: int) -> GGUFTensorInfo:
    """Expert ``e``'s matrix of a stacked [E, rows, cols] tensor: the 2-D tensor its bytes form
    (contiguous in the file), so that a rank reads only its rows of it."""
    size = info.nbytes // info.dims[2]
    return replace(info, name=f"{info.name}[{e}]", dims=info.dims[:2], offset=info.offset + e * size, nbytes=size)


def _refs(hf: str, info: GGUFTensorInfo, permute_heads: int | None, kept: bool) -> Iterator[tuple[str, Any]]:
    """The HF tensors one GGUF tensor holds: one per expert for stacked experts (each goes to
    MoEExperts.weight_loader under its checkpoint name, as from safetensors), else itself."""
    if "{}" in hf:
        for e in range(info.shape[0]):
            yield hf.format(e), _make_quant_ref(_expert(info, e), None) if kept else _make_ref(_expert(info, e), None)
    elif kept:
        yield hf, _make_quant_ref(info, permute_heads)
    else:  # Qwen2-MoE's shared expert gate is a [H] vector in files, a [1, H] matrix in HF
        yield hf, _make_ref(info, permute_heads, (1, info.shape[-1]) if hf.endswith("shared_expert_gate.weight") else None)


def _describe(gnames: set[str], tensors: dict[str, GGUFTensorInfo]) -> str:
    """GGUF tensor names with their layer folded: "blk.*.ffn_up_exps.weight Q4_K (48 layers)"."""
    groups = Counter((re.sub(r"^blk\.\d+\.", "blk.*.", g), tensors[g].type_name) for g in gnames)
    return ", ".join(f"{n} {t}" + (f" ({c} layers)" if c > 1 else "") for (n, t), c in sorted(groups.items())) or "none"


def _log_storage(tensors: dict[str, GGUFTensorInfo], kept: set[str]) -> None:
    expanded = {g for g, t in tensors.items() if g not in kept and t.ggml_type not in _NATIVE_TORCH}
    if kept:
        log.info("GGUF: %d linear matrices stay quantized (%s); dequantized at load: %s", len(kept),
                 ", ".join(sorted({tensors[g].type_name for g in kept})), _describe(expanded, tensors))
    elif expanded:
        log.info("GGUF: dequantized at load: %s", _describe(expanded, tensors))


def load_gguf(path: str) -> ModelSource:
    if not os.path.isfile(path):
        raise ModelSourceError(f"GGUF file {path!r} does not exist; check the path.")
    files = [GGUFFile(p) for p in shard_paths(path)]
    meta = dict(files[0].metadata)
    tensors: dict[str, GGUFTensorInfo] = {}
    for f in files:
        tensors.update(f.tensors)
    for k in list(meta):
        if k.startswith("split."):
            meta.pop(k)
    try:
        cfg = gguf_hf_config(meta, set(tensors), [t.ggml_type for t in tensors.values()])
    except KeyError as e:
        raise ModelSourceError(f"GGUF file {path!r} lacks metadata key {e}; is it a complete model?") from None
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    except (KeyError, ValueError) as e:
        raise ModelSourceError(f"GGUF file {path!r} has no usable tokenizer metadata ({e}).") from None
    gen = {k: v for k, v in (("bos_token_id", cfg["bos_token_id"]), ("eos_token_id", cfg["eos_token_id"]))
           if v is not None}
    if tokenizer.eos_token_ids and len(tokenizer.eos_token_ids) > 1:
        gen["eos_token_id"] = sorted(tokenizer.eos_token_ids)
    arch = meta["general.architecture"]
    permute = arch in _PERMUTED_ARCHS
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = {g: _hf_name(g) for g in tensors}
    kept = {g for g, hf in names.items() if hf is not None and _kept_quantized(hf, tensors[g])}
    if kept:
        cfg["quantization_config"] = {"quant_method": "gguf"}
    _log_storage(tensors, kept)
    # A tied output matrix is the token embedding: lookups need it dequantized, and the LM head
    # also gets it in its blocks (layers/embedding.py ParallelLMHead.load_quantized_copy).
    embed = tensors.get("token_embd.weight")
    tied_head = cfg["tie_word_embeddings"] and embed is not None and _kept_quantized("lm_head.weight", embed)
    if tied_head:
        log.info("GGUF: the tied output matrix (token_embd.weight %s) is also kept in its blocks for the "
                 "LM head", embed.type_name)

    def weights() -> Iterator[tuple[str, WeightRef]]:
        for gname, info in tensors.items():
            hf = names[gname]
            if hf is None:
                if gname not in ("rope_freqs.weight",):
                    log.warning("GGUF tensor %s has no known HF name; skipped", gname)
                continue
            heads = None
            if permute and hf.endswith(("q_proj.weight", "q_proj.bias")):
                heads = n_head
            elif permute and hf.endswith(("k_proj.weight", "k_proj.bias")):
                heads = n_kv
            yield from _refs(hf, info, heads, gname in kept)
            if tied_head and gname == "token_embd.weight":
                yield "lm_head.weight", _make_quant_ref(info, None)

    return ModelSource(name=gguf_model_name(path), path=path, hf_config=cfg, generation_config=gen,
                       tokenizer=tokenizer, _weights=weights)
