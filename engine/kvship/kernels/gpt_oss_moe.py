"""gpt-oss's routed experts: x [T, H], the router's choice (weights, ids) [T, k], stacked w13
[E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], each with a bias per output row ->
sum over the k choices of weight * (w2[e] @ act(w13[e] @ x + b13[e]) + b2[e]), where act is
gpt-oss's clamped SwiGLU: gate <= limit, -limit <= up <= limit, (up + 1) * gate * sigmoid(alpha * gate).

Weights are 16-bit, or MXFP4 as OpenAI ships them (OCP Microscaling): two e2m1 codes a byte (the
even input in the low nibble) and one e8m0 scale byte (2 ** (s - 127)) per 32 inputs, kept so on
the device: [E, N, K / 2] codes, [E, N, K / 32] scales. The Triton grouped GEMMs decode a tile's
codes in registers and multiply in the activations' dtype (W4A16: Hopper has no FP4 MMA), in
fused_moe's alignment by expert (shapes fixed by (T, k, E): CUDA-graph safe). ``gpt_oss_moe_torch``
dequantizes each chosen expert: the reference and the CPU path."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvship.kernels import mxfp4_gemv
from kvship.kernels._triton import tl, triton, use_triton
from kvship.kernels.fused_moe import _dot, align_by_expert, expert_block, expert_rows, moe_config
from kvship.kernels.mxfp4_gemv import _e2m1_times_2_pow_m14, _scale
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


@triton.jit
def _weight_tile(w_rows, s_rows, nmask, k0, K, dtype, MXFP4: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """W[rows, k0 : k0 + BLOCK_K] as [BLOCK_N, BLOCK_K] in ``dtype``: MXFP4 decoded in registers."""
    if MXFP4:
        HALF: tl.constexpr = BLOCK_K // 2
        cols = k0 // 2 + tl.arange(0, HALF)
        q = tl.load(w_rows[:, None] + cols[None, :], mask=nmask[:, None] & (cols < K // 2)[None, :], other=0)
        q = q.to(tl.int32)
        SB: tl.constexpr = BLOCK_K // 32
        g = k0 // 32 + tl.arange(0, SB)
        s = tl.load(s_rows[:, None] + g[None, :], mask=nmask[:, None] & (g < K // 32)[None, :], other=127)
        factor = _scale(s, 14)  # with the 2 ** 14 the bit-placing decode leaves out
        factor = tl.reshape(tl.broadcast_to(factor[:, :, None], (BLOCK_N, SB, 16)), (BLOCK_N, HALF))
        lo = (_e2m1_times_2_pow_m14(q & 15) * factor).to(dtype)
        hi = (_e2m1_times_2_pow_m14(q >> 4) * factor).to(dtype)
        return tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows[:, None] + offs_k[None, :], mask=nmask[:, None] & (offs_k < K)[None, :], other=0.0)
        return w.to(dtype)


@triton.jit
def _gpt_oss_gemm_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, rw_ptr, sorted_ptr, experts_ptr, padded_ptr,
                         num_pairs, N, K, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_out,
                         alpha, limit, A_DIV: tl.constexpr, GATED: tl.constexpr, MXFP4: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n] for the BLOCK_M pairs of one expert's block: GATED (w13), the clamped SwiGLU of
    the gate row n and the up row N + n (biases added); else (w2) (A . W[e, n] + b[e, n]) times the
    pair's router weight."""
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):  # a block past the routing's real end
        return
    pairs, valid, rows, expert = expert_block(sorted_ptr, experts_ptr, num_pairs, pid_m, A_DIV, BLOCK_M)
    offs_n, nmask, gate_w, gate_s = expert_rows(w_ptr, s_ptr, expert, N, stride_we, stride_wn, stride_se, stride_sn,
                                              BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        acc = _dot(a, tl.trans(_weight_tile(gate_w, gate_s, nmask, k0, K, a.dtype, MXFP4, BLOCK_N, BLOCK_K)), acc)
        if GATED:
            up = _weight_tile(gate_w + N * stride_wn, gate_s + N * stride_sn, nmask, k0, K, a.dtype, MXFP4,
                              BLOCK_N, BLOCK_K)
            acc_up = _dot(a, tl.trans(up), acc_up)
        a_ptrs += BLOCK_K
    rw = tl.load(rw_ptr + pairs, mask=valid, other=0.0)
    acc = _epilogue(acc, acc_up, bias_ptr + expert * stride_be, offs_n, nmask, N, rw, alpha, limit, GATED)
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@triton.jit
def _epilogue(acc, acc_up, b_e, offs_n, nmask, N, rw, alpha, limit, GATED: tl.constexpr):
    """Rows [M, BLOCK_N] of the products: biases added, then the clamped SwiGLU of gate (acc) and
    up (acc_up) for GATED, else times each row's router weight (rw [M])."""
    acc += tl.load(b_e + offs_n, mask=nmask, other=0.0)[None, :]
    if GATED:
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up + tl.load(b_e + N + offs_n, mask=nmask, other=0.0)[None, :], -limit), limit)
        return (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    else:
        return acc * rw[:, None]


@triton.jit
def _gpt_oss_gemv_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, rw_ptr, ids_ptr, N, K, stride_a, stride_we,
                         stride_wn, stride_se, stride_sn, stride_be, stride_out, alpha, limit, A_DIV: tl.constexpr,
                         GATED: tl.constexpr, MXFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMM kernel's out[pair, n] for one pair (program_id 1) by FMAs in float32, summed once
    at the end: no alignment by expert and no padded rows, for one token's k pairs."""
    pair = tl.program_id(1)
    row = (pair // A_DIV).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n, nmask, gate_w, gate_s = expert_rows(w_ptr, s_ptr, expert, N, stride_we, stride_wn, stride_se, stride_sn,
                                              BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + row * stride_a + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]
        acc += _weight_tile(gate_w, gate_s, nmask, k0, K, tl.float32, MXFP4, BLOCK_N, BLOCK_K) * a
        if GATED:
            acc_up += _weight_tile(gate_w + N * stride_wn, gate_s + N * stride_sn, nmask, k0, K, tl.float32, MXFP4,
                                   BLOCK_N, BLOCK_K) * a
    rw = tl.load(rw_ptr + pair + tl.zeros([1], dtype=tl.int32))
    y = _epilogue(tl.sum(acc, 1)[None, :], tl.sum(acc_up, 1)[None, :], bias_ptr + expert * stride_be, offs_n, nmask,
                  N, rw, alpha, limit, GATED)
    tl.store(out_ptr + pair.to(tl.int64) * stride_out + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=nmask[None, :])


def _gemm(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor, out: torch.Tensor,
          router_weights: torch.Tensor, aligned, num_pairs: int, a_div: int, gated: bool, cfg, alpha: float,
          limit: float) -> None:
    sorted_pairs, block_experts, num_padded = aligned
    n = w.shape[1] // 2 if gated else w.shape[1]
    block_n = max(16, cfg.block_n // 2) if gated else cfg.block_n
    s = w if scale is None else scale  # unread for 16-bit weights
    grid = (triton.cdiv(n, block_n), block_experts.numel())
    _gpt_oss_gemm_kernel[grid](
        a, w, s, bias, out, router_weights, sorted_pairs, block_experts, num_padded, num_pairs, n, a.shape[1],
        a.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), bias.stride(0), out.stride(0),
        float(alpha), float(limit), A_DIV=a_div, GATED=gated, MXFP4=scale is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=block_n, BLOCK_K=max(cfg.block_k, MXFP4_BLOCK), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def gpt_oss_moe_gemv(x: torch.Tensor, experts: GptOssExperts, weights: torch.Tensor, ids: torch.Tensor,
                     gate_up: dict | None = None, down: dict | None = None) -> torch.Tensor:
    """gpt_oss_moe_triton's result by the GEMV kernel, a program per (pair, BLOCK_N rows)."""
    tokens, top_k = ids.shape
    inter, hidden, pairs = experts.w13.shape[1] // 2, x.shape[1], ids.numel()
    ids, rw = ids.flatten().contiguous(), weights.flatten().float().contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    for a, w, scale, bias, out, a_div, gated, cfg in (
            (x.contiguous(), experts.w13, experts.w13_scale, experts.w13_bias, h, top_k, True, gate_up or GEMV_GATE_UP),
            (h, experts.w2, experts.w2_scale, experts.w2_bias, y, 1, False, down or GEMV_DOWN)):
        s = w if scale is None else scale  # unread for 16-bit weights
        _gpt_oss_gemv_kernel[(triton.cdiv(out.shape[1], cfg["block_n"]), pairs)](
            a, w, s, bias, out, rw, ids, out.shape[1], a.shape[1], a.stride(0), w.stride(0), w.stride(1),
            s.stride(0), s.stride(1), bias.stride(0), out.stride(0), float(experts.alpha), float(experts.limit),
            A_DIV=a_div, GATED=gated, MXFP4=scale is not None, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.view(tokens, top_k, hidden).sum(dim=1)


def gpt_oss_moe_triton(x: torch.Tensor, experts: GptOssExperts, weights: torch.Tensor, ids: torch.Tensor,
                       config=None) -> torch.Tensor:
    """The two grouped GEMMs (fused_moe's alignment), then the k rows of each token summed. With no
    tiles asked for: MXFP4 experts for few tokens take kernels/mxfp4_gemv.py, 16-bit ones for one
    token ``gpt_oss_moe_gemv``."""
    tokens, top_k = ids.shape
    num_experts, inter, hidden = experts.w13.shape[0], experts.w13.shape[1] // 2, x.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    few = config is None and experts.mxfp4 and mxfp4_gemv.gemv_settings(tokens)
    if few:
        return mxfp4_gemv.mxfp4_moe_gemv(x, experts.w13, experts.w13_scale, experts.w13_bias, experts.w2,
                                         experts.w2_scale, experts.w2_bias, weights, ids, experts.alpha,
                                         experts.limit, *few)
    if config is None and tokens == 1:
        return gpt_oss_moe_gemv(x, experts, weights, ids)
    cfg = config or moe_config(tokens, top_k, num_experts)
    x = x.contiguous()
    aligned = align_by_expert(ids, num_experts, cfg.block_m)
    pairs = tokens * top_k
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    common = (aligned, pairs)
    _gemm(x, experts.w13, experts.w13_scale, experts.w13_bias, h, weights, *common, top_k, True, cfg,
          experts.alpha, experts.limit)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _gemm(h, experts.w2, experts.w2_scale, experts.w2_bias, y, weights.flatten().float().contiguous(), *common, 1,
          False, cfg, experts.alpha, experts.limit)
    return y.view(tokens, top_k, hidden).sum(dim=1)


def gpt_oss_moe(x: torch.Tensor, experts: GptOssExperts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return gpt_oss_moe_triton(x, experts, weights, ids)
    return gpt_oss_moe_torch(x, experts, weights, ids)
