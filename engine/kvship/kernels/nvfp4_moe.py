"""Routed experts in NVFP4 (W4A16): x [T, H], the router's choice (weights, ids) [T, k] and
stacked codes w13 [E, 2I, H / 2] (gate rows, then up rows) and w2 [E, H, I / 2], two e2m1 codes
a byte (the even input in the low nibble), with float32 scales [E, N, K / 16] (the FP8 block
scale times the global factor, kvship.quant.nvfp4) -> sum over the k choices of
weight * w2[e] @ (silu(gate) * up), as kernels/fused_moe.py computes for other storage.

The experts stay 4-bit on the device: fused_moe's alignment by expert (shapes fixed by (T, k, E):
CUDA-graph safe), then one grouped GEMM for w13 with SiLU-and-mul in its epilogue and one for w2
scaled by the router weights, each decoding its weight tiles in registers (kernels/fp4.py) and
multiplying in the activations' dtype. One token takes ``nvfp4_moe_gemv`` instead: a program per
(pair, row tile) of FMAs in fp32, no alignment or padded rows. The reference and CPU path is
fused_moe_torch, which dequantizes each chosen expert."""
from __future__ import annotations

import torch

from kvship.kernels._triton import tl, triton, use_triton
from kvship.kernels.activation import silu_mul
from kvship.kernels.fp4 import nvfp4_tile
from kvship.kernels.fused_moe import (
    ExpertScales,
    MoEConfig,
    _dot,
    align_by_expert,
    expert_block,
    expert_rows,
    fused_moe_torch,
    moe_config,
)
from kvship.kernels.tuning.moe import NVFP4_GEMV_DOWN as GEMV_DOWN
from kvship.kernels.tuning.moe import NVFP4_GEMV_GATE_UP as GEMV_GATE_UP

GROUP = 16  # inputs per scale


@triton.jit
def _nvfp4_moe_kernel(a_ptr, w_ptr, s_ptr, out_ptr, rw_ptr, sorted_ptr, experts_ptr, padded_ptr, num_pairs, N, K,
                      stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_out, A_DIV: tl.constexpr,
                      GATED: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """out[pair, n] for the BLOCK_M pairs of one expert's block: GATED (w13), silu of the gate row
    n times the up row N + n; else (w2) A . W[e, n] times the pair's router weight."""
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
        w = nvfp4_tile(gate_w, gate_s, nmask, k0, K, GROUP, BLOCK_N, BLOCK_K)
        acc = _dot(a, tl.trans(w.to(a.dtype)), acc)
        if GATED:
            up = nvfp4_tile(gate_w + N * stride_wn, gate_s + N * stride_sn, nmask, k0, K, GROUP, BLOCK_N, BLOCK_K)
            acc_up = _dot(a, tl.trans(up.to(a.dtype)), acc_up)
        a_ptrs += BLOCK_K
    acc = _epilogue(acc, acc_up, tl.load(rw_ptr + pairs, mask=valid, other=0.0), GATED)
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@triton.jit
def _epilogue(acc, acc_up, rw, GATED: tl.constexpr):
    """Rows [M, BLOCK_N] of products: GATED, silu(gate) * up; else times each row's router weight (rw [M])."""
    if GATED:
        return silu_mul(acc, acc_up)
    else:
        return acc * rw[:, None]


@triton.jit
def _nvfp4_gemv_kernel(a_ptr, w_ptr, s_ptr, out_ptr, rw_ptr, ids_ptr, N, K, stride_a, stride_we, stride_wn, stride_se,
                       stride_sn, stride_out, A_DIV: tl.constexpr, GATED: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMM kernel's out[pair, n] for one pair (program_id 1) by FMAs in fp32, summed once."""
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
        acc += nvfp4_tile(gate_w, gate_s, nmask, k0, K, GROUP, BLOCK_N, BLOCK_K) * a
        if GATED:
            acc_up += nvfp4_tile(gate_w + N * stride_wn, gate_s + N * stride_sn, nmask, k0, K, GROUP, BLOCK_N,
                                 BLOCK_K) * a
    rw = tl.load(rw_ptr + pair + tl.zeros([1], dtype=tl.int32))
    y = _epilogue(tl.sum(acc, 1)[None, :], tl.sum(acc_up, 1)[None, :], rw, GATED)
    tl.store(out_ptr + pair.to(tl.int64) * stride_out + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=nmask[None, :])


def nvfp4_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   scales: ExpertScales, add: torch.Tensor | None = None, gate_up: dict | None = None,
                   down: dict | None = None) -> torch.Tensor:
    """nvfp4_moe_triton's result by the GEMV kernel, a program per (pair, BLOCK_N rows)."""
    tokens, top_k = ids.shape
    inter, hidden, pairs = w13.shape[1] // 2, x.shape[1], ids.numel()
    ids, rw = ids.flatten().contiguous(), weights.flatten().float().contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    for a, w, s, out, a_div, gated, cfg in ((x.contiguous(), w13, scales.w13, h, top_k, True, gate_up or GEMV_GATE_UP),
                                            (h, w2, scales.w2, y, 1, False, down or GEMV_DOWN)):
        _nvfp4_gemv_kernel[(triton.cdiv(out.shape[1], cfg["block_n"]), pairs)](
            a, w, s, out, rw, ids, out.shape[1], a.shape[1], a.stride(0), w.stride(0), w.stride(1), s.stride(0),
            s.stride(1), out.stride(0), A_DIV=a_div, GATED=gated, GROUP=GROUP, BLOCK_N=cfg["block_n"],
            BLOCK_K=max(cfg["block_k"], 2 * GROUP), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    out = y.view(tokens, top_k, hidden).sum(dim=1)
    return out if add is None else out + add


def _gemm(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, out: torch.Tensor, router_weights: torch.Tensor,
          aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_pairs: int, a_div: int, gated: bool,
          cfg: MoEConfig) -> None:
    sorted_pairs, block_experts, num_padded = aligned
    n = w.shape[1] // 2 if gated else w.shape[1]
    block_n = max(16, cfg.block_n // 2) if gated else cfg.block_n  # as many weight bytes a program as fused_moe's
    grid = (triton.cdiv(n, block_n), block_experts.numel())
    _nvfp4_moe_kernel[grid](
        a, w, s, out, router_weights, sorted_pairs, block_experts, num_padded, num_pairs, n, a.shape[1], a.stride(0),
        w.stride(0), w.stride(1), s.stride(0), s.stride(1), out.stride(0), A_DIV=a_div, GATED=gated, GROUP=GROUP,
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=max(cfg.block_k, 2 * GROUP), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def nvfp4_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     scales: ExpertScales, add: torch.Tensor | None = None, config: MoEConfig | None = None
                     ) -> torch.Tensor:
    """The two grouped GEMMs, then the k rows of each token summed; for one token (and no tiles
    asked for) ``nvfp4_moe_gemv``."""
    tokens, top_k = ids.shape
    num_experts, inter, hidden = w13.shape[0], w13.shape[1] // 2, x.shape[1]
    if tokens == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    if config is None and tokens == 1:
        return nvfp4_moe_gemv(x, w13, w2, weights, ids, scales, add)
    cfg = config or moe_config(tokens, top_k, num_experts)
    x = x.contiguous()
    aligned = align_by_expert(ids, num_experts, cfg.block_m)
    pairs = tokens * top_k
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # every pair's row is written
    _gemm(x, w13, scales.w13, h, weights, aligned, pairs, top_k, True, cfg)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _gemm(h, w2, scales.w2, y, weights.flatten().float().contiguous(), aligned, pairs, 1, False, cfg)
    out = y.view(tokens, top_k, hidden).sum(dim=1)
    return out if add is None else out + add


def nvfp4_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              scales: ExpertScales, add: torch.Tensor | None = None) -> torch.Tensor:
    """``scales``: the stacks' float32 scales per 16 inputs (``e2m1`` set); ``add``: a tensor like
    x added to the result (a shared expert's output)."""
    if use_triton(x):
        return nvfp4_moe_triton(x, w13, w2, weights, ids, scales, add)
    return fused_moe_torch(x, w13, w2, weights, ids, scales, add)
