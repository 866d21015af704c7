"""gpt-oss's experts (kernels/gpt_oss_moe.py): MXFP4 decoding against transformers' own
dequantization and against the OCP Microscaling definition written out here; the torch path
against transformers' GptOssExperts on the same (dequantized) weights; the Triton grouped GEMMs
(in the interpreter without a GPU) against the torch path, 16-bit and MXFP4."""
from __future__ import annotations

import pytest
import torch

from kvship.kernels import gpt_oss_moe as gm
from kvship.kernels._triton import HAS_TRITON
from kvship.kernels.fused_moe import MoEConfig
from test_kernels import GPU

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
DEV = "cuda" if GPU else "cpu"


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes [..., N, K / 2] and scales [..., N, K / 32] near 1 (exponents 124..129)."""
    g = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    codes = torch.randint(0, 256, (*lead, n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(124, 130, (*lead, n, k // 32), generator=g, dtype=torch.uint8)
    return codes, scales


def ocp_e2m1(code: int) -> float:
    """OCP MX spec, FP4 E2M1: bias 1; exponent 0 is subnormal, 0.M x 2 ** (1 - bias)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def test_dequantize_is_the_ocp_definition():
    codes, scales = random_mxfp4((3, 64), 0)
    got = gm.dequantize_mxfp4(codes, scales)
    for n in range(3):
        for k in range(64):
            byte = int(codes[n, k // 2])
            code = byte & 15 if k % 2 == 0 else byte >> 4  # the even element in the low nibble
            want = ocp_e2m1(code) * 2.0 ** (int(scales[n, k // 32]) - 127)  # E8M0: 2 ** (s - 127)
            assert got[n, k].item() == want, (n, k)


def test_dequantize_matches_transformers():
    """transformers reads OpenAI's *_blocks [E, N, K / 32, 16] and *_scales [E, N, K / 32] and
    returns the matrix transposed ([E, K, N]) for its experts."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    codes, scales = random_mxfp4((4, 48, 96), 1)
    blocks = codes.view(4, 48, 96 // 32, 16)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    torch.testing.assert_close(gm.dequantize_mxfp4(codes, scales).transpose(1, 2), want, rtol=0, atol=0)


def make_experts(e: int, h: int, i: int, mxfp4: bool, seed: int, device: str = "cpu") -> gm.GptOssExperts:
    g = torch.Generator().manual_seed(seed)
    b13, b2 = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g) * 0.1
    if mxfp4:
        w13, s13 = random_mxfp4((e, 2 * i, h), seed + 1)
        w2, s2 = random_mxfp4((e, h, i), seed + 2)
        s2 = s2 - 3  # keep the down projection's outputs near the inputs' size
    else:
        w13, w2, s13, s2 = torch.randn(e, 2 * i, h, generator=g) / 4, torch.randn(e, h, i, generator=g) / 8, None, None
    move = (lambda t: None if t is None else t.to(device))
    return gm.GptOssExperts(move(w13), move(b13), move(w2), move(b2), move(s13), move(s2))


def route(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    top, ids = logits.topk(k, dim=-1)
    return torch.softmax(top, dim=-1), ids


@pytest.mark.parametrize("mxfp4", [False, True])
def test_torch_path_matches_transformers_experts(mxfp4):
    """transformers' GptOssExperts holds gate_up_proj [E, H, 2I] with gate and up columns
    interleaved and down_proj [E, I, H]; the same weights in our layout give its output."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HFExperts

    e, h, i, k, t = 4, 64, 32, 2, 6
    ex = make_experts(e, h, i, mxfp4, 3)
    w13 = torch.stack([ex.weight("w13", j, torch.float32) for j in range(e)])  # [E, 2I, H] gate rows, then up
    w2 = torch.stack([ex.weight("w2", j, torch.float32) for j in range(e)])
    hf = HFExperts(GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e))
    inter = torch.stack([w13[:, :i], w13[:, i:]], dim=2).flatten(1, 2)  # rows gate0, up0, gate1, ...
    with torch.no_grad():
        hf.gate_up_proj.copy_(inter.transpose(1, 2))
        hf.gate_up_proj_bias.copy_(torch.stack([ex.w13_bias[:, :i], ex.w13_bias[:, i:]], dim=2).flatten(1))
        hf.down_proj.copy_(w2.transpose(1, 2))
        hf.down_proj_bias.copy_(ex.w2_bias)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4))
    weights, ids = route(t, e, k, 5)
    with torch.no_grad():
        want = hf(x, ids, weights)
    got = gm.gpt_oss_moe_torch(x, ex, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert want.abs().max() > 1.0  # the clamp (limit 7) and biases were exercised, not a near-zero output


@needs_triton
@pytest.mark.parametrize("path", ["gemm", "gemv"])
@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("tokens", [1, 5])
def test_triton_matches_torch(path, mxfp4, tokens):
    """The grouped GEMMs and the one-token GEMV kernels (which take any token count; the engine
    gives them one), K in several tiles (with a partial last one on the GPU)."""
    e, h, i, k = (4, 64, 32, 2) if not GPU else (32, 2880, 2880, 4)
    dtype = torch.float32 if not GPU else torch.bfloat16
    ex = make_experts(e, h, i, mxfp4, 7, DEV)
    if not mxfp4:
        ex = gm.GptOssExperts(ex.w13.to(dtype), ex.w13_bias, ex.w2.to(dtype), ex.w2_bias)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(8)).to(DEV, dtype)
    weights, ids = route(tokens, e, k, 9)
    weights, ids = weights.to(DEV), ids.to(DEV)
    if path == "gemm":
        cfg = None if GPU else MoEConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
        got = gm.gpt_oss_moe_triton(x, ex, weights, ids, cfg or MoEConfig(16, 64, 128, 4, 3))
    else:
        tiles = None if GPU else {"block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 1}
        got = gm.gpt_oss_moe_gemv(x, ex, weights, ids, tiles, tiles)
    want = gm.gpt_oss_moe_torch(x.float(), ex, weights, ids)
    err = (got.float() - want).norm() / want.norm()
    assert torch.isfinite(got).all() and err < (1e-5 if dtype == torch.float32 else 2e-2), err
