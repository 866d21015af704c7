"""Number-format helpers the kernels inline."""
from __future__ import annotations

from kvship.kernels._triton import tl, triton


@triton.jit
def small_int_to_float(c, OUT: tl.constexpr = tl.float32):
    """Non-negative integers -> their exact values in OUT, without the conversion unit: OR-ing
    each into the mantissa of 2**23 (float32, values below 2**23) or of 1024 (float16, below
    1024) and subtracting it. Int-to-float conversions run at a fraction of the FMA rate; with
    two 4-bit codes per byte they, not the memory, would set a kernel's speed."""
    # one return at the end: the GPU compiler goes on past a return inside a constexpr branch
    if OUT == tl.float16:
        x = (c.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        x = (c.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return x


@triton.jit
def fp8_round(x, FP8_E5: tl.constexpr):
    """x (fp32, already divided by the scale) clamped to the format's range and rounded to the
    nearest FP8 value, ties to even, in fp32 arithmetic: the cast after it is then exact, so
    the result does not depend on the backend's own conversion (the interpreter's is wrong when
    rounding carries into the exponent)."""
    if FP8_E5:  # largest value, mantissa bits, smallest normal exponent
        fmax, mant, min_exp = 57344.0, 2, -14
    else:
        fmax, mant, min_exp = 448.0, 3, -6
    x = tl.minimum(tl.maximum(x, -fmax), fmax)
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    quantum = ((tl.maximum(e, min_exp) - mant + 127) << 23).to(tl.float32, bitcast=True)  # one ulp there
    y = x / quantum  # |y| < 16: exact
    y = (y + 12582912.0) - 12582912.0  # + 1.5 * 2**23 drops the fraction, rounding half to even
    return y * quantum


@triton.jit
def exact_dot(a, b, acc):
    """fp32 inputs in full precision (tests and --dtype float32 compare against fp32 references;
    TF32 rounds to 10 mantissa bits), 16-bit ones on the tensor cores as they are."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)
