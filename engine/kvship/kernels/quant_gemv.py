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

from kvship.kernels._triton import INTERPRET, tl, triton
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


# ---- packed pairs: two codes per instruction ----------------------------------------------------
# The word kernel above spends about 5.9 PTX instructions per 4-bit code in its loop on sm_90 (a
# bit-field extract, the OR and the subtraction of the exact conversion, the FMA, all in fp32;
# then x and the per-tile reductions): the issue rate, not the memory, holds it at 27-42% of copy
# bandwidth. Here a word's codes become fp16 pairs (two to a 32-bit register) with one
# instruction for two: for 4 bits, w & 0x000F000F holds codes 0 and 4 in its two halves, and
# OR-ing 0x64006400 makes them the fp16 pair (1024 + c0, 1024 + c4); w & 0x00F000F0 | 0x64006400 is
# (1024 + 16 c1, 1024 + 16 c5), whose 16 goes into x's pair (x1 / 16, x5 / 16); w >> 8 gives codes
# 2, 6 and 3, 7 the same way (8 bits: w & 0x00FF00FF and (w >> 8) & 0x00FF00FF). One sub.f16x2
# takes off 1024 and the centre (exact), one fma.rn.f16x2 multiplies the pair by x's pair and adds:
# about 2 instructions a code. A word's sum leaves fp16 after its 4 (8 bits: 2) pairs and is scaled
# in fp32.
#
# Range: x enters fp16 times 2**-X_SHIFT, so that a lane's sum of a word's (centred) products stays
# finite for |x| up to 2**16; where x is subnormal there (below
# 2**(X_SHIFT-14), the 16-divided pairs 2**(X_SHIFT-10)) its absolute error stays under bf16's
# rounding of x there.
X_SHIFT = {4: 5, 8: 8}

# One word's pairs, in PTX for the GPU. $0 the f32 sum; $1 the word; $2, $3 the fp16 pairs to take
# off (1024 + centre, and for 4 bits 1024 + 16 centre); $4.. x's pairs.
_WORD_DOT_ASM_4 = tl.constexpr("""{
    .reg .b32 c, t, m, a;
    .reg .f16 lo, hi;
    .reg .f32 flo, fhi;
    mov.b32 m, 0x64006400;
    lop3.b32 c, $1, 0x000F000F, m, 0xEA;
    sub.f16x2 c, c, $2;
    mul.rn.f16x2 a, c, $4;
    lop3.b32 c, $1, 0x00F000F0, m, 0xEA;
    sub.f16x2 c, c, $3;
    fma.rn.f16x2 a, c, $5, a;
    shr.u32 t, $1, 8;
    lop3.b32 c, t, 0x000F000F, m, 0xEA;
    sub.f16x2 c, c, $2;
    fma.rn.f16x2 a, c, $6, a;
    lop3.b32 c, t, 0x00F000F0, m, 0xEA;
    sub.f16x2 c, c, $3;
    fma.rn.f16x2 a, c, $7, a;
    mov.b32 {lo, hi}, a;
    cvt.f32.f16 flo, lo;
    cvt.f32.f16 fhi, hi;
    add.f32 $0, flo, fhi;
    }""")
_WORD_DOT_ASM_8 = tl.constexpr("""{
    .reg .b32 c, t, m, a;
    .reg .f16 lo, hi;
    .reg .f32 flo, fhi;
    mov.b32 m, 0x64006400;
    lop3.b32 c, $1, 0x00FF00FF, m, 0xEA;
    sub.f16x2 c, c, $2;
    mul.rn.f16x2 a, c, $4;
    shr.u32 t, $1, 8;
    lop3.b32 c, t, 0x00FF00FF, m, 0xEA;
    sub.f16x2 c, c, $2;
    fma.rn.f16x2 a, c, $5, a;
    mov.b32 {lo, hi}, a;
    cvt.f32.f16 flo, lo;
    cvt.f32.f16 fhi, hi;
    add.f32 $0, flo, fhi;
    }""")


@triton.jit
def _pair(lo, hi, ASM: tl.constexpr):
    """fp32 values -> int32 holding (fp16(lo), fp16(hi)) as the low and high halves."""
    if ASM:
        p = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        p = (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16) \
            | (lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
    return p


@triton.jit
def _half(p, HIGH: tl.constexpr):
    """One half of int32 pairs (``_pair``'s form) as fp16: the interpreter's path."""
    if HIGH:
        p = p >> 16
    return (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _lanes(t, mask: tl.constexpr, sub, a_lo, a_hi, xp, FIRST: tl.constexpr):
    """The interpreter's form of one lop3, sub.f16x2 and fma.rn.f16x2 (numpy's fp16 rounds the
    product before the sum, the GPU once after)."""
    c = (t & mask) | 0x64006400
    lo = _half(c, False) - _half(sub, False)
    hi = _half(c, True) - _half(sub, True)
    if FIRST:
        a_lo = lo * _half(xp, False)
        a_hi = hi * _half(xp, True)
    else:
        a_lo += lo * _half(xp, False)
        a_hi += hi * _half(xp, True)
    return a_lo, a_hi


@triton.jit
def _word_dot(q, sub, sub16, x0, x1, x2, x3, BITS: tl.constexpr, ASM: tl.constexpr):
    """A word's sum of centred codes times x, in fp16 pairs -> fp32; ``sub``/``sub16`` the pairs
    taken off, x0.. x's ``_pair``s (x2, x3 unused for 8 bits)."""
    if ASM:
        if BITS == 4:
            d = tl.inline_asm_elementwise(_WORD_DOT_ASM_4, "=f,r,r,r,r,r,r,r", [q, sub, sub16, x0, x1, x2, x3],
                                          dtype=tl.float32, is_pure=True, pack=1)
        else:
            d = tl.inline_asm_elementwise(_WORD_DOT_ASM_8, "=f,r,r,r,r,r", [q, sub, sub16, x0, x1],
                                          dtype=tl.float32, is_pure=True, pack=1)
    else:
        if BITS == 4:
            a_lo, a_hi = _lanes(q, 0x000F000F, sub, q, q, x0, True)
            a_lo, a_hi = _lanes(q, 0x00F000F0, sub16, a_lo, a_hi, x1, False)
            a_lo, a_hi = _lanes(q >> 8, 0x000F000F, sub, a_lo, a_hi, x2, False)
            a_lo, a_hi = _lanes(q >> 8, 0x00F000F0, sub16, a_lo, a_hi, x3, False)
        else:
            a_lo, a_hi = _lanes(q, 0x00FF00FF, sub, q, q, x0, True)
            a_lo, a_hi = _lanes(q >> 8, 0x00FF00FF, sub, a_lo, a_hi, x1, False)
        d = a_lo.to(tl.float32) + a_hi.to(tl.float32)
    return d


@triton.jit
def _x_pair(x_ptr, offs_w, wmask, j: tl.constexpr, CODES: tl.constexpr, XSCALE: tl.constexpr, ASM: tl.constexpr):
    """x's inputs j and j + CODES/2 of every word times XSCALE, as a ``_pair``."""
    lo = tl.load(x_ptr + offs_w * CODES + j, mask=wmask, other=0.0).to(tl.float32) * XSCALE
    hi = tl.load(x_ptr + offs_w * CODES + j + CODES // 2, mask=wmask, other=0.0).to(tl.float32) * XSCALE
    return _pair(lo, hi, ASM)


@triton.jit
def _qgemv_pairs_kernel(x_ptr, w_ptr, s_ptr, b_ptr, bias_ptr, y_ptr, N, KW, stride_w, stride_s, ngroups,
                        BITS: tl.constexpr, SYMM: tl.constexpr, HAS_BIAS: tl.constexpr,
                        G: tl.constexpr, X_SHIFT: tl.constexpr, ASM: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """A program's tile is [BLOCK_N rows, NG groups, WT words]: NG whole groups of G // CODES words,
    or one part of a group (NG = 1); each (row, group) takes its scale (and offset) once, and
    every word adds scale * (its sum - centre * x's sum) into fp32, reduced once at the end."""
    CODES: tl.constexpr = 32 // BITS
    XSCALE: tl.constexpr = 1.0 / (1 << X_SHIFT)
    WPG: tl.constexpr = G // CODES  # words per group
    NG: tl.constexpr = BLOCK_W // WPG if BLOCK_W > WPG else 1
    WT: tl.constexpr = BLOCK_W // NG
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    rows = w_ptr + offs_n[:, None, None].to(tl.int64) * stride_w
    srows = (offs_n.to(tl.int64) * stride_s)[:, None]
    word = tl.arange(0, NG)[:, None] * WT + tl.arange(0, WT)[None, :]  # [NG, WT]
    acc = tl.zeros([BLOCK_N, NG, WT], tl.float32)
    # the pairs sub.f16x2 takes off: 1024 + the centre, and 1024 + 16 centre. Offset codes are centred
    # too (smaller fp16 sums: 4 times less rounding), their offsets taking back centre * scale.
    CENTRE: tl.constexpr = 1 << (BITS - 1)
    SUB: tl.constexpr = 0x64006400 + CENTRE * 0x10001
    SUB16: tl.constexpr = 0x64006400 + 16 * CENTRE * 0x10001
    sub = tl.full([BLOCK_N, NG, WT], SUB, tl.int32)
    sub16 = tl.full([BLOCK_N, NG, WT], SUB16, tl.int32)
    for w0 in range(0, KW, BLOCK_W):
        offs_w = w0 + word
        wmask = offs_w < KW
        q = tl.load(rows + offs_w[None, :, :], mask=nmask[:, None, None] & wmask[None, :, :], other=0,
                    eviction_policy="evict_first")
        if BITS == 4:  # pairs (0, 4), (1, 5) / 16, (2, 6), (3, 7) / 16
            x0 = _x_pair(x_ptr, offs_w, wmask, 0, CODES, XSCALE, ASM)[None, :, :]
            x1 = _x_pair(x_ptr, offs_w, wmask, 1, CODES, XSCALE / 16, ASM)[None, :, :]
            x2 = _x_pair(x_ptr, offs_w, wmask, 2, CODES, XSCALE, ASM)[None, :, :]
            x3 = _x_pair(x_ptr, offs_w, wmask, 3, CODES, XSCALE / 16, ASM)[None, :, :]
        else:  # pairs (0, 2), (1, 3)
            x0 = _x_pair(x_ptr, offs_w, wmask, 0, CODES, XSCALE, ASM)[None, :, :]
            x1 = _x_pair(x_ptr, offs_w, wmask, 1, CODES, XSCALE, ASM)[None, :, :]
            x2 = x1
            x3 = x1
        d = _word_dot(q, sub, sub16, x0, x1, x2, x3, BITS, ASM)
        gs = (w0 + tl.arange(0, NG) * WT) * CODES // G
        m = nmask[:, None] & (gs < ngroups)[None, :]
        s = tl.load(s_ptr + srows + gs[None, :], mask=m, other=0.0).to(tl.float32)[:, :, None]
        if SYMM:
            acc += s * d
        else:  # offsets: b times x's sum over the word
            xs = tl.zeros([NG, WT], tl.float32)
            for j in tl.static_range(CODES):
                xs += tl.load(x_ptr + offs_w * CODES + j, mask=wmask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + srows + gs[None, :], mask=m, other=0.0).to(tl.float32)[:, :, None] + CENTRE * s
            acc += s * d + b * (xs * XSCALE)[None, :, :]
    y = tl.sum(tl.sum(acc, 2), 1) * (1 << X_SHIFT)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=nmask)

def pairs_fit(bits: int, k: int, group_size: int, ngroups: int, has_g_idx: bool) -> bool:
    """Whether the pairs kernel takes this layout: integer codes of 4 or 8 bits, rows of whole words,
    no act-order table, groups of whole words whose count is a power of two (tiles hold whole groups
    or lie inside one), or one group per row."""
    codes = 32 // bits
    if bits not in (4, 8) or has_g_idx or k % codes:
        return False
    words = group_size // codes
    return ngroups == 1 or (group_size % codes == 0 and words & (words - 1) == 0)


def qgemv_pairs_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
                       bias: torch.Tensor | None, bits: int, group_size: int, k: int,
                       config: dict[str, int]) -> torch.Tensor:
    """As ``qgemv_words_triton`` for integer codes of 4 or 8 bits (``pairs_fit`` must hold)."""
    n = qweight.shape[0]
    words = qweight.view(torch.uint8).view(torch.int32)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    symm = biases is None
    _qgemv_pairs_kernel[(triton.cdiv(n, config["block_n"]),)](
        x, words, scales, biases if biases is not None else scales, bias if bias is not None else scales, y,
        n, k * bits // 32, words.stride(0), scales.stride(0), scales.shape[1],
        BITS=bits, SYMM=symm, HAS_BIAS=bias is not None,
        G=group_size if scales.shape[1] > 1 else 1 << 30, X_SHIFT=X_SHIFT[bits], ASM=not INTERPRET,
        BLOCK_N=config["block_n"], BLOCK_W=config["block_w"], num_warps=config["num_warps"],
        num_stages=config["num_stages"])
    return y
