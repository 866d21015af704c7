"""ggml's tensor types and their blocks: each type's block size and bytes, the types kvship
keeps quantized split into codes, scales and offsets (kvship's canonical QuantizedTensor), and
vectorised dequantization of the common llama.cpp types to float32.

Block layouts: ggml's ggml-common.h (block_q4_0 ... block_q6_K). ``raw`` is always a uint8 array
holding whole blocks of one tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvship.quant import QuantizedTensor
from kvship.quant.tensor import code_centre

from .errors import ModelSourceError


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
    MXFP4 = 39  # gpt-oss's experts: read by loader/gguf_gpt_oss.py, kept MXFP4


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
    GGMLType.MXFP4: ("MXFP4", 32, 17),
}

NATIVE_TORCH = {
    GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16,
    GGMLType.F64: torch.float64, GGMLType.I8: torch.int8, GGMLType.I16: torch.int16,
    GGMLType.I32: torch.int32, GGMLType.I64: torch.int64,
}


# dequantization: the result is flat float32.

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


SPLITTABLE = {
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
    **{t: (lambda raw, split=split: _combine(split(raw))) for t, split in SPLITTABLE.items()},
}


def split_tensor(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> QuantizedTensor:
    """A 2-D tensor of a type in SPLITTABLE as kvship's canonical quantized tensor (no dequantization)."""
    sp = SPLITTABLE[ggml_type](np.asarray(raw, dtype=np.uint8).reshape(-1))
    n = shape[0]
    scales = torch.from_numpy(np.ascontiguousarray(sp.scales)).reshape(n, -1)
    offsets = None if sp.offsets is None else torch.from_numpy(np.ascontiguousarray(sp.offsets)).reshape(n, -1)
    return QuantizedTensor(torch.from_numpy(np.ascontiguousarray(sp.codes)).reshape(shape), scales, offsets,
                           sp.bits, sp.group)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes of a tensor of `ggml_type` -> a CPU tensor of `shape` (torch order).

    Quantized types come back as float32; float and integer types keep their own dtype."""
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if ggml_type in NATIVE_TORCH:
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

