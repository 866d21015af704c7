"""The quantized-weight kernels, the FP8 W8A8 activation quantizers and the block-wise W8A8 GEMM compile for sm_90
(H100/H200), every variant the engine launches, on a machine without a GPU
(tests/sm90_compile.py says why)."""
from __future__ import annotations

import pytest

from kvship.kernels._triton import HAS_TRITON
from kvship.kernels.fp8_matmul import GROUP_GEMM_CONFIGS, GROUP_GEMM_SHAPES
from kvship.kernels.quant_gemv import CODE_SHIFT
from sm90_compile import compile_in_child

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

W = {"w_ptr": "*u8", "s_ptr": "*fp16", "b_ptr": "*fp16", "gi_ptr": "*i32", "N": "i32", "K": "i32", "KP": "i32",
     "stride_w": "i32", "stride_s": "i32", "ngroups": "i32"}
MODULE = "kvship.kernels.quant_linear"


def _variants():
    """(bits4, fp8, symmetric, gather, group) as the engine picks them for its formats."""
    yield from [(True, False, False, False, 128), (True, False, True, False, 32), (True, False, False, True, 32),
                (False, True, False, False, 1 << 30), (False, False, True, False, 1 << 30),
                (False, False, False, False, 16)]


def _specs():
    for bits4, fp8, symm, gather, g in _variants():
        flags = dict(BITS4=bits4, FP8=fp8, SYMM=symm, CENTRE=8.0 if bits4 else 128.0, GATHER=gather, G=g)
        for dtype, bias in (("bf16", False), ("fp32", True)):  # serving; --dtype float32 and a bias
            x = {"x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}"}
            yield {"kernel": f"{MODULE}:_qgemv_kernel", "types": {**W, **x},
                   "constexprs": {**flags, "HAS_BIAS": bias, "BLOCK_N": 16, "BLOCK_K": 256 if bits4 else 512}}
            yield {"kernel": f"{MODULE}:_qgemm_kernel",
                   "types": {**W, **x, "M": "i32", "stride_x": "i32", "stride_y": "i32"},
                   "constexprs": {**flags, "HAS_BIAS": bias, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}}
        yield {"kernel": f"{MODULE}:_dequant_kernel", "types": {**W, "out_ptr": "*bf16"},
               "constexprs": {**flags, "BLOCK_N": 32, "BLOCK_K": 64 if bits4 else 128}}
    # quant_gemv.py's one-row kernels (inline PTX in the pairs kernel: compiled here only, as the
    # interpreter runs its pure-Triton twin), every layout the engine gives them
    words = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "b_ptr": "*fp16", "bias_ptr": "*bf16",
             "y_ptr": "*bf16", "N": "i32", "KW": "i32", "stride_w": "i32", "stride_s": "i32", "ngroups": "i32"}
    for bits, symm, g in ((4, True, 128), (4, False, 32), (4, True, 1 << 30), (8, True, 1 << 30), (8, False, 16)):
        for bias in (False, True):
            yield {"kernel": "kvship.kernels.quant_gemv:_qgemv_pairs_kernel", "types": words,
                   "constexprs": {"BITS": bits, "FP8": False, "SYMM": symm, "HAS_BIAS": bias, "G": g, "ASM": True,
                                  "EVEN": bias, "CODE_SHIFT": CODE_SHIFT[bits, False],
                                  "BLOCK_N": 16, "BLOCK_W": 256}}
        yield {"kernel": "kvship.kernels.quant_gemv:_qgemv_words_kernel", "types": {**words, "K": "i32"},
               "constexprs": {"BITS": bits, "FP8": False, "SYMM": symm, "CENTRE": 8.0 if bits == 4 else 128.0,
                              "HAS_BIAS": False, "G": g, "BLOCK_N": 16, "BLOCK_W": 256}}
    for g, bias in ((1 << 30, False), (128, True)):  # FP8 (float32 scales) per row and in blocks of 128 inputs
        yield {"kernel": "kvship.kernels.quant_gemv:_qgemv_pairs_kernel",
               "types": {**words, "s_ptr": "*fp32", "b_ptr": "*fp32"},
               "constexprs": {"BITS": 8, "FP8": True, "SYMM": True, "HAS_BIAS": bias, "G": g, "ASM": True,
                              "EVEN": bias, "CODE_SHIFT": CODE_SHIFT[8, True], "BLOCK_N": 8, "BLOCK_W": 512}}
    # gate/up projections with the activation in the epilogue (GATED 1 SiLU, 2 GELU-tanh), the
    # engine's settings for the 8B's gate/up: int4 (8 rows, 2 warps), Q4_K's layout, FP8 (32 rows)
    for bits, fp8, symm, g, gated, block_n, block_w, warps in (
            (4, False, True, 128, 1, 8, 256, 2), (4, False, False, 32, 2, 8, 256, 2),
            (8, True, True, 1 << 30, 1, 32, 64, 4), (8, False, True, 16, 1, 8, 512, 4)):
        scales = "*fp32" if fp8 else "*fp16"
        yield {"kernel": "kvship.kernels.quant_gemv:_qgemv_pairs_kernel",
               "types": {**words, "s_ptr": scales, "b_ptr": scales},
               "constexprs": {"BITS": bits, "FP8": fp8, "SYMM": symm, "HAS_BIAS": False, "G": g, "ASM": True,
                              "EVEN": True, "CODE_SHIFT": CODE_SHIFT[bits, fp8], "BLOCK_N": block_n,
                              "BLOCK_W": block_w, "GATED": gated}, "options": {"num_warps": warps}}
    fp8 = "kvship.kernels.fp8_matmul"
    for dtype in ("bf16", "fp16"):  # rows read once (8B's hidden 4096) and twice (its down_proj's 14336)
        for block, one_pass in ((4096, True), (8192, False)):
            yield {"kernel": f"{fp8}:_fp8_rows_kernel",
                   "types": {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "stride_x": "i32"},
                   "constexprs": {"BLOCK_K": block, "ONE_PASS": one_pass}}
        yield {"kernel": f"{fp8}:_fp8_groups_kernel",
               "types": {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "NG": "i32",
                         "stride_x": "i32"},
               "constexprs": {"G": 128, "GROUPS": 32}, "options": {"num_warps": 4}}
    # block-wise FP8 weights' W8A8 GEMM, every tile setting the engine's tables hold, groups of 128
    gemm = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "bias_ptr": "*bf16",
            "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_a": "i32", "stride_b": "i32",
            "stride_c": "i32", "stride_as": "i32", "stride_bs": "i32"}
    settings = {tuple(c.values()) for t in (GROUP_GEMM_CONFIGS, *GROUP_GEMM_SHAPES.values()) for c in t.values()}
    for i, (bm, bn, nw, ns, gm) in enumerate(sorted(settings)):
        yield {"kernel": f"{fp8}:_fp8_group_gemm_kernel", "types": gemm,
               "constexprs": {"HAS_BIAS": i % 2 == 1, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": gm},
               "divisible": ["a_ptr", "b_ptr", "c_ptr", "stride_a", "stride_b", "stride_c"],
               "options": {"num_warps": nw, "num_stages": ns}}


@pytest.mark.timeout(900)
def test_quant_kernels_compile_for_sm90():
    compile_in_child(list(_specs()))
