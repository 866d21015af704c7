"""A few rows (decode batches of 1 to 16) times FP8 weights on FP8 tensor cores: W8A8 with the
activations quantized per 128 inputs of each row inside the kernel.

The one-row kernels of kernels/quant_linear.py and kernels/quant_gemv.py turn every FP8 weight
into fp32 before its FMA; on the H200 that conversion (two per weight on the conversion unit,
which runs at 1/8 of the FMA rate) held them to about 60% of copy bandwidth. Tensor cores take
FP8 as it is stored. The product is computed transposed, y^T [N, 16] = W [N, K] @ x^T [K, 16]
(the rows of x, up to 16, padded to the 16 columns a tensor-core tile needs; "swap AB"), so
that the weights fill the tiles' large dimension and stream through shared memory into the
tensor cores without passing through registers.

Activations: each row's inputs are quantized per block of 128 (scale = the block's amax / 448,
``quantize_fp8_blocks_torch``, which W8A8 for many rows uses per whole row), inside the kernel, tile by tile: the
K tile is 128 wide, so each tile's dot gets one scale per row, applied to its fp32 result, and
one weight scale per output row (per-channel weights) or per row and tile (128 x 128 block
scales). The reference is ``fp8_gemv_torch``: the same quantization of x, then an fp32 matmul
of the dequantized operands.
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import tl, triton
from kvship.kernels.kv_quant import fp8_round
from kvship.quant.insitu import FP8_MAX

ACT_BLOCK = 128  # inputs per activation scale; also the kernel's K tile
MAX_ROWS = 16  # rows of x one launch takes (a tensor-core tile's columns)


def quantize_fp8_blocks_torch(x2: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activations: x2 [M, K] -> (codes [M, K] float8_e4m3fn, scales [M, ceil(K / block)]
    float32) with x2 ~= codes * scale of the code's block; a block's scale is its amax / 448 (at
    least 1e-12, so that a block of zeros divides to zeros), and x / scale is rounded to
    nearest, ties to even. A short last block is padded with zeros."""
    m, k = x2.shape
    nb = -(-k // block)
    xf = torch.nn.functional.pad(x2.float(), (0, nb * block - k)).view(m, nb, block)
    scale = (xf.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    codes = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(m, -1)[:, :k], scale


def fp8_gemv_torch(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] quantized per 128 inputs @ W^T, W = codes [N, K] (float8_e4m3fn) *
    scales [N, G] (G = K / group; group 0: one scale per row), in fp32, returned in x2's dtype."""
    k = x2.shape[1]
    xq, xs = quantize_fp8_blocks_torch(x2, ACT_BLOCK)
    xd = xq.float() * xs.repeat_interleave(ACT_BLOCK, 1)[:, :k]
    ws = scales.float().repeat_interleave(group, 1)[:, :k] if group else scales.float()
    y = xd @ (codes.float() * ws).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x2.dtype)


def fits(m: int, k: int, group: int) -> bool:
    """Whether the kernel takes these shapes: up to 16 rows, whole K tiles, weight blocks that
    tiles lie inside (group 0, or a multiple of 128)."""
    return 1 <= m <= MAX_ROWS and k % ACT_BLOCK == 0 and (group == 0 or group % ACT_BLOCK == 0)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_s, stride_y,
                     GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_ROW: tl.constexpr, BLOCK_N: tl.constexpr):
    BLOCK_K: tl.constexpr = 128  # ACT_BLOCK
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, 16)
    nmask = offs_n < N
    mmask = offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_x + offs_k[:, None]  # x^T tile [BLOCK_K, 16]
    s_rows = s_ptr + offs_n.to(tl.int64) * stride_s
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # x^T's tile, each row's block quantized (rounded in fp32, then an exact cast)
        if ONE_ROW:  # one column of values, the other 15 zeros
            x1 = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
            s1 = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x1), 0), 448.0), 1e-12)
            q1 = fp8_round(tl.math.div_rn(x1, s1), False).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            xq = tl.where(offs_m[None, :] == 0, q1[:, None], 0).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            xs = tl.where(offs_m == 0, s1, 0.0)
        else:
            x = tl.load(x_cols + k0, mask=mmask[None, :], other=0.0).to(tl.float32)
            xs = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), 448.0), 1e-12)  # [16] one per row
            xq = fp8_round(tl.math.div_rn(x, xs[None, :]), False).to(tl.float8e4nv)
        w = tl.load(w_rows + k0, mask=nmask[:, None], other=0.0)
        part = tl.dot(w, xq)  # [BLOCK_N, 16] fp32
        if GROUP > 0:  # a 128 x 128 block's scale for this tile
            ws = tl.load(s_rows + k0 // GROUP, mask=nmask, other=0.0)
            acc += part * ws[:, None] * xs[None, :]
        else:
            acc += part * xs[None, :]
    if GROUP == 0:
        acc = acc * tl.load(s_rows, mask=nmask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + offs_m[None, :].to(tl.int64) * stride_y + offs_n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


# H200 sweep (bench/quant_gemv_sweep.py): see docs/benchmarks.md.
FP8_GEMV_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 4}


def fp8_gemv_triton(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int,
                    bias: torch.Tensor | None = None, config: dict[str, int] | None = None) -> torch.Tensor:
    """Triton twin of ``fp8_gemv_torch`` for ``fits`` shapes (x2 [M <= 16, K] 16-bit, contiguous rows)."""
    cfg = config or FP8_GEMV_CONFIG
    m, k = x2.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x2, codes, scales, bias if bias is not None else scales, y, m, n, k, x2.stride(0), codes.stride(0),
        scales.stride(0), y.stride(0), GROUP=group, HAS_BIAS=bias is not None, ONE_ROW=m == 1, BLOCK_N=cfg["block_n"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y
