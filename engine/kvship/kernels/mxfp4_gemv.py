"""gpt-oss's MXFP4 experts for a few tokens (decode): GEMVs that stream the chosen experts' codes.

The grouped GEMMs (kernels/gpt_oss_moe.py) pad each expert's rows to a tensor-core tile and
decode every code once per tile; at one to a few tokens the step is a read of 4 experts'
codes, and what bounds it is the instructions per code. Here a program takes one pair (token,
expert) and BLOCK_N output rows, streams [BLOCK_N, BLOCK_G groups, 16 bytes] of codes (wide
loads, each 16 bytes one group of 32 inputs) and scales (one byte a group), and per code:

- decodes e2m1 by placing its bits in a float16 (sign at bit 15, exponent and mantissa at bits
  11..9: the value times 2 ** -14 exactly, 0.5 a subnormal) and widening it to float32;
- multiplies by x (the even inputs in the low nibbles, x's even and odd halves taken once per
  tile) with one FMA into a float32 sum per (row, group);

the group's e8m0 scale (with the 2 ** 14 back) acts once per 32 inputs. The programs of one row
block and all pairs are launched together (pair fastest), so tokens that pick the same expert
read it from L2. The gate/up kernel ends in the clamped SwiGLU (biases added); the down kernel
sums a token's k experts (router weights and biases) in registers and writes the layer's output:
no alignment by expert, no padded rows, no reduction after. Shapes depend on (T, k) only: CUDA
graph safe. The reference is kernels/gpt_oss_moe.py's ``gpt_oss_moe_torch``."""
from __future__ import annotations

import torch

from kvship.kernels._triton import tl, triton
from kvship.kernels.tuning.moe import MXFP4_GEMV

GROUP = 32  # inputs per e8m0 scale; 16 code bytes


@triton.jit
def _e2m1_times_2_pow_m14(c):
    """Codes (int32, 0..15) -> float32 values times 2 ** -14, exactly, via float16 bits."""
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale(s):
    """e8m0 bytes -> 2 ** (s - 127) times the 2 ** 14 the codes' decode leaves out."""
    return tl.exp2(s.to(tl.float32) - 113.0)


@triton.jit
def _group_sums(rows, srows, nmask, x_row, g0, NG, BLOCK_G: tl.constexpr):
    """[BLOCK_N, BLOCK_G] float32: rows' groups g0 .. g0 + BLOCK_G (rows: first code byte of
    each row, srows: first scale) times x's inputs there (x_row: the activation row), scaled."""
    gs = g0 + tl.arange(0, BLOCK_G)
    gmask = gs < NG
    byte = tl.arange(0, 16)
    m3 = nmask[:, None, None] & gmask[None, :, None]
    q = tl.load(rows[:, None, None] + (gs * 16)[None, :, None] + byte[None, None, :], mask=m3, other=0,
                eviction_policy="evict_first").to(tl.int32)
    s = tl.load(srows[:, None] + gs[None, :], mask=nmask[:, None] & gmask[None, :], other=0,
                eviction_policy="evict_first")
    # x's 32 inputs of each group, then its even (low nibble) and odd (high nibble) halves
    xo = (gs * GROUP)[:, None, None] + (2 * byte)[None, :, None] + tl.arange(0, 2)[None, None, :]
    xe, xd = tl.split(tl.load(x_row + xo, mask=gmask[:, None, None], other=0.0).to(tl.float32))
    part = tl.sum(_e2m1_times_2_pow_m14(q & 15) * xe[None] + _e2m1_times_2_pow_m14(q >> 4) * xd[None], 2)
    return part * _scale(s)


@triton.jit
def _rows(w_ptr, s_ptr, expert, offs_n, stride_we, stride_wn, stride_se, stride_sn):
    n64 = offs_n.to(tl.int64)
    return w_ptr + expert * stride_we + n64 * stride_wn, s_ptr + expert * stride_se + n64 * stride_sn


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, h_ptr, ids_ptr, N, K, stride_x, stride_we, stride_wn, stride_se,
                    stride_sn, stride_be, stride_h, alpha, limit, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_G: tl.constexpr):
    """h[pair, n] for n in this program's BLOCK_N of the N intermediate outputs: the clamped SwiGLU
    of gate row n and up row N + n of the pair's expert, biases added."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_x
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    gate_w, gate_s = _rows(w_ptr, s_ptr, expert, offs_n, stride_we, stride_wn, stride_se, stride_sn)
    up_w, up_s = gate_w + N * stride_wn, gate_s + N * stride_sn
    NG = K // GROUP
    acc_gate = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    for g0 in range(0, NG, BLOCK_G):
        acc_gate += _group_sums(gate_w, gate_s, nmask, x_row, g0, NG, BLOCK_G)
        acc_up += _group_sums(up_w, up_s, nmask, x_row, g0, NG, BLOCK_G)
    b = bias_ptr + expert * stride_be
    gate = tl.minimum(tl.sum(acc_gate, 1) + tl.load(b + offs_n, mask=nmask, other=0.0), limit)
    up = tl.minimum(tl.maximum(tl.sum(acc_up, 1) + tl.load(b + N + offs_n, mask=nmask, other=0.0), -limit), limit)
    h = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + offs_n, h.to(h_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, rw_ptr, ids_ptr, N, K, stride_h, stride_we, stride_wn,
                 stride_se, stride_sn, stride_be, stride_out, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_G: tl.constexpr):
    """out[token, n] = sum over the token's k pairs of weight * (W2[e, n] . h[pair] + b2[e, n])."""
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    NG = K // GROUP
    y = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        w_rows, s_rows = _rows(w_ptr, s_ptr, expert, offs_n, stride_we, stride_wn, stride_se, stride_sn)
        h_row = h_ptr + pair.to(tl.int64) * stride_h
        acc = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
        for g0 in range(0, NG, BLOCK_G):
            acc += _group_sums(w_rows, s_rows, nmask, h_row, g0, NG, BLOCK_G)
        bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=nmask, other=0.0)
        y += tl.load(rw_ptr + pair) * (tl.sum(acc, 1) + bias)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + offs_n, y.to(out_ptr.dtype.element_ty), mask=nmask)


def gemv_settings(tokens: int) -> tuple[dict, dict] | None:
    """(gate/up, down) settings for this many tokens, or None: the grouped GEMMs take them."""
    return next(((gu, dn) for bound, gu, dn in MXFP4_GEMV if tokens <= bound), None)


def mxfp4_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w13_bias: torch.Tensor,
                   w2: torch.Tensor, w2_scale: torch.Tensor, w2_bias: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, alpha: float, limit: float, gate_up: dict, down: dict) -> torch.Tensor:
    """x [T, H]; MXFP4 stacks w13 [E, 2I, H / 2] (gate rows, then up) and w2 [E, H, I / 2] with
    scales [.., K / 32] and float32 biases; the router's (weights, ids) [T, k] -> [T, H].
    ``gate_up`` / ``down``: {"block_n", "block_g", "num_warps"} (kernels/tuning/moe.py)."""
    tokens, top_k = ids.shape
    inter, hidden = w13.shape[1] // 2, x.shape[1]
    if hidden % GROUP or inter % GROUP:
        raise ValueError(f"MXFP4 rows of {hidden} and {inter} inputs: not whole groups of {GROUP}")
    x = x.contiguous()
    ids, rw = ids.flatten().contiguous(), weights.flatten().float().contiguous()
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(tokens * top_k, triton.cdiv(inter, gate_up["block_n"]))](
        x, w13, w13_scale, w13_bias, h, ids, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), w13_bias.stride(0), h.stride(0), float(alpha), float(limit),
        TOP_K=top_k, BLOCK_N=gate_up["block_n"], BLOCK_G=gate_up["block_g"], num_warps=gate_up["num_warps"])
    _down_kernel[(tokens, triton.cdiv(hidden, down["block_n"]))](
        h, w2, w2_scale, w2_bias, out, rw, ids, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1),
        w2_scale.stride(0), w2_scale.stride(1), w2_bias.stride(0), out.stride(0), TOP_K=top_k,
        BLOCK_N=down["block_n"], BLOCK_G=down["block_g"], num_warps=down["num_warps"])
    return out
