"""Quantized weights on the CPU, multiplied as stored by torch's weight-only kernels with
bfloat16 inputs for the few rows of a decode step, and through a bfloat16 copy by oneDNN's GEMM
for more rows (prefill), where those kernels' cost grows with every row while a GEMM's barely does.

- ``Int4Groups``: 4-bit codes with a scale and an offset per group of 32 inputs
  (``_weight_int4pack_mm_for_cpu``, half a byte a weight read). A checkpoint's own 4-bit groups
  (the bundled GGUF file's Q4_1, Q4_0, Q4_K, GPTQ/AWQ) map onto it without requantizing.
- ``Int8Rows``: int8 codes with one scale per output row (``_weight_int8pack_mm``, one byte a
  weight): any other format, requantized.

Weight-only, not int8 activations: SmolLM2's activations have outlier channels, and int8
activations with a scale per token cost about 5% of perplexity on the bundled model, where these
weights with bfloat16 inputs stay within 1% of float32. The kernels are fast with bfloat16 inputs
only: a CPU without bfloat16 dot products (AVX512-BF16, AMX) gets int8 rows and a float32 copy.

``quant_linear_reference`` is the product in plain float32 torch, the definition both paths are
tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvship.quant import QuantizedTensor
from kvship.quant.tensor import code_centre

# Rows from which the 2-byte copy's GEMM beats the weight-only kernel, whose time grows with each
# row: the int4 kernel reads half the bytes of the int8 one, so it holds out longer.
GEMM_FROM_ROWS = {"int8": 6, "int4": 12}
INT4_GROUP = 32  # the kernel takes groups of 32, 64, 128 or 256; 32 is the GGUF block
INT4_ROW_MULTIPLE = 16  # its packing needs output rows in multiples of 16


def _dense(w: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    """The matrix's values in float32, whatever it is held as (the source of a requantization)."""
    return (w.dequantize() if isinstance(w, QuantizedTensor) else w).float()


@dataclass
class Int8Rows:
    """W [N, K] as int8 codes [N, K] (symmetric, -127..127) times one float32 scale per row [N]."""

    codes: torch.Tensor
    scales: torch.Tensor
    kind = "int8"

    @classmethod
    def of(cls, w: torch.Tensor | QuantizedTensor) -> "Int8Rows":
        """A float matrix, or a quantized one of any format (a GGUF file's blocks of 32, per-group
        4-bit codes...), requantized with one scale per row."""
        w = _dense(w)
        scales = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
        return cls(torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales[:, None]


@dataclass
class Int4Groups:
    """W [N, K] as codes [N, K] in 0..15 with a scale and an offset per group of 32 inputs of
    each row ([N, K / 32] each): W = (codes - 8) * scales + offsets, the kernel's convention."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    kind = "int4"

    @classmethod
    def of(cls, w: torch.Tensor | QuantizedTensor) -> "Int4Groups | None":
        """A checkpoint's 4-bit integer groups as they are (groups of 32 or a multiple of 32);
        any other matrix quantized with its groups' minimum and maximum. None where the kernel
        cannot take the shape."""
        n, k = w.shape
        if n % INT4_ROW_MULTIPLE or k % INT4_GROUP:
            return None
        if isinstance(w, QuantizedTensor) and exact_int4(w):
            # each group's scale over its blocks of 32 (a last group shorter than the others: cut)
            reps, blocks = (w.group_size if w.group_size < k else k) // INT4_GROUP, k // INT4_GROUP
            scales = w.scales.float().repeat_interleave(reps, 1)[:, :blocks]
            centre = code_centre(4, False, w.biases is not None)
            offsets = (8 - centre) * scales
            if w.biases is not None:
                offsets += w.biases.float().repeat_interleave(reps, 1)[:, :blocks]
            return cls(w.codes.to(torch.uint8), scales, offsets)
        g = _dense(w).view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scales = ((hi - lo) / 15).clamp_min(1e-12)
        codes = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
        return cls(codes, scales, lo + 8 * scales)

    def dequantize(self) -> torch.Tensor:
        g = (self.codes.float() - 8).view(self.codes.shape[0], -1, INT4_GROUP)
        return (g * self.scales[..., None] + self.offsets[..., None]).flatten(1)


def exact_int4(w: QuantizedTensor) -> bool:
    """A checkpoint's 4-bit integer codes whose groups the kernel's groups of 32 tile."""
    k = w.shape[1]
    return (w.bits == 4 and not w.is_fp8 and not w.e2m1 and w.g_idx is None
            and (w.group_size >= k or w.group_size % INT4_GROUP == 0) and k % INT4_GROUP == 0)


def bf16_kernels() -> bool:
    return torch.cpu._is_avx512_bf16_supported()


def gemm_dtype() -> torch.dtype:
    return torch.bfloat16 if bf16_kernels() else torch.float32


def cpu_quant_weight(w: torch.Tensor | QuantizedTensor, fmt: str) -> Int4Groups | Int8Rows:
    """The CPU form of a quantized matrix for ``--cpu-weight-format`` ``fmt``: "auto" keeps a
    checkpoint's 4-bit groups as int4 and requantizes anything else to int8 rows; "int4" and
    "int8" requantize to that form. Int8 where the int4 kernel cannot run."""
    wants_int4 = fmt == "int4" or (fmt == "auto" and isinstance(w, QuantizedTensor) and exact_int4(w))
    if wants_int4 and bf16_kernels():
        int4 = Int4Groups.of(w)
        if int4 is not None:
            return int4
    return Int8Rows.of(w)


class CpuQuantLinear:
    """y = x @ W^T for W held as Int4Groups or Int8Rows (and its GEMM copy)."""

    def __init__(self, w: Int4Groups | Int8Rows) -> None:
        self.kind = w.kind
        self.out_features, self.in_features = w.codes.shape
        self.gemm_from_rows = GEMM_FROM_ROWS[w.kind]
        if w.kind == "int4":
            self.codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32), 1)
            self.scales = torch.stack([w.scales.t(), w.offsets.t()], -1).to(torch.bfloat16).contiguous()
        else:
            self.codes = w.codes.contiguous()
            self.scales = w.scales.to(torch.bfloat16)
        self.gemm_weight = w.dequantize().to(gemm_dtype())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] >= self.gemm_from_rows:
            y = F.linear(x2.to(self.gemm_weight.dtype), self.gemm_weight)
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.codes, INT4_GROUP, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.codes, self.scales)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def quant_linear_reference(x: torch.Tensor, w: Int4Groups | Int8Rows) -> torch.Tensor:
    """x @ W^T with x rounded to bfloat16 (as both paths take it), in float32."""
    return F.linear(x.to(torch.bfloat16).float(), w.dequantize()).to(x.dtype)
