"""e2m1 (OCP FP4) decoding in registers, shared by the FP4 kernels (NVFP4 dense and experts,
gpt-oss's MXFP4 experts): codes two a byte, the even input in the low nibble, a scale per group
of inputs. Hopper has no FP4 tensor cores, so the kernels decode a weight tile to the
activations' dtype and multiply on the 16-bit ones (W4A16). The torch side is
kvship.quant.tensor.e2m1_values."""
from __future__ import annotations

from kvship.kernels._triton import tl, triton


@triton.jit
def e2m1(c):
    """Codes 0..15 -> fp32 values: magnitude (1 + m / 2) * 2 ** (e - 1), or m / 2 when e is 0."""
    mag = c & 7
    e = (mag >> 1).to(tl.float32)
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0.0, 0.5 * m, tl.exp2(e - 1.0) * (1.0 + 0.5 * m))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def fp4_tile(q, scale, GROUP: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Bytes q [ROWS, COLS / 2] and fp32 scales [ROWS, COLS / GROUP] -> fp32 weights [ROWS, COLS]
    in input order (each byte's low nibble, then its high one)."""
    w = tl.reshape(tl.join(e2m1(q & 15), e2m1(q >> 4)), [ROWS, COLS])
    return tl.reshape(tl.reshape(w, [ROWS, COLS // GROUP, GROUP]) * scale[:, :, None], [ROWS, COLS])


@triton.jit
def nvfp4_tile(w_rows, s_rows, nmask, k0, K, GROUP: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """W[rows, k0 : k0 + COLS] in fp32 (zero past K and on masked rows) from the rows' code bytes
    (w_rows [ROWS]: each row's first byte) and fp32 scales per GROUP inputs (s_rows [ROWS])."""
    cols = k0 // 2 + tl.arange(0, COLS // 2)
    q = tl.load(w_rows[:, None] + cols[None, :], mask=nmask[:, None] & (cols < (K + 1) // 2)[None, :], other=0)
    g = k0 // GROUP + tl.arange(0, COLS // GROUP)
    s = tl.load(s_rows[:, None] + g[None, :], mask=nmask[:, None] & (g * GROUP < K)[None, :], other=0.0)
    return fp4_tile(q, s, GROUP, ROWS, COLS)
