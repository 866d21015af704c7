"""The two low-rank products of batched LoRA, each row of a step with its own adapter (or none).

``lora_shrink``: h[t] = A[slot[t]] @ x[t]  ([T, in] -> [T, R], float32), for the stacked A of a
layer's adapter slots [S, R, in]. ``lora_expand``: y[t, cols] += B[slot[t]] @ h[t, r0:r0 + r]
for one output slice (q, k or v of a fused projection) [S, N, r]. A row whose slot is -1 has no
adapter: shrink leaves its h unwritten and expand adds nothing.

The Triton kernels take one row per program (Punica's BGMV): rows of one prefill chunk read the
same A and B, which then come from L2 after the first. Fixed shapes and no host reads, so they
run inside the decode graphs. The torch references group rows by adapter (host-side).
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import next_pow2, tl, triton, use_triton


def lora_shrink_torch(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for s in slots.unique().tolist():
        if s >= 0:
            rows = (slots == s).nonzero().squeeze(1)
            h[rows] = x[rows].float() @ a[s].float().T
    return h


def lora_expand_torch(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                      r0: int, col0: int) -> None:
    rank, n = b.shape[2], b.shape[1]
    for s in slots.unique().tolist():
        if s >= 0:
            rows = (slots == s).nonzero().squeeze(1)
            delta = h[rows, r0:r0 + rank] @ b[s].float().T
            y[rows, col0:col0 + n] += delta.to(y.dtype)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, K, R, stride_x, stride_as, stride_ar, stride_h,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        offs_k = tl.arange(0, BLOCK_K)
        rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar
        acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < K
            x = tl.load(x_ptr + t.to(tl.int64) * stride_x + kk, mask=kmask, other=0.0).to(tl.float32)
            a = tl.load(rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            acc += a.to(tl.float32) * x[None, :]
        tl.store(h_ptr + t.to(tl.int64) * stride_h + offs_r, tl.sum(acc, 1), mask=rmask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, N, RANK, r0, col0, stride_h, stride_bs, stride_bn, stride_y,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_r = tl.arange(0, BLOCK_R)
        rmask = offs_r < RANK
        h = tl.load(h_ptr + t.to(tl.int64) * stride_h + r0 + offs_r, mask=rmask, other=0.0)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=nmask[:, None] & rmask[None, :], other=0.0)
        delta = tl.sum(b.to(tl.float32) * h[None, :], 1)
        out = y_ptr + t.to(tl.int64) * stride_y + col0 + offs_n
        y = tl.load(out, mask=nmask, other=0.0)
        tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=nmask)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape
    r = a.shape[1]
    h = torch.empty(t, r, dtype=torch.float32, device=x.device)
    block_r = min(next_pow2(r), 64)
    block_k = max(16, min(256, 4096 // block_r))
    _shrink_kernel[(t, triton.cdiv(r, block_r))](x, a, slots, h, k, r, x.stride(0), a.stride(0), a.stride(1),
                                                 h.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
    return h


def lora_expand_triton(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                       r0: int, col0: int) -> None:
    t = y.shape[0]
    n, rank = b.shape[1], b.shape[2]
    block_r = next_pow2(rank)
    block_n = max(16, min(128, 4096 // block_r))
    _expand_kernel[(t, triton.cdiv(n, block_n))](h, b, slots, y, n, rank, r0, col0, h.stride(0), b.stride(0),
                                                 b.stride(1), y.stride(0), BLOCK_N=block_n, BLOCK_R=block_r)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, in] x, [S, R, in] stacked A, [T] int32 slots -> [T, R] float32 (rows of slot -1: undefined)."""
    return lora_shrink_triton(x, a, slots) if use_triton(x) else lora_shrink_torch(x, a, slots)


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, r0: int, col0: int) -> None:
    """y[:, col0:col0 + N] += h[:, r0:r0 + r] @ B[slot]^T, in place, for rows with a slot."""
    if use_triton(y):
        lora_expand_triton(y, h, b, slots, r0, col0)
    else:
        lora_expand_torch(y, h, b, slots, r0, col0)
