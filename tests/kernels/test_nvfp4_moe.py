"""NVFP4 routed experts (kernels/nvfp4_moe.py) kept 4-bit: each matrix packed by
compressed-tensors' own NVFP4 compressor and loaded through MoEExperts' weight_loader; the
stacks' dequantization against the format's definition (E2M1[code] * FP8 scale / global scale,
the codes unpacked by compressed-tensors); the grouped W4A16 GEMMs (the interpreter without a
GPU) against fp32 torch on the dequantized weights; a layer mixing NVFP4 with other storage
refused. With a GPU: Qwen3-30B-A3B's sizes in bf16, and inside a CUDA graph."""
from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from kvship.kernels import fused_moe as fm
from kvship.kernels._triton import HAS_TRITON
from kvship.kernels.nvfp4_moe import nvfp4_moe, nvfp4_moe_gemv, nvfp4_moe_triton
from kvship.layers.moe import route
from kvship.quant import quantize
from kvship.quant.nvfp4 import nvfp4
from test_fused_moe import QWEN3_30B, _close, _dequantized, _problem, _quantized_experts

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

SCHEME = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
    num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True))


def _packed(m: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' compressor on [N, K] with absmax scales (the global scale maps the
    largest block scale to FP8's largest value)."""
    n, k = m.shape
    m = m.float().cpu()
    gs = (448.0 * 6.0 / m.abs().amax()).reshape(1)
    scale = (m.view(n, k // 16, 16).abs().amax(-1) / 6.0 * gs).to(torch.float8_e4m3fn).float()
    return NVFP4PackedCompressor.compress({"weight": m, "weight_scale": scale, "weight_global_scale": gs}, SCHEME)


def _definition(m: torch.Tensor) -> torch.Tensor:
    packed = _packed(m)
    n, half = packed["weight_packed"].shape
    values = unpack_fp4_from_uint8(packed["weight_packed"], n, 2 * half, dtype=torch.float32)
    return values * (packed["weight_scale"].float() / packed["weight_global_scale"]).repeat_interleave(16, 1)


def _to_nvfp4(m: torch.Tensor):
    return nvfp4({k: v.to(m.device) for k, v in _packed(m).items()})


@pytest.mark.timeout(240)
def test_nvfp4_experts_stay_4bit_and_match_the_reference():
    """Hidden 80 and intermediate 48 (5 and 3 scales a row: ragged against every K tile), top 2
    of 8 experts with expert 0 never chosen and NaN (a kernel reading it fails): one token (the
    dispatch's GEMV, and the grouped GEMMs) and nine (two tilings, and the GEMV with tiles of a few
    rows), with and without a shared expert's output added."""
    hidden, inter, experts = 80, 48, 8
    x, router, w13, w2 = _problem(9, 2, experts, hidden, inter, seed=3, dead=0)
    weights, ids = route(x @ router.T, 2, True)
    c13, c2, scales = _quantized_experts(w13, w2, _to_nvfp4)
    assert scales.e2m1 and c13.dtype == c2.dtype == torch.uint8
    assert c13.shape == (experts, 2 * inter, hidden // 2) and c2.shape == (experts, hidden, inter // 2)
    assert scales.w13.dtype == torch.float32 and scales.w13.shape == (experts, 2 * inter, hidden // 16)
    deq13, deq2 = _dequantized(c13, c2, scales)
    for e in (1, 5):  # the stacks hold the format's values, gate rows then up rows
        want13 = torch.cat([_definition(w13[e, :inter]), _definition(w13[e, inter:])])
        torch.testing.assert_close(deq13[e].cpu(), want13, atol=0, rtol=0)
        torch.testing.assert_close(deq2[e].cpu(), _definition(w2[e]), atol=0, rtol=0)
    want = fm.fused_moe_torch(x, deq13, deq2, weights, ids)
    torch.testing.assert_close(nvfp4_moe(x.cpu(), c13.cpu(), c2.cpu(), weights.cpu(), ids.cpu(),
                                         _on(scales, "cpu")), want.cpu(), atol=1e-5, rtol=1e-5)
    close = dict(atol=1e-5, rtol=1e-5)  # fp32, only the summation order differs
    torch.testing.assert_close(nvfp4_moe_triton(x[:1], c13, c2, weights[:1], ids[:1], scales), want[:1], **close)
    torch.testing.assert_close(nvfp4_moe_triton(x[1:2], c13, c2, weights[1:2], ids[1:2], scales,
                                                config=fm.moe_config(1, 2, experts)), want[1:2], **close)
    tile = {"block_n": 4, "block_k": 32, "num_warps": 1, "num_stages": 1}
    torch.testing.assert_close(nvfp4_moe_gemv(x, c13, c2, weights, ids, scales, None, tile, tile), want, **close)
    for cfg in (fm.moe_config(9, 2, experts), fm.MoEConfig(32, 32, 32, 4, 2)):
        torch.testing.assert_close(nvfp4_moe_triton(x, c13, c2, weights, ids, scales, config=cfg), want, **close)
    add = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x)
    torch.testing.assert_close(nvfp4_moe_triton(x, c13, c2, weights, ids, scales, add), want + add, **close)
    with pytest.raises(ValueError, match="nvfp4_moe"):  # fused_moe's integer kernels would misread the codes
        fm.fused_moe_triton(x, c13, c2, weights, ids, scales=scales)


def _on(scales: fm.ExpertScales, device: str) -> fm.ExpertScales:
    return fm.ExpertScales(scales.w13.to(device), scales.w2.to(device), scales.w13_group, scales.w2_group,
                           None, None, scales.w13_bits, scales.w2_bits, scales.e2m1)


def test_a_layer_mixing_nvfp4_with_other_storage_is_refused():
    _, _, w13, w2 = _problem(1, 1, 2, 32, 16, seed=0, dead=1)
    calls = iter(range(6))

    def mixed(m: torch.Tensor):  # the second expert's matrices in 8-bit integer codes
        return _to_nvfp4(m) if next(calls) < 3 else quantize(m, "int8")

    with pytest.raises(ValueError, match="partly in NVFP4"):
        _quantized_experts(w13, w2, mixed)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tokens", [1, 4, 64, 1024])
def test_nvfp4_moe_gpu_real_sizes_and_cuda_graph(tokens):
    """Qwen3-30B-A3B's experts in NVFP4, bf16 activations, against fp32 torch on the dequantized
    weights; then captured in a CUDA graph and replayed on new tokens."""
    s = QWEN3_30B
    x, router, w13, w2 = _problem(tokens, s["top_k"], s["num_experts"], s["hidden"], s["inter"], seed=tokens,
                                  dead=7, dtype=torch.bfloat16, device="cuda")
    c13, c2, scales = _quantized_experts(w13.float(), w2.float(), _to_nvfp4, "cuda")
    ref13, ref2 = _dequantized(c13, c2, scales)

    def step():
        weights, ids = route(x @ router.T, s["top_k"], True)
        return nvfp4_moe(x, c13, c2, weights, ids, scales)

    weights, ids = route(x @ router.T, s["top_k"], True)
    _close(step(), fm.fused_moe_torch(x.float(), ref13, ref2, weights, ids), 1.6e-2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x))
    x[:, 0] = 1.0  # the dead expert (NaN weights) stays unchosen
    graph.replay()
    weights, ids = route(x @ router.T, s["top_k"], True)
    _close(out, fm.fused_moe_torch(x.float(), ref13, ref2, weights, ids), 1.6e-2)


def _sm90_specs():
    """Every NVFP4 kernel variant the engine launches, at its launch settings: the experts' grouped
    GEMMs at each moe_config tile (gated w13 and w2; bf16 activations, fp32 for --dtype float32 at
    the decode tile), their one-token GEMVs, and the dense W4A16 kernel's two tilings."""
    from kvship.kernels.nvfp4_moe import GEMV_DOWN, GEMV_GATE_UP

    sizes = ("N", "K", "stride_a", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_out")
    # gpt-oss's epilogue's arguments are None: constants the kernels never read
    packed = {"FORMAT": "nvfp4", "ACT": "silu_mul", **dict.fromkeys(("bias_ptr", "stride_be", "alpha", "limit"))}
    for cfg in sorted({fm.moe_config(t, 8, 128) for t in (1, 300, 1024, 4096)}, key=lambda c: c.block_m):
        for gated in (True, False):
            for dtype in ("bf16", "fp32") if cfg.block_m == 16 else ("bf16",):
                types = {"a_ptr": f"*{dtype}", "w_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": f"*{dtype}",
                         "rw_ptr": "*fp32", "sorted_ptr": "*i32", "experts_ptr": "*i32", "padded_ptr": "*i32",
                         "num_pairs": "i32", **dict.fromkeys(sizes, "i32")}
                yield {"kernel": "kvship.kernels.packed_moe:_packed_gemm_kernel", "types": types,
                       "constexprs": {"A_DIV": 8 if gated else 1, "GATED": gated, **packed, "BLOCK_M": cfg.block_m,
                                      "BLOCK_N": max(16, cfg.block_n // 2) if gated else cfg.block_n,
                                      "BLOCK_K": max(cfg.block_k, 32)},
                       "divisible": [n for n in types if n not in ("num_pairs", "stride_sn")],
                       "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}}
    for gated, cfg in ((True, GEMV_GATE_UP), (False, GEMV_DOWN)):
        types = {"a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": "*bf16", "rw_ptr": "*fp32",
                 "ids_ptr": "*i64", **dict.fromkeys(sizes, "i32")}
        yield {"kernel": "kvship.kernels.packed_moe:_packed_gemv_kernel", "types": types,
               "constexprs": {"A_DIV": 8 if gated else 1, "GATED": gated, **packed, "BLOCK_N": cfg["block_n"],
                              "BLOCK_K": cfg["block_k"]},
               "divisible": [n for n in types if n not in ("ids_ptr", "rw_ptr", "stride_sn")],
               "options": {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}}
    dense = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16",
             **dict.fromkeys(("M", "N", "K", "stride_x", "stride_y", "stride_w", "stride_s"), "i32")}
    for block_m, block_n, block_k in ((16, 64, 128), (64, 128, 64)):  # nvfp4_linear_triton's two tilings
        yield {"kernel": "kvship.kernels.nvfp4_linear:_nvfp4_kernel", "types": dense,
               "constexprs": {"HAS_BIAS": True, "GROUP": 16, "BLOCK_M": block_m, "BLOCK_N": block_n,
                              "BLOCK_K": block_k},
               "divisible": [n for n in dense if n not in ("M", "stride_s")],
               "options": {"num_warps": 4, "num_stages": 3}}


@pytest.mark.timeout(900)
def test_nvfp4_kernels_compile_for_sm90():
    """On a machine without a GPU (tests/sm90_compile.py says why): each variant compiles for an
    H100/H200 within a block's shared memory."""
    from sm90_compile import compile_in_child

    compile_in_child(list(_sm90_specs()))
