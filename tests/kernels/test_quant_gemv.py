"""The one-row GEMVs of kernels/quant_gemv.py (word-reading and fp16-pair) against quant_linear's
reference (dequantize, then F.linear): every tile/group arrangement they take, symmetric and
asymmetric codes, 4 and 8 bits, FP8, with and without a bias. In the interpreter on CPU (fp32), at an 8B
projection's size in bf16 on a GPU."""
from __future__ import annotations

import pytest
import torch

from kvship.kernels._triton import HAS_TRITON
from kvship.kernels.quant_gemv import fits, pairs_fit, qgemv_pairs_triton, qgemv_words_triton
from kvship.kernels.quant_linear import pack, quant_linear_torch
from kvship.quant import QuantizedTensor
from kvship.quant.insitu import FP8_MAX, quantize_groups

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _weights(n, k, bits, group, symmetric, seed, fp8=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    if fp8:  # E4M3 values with a float32 scale per row or per group (block-wise FP8 checkpoints)
        group = min(group, k)
        scales = w.view(n, -1, group).abs().amax(-1) / FP8_MAX
        codes = (w.view(n, -1, group) / scales[..., None]).view(n, k).to(torch.float8_e4m3fn)
        return pack(QuantizedTensor(codes, scales, None, 8, group), DEV)
    qt = quantize_groups(w, bits, group)
    if symmetric:  # codes centred on 2**(bits-1), no offsets (GPTQ/AWQ symmetric, in-situ int4/int8)
        qt = QuantizedTensor(qt.codes, qt.scales, None, bits, group)
    return pack(qt, DEV)


# (bits, group, block_w): tiles inside a group, tiles of one group, tiles of several groups, one
# group per row; 8-bit codes in groups of 16 (GGUF Q6_K's layout) and per row (in-situ int8)
CASES = [(4, 128, 8), (4, 32, 4), (4, 32, 16), (4, 128, 64), (4, 1 << 20, 16), (8, 16, 8), (8, 1 << 20, 32)]


FP8_CASES = [(8, 1 << 20, 32, "fp8"), (8, 128, 16, "fp8"), (8, 128, 64, "fp8")]


@pytest.mark.parametrize("bits,group,block_w,kind,symmetric",
                         [(*c, "int", symm) for c in CASES for symm in (True, False)]
                         + [(*c, True) for c in FP8_CASES])  # FP8 codes have no offsets
def test_word_gemv_matches_reference(bits, group, block_w, kind, symmetric):
    n, k = (4096, 4096) if GPU else (24, 384)
    group = min(group, k)
    w = _weights(n, k, bits, group, symmetric, seed=bits * group + block_w, fp8=kind == "fp8")
    assert fits(bits, k, group, w.scales.shape[1], False, block_w)
    _matches_reference(qgemv_words_triton, w, bits, block_w, seed=block_w, cpu_bound=1e-5)


def _matches_reference(kernel, w, bits, block_w, seed, cpu_bound):
    """``kernel`` (a one-row launcher of this module) against dequantize-then-linear, without and
    with a bias: bf16 inputs on a GPU (bound 1e-2), float32 in the interpreter (``cpu_bound``)."""
    n, k = w.n, w.k
    dtype = torch.bfloat16 if GPU else torch.float32
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(DEV, dtype)
    bias = torch.randn(n, generator=g).to(DEV, dtype)
    for b in (None, bias):
        got = kernel(x, w.qweight, w.scales, w.biases, b, bits, w.group_size, k,
                     {"block_n": 8, "block_w": block_w, "num_warps": 4, "num_stages": 2}).float()
        want = quant_linear_torch(x.float(), w, None if b is None else b.float())
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < (1e-2 if GPU else cpu_bound), f"relative error {rel:.2e}"


def test_layouts_the_word_kernel_leaves_to_the_other():
    """Act-order tables, rows that are not whole words, and groups that tiles cut."""
    assert not fits(4, 384, 32, 12, True, 8)  # g_idx
    assert not fits(4, 36, 4, 9, False, 1)  # 36 codes: 4.5 words
    assert not fits(4, 384, 48, 8, False, 8)  # 64-input tiles vs groups of 48
    assert not fits(8, 64, 2, 32, False, 1)  # groups narrower than a word


# (bits, group, block_w) for the pairs kernel: tiles inside a group, of one group, of several;
# one group per row; 8-bit codes in groups of 16 and per row
PAIR_CASES = [(4, 128, 8), (4, 32, 4), (4, 32, 16), (4, 128, 64), (4, 1 << 20, 16), (4, 64, 16), (8, 16, 8),
              (8, 128, 16), (8, 1 << 20, 32)]
# FP8 per row (in-situ --quantization fp8, per-channel checkpoints) and in blocks of 128 inputs
FP8_PAIR_CASES = [(8, 1 << 20, 32, "fp8"), (8, 128, 16, "fp8")]


@pytest.mark.parametrize("bits,group,block_w,kind,symmetric",
                         [(*c, "int", symm) for c in PAIR_CASES for symm in (True, False)]
                         + [(*c, True) for c in FP8_PAIR_CASES])
def test_pairs_gemv_matches_reference(bits, group, block_w, kind, symmetric):
    """The fp16-pair kernel: its sums of a word's products are fp16 (relative error ~1e-3), the
    rest fp32; on CPU the interpreter runs the same pair arithmetic in numpy's fp16."""
    fp8 = kind == "fp8"
    n, k = (4096, 4096) if GPU else (24 if symmetric and not fp8 else 20, 512)  # 20: rows not whole tiles
    group = min(group, k)
    w = _weights(n, k, bits, group, symmetric, seed=bits * group + block_w + 7, fp8=fp8)
    assert pairs_fit(bits, k, group, w.scales.shape[1], False)
    _matches_reference(qgemv_pairs_triton, w, bits, block_w, seed=block_w + 1, cpu_bound=2e-3)


@pytest.mark.parametrize("bits,group,kind,symmetric,act", [
    (4, 128, "int", True, "silu"), (4, 32, "int", False, "silu"), (8, 16, "int", True, "gelu_tanh"),
    (8, 1 << 20, "fp8", True, "silu"), (8, 128, "fp8", True, "gelu_tanh")])
@pytest.mark.parametrize("rows", ["whole", "ragged"])
def test_pairs_gemv_gated_epilogue(bits, group, kind, symmetric, act, rows):
    """A gate/up projection's one-row product with the activation in the pairs kernel's epilogue
    (GATED): act(gate) * up, the gate rows first in W, against the product then act_and_mul's
    reference; "ragged": N / 2 not a whole number of a program's outputs (masked, not EVEN)."""
    from kvship.kernels.activation import act_and_mul_torch
    from kvship.kernels.quant_linear import quant_linear_gated
    half = (14336 if rows == "whole" else 14344) if GPU else (16 if rows == "whole" else 10)
    k = 4096 if GPU else 512
    fp8 = kind == "fp8"
    w = _weights(2 * half, k, bits, min(group, k), symmetric, seed=bits + group + len(rows), fp8=fp8)
    dtype = torch.bfloat16 if GPU else torch.float32
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    got = qgemv_pairs_triton(x, w.qweight, w.scales, w.biases, None, bits, w.group_size, k,
                             {"block_n": 8, "block_w": 16, "num_warps": 4, "num_stages": 2}, act).float()
    want = act_and_mul_torch(quant_linear_torch(x.float(), w), act)
    assert got.shape == (1, half)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < (1e-2 if GPU else 2e-3), f"relative error {rel:.2e}"
    # the layer's entry point takes the same path for one row (and the two-kernel one on the CPU)
    rel = ((quant_linear_gated(x, w, act).float() - want).norm() / want.norm()).item()
    assert rel < (1e-2 if GPU else 2e-3), f"relative error {rel:.2e}"


@pytest.mark.parametrize("bits", [4, 8])
def test_pairs_gemv_range(bits):
    """x up to 60000 in magnitude (and tiny x beside it) gives finite sums within tolerance: the
    fp16 pairs hold codes scaled down (kernels/quant_gemv.py: Range)."""
    n, k = (256, 1024) if GPU else (8, 256)
    w = _weights(n, k, bits, 32 if bits == 4 else 16, True, seed=3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, k, generator=g)
    x[0, ::7] *= 6e4 / x[0, ::7].abs().max()
    x[0, 3::7] *= 1e-4
    x = x.to(DEV, torch.bfloat16 if GPU else torch.float32)
    got = qgemv_pairs_triton(x, w.qweight, w.scales, None, None, bits, w.group_size, k,
                             {"block_n": 8, "block_w": 16, "num_warps": 4, "num_stages": 2}).float()
    want = quant_linear_torch(x.float(), w)
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_pairs_gemv_fp8_range():
    """FP8's largest codes (448) times x of 60000 of the same sign in every input of a chain: each
    lane sums 8 such products, 52500 with the codes scaled by 2**-12 (inf at 2**-11), and the
    result stays finite and within tolerance (kernels/quant_gemv.py: Range); tiny x beside them."""
    n, k = (256, 1024) if GPU else (8, 128)
    w = _weights(n, k, 8, k, True, seed=4, fp8=True)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, k, generator=g)
    x[0, 3::7] *= 1e-4
    x[0, 16:32] = 6e4 * torch.where(x[0, 16:32] < 0, -1.0, 1.0)  # the second chain's inputs
    codes = w.qweight.float()
    codes[:, 16:32] = 448.0 * x[0, 16:32].sign()
    w.qweight = codes.to(DEV, torch.float8_e4m3fn)
    x = x.to(DEV, torch.bfloat16 if GPU else torch.float32)
    got = qgemv_pairs_triton(x, w.qweight, w.scales, None, None, 8, w.group_size, k,
                             {"block_n": 8, "block_w": 16, "num_warps": 4, "num_stages": 2}).float()
    want = quant_linear_torch(x.float(), w)
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_layouts_the_pairs_kernel_leaves():
    assert not pairs_fit(4, 384, 32, 12, True)  # g_idx
    assert not pairs_fit(4, 36, 4, 9, False)  # 36 codes: 4.5 words
    assert not pairs_fit(8, 64, 2, 32, False)  # groups narrower than a word
    assert not pairs_fit(4, 384, 16, 24, False)  # groups of 16 inputs: 2 words, half a chain
    assert pairs_fit(4, 384, 96, 4, False)  # 3 chains a group
    assert pairs_fit(4, 4096, 128, 32, False) and pairs_fit(8, 4096, 4096, 1, False)
