"""Routed experts, all at once: x [T, H], the router's choice (weights, ids) [T, k] and stacked
expert weights w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] -> sum over the k
choices of weight * w2[e] @ (silu(gate) * up) [T, H].

``fused_moe_torch`` is the reference and CPU path (one matmul pair per expert with tokens; it
syncs with the host). ``fused_moe_triton`` keeps every shape fixed by (T, k, E) and never syncs,
so CUDA graphs capture it, following vLLM's fused_moe: ``align_by_expert`` groups the (token,
choice) pairs by expert on the device, each expert's list padded to BLOCK_M rows; one grouped
GEMM for w13 with SiLU-and-mul in its epilogue; one for w2 scaled by the router weights; the k
rows of each token summed. A block reads only its expert's weights.
One token takes ``fused_moe_gemv``: two FMA kernels with no alignment, padding or summing.

Quantized experts (``ExpertScales``) are dequantized in registers: FP8 codes with float32 scales
per row or per block, or integer codes in kernels/quant_linear.py's layout (dequantized by its
``_dequant``). The reference dequantizes each chosen expert."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvship.kernels._triton import pdl_launch, pdl_wait, tl, triton, use_triton
from kvship.kernels.activation import silu_mul
from kvship.kernels.quant_linear import QWeight, _dequant, dequantize_torch
from kvship.kernels.tuning.moe import GEMV_DOWN, GEMV_GATE_UP, MOE_TILES
from kvship.quant.tensor import code_centre


@dataclass(frozen=True)
class ExpertScales:
    """How quantized experts are stored: scales of w13 [E, 2I, G13] and w2 [E, H, G2] (float32 for
    FP8, float16 for integer codes), W[e, n, k] taking scale[e, n, k // group] (group 0: one a row);
    ``*_bias`` the offsets of asymmetric codes; ``*_bits`` 8 or 4. None scales: 16-bit weights."""

    w13: torch.Tensor | None
    w2: torch.Tensor | None
    w13_group: int = 0
    w2_group: int = 0
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    w13_bits: int = 8
    w2_bits: int = 8
    e2m1: bool = False  # NVFP4 codes (4-bit floats) with float32 scales: kernels/nvfp4_moe.py multiplies them

    def of(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None, int, int]:
        """(scales, biases, group, bits) of the stack ``name``, "w13" or "w2"."""
        return getattr(self, name), getattr(self, name + "_bias"), getattr(self, name + "_group"), \
            getattr(self, name + "_bits")


NO_SCALES = ExpertScales(None, None)  # 16-bit experts


def expert_weight(w: torch.Tensor, scales: ExpertScales, name: str, e: int, k: int, dtype: torch.dtype
                  ) -> torch.Tensor:
    """Expert e's matrix [N, k] of the stack ``name`` in ``dtype`` (dequantized if need be)."""
    s, b, group, bits = scales.of(name)
    if s is None:
        return w[e]
    return dequantize_torch(QWeight(w[e], s[e], None if b is None else b[e], None, bits, group or k, k,
                                    scales.e2m1)).to(dtype)


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, scales: ExpertScales = NO_SCALES, add: torch.Tensor | None = None
                    ) -> torch.Tensor:
    hidden, inter = x.shape[1], w13.shape[1] // 2  # (w2's last dimension may hold packed codes)
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # the host sync
    token_of = order // ids.shape[1]
    weight_of = weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start:start + n]
        h = F.linear(x[rows], expert_weight(w13, scales, "w13", e, hidden, x.dtype))
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, expert_weight(w2, scales, "w2", e, inter, x.dtype)) * weight_of[start:start + n, None].to(x.dtype)
        out.index_add_(0, rows, y)
        start += n
    return out if add is None else out + add


def route_torch(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, E_POW2: tl.constexpr, K_POW2: tl.constexpr, PDL: tl.constexpr):
    """One token: softmax over its experts, then k times the largest left (lowest index on a tie)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_POW2)
    x = tl.load(logits_ptr + t * stride_l + offs, mask=offs < num_experts, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    p = e / tl.sum(e, 0)
    p = tl.where(offs < num_experts, p, -1.0)  # never chosen
    slots = tl.arange(0, K_POW2)
    top_w = tl.zeros((K_POW2,), dtype=tl.float32)
    top_i = tl.zeros((K_POW2,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, E_POW2), 0)
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, idx, top_i)
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)
    tl.store(weights_ptr + t * TOP_K + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, top_i.to(tl.int64), mask=slots < TOP_K)


def route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens > 0:
        e_pow2 = triton.next_power_of_2(num_experts)
        _route_kernel[(tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                                 RENORMALIZE=renormalize, E_POW2=e_pow2, K_POW2=triton.next_power_of_2(top_k),
                                 num_warps=1 if e_pow2 <= 256 else 4, **pdl_launch(router_logits))
    return weights, ids


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64): softmax over all experts in float32,
    the k largest, rescaled to sum to 1 when ``renormalize``."""
    if use_triton(router_logits) and router_logits.stride(-1) == 1:
        return route_triton(router_logits, top_k, renormalize)
    return route_torch(router_logits, top_k, renormalize)


def noaux_route_torch(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                      renormalize: bool, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's noaux_tc: sigmoid scores; experts chosen by score plus the correction bias
    within the best topk_group groups (a group rated by its best two); weights are the chosen
    scores, renormalized when asked, times ``scaling``."""
    scores = torch.sigmoid(logits.float())
    choice = scores + bias
    per_group = scores.shape[-1] // n_group
    rated = choice.view(-1, n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
    keep = torch.zeros_like(rated).scatter_(1, rated.topk(topk_group, dim=-1).indices, 1.0)
    choice = choice.masked_fill(keep.repeat_interleave(per_group, dim=1) == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


@triton.jit
def _noaux_route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, scaling, N_GROUP: tl.constexpr,
                        PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                        RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    """One token, its experts as [N_GROUP, PER_GROUP]: the best groups kept, then k times the
    largest choice left (lowest index on a tie)."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    grp = tl.arange(0, N_GROUP)
    col = tl.arange(0, PER_GROUP)[None, :]
    offs = grp[:, None] * PER_GROUP + col
    scores = tl.sigmoid(tl.load(logits_ptr + t * stride_l + offs).to(tl.float32))
    choice = scores + tl.load(bias_ptr + offs).to(tl.float32)
    best = tl.max(choice, 1)
    rated = best
    if PER_GROUP > 1:  # plus the second best: the best's first place taken out
        first = tl.min(tl.where(choice == best[:, None], col, PER_GROUP), 1)
        rated += tl.max(tl.where(col == first[:, None], float("-inf"), choice), 1)
    kept = grp < 0
    for _ in tl.static_range(TOPK_GROUP):
        g = tl.min(tl.where(rated == tl.max(rated, 0), grp, N_GROUP), 0)
        kept = kept | (grp == g)
        rated = tl.where(grp == g, float("-inf"), rated)
    choice = tl.where(kept[:, None], choice, float("-inf"))
    slots = tl.arange(0, K_POW2)
    top_w = tl.zeros((K_POW2,), dtype=tl.float32)
    top_i = tl.zeros((K_POW2,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, 1), 0)
        idx = tl.min(tl.min(tl.where(choice == top, offs, N_GROUP * PER_GROUP), 1), 0)
        top_w = tl.where(slots == j, tl.sum(tl.sum(tl.where(offs == idx, scores, 0.0), 1), 0), top_w)
        top_i = tl.where(slots == j, idx, top_i)
        choice = tl.where(offs == idx, float("-inf"), choice)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, 0) + 1e-20)
    tl.store(weights_ptr + t * TOP_K + slots, top_w * scaling, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, top_i.to(tl.int64), mask=slots < TOP_K)


def noaux_route_triton(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                       renormalize: bool, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``noaux_route_torch``, groups and experts in powers of two."""
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens > 0:
        _noaux_route_kernel[(tokens,)](logits, bias, weights, ids, logits.stride(0), float(scaling), N_GROUP=n_group,
                                       PER_GROUP=num_experts // n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
                                       K_POW2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                                       num_warps=1 if num_experts <= 256 else 4, **pdl_launch(logits))
    return weights, ids


def noaux_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                renormalize: bool, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int64) by DeepSeek-V3's rule: the kernel where the
    groups and experts are powers of two, else the reference."""
    per_group = logits.shape[-1] // n_group
    pow2 = triton.next_power_of_2(n_group) == n_group and triton.next_power_of_2(per_group) == per_group
    if use_triton(logits) and logits.stride(-1) == 1 and pow2:
        return noaux_route_triton(logits, bias, top_k, n_group, topk_group, renormalize, scaling)
    return noaux_route_torch(logits, bias, top_k, n_group, topk_group, renormalize, scaling)


def _num_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing: every expert that has pairs pads its list by < block_m."""
    return triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)


def align_by_expert_torch(ids: torch.Tensor, num_experts: int, block_m: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_pairs int32 [B * block_m], block_experts int32 [B], num_padded int32 [1]):
    the pairs t * k + j listed expert by expert, each list padded to block_m with T * k (no pair);
    block_experts[b] the expert of block b (-1 past num_padded). B bounds any routing, so every
    shape depends on (T, k, E, block_m) only."""
    flat = ids.flatten()
    pairs = flat.numel()
    num_blocks = _num_blocks(pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    # the i-th pair of expert e (in sorted order) goes to e's padded start + i
    rank = torch.arange(pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert]
    sorted_pairs = torch.full((num_blocks * block_m,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs.scatter_(0, (ends - padded)[expert] + rank, order.to(torch.int32))
    starts = torch.arange(num_blocks, device=ids.device) * block_m
    block_experts = torch.searchsorted(ends, starts, right=True)
    block_experts = torch.where(starts < ends[-1], block_experts, -1).to(torch.int32)
    return sorted_pairs, block_experts, ends[-1:].to(torch.int32)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, experts_ptr, padded_ptr, num_pairs, num_blocks, BLOCK_M: tl.constexpr,
                  P_POW2: tl.constexpr, E_POW2: tl.constexpr, B_POW2: tl.constexpr, FILL: tl.constexpr):
    """align_by_expert_torch in one program, from a [pairs, experts] one-hot matrix."""
    offs_p = tl.arange(0, P_POW2)
    pmask = offs_p < num_pairs
    expert_of = tl.load(ids_ptr + offs_p, mask=pmask, other=-1).to(tl.int32)
    onehot = (expert_of[:, None] == tl.arange(0, E_POW2)[None, :]).to(tl.int32)
    counts = tl.sum(onehot, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    rank = tl.cumsum(onehot, 0) - onehot
    slot = tl.sum(onehot * ((ends - padded)[None, :] + rank), 1)
    for s0 in range(0, num_blocks * BLOCK_M, FILL):  # every row "no pair" first ...
        offs = s0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs, tl.zeros((FILL,), dtype=tl.int32) + num_pairs, mask=offs < num_blocks * BLOCK_M)
    tl.debug_barrier()  # ... then the pairs over them: the fills of other threads are done
    tl.store(sorted_ptr + slot, offs_p, mask=pmask)
    starts = tl.arange(0, B_POW2) * BLOCK_M
    # a block's expert: the first whose end lies past the block's start
    block_expert = tl.sum((ends[None, :] <= starts[:, None]).to(tl.int32), 1)
    block_expert = tl.where(starts < total, block_expert, -1)
    tl.store(experts_ptr + tl.arange(0, B_POW2), block_expert, mask=tl.arange(0, B_POW2) < num_blocks)
    tl.store(padded_ptr, total)


# one-hot matrices up to this many entries (pairs x experts, both rounded up to powers of 2) stay
# in one program's registers: decode batches (Qwen3-30B-A3B: 32 tokens of 8 of 128 experts)
ALIGN_KERNEL_MAX = 1 << 15


def align_by_expert_triton(ids: torch.Tensor, num_experts: int, block_m: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pairs = ids.numel()
    num_blocks = _num_blocks(pairs, num_experts, block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](ids.contiguous(), sorted_pairs, block_experts, num_padded, pairs, num_blocks, BLOCK_M=block_m,
                        P_POW2=triton.next_power_of_2(pairs), E_POW2=triton.next_power_of_2(num_experts),
                        B_POW2=triton.next_power_of_2(num_blocks), FILL=1024, num_warps=8)
    return sorted_pairs, block_experts, num_padded


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one-program kernel where it holds the problem (decode batches), else the torch ops."""
    if triton.next_power_of_2(ids.numel()) * triton.next_power_of_2(num_experts) <= ALIGN_KERNEL_MAX:
        return align_by_expert_triton(ids, num_experts, block_m)
    return align_by_expert_torch(ids, num_experts, block_m)


@triton.jit
def _dot(a, b, acc):
    """fp32 inputs in full precision (not TF32), 16-bit ones on the tensor cores as they are."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _int_weights(q, s_ptr, b_ptr, rows, nmask, stride_sn, ngroups, k0, SYMM: tl.constexpr, CENTRE: tl.constexpr,
                 GROUP: tl.constexpr, PACK: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr):
    """Integer codes q [ROWS, TILE] (a tile of TILE * PACK inputs from k0) -> fp32 weights by
    quant_linear's _dequant."""
    if GROUP > 0:
        return _dequant(q, s_ptr, b_ptr, rows, nmask, stride_sn, ngroups, k0 // GROUP, s_ptr, rows, nmask, False,
                        SYMM, CENTRE, False, GROUP // PACK, TILE, ROWS)
    else:  # one group per row: wider than any tile
        return _dequant(q, s_ptr, b_ptr, rows, nmask, stride_sn, ngroups, 0, s_ptr, rows, nmask, False, SYMM,
                        CENTRE, False, 1 << 30, TILE, ROWS)


@triton.jit
def _gemm_step(acc, a, w_rows, s_ptr, b_ptr, rows, nmask, k0, K, stride_sn, ngroups,
               FP8: tl.constexpr, INT: tl.constexpr, PACK: tl.constexpr, SYMM: tl.constexpr, CENTRE: tl.constexpr,
               GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] . W[rows, k0 : k0 + BLOCK_K]^T: 16-bit and FP8 tiles read as a
    transposed view (FP8 block scales on the tile's products), integer codes dequantized to a's dtype."""
    if INT:
        WC: tl.constexpr = BLOCK_K // PACK
        cols = k0 // PACK + tl.arange(0, WC)
        q = tl.load(w_rows[:, None] + cols[None, :],
                    mask=nmask[:, None] & (cols < (K + PACK - 1) // PACK)[None, :], other=0)
        if PACK == 2:
            lo = _int_weights(q & 15, s_ptr, b_ptr, rows, nmask, stride_sn, ngroups, k0, SYMM, CENTRE, GROUP, PACK,
                              BLOCK_N, WC)
            hi = _int_weights(q >> 4, s_ptr, b_ptr, rows, nmask, stride_sn, ngroups, k0, SYMM, CENTRE, GROUP, PACK,
                              BLOCK_N, WC)
            w = tl.reshape(tl.join(lo.to(a.dtype), hi.to(a.dtype)), [BLOCK_N, BLOCK_K])
        else:
            w = _int_weights(q, s_ptr, b_ptr, rows, nmask, stride_sn, ngroups, k0, SYMM, CENTRE, GROUP, PACK,
                             BLOCK_N, WC).to(a.dtype)
        return _dot(a, tl.trans(w), acc)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows[None, :] + offs_k[:, None], mask=(offs_k < K)[:, None] & nmask[None, :],
                    other=0.0)
        if FP8:  # the codes arrive as their bytes (masked lanes read 0, +0.0 in E4M3)
            w = w.to(tl.float8e4nv, bitcast=True).to(a.dtype)
            if GROUP > 0:
                s = tl.load(s_ptr + rows * stride_sn + k0 // GROUP, mask=nmask, other=0.0)
                return acc + _dot(a, w, tl.zeros(acc.shape, dtype=tl.float32)) * s[None, :]
            else:
                return _dot(a, w, acc)
        else:
            return _dot(a, w, acc)


@triton.jit
def expert_block(sorted_ptr, experts_ptr, num_pairs, pid_m, A_DIV: tl.constexpr, BLOCK_M: tl.constexpr):
    """Block pid_m of align_by_expert's list: its BLOCK_M pairs, which are real, the activation
    row of each (pair // A_DIV) and the block's expert."""
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs, pairs < num_pairs, (pairs // A_DIV).to(tl.int64), tl.load(experts_ptr + pid_m).to(tl.int64)


@triton.jit
def expert_rows(w_ptr, s_ptr, expert, N, stride_we, stride_wn, stride_se, stride_sn, BLOCK_N: tl.constexpr):
    """This program's BLOCK_N output rows of the expert, for the kernels that read packed codes
    (gpt-oss's MXFP4, NVFP4): (rows, their mask, their first code bytes, their first scales); an
    up row is N rows further."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n64 = offs_n.to(tl.int64)
    return offs_n, offs_n < N, w_ptr + expert * stride_we + n64 * stride_wn, s_ptr + expert * stride_se + n64 * stride_sn


@triton.jit
def _row_scale(s_ptr, rows, nmask, stride_sn, FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] factors for the rows' sums: FP8 per-row scales, else 1."""
    if FP8 and GROUP == 0:
        return tl.load(s_ptr + rows * stride_sn, mask=nmask, other=0.0)
    else:
        return tl.full([BLOCK_N], 1.0, tl.float32)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, s_ptr, b_ptr, out_ptr, rw_ptr, sorted_ptr, experts_ptr, padded_ptr, num_pairs, N, K,
                     ngroups, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_out,
                     A_DIV: tl.constexpr, GATED: tl.constexpr, SCALE: tl.constexpr, FP8: tl.constexpr,
                     INT: tl.constexpr, PACK: tl.constexpr, SYMM: tl.constexpr, CENTRE: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n] = A[pair // A_DIV] . W[e, n] for the BLOCK_M pairs of one expert's block.
    GATED (w13): also W[e, N + n], storing silu(gate) * up. SCALE (w2): rows times their router
    weight. FP8 / INT: W holds codes (scales per row, or per GROUP inputs, which BLOCK_K divides)."""
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):  # a block past the routing's real end
        return
    pairs, valid, rows, expert = expert_block(sorted_ptr, experts_ptr, num_pairs, pid_m, A_DIV, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    gate_rows = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    w_e, s_e, b_e = w_ptr + expert * stride_we, s_ptr + expert * stride_se, b_ptr + expert * stride_se
    gate_w = w_e + gate_rows * stride_wn
    up_w = gate_w + N * stride_wn  # read when GATED
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        acc = _gemm_step(acc, a, gate_w, s_e, b_e, gate_rows, nmask, k0, K, stride_sn, ngroups, FP8, INT, PACK,
                         SYMM, CENTRE, GROUP, BLOCK_N, BLOCK_K)
        if GATED:
            acc_up = _gemm_step(acc_up, a, up_w, s_e, b_e, gate_rows + N, nmask, k0, K, stride_sn, ngroups,
                                FP8, INT, PACK, SYMM, CENTRE, GROUP, BLOCK_N, BLOCK_K)
        a_ptrs += BLOCK_K
    acc = acc * _row_scale(s_e, gate_rows, nmask, stride_sn, FP8, GROUP, BLOCK_N)[None, :]
    if GATED:
        acc = silu_mul(acc, acc_up * _row_scale(s_e, gate_rows + N, nmask, stride_sn, FP8, GROUP, BLOCK_N)[None, :])
    if SCALE:
        acc = acc * tl.load(rw_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of both GEMMs. block_n is the w2 GEMM's; the w13 one takes block_n // 2 gate rows
    and as many up rows, the same weight bytes per program."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_config(num_tokens: int, top_k: int, num_experts: int) -> MoEConfig:
    """Tiles by the pairs each expert gets on average (tuning/moe.py's MOE_TILES)."""
    per_expert = num_tokens * top_k / num_experts
    return next(MoEConfig(*tiles) for bound, tiles in MOE_TILES if bound is None or per_expert <= bound)


@dataclass(frozen=True)
class _Operands:
    """A stack as the kernels take it: bytes, scales and offsets (unread stand-ins where absent),
    their strides and groups, and the compile-time flags of its storage."""

    w: torch.Tensor
    s: torch.Tensor
    b: torch.Tensor
    stride_se: int
    stride_sn: int
    ngroups: int
    flags: dict


def _operands(w: torch.Tensor, scales: ExpertScales, name: str) -> _Operands:
    """The stack ``name`` as the kernels take it (its storage is checked once, at load, by MoEExperts)."""
    s, b, group, bits = scales.of(name)
    if scales.e2m1:
        raise ValueError("NVFP4 experts are multiplied by kernels/nvfp4_moe.py, not fused_moe's kernels")
    if s is None:
        return _Operands(w, w, w, 0, 0, 1, dict(FP8=False, INT=False, PACK=1, SYMM=False, CENTRE=0.0, GROUP=0))
    fp8 = w.dtype == torch.float8_e4m3fn
    symm = b is None and not fp8
    return _Operands(w.view(torch.uint8), s, s if b is None else b, s.stride(0), s.stride(1), s.shape[2],
                     dict(FP8=fp8, INT=not fp8, PACK=2 if bits == 4 else 1, SYMM=symm,
                          CENTRE=float(code_centre(bits, fp8, b is not None)), GROUP=group))


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, router_weights: torch.Tensor,
              aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_pairs: int, a_div: int, gated: bool,
              cfg: MoEConfig, scales: ExpertScales, name: str) -> None:
    sorted_pairs, block_experts, num_padded = aligned
    n = w.shape[1] // 2 if gated else w.shape[1]
    block_n = max(16, cfg.block_n // 2) if gated else cfg.block_n
    op = _operands(w, scales, name)
    group = op.flags["GROUP"]
    # FP8 block scales go on a K tile's products: the tile must lie inside one block
    block_k = min(cfg.block_k, group) if group and op.flags["FP8"] else cfg.block_k
    grid = (triton.cdiv(n, block_n), block_experts.numel())
    _moe_gemm_kernel[grid](
        a, op.w, op.s, op.b, out, router_weights, sorted_pairs, block_experts, num_padded, num_pairs, n, a.shape[1],
        op.ngroups, a.stride(0), op.w.stride(0), op.w.stride(1), op.stride_se, op.stride_sn, out.stride(0),
        A_DIV=a_div, GATED=gated, SCALE=not gated, BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **op.flags)


@triton.jit
def _gemv_x(x_row, k0, K, PACK: tl.constexpr, BLOCK_K: tl.constexpr):
    """A K tile's activations in fp32 as the stored columns pair with them (4-bit: the low
    nibbles' inputs and the high ones'); [1, ..] for one row, [R, ..] for R rows."""
    cols = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    k = (cols * PACK)[None, :]
    x = tl.load(x_row + k, mask=k < K, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if PACK == 2:
        x_hi = tl.load(x_row + k + 1, mask=k + 1 < K, other=0.0, eviction_policy="evict_last").to(tl.float32)
        return x, x_hi
    else:
        return x, x


@triton.jit
def _gemv_fma(acc, x, x_hi, w_rows, s_ptr, b_ptr, rows, nmask, k0, K, stride_sn, ngroups,
              FP8: tl.constexpr, INT: tl.constexpr, PACK: tl.constexpr, SYMM: tl.constexpr, CENTRE: tl.constexpr,
              GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + the weight tile W[rows, k0 : k0 + BLOCK_K] times the activations, elementwise in fp32,
    reduced once at the end. w_rows (the rows' first bytes) is computed once, outside the K loop."""
    WC: tl.constexpr = BLOCK_K // PACK
    cols = k0 // PACK + tl.arange(0, WC)
    w = tl.load(w_rows + cols[None, :], mask=nmask[:, None] & (cols < (K + PACK - 1) // PACK)[None, :], other=0,
                eviction_policy="evict_first")
    if INT:
        if PACK == 2:
            lo = _int_weights(w & 15, s_ptr, b_ptr, rows, nmask, stride_sn, ngroups, k0, SYMM, CENTRE, GROUP, PACK,
                              BLOCK_N, WC)
            hi = _int_weights(w >> 4, s_ptr, b_ptr, rows, nmask, stride_sn, ngroups, k0, SYMM, CENTRE, GROUP, PACK,
                              BLOCK_N, WC)
            return acc + lo * x + hi * x_hi
        else:
            return acc + _int_weights(w, s_ptr, b_ptr, rows, nmask, stride_sn, ngroups, k0, SYMM, CENTRE, GROUP, PACK,
                                      BLOCK_N, WC) * x
    else:
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        w = w.to(tl.float32)
        if FP8 and GROUP > 0:
            g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            s = tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :], mask=nmask[:, None] & (g < ngroups)[None, :],
                        other=0.0)
            w = w * tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K))
        return acc + w * x


@triton.jit
def _gemv_gate_up_kernel(x_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, h_ptr, N, K, ngroups, stride_x, stride_we, stride_wn,
                         stride_se, stride_sn, stride_h, TOP_K: tl.constexpr, FP8: tl.constexpr, INT: tl.constexpr,
                         PACK: tl.constexpr, SYMM: tl.constexpr, CENTRE: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """h[pair, n] = silu(x[t] . W[e, n]) * (x[t] . W[e, N + n]) for this program's BLOCK_N rows."""
    pdl_wait(PDL)
    pair = tl.program_id(1)
    t = (pair // TOP_K).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    gate_rows = offs_n.to(tl.int64)
    w_e, s_e, b_e = w_ptr + expert * stride_we, s_ptr + expert * stride_se, b_ptr + expert * stride_se
    gate_w = w_e + gate_rows[:, None] * stride_wn
    up_w = gate_w + N * stride_wn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K // PACK], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K // PACK], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x, x_hi = _gemv_x(x_ptr + t * stride_x, k0, K, PACK, BLOCK_K)
        acc_gate = _gemv_fma(acc_gate, x, x_hi, gate_w, s_e, b_e, gate_rows, nmask, k0, K, stride_sn, ngroups,
                             FP8, INT, PACK, SYMM, CENTRE, GROUP, BLOCK_N, BLOCK_K)
        acc_up = _gemv_fma(acc_up, x, x_hi, up_w, s_e, b_e, gate_rows + N, nmask, k0, K, stride_sn, ngroups,
                           FP8, INT, PACK, SYMM, CENTRE, GROUP, BLOCK_N, BLOCK_K)
    h = silu_mul(tl.sum(acc_gate, 1) * _row_scale(s_e, gate_rows, nmask, stride_sn, FP8, GROUP, BLOCK_N),
                 tl.sum(acc_up, 1) * _row_scale(s_e, gate_rows + N, nmask, stride_sn, FP8, GROUP, BLOCK_N))
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + offs_n, h.to(h_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gemv_down_kernel(h_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, rw_ptr, add_ptr, out_ptr, N, K, ngroups, stride_h,
                      stride_we, stride_wn, stride_se, stride_sn, stride_add, stride_out, TOP_K: tl.constexpr,
                      FP8: tl.constexpr, INT: tl.constexpr, PACK: tl.constexpr, SYMM: tl.constexpr,
                      CENTRE: tl.constexpr, GROUP: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr, ADD: tl.constexpr = False):
    """out[t, n] = sum over the token's k pairs of weight * (h[pair] . W[e, n]) (+ add[t, n]), summed
    in fp32 and rounded once. The tile holds the BLOCK_N rows of all k experts at once, so every
    expert's rows are in flight together."""
    pdl_wait(PDL)
    t = tl.program_id(1)
    r = tl.arange(0, BLOCK_J * BLOCK_N)
    real = r // BLOCK_N < TOP_K
    pairs = t * TOP_K + tl.minimum(r // BLOCK_N, TOP_K - 1)  # padding rows address the last choice, masked
    n = tl.program_id(0) * BLOCK_N + r % BLOCK_N
    nmask = (n < N) & real
    experts = tl.load(ids_ptr + pairs).to(tl.int64)
    n64 = n.to(tl.int64)
    w_rows = (w_ptr + experts * stride_we + n64 * stride_wn)[:, None]
    s_rows = experts * stride_se + n64 * stride_sn
    h_rows = (h_ptr + pairs.to(tl.int64) * stride_h)[:, None]
    acc = tl.zeros([BLOCK_J * BLOCK_N, BLOCK_K // PACK], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        h, h_hi = _gemv_x(h_rows, k0, K, PACK, BLOCK_K)
        acc = _gemv_fma(acc, h, h_hi, w_rows, s_ptr, b_ptr, s_rows, nmask, k0, K, 1, ngroups, FP8, INT,
                        PACK, SYMM, CENTRE, GROUP, BLOCK_J * BLOCK_N, BLOCK_K)
    rw = tl.load(rw_ptr + pairs, mask=real, other=0.0)
    y = rw * tl.sum(acc, 1) * _row_scale(s_ptr, s_rows, nmask, 1, FP8, GROUP, BLOCK_J * BLOCK_N)
    y = tl.sum(tl.reshape(y, [BLOCK_J, BLOCK_N]), 0)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if ADD:
        y += tl.load(add_ptr + t.to(tl.int64) * stride_add + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def fused_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, gate_up: dict[str, int] | None = None,
                   down: dict[str, int] | None = None, scales: ExpertScales = NO_SCALES,
                   add: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe_triton's result in two kernels, for one token (see the module's docstring); the
    down kernel adds ``add`` (same shape as x) before it rounds its sums."""
    tokens, top_k = ids.shape
    inter, hidden = w13.shape[1] // 2, x.shape[1]
    x = x.contiguous()
    ids = ids.contiguous()
    gu, dn = gate_up or GEMV_GATE_UP, down or GEMV_DOWN
    op13, op2 = _operands(w13, scales, "w13"), _operands(w2, scales, "w2")
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _gemv_gate_up_kernel[(triton.cdiv(inter, gu["block_n"]), tokens * top_k)](
        x, op13.w, op13.s, op13.b, ids, h, inter, hidden, op13.ngroups, x.stride(0), op13.w.stride(0),
        op13.w.stride(1), op13.stride_se, op13.stride_sn, h.stride(0), TOP_K=top_k, BLOCK_N=gu["block_n"],
        BLOCK_K=max(gu["block_k"], op13.flags["GROUP"]), num_warps=gu["num_warps"], num_stages=gu["num_stages"],
        **op13.flags, **pdl_launch(x))  # whole FP8 blocks
    out = torch.empty_like(x)
    assert add is None or (add.shape == x.shape and add.stride(-1) == 1)
    _gemv_down_kernel[(triton.cdiv(hidden, dn["block_n"]), tokens)](
        h, op2.w, op2.s, op2.b, ids, weights.float().contiguous(), out if add is None else add, out, hidden, inter,
        op2.ngroups, h.stride(0), op2.w.stride(0), op2.w.stride(1), op2.stride_se, op2.stride_sn,
        out.stride(0) if add is None else add.stride(0), out.stride(0), TOP_K=top_k,
        BLOCK_J=triton.next_power_of_2(top_k), BLOCK_N=dn["block_n"], BLOCK_K=max(dn["block_k"], op2.flags["GROUP"]),
        num_warps=dn["num_warps"], num_stages=dn["num_stages"], **op2.flags, ADD=add is not None, **pdl_launch(x))
    return out


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor, config: MoEConfig | None = None,
                     scales: ExpertScales = NO_SCALES, add: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped GEMMs, or for one token (and no tiles asked for) ``fused_moe_gemv``; plus
    ``add`` (same shape as x) when given."""
    tokens, top_k = ids.shape
    num_experts, inter, hidden = w13.shape[0], w13.shape[1] // 2, x.shape[1]
    if tokens == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    if config is None and tokens == 1:  # see GEMV_GATE_UP
        return fused_moe_gemv(x, w13, w2, weights, ids, scales=scales, add=add)
    cfg = config or moe_config(tokens, top_k, num_experts)
    x = x.contiguous()
    aligned = align_by_expert(ids, num_experts, cfg.block_m)
    pairs = tokens * top_k
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # every pair's row is written
    _moe_gemm(x, w13, h, weights, aligned, pairs, top_k, True, cfg, scales, "w13")
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_gemm(h, w2, y, weights.flatten().float().contiguous(), aligned, pairs, 1, False, cfg, scales, "w2")
    out = y.view(tokens, top_k, hidden).sum(dim=1)
    return out if add is None else out + add


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, scales: ExpertScales = NO_SCALES, add: torch.Tensor | None = None) -> torch.Tensor:
    """``scales``: given when w13 and w2 hold quantized codes; ``add``: a tensor like x added to
    the result (a shared expert's output: for one token, inside the down kernel)."""
    if use_triton(x):
        return fused_moe_triton(x, w13, w2, weights, ids, scales=scales, add=add)
    return fused_moe_torch(x, w13, w2, weights, ids, scales, add)
