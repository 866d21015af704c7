"""One-row GEMV (batch-1 decode) for 4- or 8-bit codes (integers or FP8) read as 32-bit words:
the fp32 word kernel, and below it the fp16-pair kernel ("packed pairs"), which the engine
prefers beside 16-bit activations.

Converting every code into a scaled weight before its FMA makes 4-bit codes instruction-bound.
Here a program loads [BLOCK_N, BLOCK_W] words and, for each position j in a word, takes code j of
every word with one shift-and, converts it exactly (OR into the mantissa of 2**23, subtract
2**23) and accumulates code * x with one FMA; centre, scales and offsets act once per group:

    sum_k (s_g (c_k - centre) + b_g) x_k = s_g (sum_k c_k x_k - centre sum_k x_k) + b_g sum_k x_k

Input k = word * CODES + j (``pack``'s byte layout), so x is read with a stride of CODES. Rows
must be whole words and groups whole tiles (or contain them), without an act-order table; the
caller keeps the per-code kernel for the rest. The reference is quant_linear.py's."""
from __future__ import annotations

import torch

from kvship.kernels._triton import INTERPRET, pdl_launch, pdl_wait, tl, triton
from kvship.kernels.activation import ACTIVATIONS, gelu_tanh_mul, silu_mul
from kvship.kernels.numerics import small_int_to_float
from kvship.quant.tensor import code_centre


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
                        G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
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
        BITS=bits, FP8=fp8, SYMM=symm, CENTRE=float(code_centre(bits, fp8, not symm)),
        HAS_BIAS=bias is not None, G=group_size if scales.shape[1] > 1 else 1 << 30, BLOCK_N=config["block_n"],
        BLOCK_W=config["block_w"], num_warps=config["num_warps"], num_stages=config["num_stages"], **pdl_launch(x))
    return y


# ---- packed pairs: two codes per instruction ----------------------------------------------------
# The word kernel above is bound by its instruction issue (several fp32 instructions a code).
# Here a word's codes become fp16 pairs (two to a 32-bit register) with one instruction for two:
# for 4 bits, w & 0x000F000F holds codes 0 and 4 in its two halves, and
# OR-ing 0x64006400 makes them the fp16 pair (1024 + c0, 1024 + c4); w & 0x00F000F0 | 0x64006400 is
# (1024 + 16 c1, 1024 + 16 c5); w >> 8 gives codes 2, 6 and 3, 7 the same way (8 bits:
# w & 0x00FF00FF and (w >> 8) & 0x00FF00FF). One fma.rn.f16x2 with constant pairs turns either
# form into (c - centre) / 2**CODE_SHIFT, exactly, and one more multiplies it by x's pair (x_j,
# x_j+CODES/2 in fp16) and adds. Four consecutive words of a row (one group's: groups are whole
# multiples of 4 words) chain their pairs in one fp16 sum, which then leaves for fp32 and takes
# its group's scale: under two instructions a 4-bit code.
#
# Range: scaled codes are at most 1/16 (8 bits: 1/8) in magnitude and a lane sums 16 (8) products,
# so no sum exceeds max |x|: any x fp16 holds (|x| < 65504) is safe, and x below 6e-5 loses only
# what fp16's subnormals drop (under 3e-8).
#
# FP8 (E4M3) codes take the same path with one conversion for two: cvt.rn.f16x2.e4m3x2 turns the
# word's bytes 0, 1 (and 2, 3) into an fp16 pair, exactly (E4M3 values are fp16 values), so x's
# pairs are (x_j, x_j+1) for them; one mul.rn.f16x2 by 2**-12 then scales both (exactly: the
# smallest code, 2**-9, becomes 2**-21, above fp16's least subnormal 2**-24). 448 / 2**12 is under
# 1/8, so the 8-bit bound above holds for them too. The NaN codes (0x7F, 0xFF) are not handled:
# quantized weights never hold them.
CODE_SHIFT = {(4, False): 7, (8, False): 10, (8, True): 12}  # (bits, FP8) -> shift
CHAIN = 4  # words a fp16 sum takes


def _half_bits(v: float) -> int:
    return torch.tensor(v, dtype=torch.float16).view(torch.int16).item() & 0xFFFF


def _code_pairs(bits: int) -> list[tuple[int, str, int, int]]:
    """Per pair of a word: (right shift, mask, scale, shift) such that, with m the masked bits OR
    0x6400 read as fp16, m * scale + shift = (c - centre) / 2**CODE_SHIFT exactly (both fp16 bits)."""
    centre, k = code_centre(bits), 2.0 ** -CODE_SHIFT[bits, False]  # offset codes are centred too
    low = (_half_bits(k), _half_bits(-(1024 + centre) * k))  # m = 1024 + c
    if bits == 8:
        return [(0, "0x00FF00FF", *low), (8, "0x00FF00FF", *low)]
    high = (_half_bits(k / 16), _half_bits(-(1024 + 16 * centre) * k / 16))  # m = 1024 + 16 c
    return [(0, "0x000F000F", *low), (0, "0x00F000F0", *high), (8, "0x000F000F", *low), (8, "0x00F000F0", *high)]


def _int_pairs_ptx(bits: int, sum_in: str | None) -> list[str]:
    """PTX that adds a word of integer codes' products to the f16x2 sum ``sum_in`` (None: starts
    it) in register a: a lop3 and an fma make each pair of codes, one more fma multiplies it by x's."""
    steps = _code_pairs(bits)
    lines = [".reg .b32 c, t, m, a, k, b;", "mov.b32 m, 0x64006400;"]
    for i, (shift, mask, scale, add) in enumerate(steps):
        if shift and steps[i - 1][0] != shift:
            lines.append(f"shr.u32 t, $1, {shift};")
        if i == 0 or (scale, add) != steps[i - 1][2:]:
            lines += [f"mov.b32 k, {scale * 0x10001:#010x};", f"mov.b32 b, {add * 0x10001:#010x};"]
        lines += [f"lop3.b32 c, {'t' if shift else '$1'}, {mask}, m, 0xEA;", "fma.rn.f16x2 c, c, k, b;"]
        lines.append(_product_ptx(2 + i, "a" if i else sum_in))
    return lines


def _fp8_pairs_ptx(sum_in: str | None) -> list[str]:
    """As ``_int_pairs_ptx`` for a word of E4M3 codes: bytes 0, 1 and 2, 3 each converted as a
    pair, scaled by 2**-CODE_SHIFT and multiplied by x's pair."""
    lines = [".reg .b32 c, a, k;", ".reg .b16 h0, h1;", "mov.b32 {h0, h1}, $1;",
             f"mov.b32 k, {_half_bits(2.0 ** -CODE_SHIFT[8, True]) * 0x10001:#010x};"]
    for i, half in enumerate(("h0", "h1")):
        lines += [f"cvt.rn.f16x2.e4m3x2 c, {half};", "mul.rn.f16x2 c, c, k;",
                  _product_ptx(2 + i, "a" if i else sum_in)]
    return lines


def _product_ptx(x: int, sum_in: str | None) -> str:
    """a = c times x's pair ($x) plus ``sum_in`` (None: no sum yet)."""
    return f"mul.rn.f16x2 a, c, ${x};" if sum_in is None else f"fma.rn.f16x2 a, c, ${x}, {sum_in};"


def _step_ptx(bits: int, fp8: bool, first: bool, last: bool) -> str:
    """PTX of one word's step in a chain: $0 the sum so far as an f16x2 pair (the last step: the
    f32 total of its two lanes); $1 the word; $2.. x's pairs; after them the sum so far (not in the
    first step)."""
    pairs = 16 // bits
    sum_in = None if first else f"${2 + pairs}"
    lines = _fp8_pairs_ptx(sum_in) if fp8 else _int_pairs_ptx(bits, sum_in)
    if last:
        lines += [".reg .f16 lo, hi;", ".reg .f32 flo, fhi;", "mov.b32 {lo, hi}, a;", "cvt.f32.f16 flo, lo;",
                  "cvt.f32.f16 fhi, hi;", "add.f32 $0, flo, fhi;"]
    else:
        lines.append("mov.b32 $0, a;")
    return "{\n" + "\n".join(lines) + "\n}"


_PTX_4_FIRST = tl.constexpr(_step_ptx(4, False, True, False))
_PTX_4_MID = tl.constexpr(_step_ptx(4, False, False, False))
_PTX_4_LAST = tl.constexpr(_step_ptx(4, False, False, True))
_PTX_8_FIRST = tl.constexpr(_step_ptx(8, False, True, False))
_PTX_8_MID = tl.constexpr(_step_ptx(8, False, False, False))
_PTX_8_LAST = tl.constexpr(_step_ptx(8, False, False, True))
_PTX_FP8_FIRST = tl.constexpr(_step_ptx(8, True, True, False))
_PTX_FP8_MID = tl.constexpr(_step_ptx(8, True, False, False))
_PTX_FP8_LAST = tl.constexpr(_step_ptx(8, True, False, True))
_P4 = _code_pairs(4)
_P8 = _code_pairs(8)
# the interpreter's copies of the constants (fp16 bits of scale and shift)
_K4, _B4, _K4H, _B4H = tl.constexpr(_P4[0][2]), tl.constexpr(_P4[0][3]), tl.constexpr(_P4[1][2]), tl.constexpr(_P4[1][3])
_K8, _B8 = tl.constexpr(_P8[0][2]), tl.constexpr(_P8[0][3])
_FP8_SCALE = tl.constexpr(2.0 ** -CODE_SHIFT[8, True])


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
def _lanes(t, mask: tl.constexpr, k: tl.constexpr, b: tl.constexpr, a_lo, a_hi, xp):
    """The interpreter's lop3 and two fma.rn.f16x2 (numpy's fp16 rounds each product before its
    sum, the GPU once after; the codes' own fma is exact either way)."""
    c = (t & mask) | 0x64006400
    kf = tl.full(c.shape, k, tl.int32).to(tl.int16).to(tl.float16, bitcast=True)
    bf = tl.full(c.shape, b, tl.int32).to(tl.int16).to(tl.float16, bitcast=True)
    a_lo += (_half(c, False) * kf + bf) * _half(xp, False)
    a_hi += (_half(c, True) * kf + bf) * _half(xp, True)
    return a_lo, a_hi


@triton.jit
def _fp8_lanes(t, a_lo, a_hi, xp):
    """The interpreter's cvt.rn.f16x2.e4m3x2 of bytes 0, 1 of t, its mul by 2**-CODE_SHIFT and the
    fma with x's pair xp."""
    c_lo = (_code_value(t & 0xFF, True) * _FP8_SCALE).to(tl.float16)
    c_hi = (_code_value((t >> 8) & 0xFF, True) * _FP8_SCALE).to(tl.float16)
    return a_lo + c_lo * _half(xp, False), a_hi + c_hi * _half(xp, True)


@triton.jit
def _split4(t):
    """[..., 4] -> its 4 slices along the last dim (in-register when a thread holds the 4)."""
    lo, hi = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))  # index 2i + k: k = 0 / 1
    t0, t2 = tl.split(lo)
    t1, t3 = tl.split(hi)
    return t0, t1, t2, t3


@triton.jit
def _step(q, x0, x1, x2, x3, a, BITS: tl.constexpr, FP8: tl.constexpr, ASM: tl.constexpr, FIRST: tl.constexpr,
          LAST: tl.constexpr):
    """One word of a chain: the sum so far ``a`` (f16x2 pairs in int32; unused when FIRST) plus the
    word's scaled, centred codes times x's pairs x0.. (x2, x3 unused for 8 bits) -> the new sum,
    or its f32 total when LAST."""
    if ASM:
        if FP8:
            if FIRST:
                out = tl.inline_asm_elementwise(_PTX_FP8_FIRST, "=r,r,r,r", [q, x0, x1], dtype=tl.int32,
                                                is_pure=True, pack=1)
            elif LAST:
                out = tl.inline_asm_elementwise(_PTX_FP8_LAST, "=f,r,r,r,r", [q, x0, x1, a], dtype=tl.float32,
                                                is_pure=True, pack=1)
            else:
                out = tl.inline_asm_elementwise(_PTX_FP8_MID, "=r,r,r,r,r", [q, x0, x1, a], dtype=tl.int32,
                                                is_pure=True, pack=1)
        elif BITS == 4:
            if FIRST:
                out = tl.inline_asm_elementwise(_PTX_4_FIRST, "=r,r,r,r,r,r", [q, x0, x1, x2, x3],
                                                dtype=tl.int32, is_pure=True, pack=1)
            elif LAST:
                out = tl.inline_asm_elementwise(_PTX_4_LAST, "=f,r,r,r,r,r,r", [q, x0, x1, x2, x3, a],
                                                dtype=tl.float32, is_pure=True, pack=1)
            else:
                out = tl.inline_asm_elementwise(_PTX_4_MID, "=r,r,r,r,r,r,r", [q, x0, x1, x2, x3, a],
                                                dtype=tl.int32, is_pure=True, pack=1)
        else:
            if FIRST:
                out = tl.inline_asm_elementwise(_PTX_8_FIRST, "=r,r,r,r", [q, x0, x1], dtype=tl.int32,
                                                is_pure=True, pack=1)
            elif LAST:
                out = tl.inline_asm_elementwise(_PTX_8_LAST, "=f,r,r,r,r", [q, x0, x1, a], dtype=tl.float32,
                                                is_pure=True, pack=1)
            else:
                out = tl.inline_asm_elementwise(_PTX_8_MID, "=r,r,r,r,r", [q, x0, x1, a], dtype=tl.int32,
                                                is_pure=True, pack=1)
    else:
        if FIRST:
            a_lo = tl.zeros(q.shape, tl.float16)
            a_hi = tl.zeros(q.shape, tl.float16)
        else:
            a_lo = _half(a, False)
            a_hi = _half(a, True)
        if FP8:
            a_lo, a_hi = _fp8_lanes(q, a_lo, a_hi, x0)
            a_lo, a_hi = _fp8_lanes(q >> 16, a_lo, a_hi, x1)
        elif BITS == 4:
            a_lo, a_hi = _lanes(q, 0x000F000F, _K4, _B4, a_lo, a_hi, x0)
            a_lo, a_hi = _lanes(q, 0x00F000F0, _K4H, _B4H, a_lo, a_hi, x1)
            a_lo, a_hi = _lanes(q >> 8, 0x000F000F, _K4, _B4, a_lo, a_hi, x2)
            a_lo, a_hi = _lanes(q >> 8, 0x00F000F0, _K4H, _B4H, a_lo, a_hi, x3)
        else:
            a_lo, a_hi = _lanes(q, 0x00FF00FF, _K8, _B8, a_lo, a_hi, x0)
            a_lo, a_hi = _lanes(q >> 8, 0x00FF00FF, _K8, _B8, a_lo, a_hi, x1)
        if LAST:
            out = a_lo.to(tl.float32) + a_hi.to(tl.float32)
        else:
            out = _pair(a_lo.to(tl.float32), a_hi.to(tl.float32), False)
    return out


@triton.jit
def _chains(q, x_ptr, first, KW, BITS: tl.constexpr, FP8: tl.constexpr, ASM: tl.constexpr):
    """fp32 sums of the chains of tile q [rows, chains, 4 words] whose first words are ``first``
    [chains], and the fp32 sums of x over each chain's inputs [chains] (what offsets multiply).
    x's pairs for the tile are made as one [chains, 4 words, pairs] tensor, each pair once per
    program (the layout change that hands them to the rows' threads goes through shared memory),
    then sliced in registers. Pair p of a word holds inputs p and p + PAIRS (integer codes) or
    2p and 2p + 1 (FP8: the bytes one conversion takes)."""
    CODES: tl.constexpr = 32 // BITS
    PAIRS: tl.constexpr = CODES // 2
    word = first[:, None, None] + tl.arange(0, 4)[None, :, None]
    wmask = word < KW
    if FP8:  # the word's inputs in one load, split into its pairs' halves
        xw = tl.load(x_ptr + word[:, :, :, None] * CODES + tl.arange(0, CODES)[None, None, None, :],
                     mask=wmask[:, :, :, None], other=0.0).to(tl.float32)
        lo, hi = tl.split(tl.reshape(xw, [first.shape[0], 4, PAIRS, 2]))
    else:
        xo = word * CODES + tl.arange(0, PAIRS)[None, None, :]
        lo = tl.load(x_ptr + xo, mask=wmask, other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + xo + PAIRS, mask=wmask, other=0.0).to(tl.float32)
    xp = _pair(lo, hi, ASM)
    xsum = tl.sum(tl.sum(lo + hi, 2), 1)
    q0, q1, q2, q3 = _split4(q)
    if BITS == 4:  # pairs (0, 4), (1, 5), (2, 6), (3, 7) of words 0..3
        p0, p1, p2, p3 = _split4(xp)
        x00, x10, x20, x30 = _split4(p0)
        x01, x11, x21, x31 = _split4(p1)
        x02, x12, x22, x32 = _split4(p2)
        x03, x13, x23, x33 = _split4(p3)
    else:  # pairs (0, 2), (1, 3); FP8: (0, 1), (2, 3)
        p0, p1 = tl.split(xp)
        x00, x10, x20, x30 = _split4(p0)
        x01, x11, x21, x31 = _split4(p1)
        x02, x12, x22, x32 = x00, x10, x20, x30
        x03, x13, x23, x33 = x00, x10, x20, x30
    d = _step(q0, x00[None], x01[None], x02[None], x03[None], q0, BITS, FP8, ASM, True, False)
    d = _step(q1, x10[None], x11[None], x12[None], x13[None], d, BITS, FP8, ASM, False, False)
    d = _step(q2, x20[None], x21[None], x22[None], x23[None], d, BITS, FP8, ASM, False, False)
    return _step(q3, x30[None], x31[None], x32[None], x33[None], d, BITS, FP8, ASM, False, True), xsum


@triton.jit
def _qgemv_pairs_kernel(x_ptr, w_ptr, s_ptr, b_ptr, bias_ptr, y_ptr, N, KW, stride_w, stride_s, ngroups,
                        BITS: tl.constexpr, FP8: tl.constexpr, SYMM: tl.constexpr, HAS_BIAS: tl.constexpr,
                        G: tl.constexpr, CODE_SHIFT: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr, GATED: tl.constexpr = 0):
    """A program's tile is [BLOCK_N rows, BLOCK_W words] = [rows, chains, 4 words]. Each chain's
    fp32 sum takes its (row, group)'s scale (and offset; a chain lies in one group) into an fp32
    accumulator, reduced once at the end. The next tile's words are loaded before this one's
    arithmetic (a tile ahead in registers); the first is loaded before x exists (with PDL: while
    the kernel before finishes). EVEN: N and the row's words are whole tiles (no masks but the
    look-ahead's).
    GATED (1 SiLU, 2 GELU-tanh): W is a gate/up projection, its N rows the gate's N/2 then the
    up's. A program's rows alternate between the two, gate row i then up row i, so that its
    epilogue writes act(gate_i) * up_i for BLOCK_N / 2 outputs (y [N / 2]): no kernel of its own
    for the activation, and the products never leave the registers."""
    CODES: tl.constexpr = 32 // BITS
    NCH: tl.constexpr = BLOCK_W // 4
    if GATED:
        HALF: tl.constexpr = BLOCK_N // 2
        j = tl.arange(0, BLOCK_N)
        out_n = tl.program_id(0) * HALF + j // 2
        offs_n = out_n + (j % 2) * (N // 2)
        nmask = out_n < N // 2
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + tl.arange(0, BLOCK_W)[None, :]
    srows = (offs_n.to(tl.int64) * stride_s)[:, None]
    chain = 4 * tl.arange(0, NCH)  # first words of the tile's chains
    acc = tl.zeros([BLOCK_N, NCH], tl.float32)
    if EVEN:
        q = tl.load(rows, eviction_policy="evict_first")
    else:
        q = tl.load(rows, mask=nmask[:, None] & (tl.arange(0, BLOCK_W) < KW)[None, :], other=0,
                    eviction_policy="evict_first")
    pdl_wait(PDL)
    for w0 in range(0, KW, BLOCK_W):
        nxt = w0 + BLOCK_W
        if EVEN:
            q_next = tl.load(rows + nxt, mask=tl.full([BLOCK_N, BLOCK_W], nxt, tl.int32) < KW, other=0,
                             eviction_policy="evict_first")
        else:
            q_next = tl.load(rows + nxt, mask=nmask[:, None] & (nxt + tl.arange(0, BLOCK_W) < KW)[None, :],
                             other=0, eviction_policy="evict_first")
        d, xs = _chains(tl.reshape(q, [BLOCK_N, NCH, 4]), x_ptr, w0 + chain, KW, BITS, FP8, ASM)
        gs = (w0 + chain) * CODES // G
        if EVEN:
            s = tl.load(s_ptr + srows + gs[None, :]).to(tl.float32)
        else:
            s = tl.load(s_ptr + srows + gs[None, :], mask=nmask[:, None] & (gs < ngroups)[None, :],
                        other=0.0).to(tl.float32)
        if SYMM:
            acc += s * d
        else:  # offsets (with the centre taken back): b times x's sum over the chain's inputs
            CENTRE: tl.constexpr = 1 << (BITS - 1)
            b = tl.load(b_ptr + srows + gs[None, :], mask=nmask[:, None] & (gs < ngroups)[None, :],
                        other=0.0).to(tl.float32) + CENTRE * s
            acc += s * d + b * (xs * (1.0 / (1 << CODE_SHIFT)))[None, :]
        q = q_next
    y = tl.sum(acc, 1) * (1 << CODE_SHIFT)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    if GATED:
        gate, up = tl.split(tl.reshape(y, [HALF, 2]))
        if GATED == 1:
            act = silu_mul(gate, up)
        else:
            act = gelu_tanh_mul(gate, up)
        offs_o = tl.program_id(0) * HALF + tl.arange(0, HALF)
        tl.store(y_ptr + offs_o, act.to(y_ptr.dtype.element_ty), mask=offs_o < N // 2)
    else:
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=nmask)


GATED_ACTS = {act: i + 1 for i, act in enumerate(ACTIVATIONS)}  # the pairs kernel's GATED: 1 SiLU, 2 GELU-tanh


def pairs_fit(bits: int, k: int, group_size: int, ngroups: int, has_g_idx: bool) -> bool:
    """Whether the pairs kernel takes this layout: codes of 4 or 8 bits (FP8: 8), rows of whole words,
    no act-order table, groups of whole chains of words (or one group per row)."""
    codes = 32 // bits
    if bits not in (4, 8) or has_g_idx or k % codes:
        return False
    return ngroups == 1 or group_size % (CHAIN * codes) == 0


def qgemv_pairs_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
                       bias: torch.Tensor | None, bits: int, group_size: int, k: int,
                       config: dict[str, int], act: str | None = None) -> torch.Tensor:
    """As ``qgemv_words_triton`` for 16-bit x (``pairs_fit`` must hold). ``act`` ("silu",
    "gelu_tanh"): W is a gate/up projection (gate rows first) and y [1, N / 2] = act(gate) * up."""
    n = qweight.shape[0]
    words = qweight.view(torch.uint8).view(torch.int32)
    rows = n // 2 if act else n  # outputs
    per_program = config["block_n"] // 2 if act else config["block_n"]
    y = torch.empty(1, rows, dtype=x.dtype, device=x.device)
    fp8 = qweight.dtype == torch.float8_e4m3fn
    symm = biases is None  # FP8: symmetric about 0
    _qgemv_pairs_kernel[(triton.cdiv(rows, per_program),)](
        x, words, scales, biases if biases is not None else scales, bias if bias is not None else scales, y,
        n, k * bits // 32, words.stride(0), scales.stride(0), scales.shape[1],
        BITS=bits, FP8=fp8, SYMM=symm, HAS_BIAS=bias is not None,
        G=group_size if scales.shape[1] > 1 else 1 << 30, CODE_SHIFT=CODE_SHIFT[bits, fp8], ASM=not INTERPRET,
        EVEN=rows % per_program == 0 and (k * bits // 32) % config["block_w"] == 0,
        BLOCK_N=config["block_n"], BLOCK_W=config["block_w"], GATED=GATED_ACTS[act] if act else 0,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **pdl_launch(x))
    return y
