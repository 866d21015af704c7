"""Rotary position embedding, NeoX / HF "rotate_half" style (as Llama in HF transformers).

positions [T] (int), q [T, Hq, D], k [T, Hkv, D], cos_sin_cache [max_pos, D] holding
cos(pos * inv_freq) in its first D/2 columns and sin in its last D/2. For each head vector
x = [x1, x2] (halves): out = [x1*cos - x2*sin, x2*cos + x1*sin].

``rotary_torch`` is the reference (out of place); ``rotary_triton`` rotates q and k in place
(they may be strided views, e.g. slices of a fused qkv projection, as long as the last dim is
contiguous) and returns them; ``rotary`` picks one by device.
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import next_pow2, tl, triton, use_triton


def build_cos_sin_cache(
    max_pos: int, head_dim: int, base: float = 10000.0, device=None, dtype=torch.float32,
    inv_freq: torch.Tensor | None = None,
) -> torch.Tensor:
    """[max_pos, head_dim]: cos in the first half, sin in the second (plain, unscaled RoPE
    unless ``inv_freq`` is given, e.g. Llama-3's scaled frequencies)."""
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    t = torch.arange(max_pos, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq.to(device=device, dtype=torch.float64))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 at least, fp64 stays fp64
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_torch(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].to(torch.promote_types(q.dtype, torch.float32))  # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@triton.jit
def _rotate_heads(x_ptr, t, stride_t, stride_h, cos, sin, offs_d, dmask,
                  H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate, in place, the H heads of token t (rotate-half layout)."""
    offs_h = tl.arange(0, BLOCK_H)
    m = (offs_h[:, None] < H) & dmask[None, :]
    p = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(p, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(p + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, cos, sin, offs_d, dmask, HQ, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr, t, stride_kt, stride_kh, cos, sin, offs_d, dmask, HKV, HALF, BLOCK_HKV)


def rotary_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "last dim must be contiguous"
    assert cos_sin_cache.stride(-1) == 1
    t, hq, d = q.shape
    hkv = k.shape[1]
    half = d // 2
    if t > 0:
        _rotary_kernel[(t,)](
            positions, q, k, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            HQ=hq, HKV=hkv, HALF=half,
            BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(hkv), BLOCK_HALF=next_pow2(half),
            num_warps=4,
        )
    return q, k


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        return rotary_triton(positions, q, k, cos_sin_cache)
    return rotary_torch(positions, q, k, cos_sin_cache)
