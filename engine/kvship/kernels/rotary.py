"""Rotary position embedding, NeoX / HF "rotate_half" style, fused with the KV-cache store.

positions [T], q [T, Hq, D], k [T, Hkv, D], cos_sin_cache [max_pos, D] (cos in the first D/2
columns, sin in the last). For each head x = [x1, x2]: out = [x1*cos - x2*sin, x2*cos + x1*sin].

``rotary_store_kv`` is one kernel per layer and step: q rotated in place, k rotated into the
cache (k itself untouched), v copied there; q, k, v may be strided views with a contiguous last
dim. Quantized caches (kernels/kv_quant.py) are written quantized, after rounding to the model's
dtype as the reference does: FP8 keys turned by R first (and q with them), int4 keys per channel
over their block (the block's first new token in the step stores it), int4 values in groups.
Per-head q/k RMSNorm (Qwen3, Gemma 3: ``QKNorm``) runs here too, in the separate norm's
arithmetic. The reference is ``rotary_torch`` then ``store_kv_torch``."""
from __future__ import annotations

from typing import NamedTuple

import torch

from kvship.kernels import kv_quant as kvq
from kvship.kernels._triton import next_pow2, pdl_launch, pdl_wait, tl, triton, use_triton
from kvship.kernels.norm import rms_norm_torch, rms_rstd
from kvship.kernels.numerics import fp8_round, small_int_to_float
from kvship.kernels.paged_attention import store_kv_torch


class QKNorm(NamedTuple):
    """Per-head RMSNorm of q and k before rotary: weights [head_dim] each, and eps."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


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
def _normed(x, rstd, w_ptr, elem, emask, ty: tl.constexpr):
    """x [BLOCK_H, N] (elements ``elem`` of each head) normalized and weighted in fp32, rounded to
    ``ty`` as the separate norm's output is, and back in fp32 for rotary."""
    w = tl.load(w_ptr + elem, mask=emask, other=0.0).to(tl.float32)[None, :]
    return (x * rstd[:, None] * w).to(ty).to(tl.float32)


@triton.jit
def rotated_halves(src, stride_h, offs_h, cos, sin, offs_d, m, w_ptr, eps,
                    HALF: tl.constexpr, NORM: tl.constexpr):
    """Both halves [BLOCK_H, BLOCK_HALF] of one token's heads at ``src``, each head RMS-normed
    with the weights at ``w_ptr`` first when NORM, rotated, in fp32. The statistics come from
    the halves already loaded, so a head rotated in place is read once, before it is written."""
    p = src + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    if NORM:
        rstd = rms_rstd(tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1), eps, 2 * HALF)
        dmask = offs_d < HALF
        x1 = _normed(x1, rstd, w_ptr, offs_d, dmask, src.dtype.element_ty)
        x2 = _normed(x2, rstd, w_ptr, offs_d + HALF, dmask, src.dtype.element_ty)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rotate_heads(src, stride_src_h, dst, stride_dst_h, cos, sin, offs_d, dmask, scale, w_ptr, eps,
                  H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
                  FP8: tl.constexpr = False, FP8_E5: tl.constexpr = False):
    """Rotate the H heads of one token at ``src`` (normed first when NORM) into ``dst``
    (rotate-half layout); the two may be the same place, and ``dst``'s dtype is the one written
    (FP8: divided by scale)."""
    offs_h = tl.arange(0, BLOCK_H)
    m = (offs_h[:, None] < H) & dmask[None, :]
    r1, r2 = rotated_halves(src, stride_src_h, offs_h, cos, sin, offs_d, m, w_ptr, eps, HALF, NORM)
    o = dst + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    src_ty = src.dtype.element_ty  # (one assignment each: a tuple of dtypes does not compile on the GPU)
    dst_ty = dst.dtype.element_ty
    tl.store(o, _to_cache(r1, src_ty, dst_ty, scale, FP8, FP8_E5), mask=m)
    tl.store(o + HALF, _to_cache(r2, src_ty, dst_ty, scale, FP8, FP8_E5), mask=m)


@triton.jit
def _hadamard_signs(rows, cols):
    """Sylvester's Hadamard matrix at [rows, cols], +1 or -1: (-1) ** popcount(row & col)
    (kv_quant.key_rotation builds the same matrix), from the indices alone."""
    p = rows[:, None] & cols[None, :]
    p ^= p >> 8
    p ^= p >> 4
    p ^= p >> 2
    p ^= p >> 1
    return 1.0 - 2.0 * (p & 1).to(tl.float32)


@triton.jit
def _turn(r1, r2, r_ptr, offs_d, dmask, ty: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
          BLOCK_D: tl.constexpr, R_ENTRY: tl.constexpr):
    """Rotated halves [BLOCK_H, BLOCK_HALF] rounded to ``ty``, times R -> fp32 [BLOCK_H, BLOCK_D].
    R_ENTRY > 0 (a Hadamard R): its +-1 signs come from the indices, exact in 16 bits, so 16-bit
    dots run on tensor cores and nothing is read; else R's fp32 rows are loaded. BLOCK_H >= 16."""
    cols = tl.arange(0, BLOCK_D)
    rm = dmask[:, None] & (cols < HEAD_DIM)[None, :]
    if R_ENTRY > 0:
        top = tl.where(rm, _hadamard_signs(offs_d, cols), 0.0).to(ty)
        bottom = tl.where(rm, _hadamard_signs(offs_d + HALF, cols), 0.0).to(ty)
        if ty == tl.float32:
            turned = tl.dot(r1, top, input_precision="ieee") + tl.dot(r2, bottom, input_precision="ieee")
        else:
            turned = tl.dot(r1.to(ty), top) + tl.dot(r2.to(ty), bottom)
        turned = turned * R_ENTRY
    else:
        top = tl.load(r_ptr + offs_d[:, None] * HEAD_DIM + cols[None, :], mask=rm, other=0.0)
        bottom = tl.load(r_ptr + (offs_d + HALF)[:, None] * HEAD_DIM + cols[None, :], mask=rm, other=0.0)
        turned = tl.dot(r1.to(ty).to(tl.float32), top, input_precision="ieee")
        turned += tl.dot(r2.to(ty).to(tl.float32), bottom, input_precision="ieee")
    return turned


@triton.jit
def _store_turned(src, stride_src_h, dst, stride_dst_h, cos, sin, offs_d, dmask, scale, r_ptr, w_ptr, eps,
                  H: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, NORM: tl.constexpr, R_ENTRY: tl.constexpr, FP8: tl.constexpr,
                  FP8_E5: tl.constexpr):
    """Heads turned by R: (normed,) rotated, rounded to the source's dtype, times R, then FP8-quantized
    into the cache (keys) or rounded in place (queries: every read before the dots, every write after)."""
    offs_h = tl.arange(0, BLOCK_H)
    m = (offs_h[:, None] < H) & dmask[None, :]
    r1, r2 = rotated_halves(src, stride_src_h, offs_h, cos, sin, offs_d, m, w_ptr, eps, HALF, NORM)
    cols = tl.arange(0, BLOCK_D)
    turned = _turn(r1, r2, r_ptr, offs_d, dmask, src.dtype.element_ty, HALF, HEAD_DIM, BLOCK_D, R_ENTRY)
    o = dst + offs_h[:, None] * stride_dst_h + cols[None, :]
    if FP8:
        out = _fp8(turned, scale, dst.dtype.element_ty, FP8_E5)
    else:
        out = turned.to(dst.dtype.element_ty)
    tl.store(o, out, mask=(offs_h[:, None] < H) & (cols < HEAD_DIM)[None, :])


@triton.jit
def _head_rstd(src, stride_h, offs_h, hmask, eps, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """1 / rms [BLOCK_H] of each of one token's heads at ``src`` (read only: k, never written)."""
    cols = tl.arange(0, BLOCK_D)
    m = hmask[:, None] & (cols < HEAD_DIM)[None, :]
    x = tl.load(src + (offs_h * stride_h)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    return rms_rstd(tl.sum(x * x, axis=1), eps, HEAD_DIM)


@triton.jit
def _heads_at(src, stride_h, offs_h, elem, pos, cs_ptr, m, rstd, w_ptr,
              ROTATE: tl.constexpr, NORM: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Elements ``elem`` of rows ``offs_h`` [BLOCK_H, BLOCK_P] in fp32, normed when NORM, rotated
    from each element's rotate-half partner and rounded to the source dtype when ROTATE."""
    p = src + (offs_h * stride_h)[:, None]
    ty = src.dtype.element_ty
    emask = elem < HEAD_DIM
    x = tl.load(p + elem[None, :], mask=m, other=0.0).to(tl.float32)
    if NORM:
        x = _normed(x, rstd, w_ptr, elem, emask, ty)
    if ROTATE:
        first = elem < HALF
        j = tl.where(first, elem, elem - HALF)
        other = tl.where(first, elem + HALF, elem - HALF)
        partner = tl.load(p + other[None, :], mask=m, other=0.0).to(tl.float32)
        if NORM:
            partner = _normed(partner, rstd, w_ptr, other, emask, ty)
        cs = cs_ptr + pos[:, None] + j[None, :]
        cos = tl.load(cs, mask=m, other=0.0).to(tl.float32)
        sin = tl.load(cs + HALF, mask=m, other=0.0).to(tl.float32)
        x = tl.where(first[None, :], x * cos - partner * sin, x * cos + partner * sin)
        x = x.to(ty).to(tl.float32)
    return x


@triton.jit
def _store_int4_values(src, stride_h, dst, stride_dst_h, grp, stride_grp_h, H: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """One token's H value heads quantized to int4 groups at dst (kv_quant.int4_store_groups)."""
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    even = 2 * tl.arange(0, BLOCK_P)
    m_even = hmask[:, None] & (even < HEAD_DIM)[None, :]
    m_odd = hmask[:, None] & (even + 1 < HEAD_DIM)[None, :]
    p = src + (offs_h * stride_h)[:, None] + even[None, :]
    x_even = tl.load(p, mask=m_even, other=0.0).to(tl.float32)
    x_odd = tl.load(p + 1, mask=m_odd, other=0.0).to(tl.float32)
    data = dst + offs_h[:, None] * stride_dst_h + (even // 2)[None, :]
    kvq.int4_store_groups(x_even, x_odd, m_even, m_odd, data, grp + offs_h * stride_grp_h, hmask,
                          HEAD_DIM, BLOCK_H, BLOCK_P)


@triton.jit
def _store_int4_key_block(k_ptr, stride_kt, t, row, slot, slot_ptr, pos_ptr, cs_ptr, stride_cs, kc, stride_kcs, ks,
                          w_ptr, eps, NORM: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr):
    """Token t, its block's first new token in this step, and the ones after it in the block: their
    keys of one head (normed, rotated) quantized per channel over the block with the rows it holds,
    those re-quantized where a channel widens (kv_quant.int4_store_keys is the reference)."""
    rows = tl.arange(0, BLOCK_SIZE)
    tok = t + rows - row
    new = (rows >= row) & (tok < tl.num_programs(0))
    new = new & (tl.load(slot_ptr + tok, mask=new, other=-1) == slot - row + rows)
    held = rows < row
    pos = tl.load(pos_ptr + tok, mask=new, other=0).to(tl.int64) * stride_cs
    even = 2 * tl.arange(0, BLOCK_P)
    em = even < HEAD_DIM
    om = even + 1 < HEAD_DIM
    m_even = new[:, None] & em[None, :]
    m_odd = new[:, None] & om[None, :]
    write = (held | new)[:, None] & em[None, :]
    rstd = tl.full((BLOCK_SIZE,), 1.0, tl.float32)
    if NORM:
        rstd = _head_rstd(k_ptr, stride_kt, tok, new, eps, HEAD_DIM, 2 * BLOCK_P)
    x_even = _heads_at(k_ptr, stride_kt, tok, even, pos, cs_ptr, m_even, rstd, w_ptr, True, NORM, HALF, HEAD_DIM)
    x_odd = _heads_at(k_ptr, stride_kt, tok, even + 1, pos, cs_ptr, m_odd, rstd, w_ptr, True, NORM, HALF, HEAD_DIM)
    data = kc + rows[:, None] * stride_kcs + (even // 2)[None, :]
    b = tl.load(data, mask=held[:, None] & em[None, :], other=0)
    sp = ks + 2 * even  # channel c's scale at 2c, its minimum at 2c + 1
    c_e = _key_block_codes(small_int_to_float(b & 15), x_even, m_even, new, sp, em, row > 0)
    c_o = _key_block_codes(small_int_to_float(b >> 4), x_odd, m_odd, new, sp + 2, om, row > 0)
    tl.store(data, (c_e | (c_o << 4)).to(tl.uint8), mask=write)


@triton.jit
def _key_block_codes(old, x, m, new, sp, cmask, held):
    """One key block's codes [BLOCK_SIZE, C] in C of its channels: ranges widened for the new values
    x (mask m, rows ``new``) and stored, old codes re-quantized in widened channels, new ones coded."""
    s = tl.load(sp, mask=cmask, other=0.0).to(tl.float32)
    z = tl.load(sp + 1, mask=cmask, other=0.0).to(tl.float32)
    s2, z2, wide = kvq.int4_block_range(x, m, s, z, held)
    c = tl.where(wide[None, :], kvq.int4_codes(old * s[None, :] + z[None, :], s2[None, :], z2[None, :]),
                 old.to(tl.int32))
    c = tl.where(new[:, None], kvq.int4_codes(x, s2[None, :], z2[None, :]), c)
    tl.store(sp, s2.to(tl.float16), mask=cmask)
    tl.store(sp + 1, z2.to(tl.float16), mask=cmask)
    return c


@triton.jit
def cos_sin(pos_ptr, cs_ptr, t, stride_cs, offs_d, dmask, HALF: tl.constexpr):
    """cos and sin of token t's position, as [1, BLOCK_HALF] fp32 rows."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rotary_store_kv_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, r_ptr, slot_ptr, qw_ptr, kw_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_gb, stride_gs, stride_gh,
    stride_ksb, stride_ksh,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_MODE: tl.constexpr, FP8_E5: tl.constexpr, TURN_K: tl.constexpr, R_ENTRY: tl.constexpr,
    QK_NORM: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)  # int4: each KV head's key blocks in a program of their own (below); else 0
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    # positions and slots come from the host before the step's first kernel and the cos/sin
    # table is constant: read before the PDL wait (kernels/_triton.py), they overlap the q/k/v
    # projection this kernel follows
    cos, sin = cos_sin(pos_ptr, cs_ptr, t, stride_cs, offs_d, dmask, HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    prev = slot - 1  # the token before's slot, read by int4 alone: it says who stores a block's keys
    if KV_MODE == 2:
        prev = tl.load(slot_ptr + t - 1, mask=t > 0, other=-1).to(tl.int64)
    pdl_wait(PDL)
    q = q_ptr + t * stride_qt
    if kh == 0:
        if TURN_K:  # the queries are turned as the keys are (kv_quant)
            _store_turned(q, stride_qh, q, stride_qh, cos, sin, offs_d, dmask, 1.0, r_ptr, qw_ptr, eps, HQ, HALF,
                          HEAD_DIM, BLOCK_HQ, BLOCK_D, QK_NORM, R_ENTRY, False, False)
        else:
            _rotate_heads(q, stride_qh, q, stride_qh, cos, sin, offs_d, dmask, 1.0, qw_ptr, eps, HQ, HALF, BLOCK_HQ,
                          QK_NORM)
    if slot >= 0:  # -1: a padding token, nothing to store
        page = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        kc = kc_ptr + page * stride_kcb + row * stride_kcs
        vc = vc_ptr + page * stride_vcb + row * stride_vcs
        if KV_MODE == 2:
            if kh == 0:
                _store_int4_values(v_ptr + t * stride_vt, stride_vh, vc, stride_vch,
                                   vs_ptr + page * stride_gb + row * stride_gs, stride_gh, HKV, HEAD_DIM, BLOCK_HKV,
                                   BLOCK_HALF)
            # A sequence's new tokens sit in consecutive slots: the first of them in each block
            # stores that block's keys (the others of the block leave them alone), one KV head a
            # program (one program looping over the heads was slower).
            if (row == 0) | (prev != slot - 1):
                _store_int4_key_block(k_ptr + kh * stride_kh, stride_kt, t, row, slot, slot_ptr, pos_ptr, cs_ptr,
                                      stride_cs, kc_ptr + page * stride_kcb + kh * stride_kch, stride_kcs,
                                      ks_ptr + page * stride_ksb + kh * stride_ksh, kw_ptr, eps, QK_NORM, HALF,
                                      HEAD_DIM, BLOCK_SIZE, BLOCK_HALF)
        else:
            k_scale = 1.0
            v_scale = 1.0
            if KV_MODE == 1:
                k_scale = tl.load(ks_ptr)
                v_scale = tl.load(vs_ptr)
            if TURN_K:
                _store_turned(k_ptr + t * stride_kt, stride_kh, kc, stride_kch, cos, sin, offs_d, dmask, k_scale, r_ptr,
                              kw_ptr, eps, HKV, HALF, HEAD_DIM, BLOCK_HKV, BLOCK_D, QK_NORM, R_ENTRY, True, FP8_E5)
            else:
                _rotate_heads(k_ptr + t * stride_kt, stride_kh, kc, stride_kch, cos, sin, offs_d, dmask, k_scale,
                              kw_ptr, eps, HKV, HALF, BLOCK_HKV, QK_NORM, KV_MODE == 1, FP8_E5)
            offs_h = tl.arange(0, BLOCK_HKV)
            offs_v = tl.arange(0, BLOCK_D)
            m = (offs_h[:, None] < HKV) & (offs_v[None, :] < HEAD_DIM)
            v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :], mask=m)
            vc = vc + offs_h[:, None] * stride_vch + offs_v[None, :]
            tl.store(vc, _to_cache(v.to(tl.float32), v_ptr.dtype.element_ty, vc_ptr.dtype.element_ty, v_scale,
                                   KV_MODE == 1, FP8_E5), mask=m)


def rotary_store_kv_torch(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                          k_scale=None, v_scale=None, k_transform=None, qk_norm: QKNorm | None = None) -> torch.Tensor:
    """Reference: norm q and k per head (``qk_norm``), rotate them, store k and v into their
    slots; returns the rotated q, transformed as the stored keys are (``k_transform``: kv_quant)."""
    if qk_norm is not None:
        q, k = rms_norm_torch(q, qk_norm.q_weight, qk_norm.eps), rms_norm_torch(k, qk_norm.k_weight, qk_norm.eps)
    q, k = rotary_torch(positions, q, k, cos_sin_cache)
    store_kv_torch(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_transform)
    return kvq.transform_queries(q, k_transform)


def rotary_store_kv_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                           k_scale=None, v_scale=None, k_transform=None, qk_norm: QKNorm | None = None) -> torch.Tensor:
    """Triton twin of ``rotary_store_kv_torch``; q is normed, rotated (and transformed) in place and returned."""
    for x in (q, k, v, cos_sin_cache, k_cache, v_cache):
        assert x.stride(-1) == 1, "last dim must be contiguous"
    t, hq, d = q.shape
    hkv = k.shape[1]
    mode = kvq.kv_mode(k_cache)
    turn = k_transform is not None
    assert not turn or mode == kvq.KV_FP8, "keys are turned in FP8 caches only"
    group_strides = kvq.scale_strides(mode, k_scale, v_scale)
    scales = (k_cache, v_cache) if mode == kvq.KV_PLAIN else (k_scale, v_scale)  # plain: unread
    norm = (qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps) if qk_norm is not None else (q, q, 0.0)  # else unread
    if t > 0:
        _rotary_store_kv_kernel[(t, hkv if mode == kvq.KV_INT4 else 1)](
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, *scales, q if k_transform is None else k_transform,
            slot_mapping,
            *norm,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *group_strides,
            HQ=hq, HKV=hkv, HALF=d // 2, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1],
            BLOCK_HQ=max(16, next_pow2(hq)) if turn else next_pow2(hq),
            BLOCK_HKV=max(16, next_pow2(hkv)) if turn else next_pow2(hkv),
            BLOCK_HALF=max(16, next_pow2(d // 2)), BLOCK_D=next_pow2(d),  # >= 16: int4 groups are 16 bytes
            KV_MODE=mode, FP8_E5=k_cache.dtype == torch.float8_e5m2, TURN_K=turn,
            R_ENTRY=kvq.hadamard_entry(d) if turn else 0.0, QK_NORM=qk_norm is not None,
            num_warps=4, **pdl_launch(q),
        )
    return q


def rotary_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                    k_scale=None, v_scale=None, k_transform=None, qk_norm: QKNorm | None = None) -> torch.Tensor:
    args = (positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_transform, qk_norm)
    return rotary_store_kv_triton(*args) if use_triton(q) else rotary_store_kv_torch(*args)
