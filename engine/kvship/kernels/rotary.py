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

A quantized cache (kernels/kv_quant.py) is written quantized: the rotated key is rounded to the
model's dtype first, as the reference's is, then divided by the layer's FP8 scale and rounded,
or, for int4, each head's rotated vector is quantized as one group; the kernel then works on
each head's even and odd elements (the two nibbles of a byte), rotating each element from its
rotate-half partner. FP8 keys may be turned by an orthogonal matrix on the way (``k_rotation``,
kv_quant.key_rotation): rotary, rounding, then the product with R, then the quantization.
"""
from __future__ import annotations

import torch

from kvship.kernels import kv_quant as kvq
from kvship.kernels._triton import next_pow2, tl, triton, use_triton
from kvship.kernels.numerics import fp8_round
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
def _fp8(x, scale, dst_ty: tl.constexpr, FP8_E5: tl.constexpr):
    return fp8_round(x / scale, FP8_E5).to(dst_ty)


@triton.jit
def _to_cache(x, src_ty: tl.constexpr, dst_ty: tl.constexpr, scale, FP8: tl.constexpr, FP8_E5: tl.constexpr):
    """fp32 values as the destination stores them: rounded to the source's dtype (as the
    reference rotates in fp32 and rounds to k's dtype), then FP8-quantized with ``scale``."""
    if FP8:
        return _fp8(x.to(src_ty).to(tl.float32), scale, dst_ty, FP8_E5)
    return x.to(dst_ty)


@triton.jit
def _rotated_halves(src, stride_h, offs_h, cos, sin, offs_d, m, HALF: tl.constexpr):
    """Both halves [BLOCK_H, BLOCK_HALF] of one token's heads at ``src``, rotated, in fp32."""
    p = src + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rotate_heads(src, stride_src_h, dst, stride_dst_h, cos, sin, offs_d, dmask, scale,
                  H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  FP8: tl.constexpr = False, FP8_E5: tl.constexpr = False):
    """Rotate the H heads of one token at ``src`` into ``dst`` (rotate-half layout); the two
    may be the same place, and ``dst``'s dtype is the one written (FP8: divided by scale)."""
    offs_h = tl.arange(0, BLOCK_H)
    m = (offs_h[:, None] < H) & dmask[None, :]
    r1, r2 = _rotated_halves(src, stride_src_h, offs_h, cos, sin, offs_d, m, HALF)
    o = dst + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    src_ty = src.dtype.element_ty  # (one assignment each: a tuple of dtypes does not compile on the GPU)
    dst_ty = dst.dtype.element_ty
    tl.store(o, _to_cache(r1, src_ty, dst_ty, scale, FP8, FP8_E5), mask=m)
    tl.store(o + HALF, _to_cache(r2, src_ty, dst_ty, scale, FP8, FP8_E5), mask=m)


@triton.jit
def _store_turned_fp8_keys(src, stride_src_h, dst, stride_dst_h, cos, sin, offs_d, dmask, scale, r_ptr,
                           H: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_E5: tl.constexpr):
    """FP8 keys turned by R (kv_quant.key_rotation): rotary, rounded to k's dtype, times R
    (the halves against R's top and bottom rows), quantized. BLOCK_H >= 16 for tl.dot."""
    offs_h = tl.arange(0, BLOCK_H)
    m = (offs_h[:, None] < H) & dmask[None, :]
    r1, r2 = _rotated_halves(src, stride_src_h, offs_h, cos, sin, offs_d, m, HALF)
    ty = src.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)
    rm = dmask[:, None] & (cols < HEAD_DIM)[None, :]
    top = tl.load(r_ptr + offs_d[:, None] * HEAD_DIM + cols[None, :], mask=rm, other=0.0)
    bottom = tl.load(r_ptr + (offs_d + HALF)[:, None] * HEAD_DIM + cols[None, :], mask=rm, other=0.0)
    turned = tl.dot(r1.to(ty).to(tl.float32), top, input_precision="ieee")
    turned += tl.dot(r2.to(ty).to(tl.float32), bottom, input_precision="ieee")
    o = dst + offs_h[:, None] * stride_dst_h + cols[None, :]
    tl.store(o, _fp8(turned, scale, dst.dtype.element_ty, FP8_E5), mask=(offs_h[:, None] < H) & (cols < HEAD_DIM)[None, :])


@triton.jit
def _heads_at(src, stride_h, offs_h, elem, pos, cs_ptr, m,
              ROTATE: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Elements ``elem`` [BLOCK_P] of every head of one token [BLOCK_H, BLOCK_P] in fp32,
    rotated (from each element's rotate-half partner, in the reference's order of operations)
    and rounded to the source dtype when ROTATE, as stored otherwise."""
    p = src + (offs_h * stride_h)[:, None]
    x = tl.load(p + elem[None, :], mask=m, other=0.0).to(tl.float32)
    if ROTATE:
        first = elem < HALF
        j = tl.where(first, elem, elem - HALF)
        partner = tl.load(p + tl.where(first, elem + HALF, elem - HALF)[None, :], mask=m, other=0.0).to(tl.float32)
        cos = tl.load(cs_ptr + pos + j, mask=elem < HEAD_DIM, other=0.0)[None, :].to(tl.float32)
        sin = tl.load(cs_ptr + pos + HALF + j, mask=elem < HEAD_DIM, other=0.0)[None, :].to(tl.float32)
        x = tl.where(first[None, :], x * cos - partner * sin, x * cos + partner * sin)
        x = x.to(src.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _store_int4_heads(src, stride_h, pos, cs_ptr, dst, stride_dst_h, grp, stride_grp_h,
                      ROTATE: tl.constexpr, H: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """One token's H heads (keys rotated first when ROTATE) quantized to int4 groups at dst."""
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    even = 2 * tl.arange(0, BLOCK_P)
    m_even = hmask[:, None] & (even < HEAD_DIM)[None, :]
    m_odd = hmask[:, None] & (even + 1 < HEAD_DIM)[None, :]
    x_even = _heads_at(src, stride_h, offs_h, even, pos, cs_ptr, m_even, ROTATE, HALF, HEAD_DIM)
    x_odd = _heads_at(src, stride_h, offs_h, even + 1, pos, cs_ptr, m_odd, ROTATE, HALF, HEAD_DIM)
    data = dst + offs_h[:, None] * stride_dst_h + (even // 2)[None, :]
    kvq.int4_store_groups(x_even, x_odd, m_even, m_odd, data, grp + offs_h * stride_grp_h, hmask,
                          HEAD_DIM, BLOCK_H, BLOCK_P)


@triton.jit
def _cos_sin(pos_ptr, cs_ptr, t, stride_cs, offs_d, dmask, HALF: tl.constexpr):
    """cos and sin of token t's position, as [1, BLOCK_HALF] fp32 rows."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rotary_store_kv_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, r_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_gb, stride_gs, stride_gh,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_MODE: tl.constexpr, FP8_E5: tl.constexpr, TURN_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    cos, sin = _cos_sin(pos_ptr, cs_ptr, t, stride_cs, offs_d, dmask, HALF)
    q = q_ptr + t * stride_qt
    _rotate_heads(q, stride_qh, q, stride_qh, cos, sin, offs_d, dmask, 1.0, HQ, HALF, BLOCK_HQ)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: a padding token, nothing to store
        page = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        kc = kc_ptr + page * stride_kcb + row * stride_kcs
        vc = vc_ptr + page * stride_vcb + row * stride_vcs
        if KV_MODE == 2:
            grp = page * stride_gb + row * stride_gs
            pos = tl.load(pos_ptr + t).to(tl.int64) * stride_cs
            _store_int4_heads(k_ptr + t * stride_kt, stride_kh, pos, cs_ptr, kc, stride_kch, ks_ptr + grp, stride_gh,
                              True, HKV, HALF, HEAD_DIM, BLOCK_HKV, BLOCK_HALF)
            _store_int4_heads(v_ptr + t * stride_vt, stride_vh, pos, cs_ptr, vc, stride_vch, vs_ptr + grp, stride_gh,
                              False, HKV, HALF, HEAD_DIM, BLOCK_HKV, BLOCK_HALF)
        else:
            k_scale = 1.0
            v_scale = 1.0
            if KV_MODE == 1:
                k_scale = tl.load(ks_ptr)
                v_scale = tl.load(vs_ptr)
            if TURN_K:
                _store_turned_fp8_keys(k_ptr + t * stride_kt, stride_kh, kc, stride_kch, cos, sin, offs_d, dmask,
                                       k_scale, r_ptr, HKV, HALF, HEAD_DIM, BLOCK_HKV, BLOCK_D, FP8_E5)
            else:
                _rotate_heads(k_ptr + t * stride_kt, stride_kh, kc, stride_kch, cos, sin, offs_d, dmask, k_scale,
                              HKV, HALF, BLOCK_HKV, KV_MODE == 1, FP8_E5)
            offs_h = tl.arange(0, BLOCK_HKV)
            offs_v = tl.arange(0, BLOCK_D)
            m = (offs_h[:, None] < HKV) & (offs_v[None, :] < HEAD_DIM)
            v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :], mask=m)
            vc = vc + offs_h[:, None] * stride_vch + offs_v[None, :]
            tl.store(vc, _to_cache(v.to(tl.float32), v_ptr.dtype.element_ty, vc_ptr.dtype.element_ty, v_scale,
                                   KV_MODE == 1, FP8_E5), mask=m)


def rotary_store_kv_torch(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                          k_scale=None, v_scale=None, k_rotation=None) -> torch.Tensor:
    """Reference: rotate q and k, store k and v into their slots; returns the rotated q (not
    turned by ``k_rotation``, which only the stored FP8 keys are: see kv_quant)."""
    q, k = rotary_torch(positions, q, k, cos_sin_cache)
    store_kv_torch(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_rotation)
    return q


def rotary_store_kv_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                           k_scale=None, v_scale=None, k_rotation=None) -> torch.Tensor:
    """Triton twin of ``rotary_store_kv_torch``; q is rotated in place and returned."""
    for x in (q, k, v, cos_sin_cache, k_cache, v_cache):
        assert x.stride(-1) == 1, "last dim must be contiguous"
    t, hq, d = q.shape
    hkv = k.shape[1]
    mode = kvq.kv_mode(k_cache)
    turn = k_rotation is not None
    assert not turn or mode == kvq.KV_FP8, "keys are turned in FP8 caches only"
    group_strides = k_scale.stride()[:3] if mode == kvq.KV_INT4 else (0, 0, 0)
    assert mode != kvq.KV_INT4 or k_scale.stride()[-2:] == (2, 1) and v_scale.stride() == k_scale.stride()
    scales = (k_cache, v_cache) if mode == kvq.KV_PLAIN else (k_scale, v_scale)  # plain: unread
    if t > 0:
        _rotary_store_kv_kernel[(t,)](
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, *scales, k_rotation if turn else q, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *group_strides,
            HQ=hq, HKV=hkv, HALF=d // 2, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_HQ=next_pow2(hq), BLOCK_HKV=max(16, next_pow2(hkv)) if turn else next_pow2(hkv),
            BLOCK_HALF=max(16, next_pow2(d // 2)), BLOCK_D=next_pow2(d),  # >= 16: int4 groups are 16 bytes
            KV_MODE=mode, FP8_E5=k_cache.dtype == torch.float8_e5m2, TURN_K=turn,
            num_warps=4,
        )
    return q


def rotary_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                    k_scale=None, v_scale=None, k_rotation=None) -> torch.Tensor:
    args = (positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_rotation)
    return rotary_store_kv_triton(*args) if use_triton(q) else rotary_store_kv_torch(*args)
