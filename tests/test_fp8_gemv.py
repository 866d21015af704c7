"""FP8 weights times a few rows on FP8 tensor cores (kernels/fp8_gemv.py): the kernel against its
torch reference (in the interpreter on CPU, at 8B projection sizes on the GPU), the reference
against the weight-only product, and quant_linear's choice of it for decode batches."""
from __future__ import annotations

import pytest
import torch

from kvship.kernels import fp8_gemv
from kvship.kernels._triton import HAS_TRITON
from kvship.quant import QuantizedTensor, quantize

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _fp8_weights(n: int, k: int, group: int, seed: int) -> QuantizedTensor:
    """Per-channel FP8 (group 0) or 128 x 128 block scales as FP8 checkpoints store them (a
    block's scale repeated over its rows)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    if not group:
        return quantize(w, "fp8")
    blocks = w.view(n // 128, 128, k // group, group).abs().amax((1, 3)) / 448.0
    scales = blocks.repeat_interleave(128, 0)
    codes = (w / scales.repeat_interleave(group, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return QuantizedTensor(codes, scales, None, 8, group)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, :128] *= 20.0  # blocks of different magnitudes: the per-block scales matter
    if m > 1:
        x[1] = 0.0  # a row of zeros quantizes to zeros
    return x


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("group", [0, 128])
def test_kernel_matches_reference(m, group):
    n, k = (4096, 4096) if GPU else (256, 384)
    qt = _fp8_weights(n, k, group, seed=m + group)
    codes, scales = qt.codes.to(DEV), qt.scales.to(DEV)
    x = _x(m, k, seed=m).to(DEV, torch.bfloat16 if GPU else torch.float16)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEV, x.dtype)
    assert fp8_gemv.fits(m, k, group)
    for b in (None, bias):
        want = fp8_gemv.fp8_gemv_torch(x, codes, scales, group, b).float()
        got = fp8_gemv.fp8_gemv_triton(x, codes, scales, group, b, {"block_n": 64, "num_warps": 4,
                                                                     "num_stages": 2}).float()
        assert got.shape == (m, n)
        rel = ((got - want).norm() / want.norm()).item()
        # the same quantized operands, summed in another order; outputs rounded to 16 bits (CPU: fp16)
        assert rel < (4e-3 if GPU else 2e-4), f"m={m} group={group} bias={b is not None}: relative error {rel:.2e}"
        if m > 1:
            assert not (got[1] - (0 if b is None else b.float())).any()


def test_reference_is_close_to_weight_only():
    """Quantizing the activations per 128 inputs costs a few percent against the weight-only
    product (FP8's 3 mantissa bits); the reference's blocks are 128 wide and padded at the end."""
    qt = _fp8_weights(256, 384, 128, seed=3)
    x = _x(4, 384, seed=4)
    want = x @ qt.dequantize().t()
    got = fp8_gemv.fp8_gemv_torch(x, qt.codes, qt.scales, 128)
    assert 1e-3 < ((got - want).norm() / want.norm()).item() < 5e-2
    codes, scales = fp8_gemv.quantize_fp8_blocks_torch(x[:, :300], 128)
    assert codes.shape == (4, 300) and scales.shape == (4, 3)
    torch.testing.assert_close(scales[:, 0], (x[:, :128].abs().amax(1) / 448).clamp_min(1e-12), rtol=0, atol=0)
    torch.testing.assert_close(scales[:, 2], (x[:, 256:300].abs().amax(1) / 448).clamp_min(1e-12), rtol=0, atol=0)


def test_fits():
    assert fp8_gemv.fits(1, 4096, 0) and fp8_gemv.fits(16, 4096, 128) and fp8_gemv.fits(5, 256, 256)
    assert not fp8_gemv.fits(17, 4096, 0)  # many rows: cuBLAS W8A8
    assert not fp8_gemv.fits(1, 4000, 0)  # a partial K tile
    assert not fp8_gemv.fits(1, 4096, 64)  # blocks the 128-wide tiles would cut
