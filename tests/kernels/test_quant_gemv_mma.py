"""The tensor-core one-row GEMV of kernels/quant_gemv_mma.py against quant_linear's reference
(dequantize, then F.linear): groups of 128 and 256 codes and one group a row, symmetric and
asymmetric codes, bf16 and fp16 x, 16 and 32 rows a program, rows and rows' words that are not
whole tiles. In the interpreter on CPU (the same sums by Triton operations), at an 8B
projection's size on a GPU (the PTX). The PTX relies on the lane each word lands in; a compile
for sm_90 checks that layout."""
from __future__ import annotations

import re

import pytest
import torch

from kvship.kernels._triton import HAS_TRITON
from kvship.kernels.quant_gemv_mma import MAGIC, _programs, mma_fit, qgemv_mma_triton
from kvship.kernels.quant_linear import pack, quant_linear_torch
from kvship.quant import QuantizedTensor
from kvship.quant.insitu import quantize_groups
from sm90_compile import ttgir_in_child

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _weights(n, k, group, symmetric, seed):
    g = torch.Generator().manual_seed(seed)
    qt = quantize_groups(torch.randn(n, k, generator=g) * 0.05, 4, group)
    if symmetric:  # codes centred on 8, no offsets (GPTQ/AWQ symmetric)
        qt = QuantizedTensor(qt.codes, qt.scales, None, 4, group)
    return pack(qt, DEV)


# (group, rows, warps, n, k, tokens) on CPU: K of whole tiles and not (640 inputs = 80 words: 2
# warps take 32 words a tile), N a multiple of the rows and not, 1 to 8 tokens
CPU_CASES = [(128, 16, 2, 40, 640, 1), (128, 32, 1, 64, 512, 3), (256, 16, 1, 16, 512, 8),
             (1 << 20, 32, 2, 40, 384, 2)]
GPU_CASES = [(128, rows, warps, 4096, 4096, 1) for rows in (16, 32) for warps in (2, 4, 8)] \
    + [(128, 16, 4, 4100, 4224, m) for m in (1, 2, 5, 8)] + [(1 << 20, 32, 4, 1024, 14336, 4)] \
    + [(128, 16, 8, 6144, 4096, m) for m in (3, 8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group,rows,warps,n,k,tokens", GPU_CASES if GPU else CPU_CASES)
def test_mma_gemv_matches_reference(group, rows, warps, n, k, tokens, symmetric, dtype):
    """Relative error under 5e-3 (bf16/fp16 outputs; the sums are fp32), without and with a bias."""
    group = min(group, k)
    w = _weights(n, k, group, symmetric, seed=group + rows + warps)
    assert mma_fit(4, k, group, w.scales.shape[1], False, dtype)
    g = torch.Generator().manual_seed(k + warps)
    x = torch.randn(tokens, k, generator=g).to(DEV, dtype)
    bias = torch.randn(n, generator=g).to(DEV, dtype)
    for b in (None, bias):
        got = qgemv_mma_triton(x, w.qweight, w.scales, w.biases, b, w.group_size, k,
                               {"mma": 1, "rows": rows, "num_warps": warps}).float()
        want = quant_linear_torch(x.float(), w, None if b is None else b.float())
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 5e-3, f"relative error {rel:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mma_gemv_range(dtype):
    """x with entries of 3e4 beside tiny ones: the magic offset's share (MAGIC times x's sum over
    a group) cancels in fp32 and leaves the products' sum within tolerance."""
    n, k = (256, 1024) if GPU else (16, 256)
    w = _weights(n, k, 128, True, seed=3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, k, generator=g)
    x[0, ::7] *= 3e4 / x[0, ::7].abs().max()
    x[0, 3::7] *= 1e-4
    x = x.to(DEV, dtype)
    got = qgemv_mma_triton(x, w.qweight, w.scales, None, None, 128, k, {"mma": 1, "rows": 16, "num_warps": 2}).float()
    want = quant_linear_torch(x.float(), w)
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 5e-3


@pytest.mark.parametrize("tokens", [1, 3])
def test_mma_gemv_reads_nothing_past_x(tokens):
    """Rows' words not a whole number of tiles (the last tile's groups past the row): with NaN
    right after each of x's rows, the sums stay finite and right (the PTX reads a lane's x 64
    bytes at a time from the first word's address; a read past the row brought NaN in on the
    H200 before x's reads were clamped to whole groups)."""
    n, k = 32, 384  # 48 words: 4 warps take 64 a tile
    w = _weights(n, k, 128, True, seed=11)
    g = torch.Generator().manual_seed(12)
    buf = torch.full((tokens, k + 128), float("nan"))
    buf[:, :k] = torch.randn(tokens, k, generator=g)
    x = buf.to(DEV, torch.bfloat16)[:, :k]
    got = qgemv_mma_triton(x, w.qweight, w.scales, None, None, 128, k, {"mma": 1, "rows": 16, "num_warps": 4}).float()
    want = quant_linear_torch(x.float(), w)
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 5e-3


def test_engine_takes_it_for_2_to_8_rows(monkeypatch):
    """quant_linear_triton's dispatch: 2 to 8 rows of bf16 x beside 4-bit groups of 128 go to this
    kernel, one row and 9 or more rows do not."""
    import kvship.kernels.quant_linear as ql

    calls = []
    real = ql.qgemv_mma_triton
    monkeypatch.setattr(ql, "qgemv_mma_triton", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    w = _weights(32, 256, 128, True, seed=9)
    for m in (1, 2, 8):
        x = torch.randn(m, 256).to(DEV, torch.bfloat16)
        got = ql.quant_linear_triton(x, w).float()
        want = quant_linear_torch(x.float(), w)
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    monkeypatch.setattr(ql, "_qgemm_kernel", None)  # 9 rows go to the GEMM: this one fails if reached
    with pytest.raises(TypeError):
        ql.quant_linear_triton(torch.randn(9, 256).to(DEV, torch.bfloat16), w)
    assert calls == [2, 8]


def test_layouts_the_mma_kernel_leaves():
    assert not mma_fit(4, 4096, 32, 128, False, torch.bfloat16)  # groups of 32 (Q4_K)
    assert not mma_fit(4, 4096, 64, 64, False, torch.bfloat16)
    assert not mma_fit(4, 4096, 128, 32, True, torch.bfloat16)  # act-order table
    assert not mma_fit(8, 4096, 128, 32, False, torch.bfloat16)  # 8-bit codes
    assert not mma_fit(4, 4096, 128, 32, False, torch.float32)  # fp32 x: no 16-bit mma operand
    assert not mma_fit(4, 4160, 4160, 1, False, torch.bfloat16)  # rows not of whole 128-code groups
    assert mma_fit(4, 4096, 128, 32, False, torch.float16) and mma_fit(4, 4096, 4096, 1, False, torch.bfloat16)
    assert set(MAGIC) == {torch.bfloat16, torch.float16}


def test_mma_kernel_layout_on_sm90():
    """The PTX takes lane 4 g + t to hold words 4 t .. 4 t + 3 of row g (a 16-byte vector), a warp's
    lanes 8 rows and warps the groups: the layout Triton gives the words' load when compiled as
    the engine launches it (pointers and the row stride divisible by 16). A Triton upgrade that
    lays them out otherwise fails here, on CPU, before the GPU gives wrong sums."""
    types = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*fp16", "b_ptr": "*fp16", "bias_ptr": "*bf16",
             "y_ptr": "*bf16", "M": "i32", "N": "i32", "KW": "i32", "stride_x": "i32", "stride_y": "i32",
             "stride_w": "i32", "stride_s": "i32"}
    for rows, warps in ((16, 4), (32, 8), (32, 2)):
        spec = {"kernel": "kvship.kernels.quant_gemv_mma:_qgemv_mma_kernel", "types": types,
                "divisible": ["x_ptr", "w_ptr", "s_ptr", "b_ptr", "bias_ptr", "y_ptr", "stride_w", "stride_x",
                              "stride_y"],
                "options": {"num_warps": warps, "num_stages": 1},
                "constexprs": {"HAS_B": True, "HAS_BIAS": False, "G": 128, "CENTRE": 0.0, "MAGIC_V": 128.0,
                               "BF16": True, "ASM": True, "ROWS": rows, "WARPS": warps, "EVEN": True,
                               **_programs(True, rows)}}
        ttgir = ttgir_in_child(spec)
        layouts = re.findall(r"tt\.load .*tensor<8x\d+x\d+x16x!tt\.ptr<i32>, #(\w+)>", ttgir)
        assert layouts, ttgir[-2000:]
        layout = layouts[0]
        definition = next(line for line in ttgir.splitlines() if line.startswith(f"#{layout} ="))
        want = (f"sizePerThread = [1, 1, 1, 4], threadsPerWarp = [8, 1, 1, 4], warpsPerCTA = [1, {warps}, 1, 1], "
                "order = [3, 0, 1, 2]")
        assert want in definition, definition
