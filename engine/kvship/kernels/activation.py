"""SiLU-and-multiply (the gated MLP's activation): x [T, 2I] -> silu(x[:, :I]) * x[:, I:].

``silu_and_mul_torch`` is the reference (and the CPU path), ``silu_and_mul_triton`` the kernel,
``silu_and_mul`` picks one by device. Math in fp32, output in the input dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvship.kernels._triton import tl, triton, use_triton


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    i = x.shape[-1] // 2
    return (F.silu(x[..., :i].float()) * x[..., i:].float()).to(x.dtype)


@triton.jit
def silu_mul(a, b):
    """silu(a) * b in fp32, for any kernel that applies the gated activation on the fly."""
    a = a.to(tl.float32)
    return a / (1.0 + tl.exp(-a)) * b.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_inter
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    b = tl.load(x_ptr + row * stride_x + n_inter + offs, mask=mask, other=0.0)
    y = silu_mul(a, b)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    i = shape[-1] // 2
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, i), dtype=x.dtype, device=x.device)
    block = 1024
    if rows > 0:
        _silu_and_mul_kernel[(rows, triton.cdiv(i, block))](
            x2, out, x2.stride(0), out.stride(0), i, BLOCK=block, num_warps=4
        )
    return out.view(*shape[:-1], i)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)
