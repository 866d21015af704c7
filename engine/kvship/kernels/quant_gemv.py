"""One-row GEMV (batch-1 decode) for codes of 4 or 8 bits (integers or FP8), read as 32-bit words.

kernels/quant_linear.py's one-row kernel turns every code into a scaled weight before its FMA:
split the byte, widen it, convert, re-centre, multiply by the group's scale, then the FMA. For
4-bit codes those instructions, not the memory, set its speed (22-32% of copy bandwidth on the
H200). Here a program loads [BLOCK_N, BLOCK_W] words (8 codes of 4 bits or 4 of 8 each) and, for
each position j in the word, takes code j of every word with one shift-and, converts it exactly
by OR-ing it into the mantissa of 2**23 and subtracting 2**23, and accumulates code * x with one
FMA. The centre, scales and offsets act once per group after the tile's reduction:

    sum_k (s_g (c_k - centre) + b_g) x_k = s_g (sum_k c_k x_k - centre sum_k x_k) + b_g sum_k x_k

(centre for symmetric integer codes, offsets b_g for asymmetric ones; FP8 codes are the values,
converted by the hardware, with centre 0). Input k = word * CODES + j, the
order of the byte layout (``pack``: low nibble first, bytes little-endian), so x is read with a
stride of CODES per position. Takes codes whose rows are whole words (K a multiple of 8 for 4 bits,
of 4 for 8 bits) and groups that tiles hold whole or lie inside (no act-order table); the
caller keeps the per-code kernel for the rest.

Its reference is quant_linear.py's: dequantize, then F.linear.
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import tl, triton
from kvship.kernels.numerics import small_int_to_float


def tiles_keep_groups(tile: int, group_size: int, ngroups: int) -> bool:
    """Whether tiles of ``tile`` inputs hold whole groups or lie inside one (or the row has one
    group), so that a kernel takes a tile's scales as a [.., groups, group] view, without a
    per-input group table."""
    return ngroups == 1 or tile % group_size == 0 or group_size % tile == 0


def fits(bits: int, k: int, group_size: int, ngroups: int, has_g_idx: bool, block_w: int) -> bool:
    """Whether the word kernel takes this layout with tiles of ``block_w`` words."""
    codes = 32 // bits
    if bits not in (4, 8) or has_g_idx or k % codes:
        return False
    return ngroups == 1 or (group_size % codes == 0 and tiles_keep_groups(block_w * codes, group_size, ngroups))


@triton.jit
def _code_value(c, FP8: tl.constexpr):
    """Codes (int32 holding one code each) -> their fp32 values, exactly."""
    if FP8:  # E4M3 bytes: the conversion unit (Hopper converts them in pairs)
        return c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return small_int_to_float(c)


@triton.jit
def _qgemv_words_kernel(x_ptr, w_ptr, s_ptr, b_ptr, bias_ptr, y_ptr, N, K, KW, stride_w, stride_s, ngroups,
                        BITS: tl.constexpr, FP8: tl.constexpr, SYMM: tl.constexpr, CENTRE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    CODES: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    TILE: tl.constexpr = BLOCK_W * CODES  # inputs per tile
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    srows = offs_n.to(tl.int64) * stride_s
    y = tl.zeros([BLOCK_N], tl.float32)
    for w0 in range(0, KW, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        wmask = offs_w < KW
        q = tl.load(rows + offs_w[None, :], mask=nmask[:, None] & wmask[None, :], other=0,
                    eviction_policy="evict_first")
        acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
        xs = tl.zeros([BLOCK_W], tl.float32)
        for j in tl.static_range(CODES):  # code j of every word; x with a stride of CODES (from L1)
            x = tl.load(x_ptr + offs_w * CODES + j, mask=wmask, other=0.0).to(tl.float32)
            acc += _code_value((q >> (BITS * j)) & MASK, FP8) * x[None, :]
            xs += x
        g0 = w0 * CODES // G
        if G >= TILE:  # the tile lies inside group g0 (or the row has one group)
            part = tl.sum(acc, 1)
            xsum = tl.sum(xs, 0)
            s = tl.load(s_ptr + srows + g0, mask=nmask, other=0.0).to(tl.float32)
            if SYMM:
                y += s * (part - CENTRE * xsum)
            else:
                y += s * part + tl.load(b_ptr + srows + g0, mask=nmask, other=0.0).to(tl.float32) * xsum
        else:  # the tile holds NG whole groups of G // CODES words each
            NG: tl.constexpr = TILE // G
            part = tl.sum(tl.reshape(acc, [BLOCK_N, NG, BLOCK_W // NG]), 2)
            xsum = tl.sum(tl.reshape(xs, [NG, BLOCK_W // NG]), 1)
            gs = g0 + tl.arange(0, NG)
            m = nmask[:, None] & (gs < ngroups)[None, :]
            s = tl.load(s_ptr + srows[:, None] + gs[None, :], mask=m, other=0.0).to(tl.float32)
            if SYMM:
                y += tl.sum(s * (part - CENTRE * xsum[None, :]), 1)
            else:
                b = tl.load(b_ptr + srows[:, None] + gs[None, :], mask=m, other=0.0).to(tl.float32)
                y += tl.sum(s * part + b * xsum[None, :], 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=nmask)


def qgemv_words_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
                       bias: torch.Tensor | None, bits: int, group_size: int, k: int,
                       config: dict[str, int]) -> torch.Tensor:
    """y [1, N] = x [1, K] @ W^T for the layout of kernels/quant_linear.py (codes [N, stored bytes]
    as uint8 or float8_e4m3fn, scales/offsets [N, groups]); ``fits`` must hold for config["block_w"]."""
    n = qweight.shape[0]
    words = qweight.view(torch.uint8).view(torch.int32)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    fp8 = qweight.dtype == torch.float8_e4m3fn
    symm = biases is None  # FP8: symmetric about 0
    _qgemv_words_kernel[(triton.cdiv(n, config["block_n"]),)](
        x, words, scales, biases if biases is not None else scales, bias if bias is not None else scales, y,
        n, k, k * bits // 32, words.stride(0), scales.stride(0), scales.shape[1],
        BITS=bits, FP8=fp8, SYMM=symm, CENTRE=float(1 << (bits - 1)) if symm and not fp8 else 0.0,
        HAS_BIAS=bias is not None, G=group_size if scales.shape[1] > 1 else 1 << 30, BLOCK_N=config["block_n"],
        BLOCK_W=config["block_w"], num_warps=config["num_warps"], num_stages=config["num_stages"])
    return y
