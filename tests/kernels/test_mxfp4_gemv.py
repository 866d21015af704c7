"""gpt-oss's few-token MXFP4 expert GEMVs (kernels/mxfp4_gemv.py), in the interpreter without a
GPU: the e2m1 decode against the OCP definition, the layer against the torch reference
(dequantized experts, biases and the clamped SwiGLU's clamps both reached) and against the
grouped GEMMs; rows and groups in partial tiles. On the GPU: gpt-oss-20b's sizes, and the
dispatch's few-token path inside a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from kvship.kernels import gpt_oss_moe as gm
from kvship.kernels import mxfp4_gemv
from kvship.kernels._triton import HAS_TRITON, tl, triton
from kvship.kernels.fused_moe import MoEConfig
from sm90_compile import compile_in_child, ints
from test_gpt_oss_moe import make_experts, ocp_e2m1, route
from test_kernels import GPU

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
DEV = "cuda" if GPU else "cpu"


@triton.jit
def _decode_kernel(c_ptr, out_ptr):
    c = tl.load(c_ptr + tl.arange(0, 16))
    tl.store(out_ptr + tl.arange(0, 16), mxfp4_gemv._e2m1_times_2_pow_m14(c))


def test_e2m1_decode_is_the_ocp_definition():
    codes = torch.arange(16, dtype=torch.int32, device=DEV)
    out = torch.empty(16, dtype=torch.float32, device=DEV)
    _decode_kernel[(1,)](codes, out)
    want = torch.tensor([ocp_e2m1(c) * 2.0 ** -14 for c in range(16)])
    assert torch.equal(out.cpu(), want)  # exact, the subnormal +-0.5 included


def test_pair_bits_are_the_ocp_definition():
    """The packed pairs' shifts and masks (which the PTX is written from): every word's pair j
    holds codes j and j + 4 as float16 bits of the value times 2 ** -14, the subnormal included."""
    words = torch.randint(-2 ** 31, 2 ** 31, (4096,), generator=torch.Generator().manual_seed(1), dtype=torch.int64)
    words = torch.cat([words, torch.tensor([0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567])]) & 0xFFFFFFFF
    assert torch.tensor(mxfp4_gemv.F16_2_POW_14, dtype=torch.int16).view(torch.float16).item() == 2.0 ** 14
    table = torch.tensor([ocp_e2m1(c) for c in range(16)])
    for j, (sign, rest) in enumerate(mxfp4_gemv.PAIR_SHIFTS):
        t = (words << sign if sign >= 0 else words >> -sign) & 0xFFFFFFFF
        u = (words << rest if rest >= 0 else words >> -rest) & 0xFFFFFFFF
        w = (t & mxfp4_gemv.SIGNS) | (u & mxfp4_gemv.MAGNITUDES)
        for half, code in ((w & 0xFFFF, (words >> 4 * j) & 15), (w >> 16, (words >> 4 * (j + 4)) & 15)):
            got = half.to(torch.int32).to(torch.int16).view(torch.float16).float() * 2.0 ** 14
            assert torch.equal(got, table[code]), j


def problem(e: int, h: int, i: int, k: int, tokens: int, seed: int):
    """Random MXFP4 experts, activations (std 2) and a routing, float32 on the test device."""
    ex = make_experts(e, h, i, True, seed, DEV)
    x = (torch.randn(tokens, h, generator=torch.Generator().manual_seed(seed + 1)) * 2).to(DEV)
    weights, ids = route(tokens, e, k, seed + 2)
    return ex, x, weights.to(DEV), ids.to(DEV)


def run_gemv(x, ex, weights, ids, gate_up, down):
    return mxfp4_gemv.mxfp4_moe_gemv(x, ex.w13, ex.w13_scale, ex.w13_bias, ex.w2, ex.w2_scale, ex.w2_bias,
                                     weights, ids, ex.alpha, ex.limit, gate_up, down)


def settings(block_n: int, pairs) -> dict:
    return {"block_n": block_n, "block_g": 2, "num_warps": 1, "pairs": int(bool(pairs)),
            "x_words": int(pairs == "x_words")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pairs", [(0, 0), (1, 1), (0, 1), (1, 0), (1, "x_words"), ("x_words", 1),
                                   ("x_words", "x_words"), (0, "x_words")])
@pytest.mark.parametrize("tokens", [1, 3])
def test_gemv_matches_torch_and_grouped(tokens, pairs):
    """3 groups of 32 a hidden row in tiles of 2 groups (a partial last tile), 96 down rows in
    tiles of 64 (a partial last block), 2 groups of h; two tokens may share an expert. The float32
    decode matches to float32 rounding, the packed pairs (float16 products and word sums) to
    float16's; each kernel takes either (pairs: gate/up's, down's; "x_words": the pairs with
    the input as words made once), so that h is written as words by a gate/up kernel of either
    decode."""
    e, h, i, k = 4, 96, 64, 2
    ex, x, weights, ids = problem(e, h, i, k, tokens, 11)
    want = gm.gpt_oss_moe_torch(x, ex, weights, ids)
    got = run_gemv(x, ex, weights, ids, settings(16, pairs[0]), settings(64, pairs[1]))
    tol = 3e-3 if any(pairs) else 1e-4 if GPU else 1e-5
    assert ((got - want).norm() / want.norm()).item() < tol
    grouped = gm.gpt_oss_moe_triton(x, ex, weights, ids, MoEConfig(16, 32, 32, 4, 1))
    assert ((got - grouped).norm() / grouped.norm()).item() < tol
    # the clamps act: some gate sums above the limit and some up sums beyond +-limit
    pre = torch.stack([torch.nn.functional.linear(x, ex.weight("w13", j, torch.float32), ex.w13_bias[j])
                       for j in range(e)])
    assert (pre[..., :i] > ex.limit).any() and (pre[..., i:].abs() > ex.limit).any()
    assert want.abs().max() > 1.0


@pytest.mark.timeout(300)
def test_packed_pairs_take_outlier_activations():
    """Inputs of 3000 against codes of +6 (inputs 0..3) and -6 (4..7): each half of the word's
    float16 sum (4 products, 72000) would overflow, the two infinities cancel to NaN (the
    clamps would hide one infinity alone); the packed pairs hold x / 16, and the layer stays
    finite and matches the reference (where the 8 products cancel)."""
    e, h, i, k = 2, 64, 32, 1
    ex, x, weights, ids = problem(e, h, i, k, 1, 51)
    ex.w13[:, :, :2] = 0x77  # two codes a byte: inputs 0..3 of every gate/up row +6, 4..7 -6
    ex.w13[:, :, 2:4] = 0xFF
    x[0, :8] = 3000.0
    want = gm.gpt_oss_moe_torch(x, ex, weights, ids)
    settings = {"block_n": 32, "block_g": 2, "num_warps": 1, "pairs": 1}
    got = run_gemv(x, ex, weights, ids, settings, settings)
    assert torch.isfinite(got).all() and ((got - want).norm() / want.norm()).item() < 3e-3


def test_dispatch_takes_the_gemv_for_few_tokens(monkeypatch):
    """gpt_oss_moe_triton with no tiles asked for: MXFP4 and few tokens go to the GEMVs, more to
    the grouped GEMMs (the table's bound)."""
    calls = []
    monkeypatch.setattr(mxfp4_gemv, "MXFP4_GEMV", ((2, {"block_n": 16, "block_g": 2, "num_warps": 1},
                                                    {"block_n": 32, "block_g": 2, "num_warps": 1}),))
    real = mxfp4_gemv.mxfp4_moe_gemv
    monkeypatch.setattr(mxfp4_gemv, "mxfp4_moe_gemv", lambda *a: calls.append(a) or real(*a))
    assert mxfp4_gemv.gemv_settings(3) is None
    ex, x, weights, ids = problem(2, 64, 32, 1, 2, 21)
    got = gm.gpt_oss_moe_triton(x, ex, weights, ids)
    assert len(calls) == 1
    torch.testing.assert_close(got, gm.gpt_oss_moe_torch(x, ex, weights, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(600)
def test_kernels_compile_for_sm90():
    """Both kernels with both decodes (the packed pairs' inline PTX is compiled only here and on
    the GPU: the interpreter runs its pure-Triton twin), at the table's settings and a few more,
    and the grouped GEMMs' MXFP4 path."""
    sizes = ints("N", "K", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_be")
    common = {"s_ptr": "*u8", "bias_ptr": "*fp32", "ids_ptr": "*i64", **sizes}
    gate_up = {"x_ptr": "*bf16", "h_ptr": "*bf16", "alpha": "fp32", "limit": "fp32", **ints("stride_x", "stride_h")}
    down = {"h_ptr": "*bf16", "out_ptr": "*bf16", "rw_ptr": "*fp32", **ints("stride_h", "stride_out")}
    narrow = ({"block_n": 2, "block_g": 32, "num_warps": 1}, {"block_n": 1, "block_g": 32, "num_warps": 1})
    tables = [(gu, dn) for _, gu, dn in mxfp4_gemv.MXFP4_GEMV] + [narrow]
    specs = []
    for pairs in (False, True):
        codes = {"w_ptr": "*i32" if pairs else "*u8"}
        for gu, dn in tables:
            for name, types, cfg, extra in (("_gate_up_kernel", gate_up, gu, {}),
                                            ("_down_kernel", down, dn, {"K_POW2": 4})):
                specs.append({"kernel": f"kvship.kernels.mxfp4_gemv:{name}", "types": {**common, **codes, **types},
                              "constexprs": {"TOP_K": 4, "BLOCK_N": cfg["block_n"], "BLOCK_G": cfg["block_g"],
                                             "PAIRS": pairs, "ASM": True, **extra},
                              "options": {"num_warps": cfg["num_warps"]}})
    # the grouped GEMMs' MXFP4 tiles (kernels/packed_moe.py) decode with the same bit placing
    grouped = {"a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "bias_ptr": "*fp32", "out_ptr": "*bf16",
               "rw_ptr": "*fp32", "sorted_ptr": "*i32", "experts_ptr": "*i32", "padded_ptr": "*i32", "alpha": "fp32",
               "limit": "fp32", **ints("num_pairs", "N", "K", "stride_a", "stride_we", "stride_wn", "stride_se",
                                        "stride_sn", "stride_be", "stride_out")}
    for gated in (True, False):
        specs.append({"kernel": "kvship.kernels.packed_moe:_packed_gemm_kernel", "types": grouped,
                      "constexprs": {"A_DIV": 4 if gated else 1, "GATED": gated, "FORMAT": "mxfp4",
                                     "ACT": "clamped_swiglu", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128},
                      "options": {"num_warps": 4, "num_stages": 3}})
    compile_in_child(specs)


# -- GPU: gpt-oss-20b's sizes, bf16 activations ----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4, 16])
def test_gemv_gpu_real_sizes(tokens):
    e, h, i, k = 32, 2880, 2880, 4
    ex = make_experts(e, h, i, True, 31, "cuda")
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(32)).to("cuda", torch.bfloat16)
    weights, ids = (t.cuda() for t in route(tokens, e, k, 33))
    want = gm.gpt_oss_moe_torch(x.float(), ex, weights, ids)
    both = [({"block_n": 8, "block_g": 16, "num_warps": 2, "pairs": p}, {"block_n": 4, "block_g": 16, "num_warps": 2,
                                                                       "pairs": p}) for p in (0, 1)]
    for gate_up, down in both + [(gu, dn) for _, gu, dn in mxfp4_gemv.MXFP4_GEMV]:
        got = run_gemv(x, ex, weights, ids, gate_up, down)
        err = (got.float() - want).norm() / want.norm()
        assert torch.isfinite(got).all() and err < 1e-2, (gate_up, down, err)


@pytest.mark.gpu
def test_gemv_gpu_cuda_graph():
    """The few-token path captured once and replayed on new routing: no host sync, same result."""
    e, h, i, k = 32, 2880, 2880, 4
    ex = make_experts(e, h, i, True, 41, "cuda")
    x = torch.randn(1, h, generator=torch.Generator().manual_seed(42)).to("cuda", torch.bfloat16)
    weights, ids = (t.cuda() for t in route(1, e, k, 43))
    gm.gpt_oss_moe(x, ex, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gm.gpt_oss_moe(x, ex, weights, ids)
    new_w, new_ids = route(1, e, k, 44)
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    want = gm.gpt_oss_moe_torch(x.float(), ex, weights, ids)
    assert (out.float() - want).norm() / want.norm() < 1e-2
