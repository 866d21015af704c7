"""y = x @ W^T for NVFP4 weights (W4A16): e2m1 codes two a byte [N, K/2] (input 2j in the low
nibble, 2j + 1 in the high one) and float32 scales [N, K/16] (the FP8 block scale times the
global factor, kvship.quant.nvfp4), decoded in registers; nothing 16-bit is written.

One kernel for every row count: [BLOCK_M, BLOCK_N] output tiles over K, each weight tile's
nibbles decoded (sign bit 3, exponent bits 1-2, mantissa bit 0), interleaved back into input
order, scaled per 16 inputs and fed to the tensor cores in x's dtype (Hopper has no FP4 MMA).
``nvfp4_linear_torch`` (decode, F.linear) is the reference and the CPU path."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvship.kernels._triton import tl, triton, use_triton
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
def _e2m1(c):
    """Codes 0..15 -> fp32 values: magnitude (1 + m / 2) * 2 ** (e - 1), or m / 2 when e is 0."""
    mag = c & 7
    e = (mag >> 1).to(tl.float32)
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0.0, 0.5 * m, tl.exp2(e - 1.0) * (1.0 + 0.5 * m))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _nvfp4_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, M, N, K, KP, stride_x, stride_y, stride_w, stride_s,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_K counts stored bytes (2 * BLOCK_K inputs, 2 * BLOCK_K / 16 scales a row)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = offs_m < M, offs_n < N
    NG: tl.constexpr = 2 * BLOCK_K // 16
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dt = x_ptr.dtype.element_ty
    for kp0 in range(0, KP, BLOCK_K):
        offs = kp0 + tl.arange(0, BLOCK_K)
        q = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs[None, :],
                    mask=nmask[:, None] & (offs < KP)[None, :], other=0)
        w = tl.reshape(tl.join(_e2m1(q & 15), _e2m1(q >> 4)), [BLOCK_N, 2 * BLOCK_K])  # input order
        gs = 2 * kp0 // 16 + tl.arange(0, NG)
        s = tl.load(s_ptr + offs_n[:, None].to(tl.int64) * stride_s + gs[None, :],
                    mask=nmask[:, None] & (gs * 16 < K)[None, :], other=0.0)
        w = tl.reshape(tl.reshape(w, [BLOCK_N, NG, 16]) * s[:, :, None], [BLOCK_N, 2 * BLOCK_K])
        kk = 2 * kp0 + tl.arange(0, 2 * BLOCK_K)
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
        block_m, block_n, block_k = (16, 64, 64) if m <= 16 else (64, 128, 32)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _nvfp4_kernel[grid](x2, qweight, scales, bias if bias is not None else scales, y, m, n, k,
                            qweight.shape[1], x2.stride(0), y.stride(0), qweight.stride(0), scales.stride(0),
                            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                            num_warps=4, num_stages=3)
    return y.view(*shape[:-1], n)


def nvfp4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, k: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x):
        return nvfp4_linear_triton(x, qweight, scales, k, bias)
    return nvfp4_linear_torch(x, qweight, scales, k, bias)
