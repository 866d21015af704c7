"""Quantized weight matrices in one canonical form, whatever format they came from.

A weight W [N, K] (output features, input features) is held as codes with a scale and an
optional offset per group of inputs of each row:

    W[n, k] = codes[n, k] * scales[n, g(k)] + biases[n, g(k)]      g(k) = k // group_size, or g_idx[k]

or, for symmetric integer codes (no biases), W[n, k] = (codes[n, k] - 2**(bits - 1)) * scales[n, g(k)],
or, for e2m1 codes (NVFP4: 4-bit floats, sign in bit 3), W[n, k] = E2M1[codes[n, k]] * scales[n, g(k)].

GPTQ and AWQ (bias = -zero * scale), compressed-tensors, block-wise FP8 (a 128 x 128 block's
scale repeated over its rows), GGUF k-quants (bias = -min) and in-situ quantization all land
here without loss, so one set of kernels serves every format, and tensor-parallel sharding is
plain row or column slicing. The device layout (kvship.quant.layout) packs this form.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedTensor:
    codes: torch.Tensor  # [N, K]: uint8 integer codes in [0, 2**bits), or float8_e4m3fn values
    scales: torch.Tensor  # [N, groups] float32
    biases: torch.Tensor | None  # [N, groups] float32; None: symmetric (integer codes centred on 2**(bits-1))
    bits: int  # 4 or 8 (integer codes), 8 for FP8 codes
    group_size: int  # inputs per group; the full K for one scale per row
    g_idx: torch.Tensor | None = None  # [K] int32 group of each input (GPTQ act-order); None: k // group_size
    e2m1: bool = False  # 4-bit float codes (NVFP4), the values E2M1[code]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def is_fp8(self) -> bool:
        return self.codes.dtype == torch.float8_e4m3fn

    def rows(self, start: int, size: int) -> "QuantizedTensor":
        """Output features [start, start + size) (a column-parallel shard, or one of q/k/v)."""
        s = slice(start, start + size)
        return QuantizedTensor(self.codes[s], self.scales[s], None if self.biases is None else self.biases[s],
                               self.bits, self.group_size, self.g_idx, self.e2m1)

    def map_rows(self, fn) -> "QuantizedTensor":
        """The same tensor with ``fn`` (a reordering of the first dimension) applied to every row-indexed part."""
        return QuantizedTensor(fn(self.codes), fn(self.scales), None if self.biases is None else fn(self.biases),
                               self.bits, self.group_size, self.g_idx, self.e2m1)

    def cols(self, start: int, size: int) -> "QuantizedTensor":
        """Input features [start, start + size) (a row-parallel shard). Groups must not be split:
        a shard that starts or ends inside a group has no scale of its own."""
        k = self.codes.shape[1]
        codes = self.codes[:, start:start + size]
        if self.g_idx is not None:  # act-order: every group's scale stays, the shard's inputs point into them
            return QuantizedTensor(codes, self.scales, self.biases, self.bits, self.group_size,
                                   self.g_idx[start:start + size])
        g = self.group_size
        if g >= k:  # one scale per row applies to any subset of the row
            return QuantizedTensor(codes, self.scales, self.biases, self.bits, size, e2m1=self.e2m1)
        if start % g or (size % g and start + size != k):
            raise ValueError(f"a tensor-parallel shard of inputs [{start}, {start + size}) would split a "
                             f"quantization group of {g} inputs; use a tensor-parallel size that divides "
                             f"the {k // g} groups")
        gs = slice(start // g, -(-(start + size) // g))
        return QuantizedTensor(codes, self.scales[:, gs], None if self.biases is None else self.biases[:, gs],
                               self.bits, g, e2m1=self.e2m1)

    def group_index(self) -> torch.Tensor:
        """[K] the group of each input."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.codes.shape[1], device=self.codes.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        gi = self.group_index()
        if self.e2m1:
            return (e2m1_values(self.codes) * self.scales.float()[:, gi]).to(dtype)
        codes = self.codes.float()
        centre = code_centre(self.bits, self.is_fp8, self.biases is not None)
        if centre:
            codes -= centre
        w = codes * self.scales.float()[:, gi]
        if self.biases is not None:
            w += self.biases.float()[:, gi]
        return w.to(dtype)



# e2m1 (OCP FP4): sign bit 3, then 2 exponent bits (bias 1) and 1 mantissa bit; exponent 0 is 0 or 0.5
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (one a byte, 0..15) -> float32 values."""
    return torch.tensor(E2M1, dtype=torch.float32, device=codes.device)[codes.long()]


def code_centre(bits: int, fp8: bool = False, biased: bool = False) -> int:
    """The code that stands for zero: 2**(bits - 1) for symmetric integer codes (no biases), 0
    for FP8 codes (they are the values) and for codes whose offset is stored (biases)."""
    return 0 if fp8 or biased else 1 << (bits - 1)


def groups(k: int, group_size: int) -> int:
    return -(-k // group_size)


def widened(t: QuantizedTensor, bits: int, group: int, explicit_bias: bool) -> QuantizedTensor:
    """The same values with ``bits``-bit codes, groups of ``group`` (a divisor of t's) and, if
    asked, the offset stored explicitly instead of implied by symmetric codes."""
    codes, biases = t.codes, t.biases
    if t.e2m1:
        if (bits, group, explicit_bias) != (t.bits, t.group_size, False):
            raise ValueError("e2m1 (NVFP4) codes cannot be widened into integer codes")
        return t
    if t.bits != bits and biases is None:  # symmetric: re-centre the codes on the wider middle
        codes = (codes.to(torch.int16) + (code_centre(bits) - code_centre(t.bits))).to(torch.uint8)
    scales = t.scales
    if explicit_bias and biases is None:
        biases = -float(code_centre(bits)) * scales
    if group != t.group_size:
        rep = t.group_size // group
        scales = scales.repeat_interleave(rep, 1)[:, :groups(codes.shape[1], group)]
        biases = None if biases is None else biases.repeat_interleave(rep, 1)[:, :scales.shape[1]]
    return QuantizedTensor(codes, scales, biases, bits, group, t.g_idx)


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """One tensor of the parts' rows in order (q, k, v). Parts stored differently (a GGUF Q4_K_M
    file keeps some v projections in Q6_K) are widened to the finest of them: more bits,
    smaller groups, explicit offsets."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if any(p.is_fp8 != first.is_fp8 for p in parts):
        raise ValueError("a fused layer mixes FP8 and integer quantized tensors")
    if any(p.e2m1 != first.e2m1 or (p.e2m1 and p.group_size != first.group_size) for p in parts):
        raise ValueError("a fused layer mixes NVFP4 tensors with tensors stored otherwise")
    if any((p.g_idx is None) != (first.g_idx is None) or (p.g_idx is not None and not torch.equal(p.g_idx, first.g_idx))
           for p in parts):
        raise ValueError("a fused layer's quantized tensors have different act-order group tables")
    bits = max(p.bits for p in parts)
    group = min(p.group_size for p in parts)
    if any(p.group_size % group for p in parts):
        raise ValueError(f"a fused layer's quantized tensors have group sizes {sorted({p.group_size for p in parts})} "
                         "that do not divide one another")
    explicit = any(p.biases is not None for p in parts)
    parts = [widened(p, bits, group, explicit) for p in parts]
    return QuantizedTensor(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           torch.cat([p.biases for p in parts]) if explicit else None, bits, group, first.g_idx,
                           first.e2m1)
