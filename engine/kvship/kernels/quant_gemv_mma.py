"""Small-batch GEMV (decode at 2 to 8 sequences) for 4-bit codes in groups of 128 (or one group
a row) beside 16-bit x, on the tensor cores: y [M, N] = x [M, K] W^T for M <= 8, reading the
weights once for all M rows, where the dequantizing GEMM of kernels/quant_linear.py pads M to a
16-row tile and the one-row kernels would read the weights M times. The codes become 16-bit
values by bit operations alone and mma.sync multiplies them by x: a word of 8 codes costs 7
integer instructions and one mma. (One row stays on kernels/quant_gemv.py's pairs kernel, which
is faster there.)

Codes as 16-bit values: ``(w >> 4p) & 0x000F000F`` holds codes p and p + 4 of word w in its two
halves, and OR-ing MAGIC's bits into both halves makes them the pair (MAGIC + c_p, MAGIC + c_p+4)
exactly: bf16 128 + c (step 1 between 128 and 256), fp16 1024 + c (step 1 between 1024 and
2048). x's pair for it is (x_p, x_p+4), one byte permute of two of x's 32-bit words. Each
product and the sums run in fp32 in the tensor cores, and the group's result is

    sum_k (MAGIC + c_k) x_k = sum_k c_k x_k + MAGIC sum_k x_k,

so the kernel takes MAGIC times x's sum back (one more mma, of ones by x) before the group's
scale and offset: s (sum c x - MAGIC sum x) + b sum x, with b = -8 s for symmetric codes. The
cancelled term is at most about MAGIC * 128 |x|max, which fp32 holds to 2**-24 of itself.

The mma's operands (m16n8k16, A row-major and B column-major, fp32 accumulators):
- A, 16 rows by 16 inputs, is the weights. A program's tile is [8, warps, ROWS // 8, 16 words]:
  lane 4g + t holds words 4t..4t+3 of rows g, g + 8, .. (16-byte vectors), warps take different
  groups along the row. That is the layout Triton gives this load (sizePerThread 4 words,
  threadsPerWarp [8, .., 4]); the PTX relies on it, and tests/test_quant_gemv_mma.py checks the
  compiled layout. A's register i of lane (g, t) holds row g (i = 0, 2) or row g + 8 (i = 1, 3)
  at inputs 2t, 2t + 1 (i < 2) or 2t + 8, 2t + 9. Any order of the 16 inputs works if B uses the
  same, so an mma takes pairs p and p + 1 of word j of each lane, and word j's inputs across
  lanes t are those of words 4t + j: the 16 words are one group of 128 codes, summed whole by 8
  mmas.
- B, 16 inputs by 8 columns, is x: lane (g, t) gives the pairs of token g's x for its own words
  (tokens past M repeat the last; their sums are dropped).
- C: lane (g, t) holds the sums of rows g and g + 8 for tokens 2t and 2t + 1.

The next tile's words, scales and offsets are loaded before this one's mmas. The kernel runs
only on the GPU (PTX); the interpreter computes the same sums with Triton operations (ASM=False).
Its reference is quant_linear.py's: dequantize, then F.linear.
"""
from __future__ import annotations

import functools

import torch

from kvship.kernels._triton import INTERPRET, pdl_launch, pdl_wait, tl, triton
from kvship.quant.tensor import code_centre

MAX_TOKENS = 8  # the mma's 8 columns: one token each
GROUP_WORDS = 16  # words of a tile's row: one group of 128 4-bit codes, the 4 lanes t of 4 words each
MAGIC = {torch.bfloat16: (128, 0x43004300), torch.float16: (1024, 0x64006400)}  # value, its bits in both halves
_GW = tl.constexpr(GROUP_WORDS)


def mma_fit(bits: int, k: int, group_size: int, ngroups: int, has_g_idx: bool, dtype: torch.dtype) -> bool:
    """Whether this kernel takes the layout: 4-bit codes beside bf16 or fp16 x, rows of whole
    128-code groups, groups of a multiple of 128 codes (or one a row), no act-order table."""
    if bits != 4 or has_g_idx or dtype not in MAGIC or k % (8 * GROUP_WORDS):
        return False
    return ngroups == 1 or group_size % (8 * GROUP_WORDS) == 0


def _mma_ptx(bf16: bool, vectors: int) -> str:
    """PTX of one call for a lane's ``vectors`` 16-byte vectors of 4 words (pack 4 * vectors),
    vector v holding row g + 8 v of the program's rows. Operands, 4 * vectors each, in order: the
    accumulators out; the words; x's address for each word (element 0's is read: the lane's 4
    words' x, 64 contiguous bytes); the scales and the offsets as fp32 (element 4 v's is
    vector v's); the accumulators in. Vectors 2 i and 2 i + 1 are the A operand's rows g and g + 8."""
    kind = "bf16" if bf16 else "f16"
    magic, magic_bits = MAGIC[torch.bfloat16 if bf16 else torch.float16]
    ones = 0x3F803F80 if bf16 else 0x3C003C00
    zero = "0f00000000"
    e = 4 * vectors  # operands per tensor
    out, words, xptr, sc, off, acc = (list(range(i * e, (i + 1) * e)) for i in range(6))
    lines = [".reg .b32 xw<16>, xp<16>, p<8>, t, ones;", ".reg .f32 c<4>, e<4>, v;", f"mov.b32 ones, {ones:#010x};"]
    lines += [f"ld.global.v4.b32 {{xw{4 * j}, xw{4 * j + 1}, xw{4 * j + 2}, xw{4 * j + 3}}}, [${xptr[0]} + {16 * j}];"
              for j in range(4)]
    for j in range(4):  # word j's x pairs (x_p, x_p+4), p = 0..3
        x01, x23, x45, x67 = (f"xw{4 * j + i}" for i in range(4))
        lines += [f"prmt.b32 xp{4 * j}, {x01}, {x45}, 0x5410;", f"prmt.b32 xp{4 * j + 1}, {x01}, {x45}, 0x7632;",
                  f"prmt.b32 xp{4 * j + 2}, {x23}, {x67}, 0x5410;", f"prmt.b32 xp{4 * j + 3}, {x23}, {x67}, 0x7632;"]
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    lines += [f"mov.f32 e{i}, {zero};" for i in range(4)]
    for j in range(4):  # x's sum over the group: ones times x
        for q in (0, 2):
            lines.append(f"{mma} {{e0, e1, e2, e3}}, {{ones, ones, ones, ones}}, {{xp{4 * j + q}, xp{4 * j + q + 1}}}, "
                         "{e0, e1, e2, e3};")
    for i in range(vectors // 2):
        va, vb = 2 * i, 2 * i + 1
        lines += [f"mov.f32 c{k}, {zero};" for k in range(4)]
        for j in range(4):
            for pr in range(4):  # p0..p3: row a's pairs, p4..p7: row b's
                for base, v in ((0, va), (4, vb)):
                    src = f"${words[4 * v + j]}"
                    if pr:
                        lines.append(f"shr.u32 t, {src}, {4 * pr};")
                        src = "t"
                    lines.append(f"lop3.b32 p{base + pr}, {src}, 0x000F000F, {magic_bits:#010x}, 0xEA;")
            for q in (0, 2):
                lines.append(f"{mma} {{c0, c1, c2, c3}}, {{p{q}, p{4 + q}, p{q + 1}, p{5 + q}}}, "
                             f"{{xp{4 * j + q}, xp{4 * j + q + 1}}}, {{c0, c1, c2, c3}};")
        for v, cs in ((va, ("c0", "c1")), (vb, ("c2", "c3"))):  # tokens 2t, 2t + 1: s (c - MAGIC e) + b e
            for k, (c, ek) in enumerate(zip(cs, ("e0", "e1"))):
                lines += [f"fma.rn.f32 v, {ek}, {_f32(-magic)}, {c};", f"mul.rn.f32 v, v, ${sc[4 * v]};",
                          f"fma.rn.f32 v, ${off[4 * v]}, {ek}, v;", f"add.f32 ${out[4 * v + k]}, ${acc[4 * v + k]}, v;"]
            lines += [f"mov.f32 ${out[4 * v + k]}, ${acc[4 * v + k]};" for k in (2, 3)]
    return "{\n" + "\n".join(lines) + "\n}"


def _f32(value: float) -> str:
    """A PTX fp32 literal."""
    bits = torch.tensor(value, dtype=torch.float32).view(torch.int32).item()
    return "0f" + bits.to_bytes(4, "big", signed=True).hex()


def _scale_ptx(vectors: int) -> str:
    """fp16 values at each vector's element-0 address ($4v of the pointers), as fp32 in all its 4
    elements."""
    e = 4 * vectors
    lines = [".reg .b16 h;"]
    for v in range(vectors):
        lines += [f"ld.global.b16 h, [${e + 4 * v}];", f"cvt.f32.f16 ${4 * v}, h;"]
        lines += [f"mov.f32 ${4 * v + k}, ${4 * v};" for k in (1, 2, 3)]
    return "{\n" + "\n".join(lines) + "\n}"


@functools.cache
def _programs(bf16: bool, rows: int) -> dict[str, str]:
    """The kernel's PTX and operand constraints for x's dtype and the rows a program takes (the
    launch passes them as compile-time strings)."""
    e = rows // 2  # elements a lane holds: 4 words of each of rows // 8 rows
    return {"MMA_PTX": _mma_ptx(bf16, rows // 8),
            "MMA_ARGS": ",".join(["=f"] * e + ["r"] * e + ["l"] * e + ["f"] * 3 * e),  # out; words, x, s, b, acc
            "SCALE_PTX": _scale_ptx(rows // 8), "SCALE_ARGS": ",".join(["=f"] * e + ["l"] * e)}


@triton.jit
def _load_scale(p, PTX: tl.constexpr, ARGS: tl.constexpr, PACK: tl.constexpr, ASM: tl.constexpr):
    """fp16 values at p (constant over a lane's 4 words) as fp32."""
    if ASM:
        v = tl.inline_asm_elementwise(PTX, ARGS, [p], dtype=tl.float32, is_pure=True, pack=PACK)
    else:
        v = tl.load(p).to(tl.float32)
    return v


@triton.jit
def _word_sums(q, xp, MAGIC_V: tl.constexpr, BF16: tl.constexpr):
    """The interpreter's path: a word's sums of (MAGIC + c) x and of x over its 8 codes, fp32;
    xp: the word's first x word (x_0, x_1)."""
    s = tl.zeros(q.shape, tl.float32)
    e = tl.zeros(q.shape, tl.float32)
    for p in tl.static_range(4):
        for half in tl.static_range(2):  # code p + 4 half: x_p in word p // 2, x_p+4 in word 2 + p // 2
            xw = tl.load(xp + 2 * half + p // 2)
            bits = (xw >> (16 * (p % 2))) & 0xFFFF
            if BF16:
                xv = (bits << 16).to(tl.float32, bitcast=True)
            else:
                xv = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            c = (q >> (4 * p + 16 * half)) & 0xF
            s += (c.to(tl.float32) + MAGIC_V) * xv
            e += xv
    return s, e


@triton.jit
def _slot_token(slot, M):
    """The token a slot (word position 0..15 of a lane group's tile row) sums: lane t's elements 0
    and 1 (slots 4t, 4t + 1) hold tokens 2t and 2t + 1, its elements 2 and 3 none; and whether
    that is a token of the M."""
    tok = (slot // 4) * 2 + slot % 4
    return tok, (slot % 4 < 2) & (tok < M)


@triton.jit
def _accumulate_interpreted(pw, w0, gw, wmask, x_ptr, xrow, tok_ok, s, b, acc, KW, MAGIC_V: tl.constexpr,
                            BF16: tl.constexpr):
    """The interpreter's path to the same sums: each element (slot) adds its own row's and token's
    sum over the whole group (words gw .. gw + 15 of the tile), reading them again."""
    c = tl.zeros(acc.shape, tl.float32)
    e = tl.zeros(acc.shape, tl.float32)
    for u in tl.static_range(16):
        word = gw + w0 + u
        q = tl.load(pw + word, mask=wmask & (word < KW), other=0)
        cu, eu = _word_sums(q, x_ptr + xrow + 4 * tl.minimum(word, KW - 1), MAGIC_V, BF16)
        c += cu
        e += eu
    return acc + tl.where(tok_ok, s * (c - MAGIC_V * e) + b * e, 0.0)


@triton.jit
def _qgemv_mma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, bias_ptr, y_ptr, M, N, KW, stride_x, stride_y, stride_w, stride_s,
                      HAS_B: tl.constexpr, HAS_BIAS: tl.constexpr, G: tl.constexpr, CENTRE: tl.constexpr,
                      MAGIC_V: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr, ROWS: tl.constexpr,
                      WARPS: tl.constexpr, EVEN: tl.constexpr, MMA_PTX: tl.constexpr, MMA_ARGS: tl.constexpr,
                      SCALE_PTX: tl.constexpr, SCALE_ARGS: tl.constexpr, PDL: tl.constexpr):
    """y [M, N] for M <= 8 tokens. x_ptr: x as int32 words (x_2i, x_2i+1), rows stride_x words
    apart. The program's rows: ROWS (16 or 32) from pid * ROWS. A tile is [8, WARPS, ROWS // 8,
    16 words]: element (g, i, v, w) is word w of group i of the tile in row 8 v + g, so that lanes
    take (g, t), warps the groups, and a thread's vectors the rows 8 apart; lane (g, t) reads
    token g's x (the mma's column g) and sums tokens 2t and 2t + 1 (its elements 0 and 1, the
    slots w = 4t, 4t + 1). G: inputs a group, a multiple of 128 (1 << 30: one group a row).
    HAS_B: offsets stored (else symmetric codes about CENTRE: offset -CENTRE s). EVEN: N a
    multiple of ROWS and the row's words of WARPS * 16 (no masks)."""
    GW: tl.constexpr = _GW
    V: tl.constexpr = ROWS // 8
    STEP: tl.constexpr = WARPS * GW  # words a tile spans along the row
    zero = tl.zeros([8, WARPS, V, GW], tl.int32)
    r2 = tl.program_id(0) * ROWS + tl.arange(0, V)[None, :] * 8 + tl.arange(0, 8)[:, None]  # [8, V]
    rows = r2[:, None, :, None] + zero
    gw = tl.arange(0, WARPS)[None, :, None, None] * GW + zero  # each word's group's first word in the tile
    slot = tl.arange(0, GW)[None, None, None, :] + zero
    cols = gw + slot
    tok, tok_ok = _slot_token(slot, M)
    pw = w_ptr + rows.to(tl.int64) * stride_w
    ps = tl.minimum(rows, N - 1).to(tl.int64) * stride_s  # scale reads stay inside the rows
    if ASM:  # lane (g, t) reads token g's x: the element's dim 0
        xrow = tl.minimum(tl.arange(0, 8), M - 1)[:, None, None, None].to(tl.int64) * stride_x
    else:
        xrow = tl.minimum(tok, M - 1).to(tl.int64) * stride_x
    PACK: tl.constexpr = ROWS // 2  # elements a lane holds
    if EVEN:
        q = tl.load(pw + cols, eviction_policy="evict_first")
        g0 = gw * 8 // G
    else:
        q = tl.load(pw + cols, mask=(rows < N) & (cols < KW), other=0, eviction_policy="evict_first")
        g0 = tl.minimum(gw, KW - GW) * 8 // G
    s = _load_scale(s_ptr + ps + g0, SCALE_PTX, SCALE_ARGS, PACK, ASM)
    if HAS_B:
        b = _load_scale(b_ptr + ps + g0, SCALE_PTX, SCALE_ARGS, PACK, ASM)
    else:
        b = -CENTRE * s
    pdl_wait(PDL)
    acc = tl.zeros([8, WARPS, V, GW], tl.float32)
    for w0 in range(0, KW, STEP):
        nxt = w0 + STEP
        gn = tl.minimum(gw + nxt, KW - GW) * 8 // G  # the next tile's groups (after the last: the last's)
        if EVEN:
            q_next = tl.load(pw + cols + nxt, mask=cols + nxt < KW, other=0, eviction_policy="evict_first")
            live_s = s
            live_b = b
            xp = x_ptr + xrow + 4 * (cols + w0)
        else:
            q_next = tl.load(pw + cols + nxt, mask=(rows < N) & (cols + nxt < KW), other=0,
                             eviction_policy="evict_first")
            # a group past the row's end has zero codes and reads the row's last group's x (the PTX
            # reads a lane's 4 words' x, 64 bytes, from its first word's address: clamping words
            # one by one would let it read past the row); its scale and offset are 0, so that it
            # adds nothing
            live = cols + w0 < KW
            live_s = tl.where(live, s, 0.0)
            live_b = tl.where(live, b, 0.0)
            xp = x_ptr + xrow + 4 * (tl.minimum(gw + w0, KW - GW) + (cols - gw))
        s_next = _load_scale(s_ptr + ps + gn, SCALE_PTX, SCALE_ARGS, PACK, ASM)
        if HAS_B:
            b_next = _load_scale(b_ptr + ps + gn, SCALE_PTX, SCALE_ARGS, PACK, ASM)
        else:
            b_next = -CENTRE * s_next
        if ASM:
            # acc += s (sum (MAGIC + c) x - MAGIC sum x) + b sum x over each group, tokens 2t and
            # 2t + 1 in elements 0 and 1 of lane t's vectors
            acc = tl.inline_asm_elementwise(MMA_PTX, MMA_ARGS, [q, xp, live_s, live_b, acc], dtype=tl.float32,
                                            is_pure=False, pack=PACK)
        else:
            acc = _accumulate_interpreted(pw, w0, gw, rows < N, x_ptr, xrow, tok_ok, live_s, live_b, acc, KW,
                                          MAGIC_V, BF16)
        q = q_next
        s = s_next
        b = b_next
    y = tl.sum(acc, 1)  # [8, V, 16]: row 8 v + g, the token of the slot
    yrow = r2[:, :, None]
    ytok, ytok_ok = _slot_token(tl.arange(0, GW)[None, None, :], M)
    ymask = (yrow < N) & ytok_ok
    if HAS_BIAS:
        y += tl.load(bias_ptr + yrow + 0 * ytok, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_ptr + ytok.to(tl.int64) * stride_y + yrow, y.to(y_ptr.dtype.element_ty), mask=ymask)


def qgemv_mma_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None,
                     bias: torch.Tensor | None, group_size: int, k: int, config: dict[str, int]) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for M <= 8 tokens and 4-bit codes in kernels/quant_linear.py's
    layout (``mma_fit`` must hold; x's rows contiguous); config: {"mma": 1, "rows": 16 or 32,
    "num_warps": W}."""
    m, n = x.shape[0], qweight.shape[0]
    assert m <= MAX_TOKENS and x.stride(1) == 1 and x.stride(0) % 2 == 0
    words = qweight.view(torch.uint8).view(torch.int32)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    warps, rows = config["num_warps"], config["rows"]
    _qgemv_mma_kernel[(triton.cdiv(n, rows),)](
        x.view(torch.int32), words, scales, biases if biases is not None else scales,
        bias if bias is not None else scales, y, m, n, k // 8, x.stride(0) // 2, y.stride(0), words.stride(0),
        scales.stride(0), HAS_B=biases is not None, HAS_BIAS=bias is not None,
        G=group_size if scales.shape[1] > 1 else 1 << 30, CENTRE=float(code_centre(4, False, biases is not None)),
        MAGIC_V=float(MAGIC[x.dtype][0]), BF16=x.dtype == torch.bfloat16, ASM=not INTERPRET, ROWS=rows, WARPS=warps,
        EVEN=n % rows == 0 and (k // 8) % (GROUP_WORDS * warps) == 0, **_programs(x.dtype == torch.bfloat16, rows),
        num_warps=warps, num_stages=1, **pdl_launch(x))
    return y
