"""Routed experts held as packed codes (or 16-bit), for gpt-oss's and the NVFP4 experts: a grouped
GEMM over fused_moe's alignment by expert and a one-token GEMV, each decoding its weight tiles in
registers. The constexpr FORMAT picks the tile decode ("16bit", "mxfp4", "nvfp4") and ACT the
epilogue ("clamped_swiglu": gpt-oss's biases and clamped SwiGLU; "silu_mul": no bias)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvship.kernels._triton import tl, triton
from kvship.kernels.activation import silu_mul
from kvship.kernels.fp4 import nvfp4_tile
from kvship.kernels.fused_moe import MoEConfig, _dot, align_by_expert, expert_block, expert_rows
from kvship.kernels.mxfp4_gemv import _e2m1_times_2_pow_m14, _scale

NVFP4_GROUP = 16  # inputs per float32 scale
_NVFP4_GROUP = tl.constexpr(NVFP4_GROUP)  # the kernels' copy
MIN_BLOCK_K = 32  # a packed K tile holds whole scale groups: an MXFP4 block, two NVFP4 groups


@dataclass(frozen=True)
class PackedExperts:
    """One layer's stacks as the kernels read them: w13 [E, 2I, ..] (gate rows, then up rows) and
    w2 [E, H, ..], 16-bit [.., K] or code bytes [.., K / 2] with scales [.., K / group] (``fmt``
    "mxfp4": e8m0 bytes per 32; "nvfp4": float32 per 16). ``act`` "clamped_swiglu" adds the
    float32 biases [E, N] and clamps at ``limit``; "silu_mul" takes no biases, alpha or limit."""

    w13: torch.Tensor
    w2: torch.Tensor
    fmt: str
    act: str
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    alpha: float | None = None
    limit: float | None = None

    def operands(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int | None]:
        """Stack ``name``'s (codes, scales, biases, the biases' expert stride); missing scales are
        the codes, never read; missing biases None, which the kernels take as a constant."""
        w = getattr(self, name)
        scale, bias = getattr(self, name + "_scale"), getattr(self, name + "_bias")
        return w, w if scale is None else scale, bias, None if bias is None else bias.stride(0)


@triton.jit
def _mxfp4_tile(w_rows, s_rows, nmask, k0, K, dtype, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """MXFP4 codes and e8m0 scales of W[rows, k0 : k0 + BLOCK_K] decoded in registers to ``dtype``."""
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


@triton.jit
def _weight_tile(w_rows, s_rows, nmask, k0, K, dtype, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """W[rows, k0 : k0 + BLOCK_K] as [BLOCK_N, BLOCK_K] in ``dtype`` (zero past K and on masked
    rows); w_rows / s_rows: each row's first code (or weight) and first scale."""
    if FORMAT == "mxfp4":
        return _mxfp4_tile(w_rows, s_rows, nmask, k0, K, dtype, BLOCK_N, BLOCK_K)
    elif FORMAT == "nvfp4":
        return nvfp4_tile(w_rows, s_rows, nmask, k0, K, _NVFP4_GROUP, BLOCK_N, BLOCK_K).to(dtype)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows[:, None] + offs_k[None, :], mask=nmask[:, None] & (offs_k < K)[None, :], other=0.0)
        return w.to(dtype)


@triton.jit
def _gate(gate, up, b_e, N, offs_n, nmask, alpha, limit, ACT: tl.constexpr):
    """The gated activation of gate and up rows [M, BLOCK_N] (gate's biases already added; the up
    rows' biases at b_e + N, b_e: the expert's)."""
    if ACT == "clamped_swiglu":
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up + tl.load(b_e + N + offs_n, mask=nmask, other=0.0)[None, :], -limit), limit)
        return (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    else:
        return silu_mul(gate, up)


@triton.jit
def _epilogue(acc, acc_up, bias_ptr, expert, stride_be, offs_n, nmask, N, rw, alpha, limit, GATED: tl.constexpr,
              ACT: tl.constexpr):
    """Rows [M, BLOCK_N] of the products: expert's biases added for "clamped_swiglu", then the gated
    activation of gate (acc) and up (acc_up) for GATED, else times each row's router weight (rw [M]).
    "silu_mul" gets None for the biases, their stride, alpha and limit."""
    if ACT == "clamped_swiglu":
        bias_ptr += expert * stride_be
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0)[None, :]
    if GATED:
        return _gate(acc, acc_up, bias_ptr, N, offs_n, nmask, alpha, limit, ACT)
    else:
        return acc * rw[:, None]


@triton.jit
def _packed_gemm_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, rw_ptr, sorted_ptr, experts_ptr, padded_ptr,
                        num_pairs, N, K, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_out,
                        alpha, limit, A_DIV: tl.constexpr, GATED: tl.constexpr, FORMAT: tl.constexpr,
                        ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n] for the BLOCK_M pairs of one expert's block: GATED (w13), the activation of the
    gate row n and the up row N + n; else (w2) A . W[e, n] (plus its bias) times the pair's router
    weight."""
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
        acc = _dot(a, tl.trans(_weight_tile(gate_w, gate_s, nmask, k0, K, a.dtype, FORMAT, BLOCK_N, BLOCK_K)), acc)
        if GATED:
            up = _weight_tile(gate_w + N * stride_wn, gate_s + N * stride_sn, nmask, k0, K, a.dtype, FORMAT,
                              BLOCK_N, BLOCK_K)
            acc_up = _dot(a, tl.trans(up), acc_up)
        a_ptrs += BLOCK_K
    rw = tl.load(rw_ptr + pairs, mask=valid, other=0.0)
    acc = _epilogue(acc, acc_up, bias_ptr, expert, stride_be, offs_n, nmask, N, rw, alpha, limit, GATED, ACT)
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@triton.jit
def _packed_gemv_kernel(a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, rw_ptr, ids_ptr, N, K, stride_a, stride_we,
                        stride_wn, stride_se, stride_sn, stride_be, stride_out, alpha, limit, A_DIV: tl.constexpr,
                        GATED: tl.constexpr, FORMAT: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
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
        acc += _weight_tile(gate_w, gate_s, nmask, k0, K, tl.float32, FORMAT, BLOCK_N, BLOCK_K) * a
        if GATED:
            acc_up += _weight_tile(gate_w + N * stride_wn, gate_s + N * stride_sn, nmask, k0, K, tl.float32, FORMAT,
                                   BLOCK_N, BLOCK_K) * a
    rw = tl.load(rw_ptr + pair + tl.zeros([1], dtype=tl.int32))
    y = _epilogue(tl.sum(acc, 1)[None, :], tl.sum(acc_up, 1)[None, :], bias_ptr, expert, stride_be, offs_n, nmask,
                  N, rw, alpha, limit, GATED, ACT)
    tl.store(out_ptr + pair.to(tl.int64) * stride_out + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=nmask[None, :])


def _gemm(a: torch.Tensor, ex: PackedExperts, name: str, out: torch.Tensor, router_weights: torch.Tensor,
          aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], a_div: int, cfg: MoEConfig) -> None:
    """One grouped GEMM of stack ``name`` into out [pairs, N]."""
    w, s, b, stride_be = ex.operands(name)
    sorted_pairs, block_experts, num_padded = aligned
    gated = name == "w13"
    block_n = max(16, cfg.block_n // 2) if gated else cfg.block_n  # as many weight bytes a program as fused_moe's
    grid = (triton.cdiv(out.shape[1], block_n), block_experts.numel())
    _packed_gemm_kernel[grid](
        a, w, s, b, out, router_weights, sorted_pairs, block_experts, num_padded, out.shape[0], out.shape[1],
        a.shape[1], a.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), stride_be, out.stride(0),
        ex.alpha, ex.limit, A_DIV=a_div, GATED=gated, FORMAT=ex.fmt, ACT=ex.act, BLOCK_M=cfg.block_m,
        BLOCK_N=block_n, BLOCK_K=max(cfg.block_k, MIN_BLOCK_K), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def packed_moe_gemm(x: torch.Tensor, ex: PackedExperts, weights: torch.Tensor, ids: torch.Tensor, cfg: MoEConfig
                    ) -> torch.Tensor:
    """x [T, H], the router's (weights, ids) [T, k] -> [T, H]: the two grouped GEMMs (fused_moe's
    alignment by expert), then the k rows of each token summed."""
    tokens, top_k = ids.shape
    x = x.contiguous()
    aligned = align_by_expert(ids, ex.w13.shape[0], cfg.block_m)
    h = torch.empty(ids.numel(), ex.w13.shape[1] // 2, dtype=x.dtype, device=x.device)  # every pair's row is written
    _gemm(x, ex, "w13", h, weights, aligned, top_k, cfg)
    y = torch.empty(ids.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    _gemm(h, ex, "w2", y, weights.flatten().float().contiguous(), aligned, 1, cfg)
    return y.view(tokens, top_k, x.shape[1]).sum(dim=1)


def packed_moe_gemv(x: torch.Tensor, ex: PackedExperts, weights: torch.Tensor, ids: torch.Tensor, gate_up: dict,
                    down: dict) -> torch.Tensor:
    """packed_moe_gemm's result by the GEMV kernel, a program per (pair, BLOCK_N rows); ``gate_up``
    / ``down``: {"block_n", "block_k", "num_warps", "num_stages"}."""
    tokens, top_k = ids.shape
    ids, rw = ids.flatten().contiguous(), weights.flatten().float().contiguous()
    h = torch.empty(ids.numel(), ex.w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    y = torch.empty(ids.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    for a, name, out, a_div, cfg in ((x.contiguous(), "w13", h, top_k, gate_up), (h, "w2", y, 1, down)):
        w, s, b, stride_be = ex.operands(name)
        block_k = cfg["block_k"] if ex.fmt == "16bit" else max(cfg["block_k"], MIN_BLOCK_K)
        _packed_gemv_kernel[(triton.cdiv(out.shape[1], cfg["block_n"]), ids.numel())](
            a, w, s, b, out, rw, ids, out.shape[1], a.shape[1], a.stride(0), w.stride(0), w.stride(1), s.stride(0),
            s.stride(1), stride_be, out.stride(0), ex.alpha, ex.limit, A_DIV=a_div,
            GATED=name == "w13", FORMAT=ex.fmt, ACT=ex.act, BLOCK_N=cfg["block_n"], BLOCK_K=block_k,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.view(tokens, top_k, x.shape[1]).sum(dim=1)
