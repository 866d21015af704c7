"""Rotary position embedding, NeoX / HF "rotate_half" style (as Llama in HF transformers).

positions [T] (int), q [T, Hq, D], k [T, Hkv, D], cos_sin_cache [max_pos, D] holding
cos(pos * inv_freq) in its first D/2 columns and sin in its last D/2. For each head vector
x = [x1, x2] (halves): out = [x1*cos - x2*sin, x2*cos + x1*sin].

``rotary_torch`` is the reference (out of place). The GPU never rotates on its own: attention
layers call ``rotary_store_kv``, rotary fused with the KV-cache store (one kernel per layer and
step instead of two). q is rotated in place; k is rotated on its way into the cache (k itself is
left as it was: attention reads keys from the cache only) and v is copied there. q, k, v may be
strided views (slices of the fused qkv projection) as long as the last dim is contiguous. The
reference is the two references in sequence (``rotary_torch`` then ``store_kv_torch``).
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import next_pow2, tl, triton, use_triton
from kvship.kernels.paged_attention import store_kv_torch


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
def _rotate_heads(src, stride_src_h, dst, stride_dst_h, cos, sin, offs_d, dmask,
                  H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate the H heads of one token at ``src`` into ``dst`` (rotate-half layout); the two
    may be the same place, and ``dst``'s dtype is the one written."""
    offs_h = tl.arange(0, BLOCK_H)
    m = (offs_h[:, None] < H) & dmask[None, :]
    p = src + offs_h[:, None] * stride_src_h + offs_d[None, :]
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    o = dst + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    tl.store(o, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=m)
    tl.store(o + HALF, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=m)


@triton.jit
def _cos_sin(pos_ptr, cs_ptr, t, stride_cs, offs_d, dmask, HALF: tl.constexpr):
    """cos and sin of token t's position, as [1, BLOCK_HALF] fp32 rows."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rotary_store_kv_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    cos, sin = _cos_sin(pos_ptr, cs_ptr, t, stride_cs, offs_d, dmask, HALF)
    q = q_ptr + t * stride_qt
    _rotate_heads(q, stride_qh, q, stride_qh, cos, sin, offs_d, dmask, HQ, HALF, BLOCK_HQ)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: a padding token, nothing to store
        page = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        kc = kc_ptr + page * stride_kcb + row * stride_kcs
        _rotate_heads(k_ptr + t * stride_kt, stride_kh, kc, stride_kch, cos, sin, offs_d, dmask, HKV, HALF, BLOCK_HKV)
        offs_h = tl.arange(0, BLOCK_HKV)
        offs_v = tl.arange(0, BLOCK_D)
        m = (offs_h[:, None] < HKV) & (offs_v[None, :] < HEAD_DIM)
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :], mask=m)
        vc = vc_ptr + page * stride_vcb + row * stride_vcs + offs_h[:, None] * stride_vch + offs_v[None, :]
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=m)


def rotary_store_kv_torch(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """Reference: rotate q and k, store k and v into their slots; returns the rotated q."""
    q, k = rotary_torch(positions, q, k, cos_sin_cache)
    store_kv_torch(k, v, k_cache, v_cache, slot_mapping)
    return q


def rotary_store_kv_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """Triton twin of ``rotary_store_kv_torch``; q is rotated in place and returned."""
    for x in (q, k, v, cos_sin_cache, k_cache, v_cache):
        assert x.stride(-1) == 1, "last dim must be contiguous"
    t, hq, d = q.shape
    hkv = k.shape[1]
    if t > 0:
        _rotary_store_kv_kernel[(t,)](
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HQ=hq, HKV=hkv, HALF=d // 2, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(hkv), BLOCK_HALF=next_pow2(d // 2), BLOCK_D=next_pow2(d),
            num_warps=4,
        )
    return q


def rotary_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    if use_triton(q):
        return rotary_store_kv_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return rotary_store_kv_torch(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
