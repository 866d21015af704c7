"""The grouped (segment) form of kernels/lora.py's shrink and expand, for steps with prompt chunks
(Punica's SGMV): the step's rows in runs of one adapter, each block of up to BLOCK_M rows of a
run multiplied by the adapter's matrix on the tensor cores, A or B read once per block. Rows of
the base model are in no block. Launched with host-built blocks, so never inside a graph.
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import next_pow2, tl, triton

SEGMENT_BLOCK_M = 32


def segment_blocks(slots: list[int], block_m: int = SEGMENT_BLOCK_M) -> list[tuple[int, int, int]]:
    """(start, length, slot) of each block of a step's per-row slots (host side)."""
    out, i, n = [], 0, len(slots)
    while i < n:
        j = i
        while j < n and slots[j] == slots[i] and j - i < block_m:
            j += 1
        if slots[i] >= 0:
            out.append((i, j - i, slots[i]))
        i = j
    return out


@triton.jit
def _segment_rows(blocks_ptr, NUM_BLOCKS, BLOCK_M: tl.constexpr):
    """This program's block of one adapter's rows: (row indices, which are real, the adapter's slot)."""
    b = tl.program_id(0)
    start = tl.load(blocks_ptr + b)
    length = tl.load(blocks_ptr + NUM_BLOCKS + b)
    slot = tl.load(blocks_ptr + 2 * NUM_BLOCKS + b)
    offs_m = tl.arange(0, BLOCK_M)
    return (start + offs_m).to(tl.int64), offs_m < length, slot


@triton.jit
def _shrink_segment_kernel(x_ptr, a_ptr, blocks_ptr, h_ptr, K, R, stride_x, stride_as, stride_ar, stride_h,
                           NUM_BLOCKS, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, mmask, slot = _segment_rows(blocks_ptr, NUM_BLOCKS, BLOCK_M)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        a = tl.load(a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar + kk[:, None],
                    mask=rmask[None, :] & kmask[:, None], other=0.0)
        acc += tl.dot(x, a.to(x.dtype))
    tl.store(h_ptr + rows[:, None] * stride_h + offs_r[None, :], acc, mask=mmask[:, None] & rmask[None, :])


@triton.jit
def _expand_segment_kernel(h_ptr, b_ptr, blocks_ptr, y_ptr, N, RANK, r0, col0, stride_h, stride_bs, stride_bn,
                           stride_y, NUM_BLOCKS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_R: tl.constexpr):
    rows, mmask, slot = _segment_rows(blocks_ptr, NUM_BLOCKS, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < RANK
    h = tl.load(h_ptr + rows[:, None] * stride_h + r0 + offs_r[None, :], mask=mmask[:, None] & rmask[None, :],
                other=0.0)
    w = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                mask=nmask[None, :] & rmask[:, None], other=0.0)
    delta = tl.dot(h.to(w.dtype), w)
    out = y_ptr + rows[:, None] * stride_y + col0 + offs_n[None, :]
    omask = mmask[:, None] & nmask[None, :]
    y = tl.load(out, mask=omask, other=0.0)
    tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=omask)


def lora_shrink_segments(x: torch.Tensor, a: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """kernels/lora.py's lora_shrink ([1, T, R]) for the rows ``blocks`` ([3, nb] int32 on the
    device: starts, lengths, slots) covers."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape
    r = a.shape[1]
    h = torch.empty(1, t, r, dtype=torch.float32, device=x.device)
    nb = blocks.shape[1]
    if nb:
        block_r = max(16, min(next_pow2(r), 64))
        _shrink_segment_kernel[(nb, triton.cdiv(r, block_r))](
            x, a, blocks, h, k, r, x.stride(0), a.stride(0), a.stride(1), h.stride(1), nb,
            BLOCK_M=SEGMENT_BLOCK_M, BLOCK_R=block_r, BLOCK_K=64)
    return h


def lora_expand_segments(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, blocks: torch.Tensor,
                         slices: list[int]) -> None:
    """kernels/lora.py's lora_expand for the rows ``blocks`` covers: one launch per slice."""
    rank = b.shape[2]
    nb = blocks.shape[1]
    col0 = 0
    for i, n in enumerate(slices):
        if nb:
            block_n = 64
            part = b[:, col0:col0 + n]
            _expand_segment_kernel[(nb, triton.cdiv(n, block_n))](
                h[0], part, blocks, y, n, rank, i * rank, col0, h.stride(1), part.stride(0), part.stride(1),
                y.stride(0), nb, BLOCK_M=SEGMENT_BLOCK_M, BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(rank)))
        col0 += n
