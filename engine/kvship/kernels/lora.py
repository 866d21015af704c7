"""The two low-rank products of batched LoRA, each row of a step with its own adapter (or none).

``lora_shrink``: h[t] = A[slot[t]] @ x[t] for the stacked A of a layer's adapter slots
[S, R, in] (the parts of a fused projection side by side, ``rank`` rows each), as float32
partial sums [SPLIT, T, R] over slices of ``in`` (the expand adds them up). ``lora_expand``:
y[t, part's columns] += B[slot[t]] @ h[t, part's ranks] for every part at once, with B
[S, out, rank] (the parts' rows stacked as in y). A row whose slot is -1 has no adapter: shrink
leaves its h unwritten and expand adds nothing.

The Triton kernels here take one row per program (Punica's BGMV): fixed shapes and no host
reads, so they run inside the decode graphs; the shrink splits ``in`` over programs, so that a
small batch still fills the GPU. An eager step with prompt chunks takes the grouped kernels of
kernels/lora_segments.py instead. The torch references group rows by adapter (host-side).
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import device_sms, next_pow2, tl, triton, use_triton
from kvship.kernels.lora_segments import lora_expand_segments, lora_shrink_segments


def lora_shrink_torch(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    h = torch.zeros(1, x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for s in slots.unique().tolist():
        if s >= 0:
            rows = (slots == s).nonzero().squeeze(1)
            h[0, rows] = x[rows].float() @ a[s].float().T
    return h


def lora_expand_torch(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                      slices: list[int]) -> None:
    rank, h = b.shape[2], h.sum(0)
    for s in slots.unique().tolist():
        if s >= 0:
            rows = (slots == s).nonzero().squeeze(1)
            col0 = 0
            for i, n in enumerate(slices):
                delta = h[rows, i * rank:(i + 1) * rank] @ b[s, col0:col0 + n].float().T
                y[rows, col0:col0 + n] += delta.to(y.dtype)
                col0 += n


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, K, R, K_PER_SPLIT, stride_x, stride_as, stride_ar, stride_hs,
                   stride_h, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        split = tl.program_id(2)
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        offs_k = tl.arange(0, BLOCK_K)
        rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar
        acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        k_start = split * K_PER_SPLIT
        for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < K
            x = tl.load(x_ptr + t.to(tl.int64) * stride_x + kk, mask=kmask, other=0.0).to(tl.float32)
            a = tl.load(rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            acc += a.to(tl.float32) * x[None, :]
        tl.store(h_ptr + split * stride_hs + t.to(tl.int64) * stride_h + offs_r, tl.sum(acc, 1), mask=rmask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, N, RANK, C1, C2, stride_hs, stride_h, stride_bs, stride_bn,
                   stride_y, SPLIT: tl.constexpr, PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_r = tl.arange(0, BLOCK_R)
        rmask = offs_r < RANK
        mask = nmask[:, None] & rmask[None, :]
        # each part's ranks of this row, the shrink's partial sums added up
        h_row = h_ptr + t.to(tl.int64) * stride_h + offs_r
        h0 = tl.zeros([BLOCK_R], tl.float32)
        h1 = tl.zeros([BLOCK_R], tl.float32)
        h2 = tl.zeros([BLOCK_R], tl.float32)
        for s in tl.static_range(SPLIT):
            h0 += tl.load(h_row + s * stride_hs, mask=rmask, other=0.0)
            if PARTS > 1:
                h1 += tl.load(h_row + s * stride_hs + RANK, mask=rmask, other=0.0)
            if PARTS > 2:
                h2 += tl.load(h_row + s * stride_hs + 2 * RANK, mask=rmask, other=0.0)
        part = ((offs_n >= C1).to(tl.int32) + (offs_n >= C2).to(tl.int32))[:, None]  # q/k/v or gate/up
        h = tl.where(part == 0, h0[None, :], tl.where(part == 1, h1[None, :], h2[None, :]))
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=mask, other=0.0)
        delta = tl.sum(b.to(tl.float32) * h, 1)
        out = y_ptr + t.to(tl.int64) * stride_y + offs_n
        y = tl.load(out, mask=nmask, other=0.0)
        tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=nmask)


SHRINK_BLOCK_K = 64
# The shrink's split of the input features: enough programs for about two an SM, but at most
# this many partial sums for the expand to add up.
MAX_SPLIT = 8


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape
    r = a.shape[1]
    block_r = min(next_pow2(r), 16)
    r_blocks = triton.cdiv(r, block_r)
    k_blocks = triton.cdiv(k, SHRINK_BLOCK_K)
    split = max(1, min(k_blocks, MAX_SPLIT, triton.cdiv(2 * device_sms(x), t * r_blocks)))
    k_per_split = triton.cdiv(k_blocks, split) * SHRINK_BLOCK_K
    split = triton.cdiv(k, k_per_split)
    h = torch.empty(split, t, r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(t, r_blocks, split)](x, a, slots, h, k, r, k_per_split, x.stride(0), a.stride(0), a.stride(1),
                                         h.stride(0), h.stride(1), BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K)
    return h


def lora_expand_triton(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                       slices: list[int]) -> None:
    if len(slices) > 3:
        raise ValueError(f"a fused projection of {len(slices)} parts; LoRA takes up to 3")
    t, n, rank = y.shape[0], b.shape[1], b.shape[2]
    starts = [sum(slices[:i]) for i in range(1, len(slices))] + [n] * (3 - len(slices))
    block_r = next_pow2(rank)
    block_n = max(16, min(128, 4096 // block_r))
    _expand_kernel[(t, triton.cdiv(n, block_n))](h, b, slots, y, n, rank, starts[0], starts[1], h.stride(0),
                                                 h.stride(1), b.stride(0), b.stride(1), y.stride(0),
                                                 SPLIT=h.shape[0], PARTS=len(slices), BLOCK_N=block_n,
                                                 BLOCK_R=block_r)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor | None = None
                ) -> torch.Tensor:
    """[T, in] x, [S, R, in] stacked A, [T] int32 slots -> [SPLIT, T, R] float32 partial sums
    (rows of slot -1: undefined). ``blocks`` (lora_segments.segment_blocks of the same slots, on
    the device): the grouped kernel."""
    if not use_triton(x):
        return lora_shrink_torch(x, a, slots)
    return lora_shrink_triton(x, a, slots) if blocks is None else lora_shrink_segments(x, a, blocks)


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, slices: list[int],
                blocks: torch.Tensor | None = None) -> None:
    """y [T, out] += each part's B[slot] @ h's ranks of that part, in place, for rows with a slot;
    ``slices``: the parts' output sizes, summing to out."""
    if not use_triton(y):
        lora_expand_torch(y, h, b, slots, slices)
    elif blocks is None:
        lora_expand_triton(y, h, b, slots, slices)
    else:
        lora_expand_segments(y, h, b, blocks, slices)
