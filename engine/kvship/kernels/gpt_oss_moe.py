"""gpt-oss's routed experts: x [T, H], the router's choice (weights, ids) [T, k], stacked w13
[E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], each with a bias per output row ->
sum over the k choices of weight * (w2[e] @ act(w13[e] @ x + b13[e]) + b2[e]), where act is
gpt-oss's clamped SwiGLU: gate <= limit, -limit <= up <= limit, (up + 1) * gate * sigmoid(alpha * gate).

Weights are 16-bit, or MXFP4 as OpenAI ships them (OCP Microscaling): two e2m1 codes a byte (the
even input in the low nibble) and one e8m0 scale byte (2 ** (s - 127)) per 32 inputs, kept so on
the device: [E, N, K / 2] codes, [E, N, K / 32] scales. The Triton grouped GEMMs
(kernels/packed_moe.py) decode a tile's codes in registers and multiply in the activations'
dtype (W4A16: Hopper has no FP4 MMA), in fused_moe's alignment by expert (shapes fixed by
(T, k, E): CUDA-graph safe). ``gpt_oss_moe_torch`` dequantizes each chosen expert: the
reference and the CPU path."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from kvship.kernels import mxfp4_gemv
from kvship.kernels._triton import use_triton
from kvship.kernels.fused_moe import moe_config
from kvship.kernels.packed_moe import PackedExperts, packed_moe_gemm, packed_moe_gemv
from kvship.kernels.tuning.moe import GPT_OSS_GEMV_DOWN as GEMV_DOWN
from kvship.kernels.tuning.moe import GPT_OSS_GEMV_GATE_UP as GEMV_GATE_UP
from kvship.quant.tensor import e2m1_values

MXFP4_BLOCK = 32  # inputs per e8m0 scale


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., N, K / 2] uint8 and scales [..., N, K / 32] uint8 -> [..., N, K] in ``dtype``."""
    values = torch.stack([e2m1_values(codes & 15), e2m1_values(codes >> 4)], dim=-1).flatten(-2)
    factor = torch.exp2(scales.float() - 127).repeat_interleave(MXFP4_BLOCK, dim=-1)
    return (values * factor).to(dtype)


@dataclass(frozen=True)
class GptOssExperts:
    """One layer's experts as the kernels take them; ``*_scale`` None: 16-bit weights."""

    w13: torch.Tensor
    w13_bias: torch.Tensor  # [E, 2I] float32
    w2: torch.Tensor
    w2_bias: torch.Tensor  # [E, H] float32
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    alpha: float = 1.702
    limit: float = 7.0

    @property
    def mxfp4(self) -> bool:
        return self.w13_scale is not None

    def weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's matrix of the stack ``name`` ("w13" or "w2") in ``dtype``."""
        scale = getattr(self, name + "_scale")
        w = getattr(self, name)[e]
        return w.to(dtype) if scale is None else dequantize_mxfp4(w, scale[e], dtype)

    @cached_property
    def packed(self) -> PackedExperts:
        """The stacks as kernels/packed_moe.py reads them, made once: an eager forward would pay
        for it on the host at every call."""
        return PackedExperts(self.w13, self.w2, "mxfp4" if self.mxfp4 else "16bit", "clamped_swiglu", self.w13_scale,
                             self.w2_scale, self.w13_bias, self.w2_bias, float(self.alpha), float(self.limit))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def gpt_oss_moe_torch(x: torch.Tensor, experts: GptOssExperts, weights: torch.Tensor, ids: torch.Tensor
                      ) -> torch.Tensor:
    inter = experts.w13.shape[1] // 2
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.w13.shape[0]).tolist()  # the host sync
    token_of, weight_of = order // ids.shape[1], weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start:start + n]
        h = F.linear(x[rows], experts.weight("w13", e, x.dtype), experts.w13_bias[e].to(x.dtype))
        h = clamped_swiglu(h[:, :inter], h[:, inter:], experts.alpha, experts.limit)
        y = F.linear(h, experts.weight("w2", e, x.dtype), experts.w2_bias[e].to(x.dtype))
        out.index_add_(0, rows, y * weight_of[start:start + n, None].to(x.dtype))
        start += n
    return out


def gpt_oss_moe_gemv(x: torch.Tensor, experts: GptOssExperts, weights: torch.Tensor, ids: torch.Tensor,
                     gate_up: dict | None = None, down: dict | None = None) -> torch.Tensor:
    """gpt_oss_moe_triton's result by the GEMV kernel, a program per (pair, BLOCK_N rows)."""
    return packed_moe_gemv(x, experts.packed, weights, ids, gate_up or GEMV_GATE_UP, down or GEMV_DOWN)


def gpt_oss_moe_triton(x: torch.Tensor, experts: GptOssExperts, weights: torch.Tensor, ids: torch.Tensor,
                       config=None) -> torch.Tensor:
    """The two grouped GEMMs (fused_moe's alignment), then the k rows of each token summed. With no
    tiles asked for: MXFP4 experts for few tokens take kernels/mxfp4_gemv.py, 16-bit ones for one
    token ``gpt_oss_moe_gemv``."""
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    few = config is None and experts.mxfp4 and mxfp4_gemv.gemv_settings(tokens)
    if few:
        return mxfp4_gemv.mxfp4_moe_gemv(x, experts.w13, experts.w13_scale, experts.w13_bias, experts.w2,
                                         experts.w2_scale, experts.w2_bias, weights, ids, experts.alpha,
                                         experts.limit, *few)
    if config is None and tokens == 1:
        return gpt_oss_moe_gemv(x, experts, weights, ids)
    cfg = config or moe_config(tokens, top_k, experts.w13.shape[0])
    return packed_moe_gemm(x, experts.packed, weights, ids, cfg)


def gpt_oss_moe(x: torch.Tensor, experts: GptOssExperts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return gpt_oss_moe_triton(x, experts, weights, ids)
    return gpt_oss_moe_torch(x, experts, weights, ids)
