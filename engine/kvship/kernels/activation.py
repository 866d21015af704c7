"""Gated activations (the gated MLP's): x [T, 2I] -> act(x[:, :I]) * x[:, I:], with act SiLU
(Llama and most families) or GELU with the tanh approximation (Gemma's GeGLU,
``gelu_pytorch_tanh``).

``silu_and_mul_torch`` / ``gelu_tanh_and_mul_torch`` are the references (and the CPU path),
``silu_and_mul_triton`` / ``gelu_tanh_and_mul_triton`` the one kernel with the activation
chosen at compile time, ``silu_and_mul`` / ``gelu_tanh_and_mul`` / ``act_and_mul`` pick one by
device. Math in fp32, output in the input dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvship.kernels._triton import pdl_launch, pdl_wait, tl, triton, use_triton

ACTIVATIONS = ("silu", "gelu_tanh")


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    i = x.shape[-1] // 2
    return (F.silu(x[..., :i].float()) * x[..., i:].float()).to(x.dtype)


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    i = x.shape[-1] // 2
    return (F.gelu(x[..., :i].float(), approximate="tanh") * x[..., i:].float()).to(x.dtype)


@triton.jit
def silu_mul(a, b):
    """silu(a) * b in fp32, for any kernel that applies the gated activation on the fly."""
    a = a.to(tl.float32)
    return a / (1.0 + tl.exp(-a)) * b.to(tl.float32)


@triton.jit
def tanh(x):
    """tanh in fp32 from exp (Triton's core language has none): saturates to +-1 without NaN."""
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def gelu_tanh_mul(a, b):
    """gelu_tanh(a) * b in fp32: 0.5 a (1 + tanh(u)) written as a * sigmoid(2u), the same value
    without the cancellation of 1 + tanh(u) for negative u; u = sqrt(2/pi) (a + 0.044715 a^3)."""
    a = a.to(tl.float32)
    u2 = 1.5957691216057308 * (a + 0.044715 * a * a * a)  # 2u
    return a / (1.0 + tl.exp(-u2)) * b.to(tl.float32)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_inter, BLOCK: tl.constexpr, GELU: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_inter
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    b = tl.load(x_ptr + row * stride_x + n_inter + offs, mask=mask, other=0.0)
    if GELU:
        y = gelu_tanh_mul(a, b)
    else:
        y = silu_mul(a, b)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul_triton(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    shape = x.shape
    i = shape[-1] // 2
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, i), dtype=x.dtype, device=x.device)
    block = 1024
    if rows > 0:
        _act_and_mul_kernel[(rows, triton.cdiv(i, block))](
            x2, out, x2.stride(0), out.stride(0), i, BLOCK=block, GELU=gelu, num_warps=4, **pdl_launch(x2)
        )
    return out.view(*shape[:-1], i)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul_triton(x, gelu=False)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul_triton(x, gelu=True)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_torch(x)


def act_and_mul_torch(x: torch.Tensor, act: str) -> torch.Tensor:
    """The reference of ``act_and_mul``; ``act`` is one of ACTIVATIONS."""
    return gelu_tanh_and_mul_torch(x) if act == "gelu_tanh" else silu_and_mul_torch(x)


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """``act`` is one of ACTIVATIONS."""
    return gelu_tanh_and_mul(x) if act == "gelu_tanh" else silu_and_mul(x)
