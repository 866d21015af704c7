"""RMSNorm, plain, fused with the residual add, and gated (Gated DeltaNet's output norm).

``rms_norm_torch`` / ``fused_add_rms_norm_torch`` are the references (and the CPU path);
``rms_norm_triton`` / ``fused_add_rms_norm_triton`` are one-pass Triton kernels (one program
per row); ``rms_norm`` / ``fused_add_rms_norm`` pick one by device. Statistics in fp32, output
in the input dtype. The fused variant returns ``(normed, new_residual)`` with
``new_residual = x + residual`` rounded to the input dtype (what an unfused model computes).
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import next_pow2, pdl_launch, pdl_wait, tl, triton, use_triton


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_torch(new_residual, weight, eps), new_residual


@triton.jit
def rms_rstd(sum_sq, eps, N):
    """1 / rms from a row's sum of squares over N elements, the arithmetic every norm kernel
    shares (this one's, the fused all-reduce norm's and rotary's per-head q/k norm): one rounding
    of the mean, a square root and a division, as the unfused kernels always computed it."""
    return 1.0 / tl.sqrt(sum_sq / N + eps)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        x = x + r
        x_round = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x_round, mask=mask)
        x = x_round.to(tl.float32)
    rstd = rms_rstd(tl.sum(x * x, axis=0), eps, N)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps):
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = next_pow2(n)
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    else:
        r2, res_out = x2, out
    if rows > 0:
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps, **pdl_launch(x2),
        )
    if residual is not None:
        return out.view(shape), res_out.view(shape)
    return out.view(shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_torch(x, residual, weight, eps)


def gated_rms_norm_torch(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                         dtype: torch.dtype) -> torch.Tensor:
    """Gated DeltaNet's output norm: ``o`` [..., D] rounded to ``dtype``, RMS-normed per row
    (times ``weight``), then times silu(z) in float32; ``z`` has o's shape."""
    normed = rms_norm_torch(o.to(dtype), weight, eps)
    return (normed.float() * torch.nn.functional.silu(z.float())).to(dtype)


@triton.jit
def _gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, H, so, sz, sout, N, eps, BLOCK: tl.constexpr):
    """One row (token, head): the roundings of the torch reference, in one pass."""
    row = tl.program_id(0).to(tl.int64)
    t, h = row // H, row % H
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = out_ptr.dtype.element_ty
    x = tl.load(o_ptr + t * so + h * N + offs, mask=mask, other=0.0).to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * rms_rstd(tl.sum(x * x, axis=0), eps, N) * w).to(dt).to(tl.float32)
    z = tl.load(z_ptr + t * sz + h * N + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * sout + h * N + offs, (y * z * tl.sigmoid(z)).to(dt), mask=mask)


def gated_rms_norm_triton(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          dtype: torch.dtype) -> torch.Tensor:
    """``o`` [T, H, D] (any float dtype, rows contiguous per token), ``z`` [T, H * D] (a view
    into in_proj's output is fine) -> [T, H * D] in ``dtype``."""
    t, h, n = o.shape
    assert o.stride(2) == 1 and o.stride(1) == n and z.stride(-1) == 1
    out = torch.empty(t, h * n, dtype=dtype, device=o.device)
    if t:
        _gated_rms_norm_kernel[(t * h,)](o, z, weight, out, h, o.stride(0), z.stride(0), out.stride(0), n, eps,
                                         BLOCK=next_pow2(n), num_warps=1 if n <= 256 else 4)
    return out


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    if use_triton(o):
        return gated_rms_norm_triton(o, z, weight, eps, dtype)
    t, h, n = o.shape
    return gated_rms_norm_torch(o, z.reshape(t, h, n), weight, eps, dtype).reshape(t, h * n)
