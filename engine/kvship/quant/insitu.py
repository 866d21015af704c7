"""In-situ quantization (``kvship serve --quantization``): a float weight becomes a
QuantizedTensor as it is loaded, one matrix at a time, on the device it will live on, so the
model never holds more than one matrix in 16 bits.

- fp8: one scale per output row (amax / 448), FP8 E4M3 codes; W8A8 on GPUs with FP8 tensor cores.
- int8: one scale per output row (amax / 127), symmetric codes, weight-only.
- int4: a scale and an offset per group of 128 inputs (min/max, asymmetric: the offset keeps
  groups whose values are not centred on zero from wasting half of the 16 levels), weight-only.
"""
from __future__ import annotations

import torch

from .tensor import QuantizedTensor

INSITU_METHODS = ("fp8", "int8", "int4")
INT4_GROUP = 128
# 0: fp8 takes a scale per output row. A block size (the benchmarks' "fp8-block"): a scale per
# block of FP8_BLOCK x FP8_BLOCK, the layout block-wise FP8 checkpoints (DeepSeek-V3, Qwen3-FP8)
# load into, for matrices whose sides are whole blocks.
FP8_BLOCK = 0
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize(w: torch.Tensor, method: str) -> QuantizedTensor:
    w = w.float()
    if method == "fp8" and FP8_BLOCK and w.shape[0] % FP8_BLOCK == 0 and w.shape[1] % FP8_BLOCK == 0:
        return quantize_fp8_blocks(w, FP8_BLOCK)
    if method == "fp8":
        scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedTensor(codes, scale, None, 8, w.shape[1])
    if method == "int8":
        scale = (w.abs().amax(1, keepdim=True) / 127.0).clamp_min(1e-12)
        codes = (torch.round(w / scale).clamp(-127, 127) + 128).to(torch.uint8)
        return QuantizedTensor(codes, scale, None, 8, w.shape[1])
    if method == "int4":
        return quantize_groups(w, 4, INT4_GROUP)
    raise ValueError(f"unknown in-situ quantization {method!r}; choose one of {', '.join(INSITU_METHODS)}")


def quantize_fp8_blocks(w: torch.Tensor, block: int) -> QuantizedTensor:
    """FP8 codes with a scale per block x block tile (amax / 448), held as quant/formats.py holds
    a block-wise checkpoint's: each block's scale repeated over its rows, groups of ``block``."""
    n, k = w.shape
    scale = (w.view(n // block, block, k // block, block).abs().amax((1, 3)) / FP8_MAX).clamp_min(1e-12)
    rows = scale.repeat_interleave(block, 0)
    codes = (w / rows.repeat_interleave(block, 1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedTensor(codes, rows.contiguous(), None, 8, block)


def quantize_groups(w: torch.Tensor, bits: int, group: int) -> QuantizedTensor:
    """Asymmetric min/max codes per group of ``group`` inputs (the last group may be shorter)."""
    n, k = w.shape
    pad = -k % group
    wp = torch.nn.functional.pad(w.float(), (0, pad)).view(n, -1, group)
    if pad:  # the padding must not widen the last group's range: repeat its first value
        wp[:, -1, group - pad:] = wp[:, -1, :1]
    lo, hi = wp.amin(2), wp.amax(2)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).clamp_min(1e-12)
    codes = torch.round((wp - lo[..., None]) / scale[..., None]).clamp(0, levels).to(torch.uint8)
    return QuantizedTensor(codes.view(n, -1)[:, :k].contiguous(), scale, lo, bits, group)
