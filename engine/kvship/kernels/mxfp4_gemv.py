"""gpt-oss's MXFP4 experts for a few tokens (decode): GEMVs that stream the chosen experts' codes.

The grouped GEMMs (kernels/gpt_oss_moe.py) pad each expert's rows to a tensor-core tile and
decode every code once per tile; at one to a few tokens the step is a read of k experts'
codes, and what bounds it is the instructions a code takes. Here a gate/up program takes one
pair (token, expert) and BLOCK_N of its outputs (gate and up rows), a down program one token's
k experts and BLOCK_N rows of each; they stream [rows, BLOCK_G groups, 16 bytes] of codes (wide
loads, 16 bytes one group of 32 inputs) and one scale byte a group. Two decodes (a setting):

- float32: each code's bits placed in a float16 (sign at bit 15, exponent and mantissa at bits
  11..9: the value times 2 ** -14 exactly, 0.5 a subnormal), widened, one FMA with x (even
  inputs in the low nibbles: x's even and odd halves taken once per tile);
- packed pairs (below): two codes a float16x2 instruction, under half the instructions.

Sums are float32 per (row, group); the group's e8m0 scale acts once per 32 inputs. The programs
of one row block and all pairs are launched together (pair fastest), so tokens that pick the
same expert read it from L2. The gate/up kernel ends in the clamped SwiGLU (biases added); the
down kernel sums the k experts (router weights and biases) in registers and writes the layer's
output: no alignment by expert, no padded rows, no reduction after. Shapes depend on (T, k)
only: CUDA graph safe. The reference is kernels/gpt_oss_moe.py's ``gpt_oss_moe_torch``."""
from __future__ import annotations

import torch

from kvship.kernels._triton import INTERPRET, pdl_launch, pdl_wait, tl, triton
from kvship.kernels.quant_gemv import _half, _pair, _split4
from kvship.kernels.tuning.moe import MXFP4_GEMV

GROUP = 32  # inputs per e8m0 scale; 16 code bytes
_GROUP = tl.constexpr(GROUP)  # the kernels' copy


@triton.jit
def _e2m1_times_2_pow_m14(c):
    """Codes (int32, 0..15) -> float32 values times 2 ** -14, exactly, via float16 bits."""
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale(s, EXTRA: tl.constexpr):
    """e8m0 bytes -> 2 ** (s - 127 + EXTRA) as float32 bits (exact; 2 ** -127 alone becomes 0)."""
    return ((s.to(tl.int32) + EXTRA) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _sums_f32(q, xe, xd):
    """[.., BLOCK_G] float32: code bytes q [.., BLOCK_G, 16] (int32) times x's even (low nibble)
    and odd (high nibble) inputs xe, xd (broadcast against q), per group, times 2 ** -14."""
    return tl.sum(_e2m1_times_2_pow_m14(q & 15) * xe + _e2m1_times_2_pow_m14(q >> 4) * xd, -1)


# ---- packed pairs: two codes per instruction --------------------------------------------------
# The float32 decode above spends about five instructions a code. Here a 32-bit word
# (8 codes, code j = input j) is taken as 4 float16 pairs, codes (j, j + 4) in the two halves:
# shifted left so that their signs sit at bits 15 and 31, and so that their exponent and mantissa
# bits sit at 11..9 and 27..25, one AND and one LOP3 make the pair's float16 bits (the values
# times 2 ** -14, as above), one mul.rn.f16x2 by 2 ** 14 makes them exact values, one
# fma.rn.f16x2 multiplies them by x's pair (inputs j, j + 4 as float16) into the word's sum,
# which leaves for float32 after its 4 pairs. x's pairs hold x / 16 (the 16 back in the group's
# scale): 8 products of |code| <= 6 stay in float16 for any |x| under 21800 (activations with
# outliers in the thousands), and only inputs under 1e-3 fall to float16's subnormals, whose
# error (under 1e-6 of x) nothing here notices. Under two integer instructions a code.
PAIR_SHIFTS = ((12, 9), (8, 5), (4, 1), (0, -3))  # pair j: left shifts (right if < 0) for sign, for the rest
SIGNS, MAGNITUDES = 0x80008000, 0x0E000E00
F16_2_POW_14 = 0x7400
X_PAIR_SCALE = tl.constexpr(1 / 16)


def _shift_ptx(dst: str, src: str, n: int) -> str:
    return f"shl.b32 {dst}, {src}, {n};" if n >= 0 else f"shr.b32 {dst}, {src}, {-n};"


def _word_ptx() -> str:
    """$0 (f32) = the word $1's 8 decoded codes times x's pairs $2..$5, summed."""
    lines = [".reg .b32 t, u, w, k, a;", ".reg .f16 lo, hi;", ".reg .f32 flo, fhi;",
             f"mov.b32 k, {F16_2_POW_14 * 0x10001:#010x};"]
    for j, (sign, rest) in enumerate(PAIR_SHIFTS):
        lines += [_shift_ptx("t", "$1", sign), _shift_ptx("u", "$1", rest), f"and.b32 t, t, {SIGNS:#010x};",
                  f"lop3.b32 w, u, {MAGNITUDES:#010x}, t, 0xEA;", "mul.rn.f16x2 w, w, k;",
                  f"mul.rn.f16x2 a, w, ${2 + j};" if j == 0 else f"fma.rn.f16x2 a, w, ${2 + j}, a;"]
    lines += ["mov.b32 {lo, hi}, a;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", "add.f32 $0, flo, fhi;"]
    return "{\n" + "\n".join(lines) + "\n}"


_WORD_PTX = tl.constexpr(_word_ptx())


@triton.jit
def _pair_bits(q, SIGN: tl.constexpr, REST: tl.constexpr):
    """The interpreter's shifts, AND and LOP3 of one pair (int32: 0x80008000 is -0x7FFF8000)."""
    t = q << SIGN
    if REST >= 0:
        u = q << REST
    else:
        u = q >> -REST  # arithmetic: the bits it brings in are masked off
    return (t & -0x7FFF8000) | (u & 0x0E000E00)


@triton.jit
def _pair_fma(a_lo, a_hi, w, xp):
    """The interpreter's mul.rn.f16x2 by 2 ** 14 and fma.rn.f16x2 with x's pair xp."""
    k = tl.full(w.shape, 16384.0, tl.float16)
    return a_lo + _half(w, False) * k * _half(xp, False), a_hi + _half(w, True) * k * _half(xp, True)


@triton.jit
def _word_sums(q, x0, x1, x2, x3, ASM: tl.constexpr):
    """float32 [..]: each word of q (int32) decoded and multiplied by x's pairs x0..x3 (int32
    holding two float16: inputs j and j + 4 of the word), summed."""
    if ASM:
        out = tl.inline_asm_elementwise(_WORD_PTX, "=f,r,r,r,r,r", [q, x0, x1, x2, x3], dtype=tl.float32,
                                        is_pure=True, pack=1)
    else:
        a_lo = tl.zeros(q.shape, tl.float16)
        a_hi = tl.zeros(q.shape, tl.float16)
        a_lo, a_hi = _pair_fma(a_lo, a_hi, _pair_bits(q, 12, 9), x0)
        a_lo, a_hi = _pair_fma(a_lo, a_hi, _pair_bits(q, 8, 5), x1)
        a_lo, a_hi = _pair_fma(a_lo, a_hi, _pair_bits(q, 4, 1), x2)
        a_lo, a_hi = _pair_fma(a_lo, a_hi, _pair_bits(q, 0, -3), x3)
        out = a_lo.to(tl.float32) + a_hi.to(tl.float32)
    return out


@triton.jit
def _x_tile(x_rows, gs, gmask, PAIRS: tl.constexpr, ASM: tl.constexpr):
    """x's inputs in groups gs as the codes take them, made once per tile for all its rows;
    x_rows: a row's first input (or [R, 1, 1, 1] of them). PAIRS: 4 int32 [(R,) BLOCK_G, 4 words]
    (pair j: inputs j and j + 4 of each word as float16); else float32 [(R,) BLOCK_G, 16] even
    and odd inputs (twice)."""
    if PAIRS:
        xo = (gs * _GROUP)[:, None, None] + (tl.arange(0, 4) * 8)[None, :, None] + tl.arange(0, 4)[None, None, :]
        xm = gmask[:, None, None]
        xp = _pair(tl.load(x_rows + xo, mask=xm, other=0.0).to(tl.float32) * X_PAIR_SCALE,
                   tl.load(x_rows + xo + 4, mask=xm, other=0.0).to(tl.float32) * X_PAIR_SCALE, ASM)
        x0, x1, x2, x3 = _split4(xp)
    else:
        xo = (gs * _GROUP)[:, None, None] + (2 * tl.arange(0, 16))[None, :, None] + tl.arange(0, 2)[None, None, :]
        x0, x1 = tl.split(tl.load(x_rows + xo, mask=gmask[:, None, None], other=0.0).to(tl.float32))
        x2, x3 = x0, x1
    return x0, x1, x2, x3


@triton.jit
def _x_pairs_kernel(x_ptr, xp_ptr, NG, stride_x, stride_xp, BLOCK_G: tl.constexpr, ASM: tl.constexpr,
                    PDL: tl.constexpr):
    """One token's x as ``_x_tile``'s pairs, stored in the codes' order: xp[t, g, j, w] holds
    inputs j and j + 4 of word w of group g. The kernels then load them in their code tile's
    own layout, no exchange between threads (BLOCK_G: NG rounded up to a power of 2)."""
    pdl_wait(PDL)  # x comes from the kernel before
    t = tl.program_id(0).to(tl.int64)
    gs = tl.arange(0, BLOCK_G)
    x0, x1, x2, x3 = _x_tile(x_ptr + t * stride_x, gs, gs < NG, True, ASM)  # each [BLOCK_G, 4 words]
    out = xp_ptr + t * stride_xp + (gs * 16)[:, None] + tl.arange(0, 4)[None, :]
    m = (gs < NG)[:, None]
    tl.store(out, x0, mask=m)
    tl.store(out + 4, x1, mask=m)
    tl.store(out + 8, x2, mask=m)
    tl.store(out + 12, x3, mask=m)


@triton.jit
def _x_words(xp_row, gs, NG, shape: tl.constexpr):
    """``_x_pairs_kernel``'s words of groups gs (those from NG on masked off), 4 int32 of the code
    tile's shape [.., BLOCK_G, 4 words] (pair j of each word): each thread loads those its own
    codes take (from L1)."""
    off = (gs * 16)[:, None] + tl.arange(0, 4)[None, :] + tl.zeros(shape, tl.int32)
    m = off < NG * 16
    return (tl.load(xp_row + off, mask=m, other=0), tl.load(xp_row + off + 4, mask=m, other=0),
            tl.load(xp_row + off + 8, mask=m, other=0), tl.load(xp_row + off + 12, mask=m, other=0))


@triton.jit
def _load(rows, srows, rmask, g0, NG, BLOCK_G: tl.constexpr, PAIRS: tl.constexpr):
    """Codes and scales of rows [.., 1] (each row's first code byte, or word for PAIRS; srows:
    its first scale; rmask: which are real) in groups g0 .. g0 + BLOCK_G: q int32 [.., BLOCK_G,
    4 words or 16 bytes], s [.., BLOCK_G]. Groups from NG on are masked off (the look-ahead)."""
    gs = g0 + tl.arange(0, BLOCK_G)
    m = rmask & (gs < NG)
    s = tl.load(srows + gs, mask=m, other=0, eviction_policy="evict_first")
    if PAIRS:
        q = tl.load(tl.expand_dims(rows, -1) + (gs * 4)[:, None] + tl.arange(0, 4)[None, :],
                    mask=tl.expand_dims(m, -1), other=0, eviction_policy="evict_first")
    else:
        q = tl.load(tl.expand_dims(rows, -1) + (gs * 16)[:, None] + tl.arange(0, 16)[None, :],
                    mask=tl.expand_dims(m, -1), other=0, eviction_policy="evict_first").to(tl.int32)
    return q, s


@triton.jit
def _sums(q, s, x0, x1, x2, x3, PAIRS: tl.constexpr, ASM: tl.constexpr):
    """[.., BLOCK_G] float32: ``_load``'s tile times x's inputs (``_x_tile``, shaped to broadcast
    against q), per group and scaled."""
    if PAIRS:
        out = tl.sum(_word_sums(q, x0, x1, x2, x3, ASM), -1) * _scale(s, 4)  # the 16 x's pairs leave out
    else:
        out = _sums_f32(q, x0, x1) * _scale(s, 14)  # the 2 ** 14 the decode leaves out
    return out


@triton.jit
def _stream(rows, srows, rmask, x_rows, q, s, NG, BLOCK_G: tl.constexpr, PAIRS: tl.constexpr, ASM: tl.constexpr,
            X_WORDS: tl.constexpr = False):
    """[R, BLOCK_N] float32 sums of rows [R, BLOCK_N, 1] times x (x_rows: one row's first input,
    or [R, 1, 1, 1] of them; for X_WORDS, one row of ``_x_pairs_kernel``'s words), the first
    tile (q, s) already loaded; each next tile is loaded before this one's arithmetic (a tile
    ahead in registers)."""
    acc = tl.zeros(s.shape, tl.float32)
    for g0 in range(0, NG, BLOCK_G):
        q_next, s_next = _load(rows, srows, rmask, g0 + BLOCK_G, NG, BLOCK_G, PAIRS)
        gs = g0 + tl.arange(0, BLOCK_G)
        if X_WORDS:  # already in q's shape
            x0, x1, x2, x3 = _x_words(x_rows, gs, NG, q.shape)
            acc += _sums(q, s, x0, x1, x2, x3, PAIRS, ASM)
        else:
            x0, x1, x2, x3 = _x_tile(x_rows, gs, gs < NG, PAIRS, ASM)  # [(R,) BLOCK_G, ..], once for every row
            if len(x0.shape) == 2:
                acc += _sums(q, s, x0[None, None], x1[None, None], x2[None, None], x3[None, None], PAIRS, ASM)
            else:
                acc += _sums(q, s, x0[:, None], x1[:, None], x2[:, None], x3[:, None], PAIRS, ASM)
        q, s = q_next, s_next
    return tl.sum(acc, 2)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, h_ptr, ids_ptr, N, K, stride_x, stride_we, stride_wn, stride_se,
                    stride_sn, stride_be, stride_h, alpha, limit, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_G: tl.constexpr, PAIRS: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
                    X_WORDS: tl.constexpr = False, H_WORDS: tl.constexpr = False,
                    H_DTYPE: tl.constexpr = tl.bfloat16):
    """h[pair, n] for n in this program's BLOCK_N of the N intermediate outputs: the clamped SwiGLU
    of gate row n and up row N + n of the pair's expert, biases added. The tile holds both.
    X_WORDS: x given as ``_x_pairs_kernel``'s words. H_WORDS: h written as ``_x_pairs_kernel``
    writes x (h_ptr: those words as float16 halves), rounded to H_DTYPE first as a 16-bit h
    would be, for the down kernel's packed pairs."""
    pdl_wait(PDL)  # the routing and x come from the kernels before
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    n = tl.arange(0, 2)[:, None] * N + offs_n[None, :]  # gate rows, up rows
    rows = (w_ptr + expert * stride_we + n.to(tl.int64) * stride_wn)[:, :, None]
    srows = (s_ptr + expert * stride_se + n.to(tl.int64) * stride_sn)[:, :, None]
    NG = K // _GROUP
    q, s = _load(rows, srows, nmask[None, :, None], 0, NG, BLOCK_G, PAIRS)
    y = _stream(rows, srows, nmask[None, :, None], x_ptr + (pair // TOP_K).to(tl.int64) * stride_x, q, s, NG,
                BLOCK_G, PAIRS, ASM, X_WORDS)
    y += tl.load(bias_ptr + expert * stride_be + n, mask=nmask[None, :], other=0.0)
    gate, up = tl.split(tl.trans(y))
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    if H_WORDS:  # input n is half n // 4 % 2 of pair n % 4 of word n // 8 % 4 of group n // 32
        half = ((offs_n // _GROUP * 4 + offs_n % 4) * 4 + offs_n // 8 % 4) * 2 + offs_n // 4 % 2
        tl.store(h_ptr + pair.to(tl.int64) * stride_h + half,
                 (h.to(H_DTYPE).to(tl.float32) * X_PAIR_SCALE).to(tl.float16), mask=nmask)
    else:
        tl.store(h_ptr + pair.to(tl.int64) * stride_h + offs_n, h.to(h_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, rw_ptr, ids_ptr, N, K, stride_h, stride_we, stride_wn,
                 stride_se, stride_sn, stride_be, stride_out, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, PAIRS: tl.constexpr, ASM: tl.constexpr,
                 PDL: tl.constexpr, X_WORDS: tl.constexpr = False):
    """out[token, n] = sum over the token's k pairs of weight * (W2[e, n] . h[pair] + b2[e, n]).
    A program's tile holds BLOCK_N rows of each of the k experts (padded to K_POW2: repeats of
    the last, weighted 0), so that one token's few programs keep k times the bytes in flight.
    Its first tile is loaded before the wait for h: the routing it needs was waited for by the
    gate/up kernel, which lets this one launch only after that."""
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    j = tl.arange(0, K_POW2)
    pairs = token * TOP_K + tl.minimum(j, TOP_K - 1)
    experts = tl.load(ids_ptr + pairs).to(tl.int64)
    rows = (w_ptr + experts[:, None] * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn)[:, :, None]
    srows = (s_ptr + experts[:, None] * stride_se + offs_n.to(tl.int64)[None, :] * stride_sn)[:, :, None]
    NG = K // _GROUP
    q, s = _load(rows, srows, nmask[None, :, None], 0, NG, BLOCK_G, PAIRS)
    pdl_wait(PDL)  # h comes from the gate/up kernel
    y = _stream(rows, srows, nmask[None, :, None], (h_ptr + pairs.to(tl.int64) * stride_h)[:, None, None, None],
                q, s, NG, BLOCK_G, PAIRS, ASM, X_WORDS)
    bias = tl.load(bias_ptr + experts[:, None] * stride_be + offs_n[None, :], mask=nmask[None, :], other=0.0)
    weight = tl.load(rw_ptr + pairs, mask=j < TOP_K, other=0.0)
    y = tl.sum(weight[:, None] * (y + bias), 0)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + offs_n, y.to(out_ptr.dtype.element_ty), mask=nmask)


def gemv_settings(tokens: int) -> tuple[dict, dict] | None:
    """(gate/up, down) settings for this many tokens, or None: the grouped GEMMs take them."""
    return next(((gu, dn) for bound, gu, dn in MXFP4_GEMV if tokens <= bound), None)


def mxfp4_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w13_bias: torch.Tensor,
                   w2: torch.Tensor, w2_scale: torch.Tensor, w2_bias: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, alpha: float, limit: float, gate_up: dict, down: dict) -> torch.Tensor:
    """x [T, H]; MXFP4 stacks w13 [E, 2I, H / 2] (gate rows, then up) and w2 [E, H, I / 2] with
    scales [.., K / 32] and float32 biases; the router's (weights, ids) [T, k] -> [T, H].
    ``gate_up`` / ``down``: {"block_n", "block_g", "num_warps", "pairs", "x_words"}
    (kernels/tuning/moe.py; pairs: 1 for the packed-pair decode, else the float32 one; x_words: 1
    for its input as pair words made once, by a small kernel for x, by the gate/up kernel for
    h, and loaded in the code tile's layout: no exchange between threads each tile, one launch
    more for x)."""
    tokens, top_k = ids.shape
    inter, hidden = w13.shape[1] // 2, x.shape[1]
    if hidden % GROUP or inter % GROUP:
        raise ValueError(f"MXFP4 rows of {hidden} and {inter} inputs: not whole groups of {GROUP}")
    x = x.contiguous()
    ids, rw = ids.flatten().contiguous(), weights.flatten().float().contiguous()
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    gu_w, dn_w = (_words(w13, gate_up), _words(w2, down))
    if _x_words_on(gate_up):  # x as the packed pairs' words, made once for all the programs
        ng = hidden // GROUP
        xp = torch.empty(tokens, ng * 16, dtype=torch.int32, device=x.device)
        _x_pairs_kernel[(tokens,)](x, xp, ng, x.stride(0), xp.stride(0), BLOCK_G=triton.next_power_of_2(ng),
                                   ASM=not INTERPRET, **pdl_launch(x))
        x = xp
    h_words = _x_words_on(down)  # h as the packed pairs' words, written so by the gate/up kernel
    h = torch.empty(tokens * top_k, inter // GROUP * 16 if h_words else inter,
                    dtype=torch.int32 if h_words else out.dtype, device=x.device)
    h_out = h.view(torch.float16) if h_words else h
    _gate_up_kernel[(tokens * top_k, triton.cdiv(inter, gate_up["block_n"]))](
        x, gu_w, w13_scale, w13_bias, h_out, ids, inter, hidden, x.stride(0), gu_w.stride(0), gu_w.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), w13_bias.stride(0), h_out.stride(0), float(alpha), float(limit),
        TOP_K=top_k, H_WORDS=h_words, H_DTYPE=_TL_DTYPES[out.dtype], **_launch(gate_up, x))
    _down_kernel[(tokens, triton.cdiv(hidden, down["block_n"]))](
        h, dn_w, w2_scale, w2_bias, out, rw, ids, hidden, inter, h.stride(0), dn_w.stride(0), dn_w.stride(1),
        w2_scale.stride(0), w2_scale.stride(1), w2_bias.stride(0), out.stride(0), TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k), **_launch(down, x))
    return out


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _x_words_on(settings: dict) -> bool:
    """Whether a kernel takes its input as the packed pairs' words (a setting of the pair decode)."""
    return bool(settings.get("pairs") and settings.get("x_words"))


def _words(codes: torch.Tensor, settings: dict) -> torch.Tensor:
    """The codes as the kernel reads them: bytes, or int32 words for the packed pairs."""
    return codes.view(torch.int32) if settings.get("pairs") else codes


def _launch(settings: dict, x: torch.Tensor) -> dict:
    return dict(BLOCK_N=settings["block_n"], BLOCK_G=settings["block_g"], PAIRS=bool(settings.get("pairs")),
                X_WORDS=_x_words_on(settings),
                ASM=not INTERPRET, num_warps=settings["num_warps"], **pdl_launch(x))
