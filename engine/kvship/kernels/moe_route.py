"""The router's choice for mixture-of-experts layers: softmax over the experts in float32, the
top k, rescaled to sum to 1 when the model renormalizes (Mixtral, Qwen3-MoE's norm_topk_prob).

``route_torch`` is the reference and the CPU path, ``route_triton`` one program per token, and
``route`` picks one. ``norm_route`` does a whole token's routing in one launch where the router
would take the GEMV kernel (one row, in a CUDA graph, its shape listed in kernels/gemv.py): the
RMSNorm before the router, the router's product, and the choice. At batch 1 on the Qwen3-30B-A3B
shape that is one launch a layer instead of three (norm, router, choice), each a few
microseconds of dependent memory round trips for a few kilobytes of data.
"""
from __future__ import annotations

import torch

from kvship.kernels import gemv
from kvship.kernels._triton import pdl_launch, pdl_wait, tl, triton, use_triton
from kvship.kernels.gemv import PreNorm, gemv_rows


def route_torch(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@triton.jit
def _top_k_row(logits_ptr, weights_ptr, ids_ptr, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
               E_POW2: tl.constexpr, K_POW2: tl.constexpr, CACHE: tl.constexpr):
    """One token: softmax over its experts' logits, then k times the largest left (lowest index
    on a tie); the choice's weights (renormalized or not) and ids stored. CACHE: the logits'
    load cache modifier (".cg" where other programs just wrote them: past L1, to L2)."""
    offs = tl.arange(0, E_POW2)
    x = tl.load(logits_ptr + offs, mask=offs < num_experts, other=float("-inf"), cache_modifier=CACHE).to(tl.float32)
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
    tl.store(weights_ptr + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + slots, top_i.to(tl.int64), mask=slots < TOP_K)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, E_POW2: tl.constexpr, K_POW2: tl.constexpr, PDL: tl.constexpr):
    """One program per token."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    _top_k_row(logits_ptr + t * stride_l, weights_ptr + t * TOP_K, ids_ptr + t * TOP_K, num_experts, TOP_K,
               RENORMALIZE, E_POW2, K_POW2, "")


@triton.jit
def _norm_route_kernel(x_ptr, res_ptr, g_ptr, w_ptr, res_out_ptr, normed_ptr, logits_ptr, weights_ptr, ids_ptr,
                       count_ptr, num_experts, K, stride_w, eps, RESIDUAL: tl.constexpr, TOP_K: tl.constexpr,
                       RENORMALIZE: tl.constexpr, E_POW2: tl.constexpr, K_POW2: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One token's routing in one launch: each program takes BLOCK_N router rows of the GEMV with
    the norm taken in (kernels/gemv.py's gemv_rows; the first program stores the new residual
    and the normalized input) and stores their logits, rounded as the router's linear outputs
    them; the program that finishes last chooses the experts. Programs count themselves in
    ``count_ptr`` after their stores (the barrier puts every thread's stores before the one
    thread's atomic, whose release publishes them; its acquire, in the last program, makes the
    others' visible); the last one zeroes the counter for the next launch, so a CUDA graph
    replays as captured."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    y, offs_n, nmask = gemv_rows(x_ptr, w_ptr, res_ptr, g_ptr, res_out_ptr, normed_ptr, num_experts, K, stride_w,
                                 eps, pid, False, False, True, RESIDUAL, True, BLOCK_N, BLOCK_K)
    tl.store(logits_ptr + offs_n, y.to(x_ptr.dtype.element_ty).to(tl.float32), mask=nmask)
    tl.debug_barrier()
    if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(count_ptr, 0)
        _top_k_row(logits_ptr, weights_ptr, ids_ptr, num_experts, TOP_K, RENORMALIZE, E_POW2, K_POW2, ".cg")


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


def norm_route(x: torch.Tensor, norm: PreNorm, router: torch.Tensor, top_k: int, renormalize: bool,
               count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(weights [1, k], ids [1, k], new residual, normalized input) of one token whose router
    input still needs ``norm`` (x: its sublayer output [1, H]), in one launch; None where the
    router would not take the GEMV kernel (the caller then runs the norm, the router and
    ``route``). ``count``: a zeroed int32 counter of the caller's own, left zeroed."""
    config = gemv.graph_config(x, router)
    if config is None:
        return None
    num_experts, hidden = router.shape
    x = x.contiguous()
    res = None if norm.residual is None else norm.residual.contiguous()
    residual = x if res is None else torch.empty_like(x)
    normed = torch.empty_like(x)
    logits = torch.empty(num_experts, dtype=torch.float32, device=x.device)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int64, device=x.device)
    e_pow2 = triton.next_power_of_2(num_experts)
    _norm_route_kernel[(triton.cdiv(num_experts, config["block_n"]),)](
        x, x if res is None else res, norm.weight, router, residual, normed, logits, weights, ids, count, num_experts,
        hidden, router.stride(0), norm.eps, RESIDUAL=res is not None, TOP_K=top_k, RENORMALIZE=renormalize,
        E_POW2=e_pow2, K_POW2=triton.next_power_of_2(top_k), BLOCK_N=config["block_n"], BLOCK_K=config["block_k"],
        num_warps=config["num_warps"], num_stages=config["num_stages"], **pdl_launch(x))
    return weights, ids, residual, normed
