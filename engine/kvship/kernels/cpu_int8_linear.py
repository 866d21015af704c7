"""Integer weight products on the CPU: int8 weights with one scale per output row, multiplied
as stored by torch's weight-only int8 kernel (``_weight_int8pack_mm``) with bfloat16 inputs.
A decode step reads 1 byte a weight instead of float32's 4.

Weight-only, not int8 activations: SmolLM2's activations have outlier channels, and int8
activations with a scale per token cost about 5% of perplexity on the bundled model, where these
weights with bfloat16 inputs stay within 1% of float32. The kernel is fast with bfloat16 inputs
only (float32 ones take a slow path).

``int8_linear_reference`` is the same product in plain float32 torch, the definition the kernel
is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvship.quant import QuantizedTensor


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


class CpuInt8Linear:
    """y = x @ W^T for W held as Int8Rows."""

    def __init__(self, w: Int8Rows) -> None:
        self.codes = w.codes.contiguous()
        self.scales = w.scales.to(torch.bfloat16)
        self.out_features, self.in_features = w.codes.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.codes, self.scales)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def int8_linear_reference(x: torch.Tensor, w: Int8Rows) -> torch.Tensor:
    """x @ W^T with x rounded to bfloat16 (as the kernel takes it), in float32."""
    return F.linear(x.to(torch.bfloat16).float(), w.dequantize()).to(x.dtype)
