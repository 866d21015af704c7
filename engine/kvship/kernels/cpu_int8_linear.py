"""Quantized weights on the CPU: int8 codes with one scale per output row, multiplied as stored
by torch's weight-only int8 kernel (``_weight_int8pack_mm``) with bfloat16 inputs for the few
rows of a decode step (1 byte a weight read instead of float32's 4), and a bfloat16 copy through
oneDNN's matmul for more rows (prefill), where that kernel's cost grows with every row while a
GEMM's barely does.

Weight-only, not int8 activations: SmolLM2's activations have outlier channels, and int8
activations with a scale per token cost about 5% of perplexity on the bundled model, where these
weights with bfloat16 inputs stay within 1% of float32. Both kernels are fast with bfloat16
inputs only; a CPU without bfloat16 dot products (AVX512-BF16, AMX) gets a float32 copy instead.

``int8_linear_reference`` is the product in plain float32 torch, the definition both paths are
tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvship.quant import QuantizedTensor

# Rows from which the 2-byte copy's GEMM beats the int8 kernel, whose time grows with each row.
GEMM_FROM_ROWS = 6


@dataclass
class Int8Rows:
    """W [N, K] as int8 codes [N, K] (symmetric, -127..127) times one float32 scale per row [N]."""

    codes: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def of(cls, w: torch.Tensor | QuantizedTensor) -> "Int8Rows":
        """A float matrix, or a quantized one of any format (a GGUF file's blocks of 32, per-group
        4-bit codes...), requantized with one scale per row."""
        w = (w.dequantize() if isinstance(w, QuantizedTensor) else w).float()
        scales = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
        return cls(torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales[:, None]


def gemm_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32


class CpuInt8Linear:
    """y = x @ W^T for W held as Int8Rows (and its GEMM copy)."""

    def __init__(self, w: Int8Rows) -> None:
        self.codes = w.codes.contiguous()
        self.scales = w.scales.to(torch.bfloat16)
        self.gemm_weight = w.dequantize().to(gemm_dtype())
        self.out_features, self.in_features = w.codes.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] >= GEMM_FROM_ROWS:
            y = F.linear(x2.to(self.gemm_weight.dtype), self.gemm_weight)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.codes, self.scales)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def int8_linear_reference(x: torch.Tensor, w: Int8Rows) -> torch.Tensor:
    """x @ W^T with x rounded to bfloat16 (as both paths take it), in float32."""
    return F.linear(x.to(torch.bfloat16).float(), w.dequantize()).to(x.dtype)
