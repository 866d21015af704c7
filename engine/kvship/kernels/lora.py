"""The two low-rank products of batched LoRA, each row of a step with its own adapter (or none).

``lora_shrink``: h[t] = A[slot[t]] @ x[t]  ([T, in] -> [T, R], float32), for the stacked A of a
layer's adapter slots [S, R, in]. ``lora_expand``: y[t, cols] += B[slot[t]] @ h[t, r0:r0 + r]
for one output slice (q, k or v of a fused projection) [S, N, r]. A row whose slot is -1 has no
adapter: shrink leaves its h unwritten and expand adds nothing.

Two Triton forms. Per row (Punica's BGMV): one program a row, fixed shapes and no host reads,
so they run inside the decode graphs. Per segment (SGMV, below): an eager step with prompt
chunks groups its rows in runs of one adapter, each block of a run multiplied on the tensor
cores. The torch references group rows by adapter (host-side).
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


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor | None = None
                ) -> torch.Tensor:
    """[T, in] x, [S, R, in] stacked A, [T] int32 slots -> [T, R] float32 (rows of slot -1: undefined).
    ``blocks`` (segment_blocks of the same slots, [3, nb] on the device): the grouped kernel."""
    if not use_triton(x):
        return lora_shrink_torch(x, a, slots)
    return lora_shrink_triton(x, a, slots) if blocks is None else lora_shrink_segments(x, a, blocks)


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, r0: int, col0: int,
                blocks: torch.Tensor | None = None) -> None:
    """y[:, col0:col0 + N] += h[:, r0:r0 + r] @ B[slot]^T, in place, for rows with a slot."""
    if not use_triton(y):
        lora_expand_torch(y, h, b, slots, r0, col0)
    elif blocks is None:
        lora_expand_triton(y, h, b, slots, r0, col0)
    else:
        lora_expand_segments(y, h, b, blocks, r0, col0)


# -- segments: the rows of one step grouped in runs of one adapter (prefill chunks) ----------------
# A block is up to BLOCK_M consecutive rows of one adapter (block_start, block_len, block_slot);
# rows without an adapter are in no block. Each program multiplies its block's rows by the
# adapter's matrix on the tensor cores (Punica's SGMV), reading A or B once per block.
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
def _shrink_segment_kernel(x_ptr, a_ptr, blocks_ptr, h_ptr, K, R, stride_x, stride_as, stride_ar, stride_h,
                           NUM_BLOCKS, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(blocks_ptr + b)
    length = tl.load(blocks_ptr + NUM_BLOCKS + b)
    slot = tl.load(blocks_ptr + 2 * NUM_BLOCKS + b)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < length
    rows = (start + offs_m).to(tl.int64)
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
    b = tl.program_id(0)
    start = tl.load(blocks_ptr + b)
    length = tl.load(blocks_ptr + NUM_BLOCKS + b)
    slot = tl.load(blocks_ptr + 2 * NUM_BLOCKS + b)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < length
    rows = (start + offs_m).to(tl.int64)
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
    """As lora_shrink, for the rows ``blocks`` ([3, nb] int32 on the device: starts, lengths,
    slots) covers."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape
    r = a.shape[1]
    h = torch.empty(t, r, dtype=torch.float32, device=x.device)
    nb = blocks.shape[1]
    if nb:
        block_r = max(16, min(next_pow2(r), 64))
        _shrink_segment_kernel[(nb, triton.cdiv(r, block_r))](
            x, a, blocks, h, k, r, x.stride(0), a.stride(0), a.stride(1), h.stride(0), nb,
            BLOCK_M=SEGMENT_BLOCK_M, BLOCK_R=block_r, BLOCK_K=64)
    return h


def lora_expand_segments(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, blocks: torch.Tensor,
                         r0: int, col0: int) -> None:
    n, rank = b.shape[1], b.shape[2]
    nb = blocks.shape[1]
    if nb:
        block_n = 64
        _expand_segment_kernel[(nb, triton.cdiv(n, block_n))](
            h, b, blocks, y, n, rank, r0, col0, h.stride(0), b.stride(0), b.stride(1), y.stride(0), nb,
            BLOCK_M=SEGMENT_BLOCK_M, BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(rank)))
