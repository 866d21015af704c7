"""y = x @ W^T for NVFP4 weights (W4A16): e2m1 codes two a byte [N, K/2] (input 2j in the low
nibble, 2j + 1 in the high one) and float32 scales [N, K/16] (the FP8 block scale times the
global factor, kvship.quant.nvfp4), decoded in registers; nothing 16-bit is written.

One kernel for every row count: [BLOCK_M, BLOCK_N] output tiles over K, each weight tile decoded
by kernels/fp4.py (e2m1 nibbles back in input order, scaled per 16 inputs) and fed to the tensor
cores in x's dtype (Hopper has no FP4 MMA).
``nvfp4_linear_torch`` (decode, F.linear) is the reference and the CPU path."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvship.kernels._triton import tl, triton, use_triton
from kvship.kernels.fp4 import nvfp4_tile
from kvship.kernels.numerics import exact_dot
from kvship.quant.tensor import e2m1_values

GROUP = 16  # inputs per scale


def dequantize_nvfp4_torch(qweight: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """[N, K] float32."""
    codes = torch.stack((qweight & 15, qweight >> 4), -1).view(qweight.shape[0], -1)[:, :k]
    return e2m1_values(codes) * scales.float().repeat_interleave(GROUP, dim=1)[:, :k]


def nvfp4_linear_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, k: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_nvfp4_torch(qweight, scales, k).to(x.dtype), bias)


@triton.jit
def _nvfp4_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, M, N, K, stride_x, stride_y, stride_w, stride_s,
                  HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = offs_m < M, offs_n < N
    n64 = offs_n.to(tl.int64)
    w_rows, s_rows = w_ptr + n64 * stride_w, s_ptr + n64 * stride_s
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dt = x_ptr.dtype.element_ty
    for k0 in range(0, K, BLOCK_K):
        w = nvfp4_tile(w_rows, s_rows, nmask, k0, K, GROUP, BLOCK_N, BLOCK_K)
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_x + kk[None, :],
                    mask=mmask[:, None] & (kk < K)[None, :], other=0.0)
        acc = exact_dot(a, tl.trans(w.to(dt)), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def nvfp4_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, k: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m > 0:
        # decode-sized batches take narrow row tiles (the tensor cores' least), prefill wider ones
        block_m, block_n, block_k = (16, 64, 128) if m <= 16 else (64, 128, 64)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _nvfp4_kernel[grid](x2, qweight, scales, bias if bias is not None else scales, y, m, n, k,
                            x2.stride(0), y.stride(0), qweight.stride(0), scales.stride(0),
                            HAS_BIAS=bias is not None, GROUP=GROUP, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                            num_warps=4, num_stages=3)
    return y.view(*shape[:-1], n)


def nvfp4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, k: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x):
        return nvfp4_linear_triton(x, qweight, scales, k, bias)
    return nvfp4_linear_torch(x, qweight, scales, k, bias)
