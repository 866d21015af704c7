"""Block-wise FP8 W8A8 (kernels/fp8_matmul.py): the per-group activation quantizer equals its
torch reference bit for bit, the group GEMM equals the float32 product of the dequantized
operands, in the interpreter on CPU and at an 8B projection's size on a GPU; and on a GPU a
block-wise FP8 linear of two rows or more runs through them, close to the dequantized weights'
product."""
from __future__ import annotations

import pytest
import torch

from kvship.kernels import fp8_matmul, quant_linear
from kvship.kernels._triton import HAS_TRITON
from kvship.kernels.fp8_matmul import (
    fp8_group_matmul_torch,
    fp8_group_matmul_triton,
    quantize_fp8_groups_torch,
    quantize_fp8_groups_triton,
    quantize_fp8_rows_torch,
)
from kvship.kernels.quant_linear import dense_rows, pack, quant_linear_torch, quant_linear_triton
from kvship.quant.insitu import FP8_MAX, quantize_fp8_blocks

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows, and rows that reach the quantizer's edges: zeros, one large value over FP8
    subnormals, a group near fp16's largest, negatives that round to -0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[1] = 0.0
    x[2, 1:] *= 1e-4
    x[3] *= (6e4 if dtype == torch.float16 else 1e6) / x[3].abs().max()
    x[4] = -torch.rand(k, generator=g) * 1e-6
    x[4, 0] = -1.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k,group", [(256, 128), (320, 128), (96, 32), (4096 + 64, 64)])
def test_group_quantization_matches_reference(dtype, k, group):
    x = _activations(6, k, dtype, seed=k + group)
    codes, scales = quantize_fp8_groups_triton(x.to(DEV), group)
    ref_codes, ref_scales = quantize_fp8_groups_torch(x, group)
    assert scales.shape == (6, -(-k // group)) and scales.dtype == torch.float32
    torch.testing.assert_close(scales.cpu(), ref_scales, atol=0, rtol=0)
    assert torch.equal(codes.cpu().view(torch.uint8), ref_codes.view(torch.uint8))
    # the reference: each group's largest value maps to FP8's largest, zeros stay zeros with the least scale
    assert ref_codes.float().abs().view(6, -1)[0].max().item() == FP8_MAX
    assert (ref_scales[1] == torch.tensor(1e-12)).all() and not ref_codes[1].float().any()
    assert ref_codes[4].view(torch.uint8)[1:group].eq(0x80).any()  # -0 kept where a negative rounds to zero


def test_rows_are_one_group():
    x = _activations(6, 200, torch.bfloat16, seed=3)
    codes, scales = quantize_fp8_rows_torch(x)
    assert scales.shape == (6, 1)
    ref = (x.float() / (x.float().abs().amax(1, keepdim=True) / FP8_MAX).clamp_min(1e-12)).clamp(-FP8_MAX, FP8_MAX)
    assert torch.equal(codes.view(torch.uint8), ref.to(torch.float8_e4m3fn).view(torch.uint8))


def _operands(m, n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    xq, xs = quantize_fp8_groups_torch(torch.randn(m, k, generator=g), group)
    wq, ws = quantize_fp8_groups_torch(torch.randn(n, k, generator=g) * 0.05, group)
    bias = torch.randn(n, generator=g)
    return xq, xs, wq, ws, bias


# rows: one, a 16-row tile's partial, a 64-row tile's, and several 128-row tiles walked in
# GROUP_M order; columns a partial tile; K whole groups and a partial last group
CASES = [(1, 48, 256, 128), (5, 48, 320, 128), (20, 72, 256, 64), (130, 200, 160, 32)] if not GPU else \
    [(1, 6144, 4096, 128), (7, 4096, 4096, 128), (48, 28672, 4096, 128), (256, 4096, 14336, 128), (300, 6144, 4160, 128)]


@pytest.mark.parametrize("m,n,k,group", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_group_gemm_matches_dequantized_product(m, n, k, group, bias):
    xq, xs, wq, ws, b = _operands(m, n, k, group, seed=m + n + k)
    b = b if bias else None
    ref = fp8_group_matmul_torch(xq, xs, wq, ws, group, b, torch.float32)
    got = fp8_group_matmul_triton(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), group,
                                  b.to(DEV) if bias else None, torch.float32).cpu()
    # FP8 products are exact in float32 and the interpreter sums them in float32: only the order
    # differs. Hopper's FP8 tensor cores keep about 14 bits in the sums of one dot (DeepSeek-V3's
    # report, 3.3.2), which the kernel takes to float32 after each group: on the H200 the largest
    # error was 1.7e-4 of the largest output (K 4160).
    torch.testing.assert_close(got, ref, atol=(1e-3 if GPU else 1e-4) * ref.abs().max().item(), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 16, 256])
def test_block_fp8_linear_runs_the_group_gemm(monkeypatch, m):
    # a block-wise FP8 matrix as quant/formats.py loads one: each 128 x 128 block's scale over its rows
    w = pack(quantize_fp8_blocks(torch.randn(1024, 2048, generator=torch.Generator().manual_seed(m)) * 0.05, 128), DEV)
    x = torch.randn(m, 2048, device=DEV, dtype=torch.bfloat16)
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    calls = []
    gemm = fp8_matmul.fp8_group_matmul_triton
    monkeypatch.setattr(quant_linear, "fp8_group_matmul_triton", lambda *a, **kw: calls.append(1) or gemm(*a, **kw))
    assert dense_rows(x, w) <= 2
    got = quant_linear_triton(x, w).float()
    ref = quant_linear_torch(x.float(), w).float()  # dequantized weights, 16-bit activations
    assert calls, "the block-wise FP8 linear did not take the group GEMM"
    # the activations' FP8 rounding (3 mantissa bits, a scale per 128 inputs) is the difference:
    # 2.6-3.0e-2 on the 8B projections (bench/fp8_gemm.py)
    assert (got - ref).norm() / ref.norm() < 4e-2
