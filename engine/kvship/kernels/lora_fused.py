"""A projection's LoRA shrink and expand as one kernel, for the few rows of a small decode batch:
y[t, tile] += B[slot[t], tile] @ (A[slot[t], part] @ x[t]).

One program a row and a tile of one part's output columns (q/k/v or gate/up; a tile never spans
two parts): it takes the whole shrink of its part itself, reading that part's A (rank x in, a few
hundred KB, from L2 after the first program), then its tile of the expand. At a row or a few the
kernel boundary between a separate shrink and expand (the wait, the ramp, the partial sums' round
trip) costs more than those repeated reads. The slot, B's tile and A's first tile are loaded
before the PDL wait: the host wrote them before the step began. The torch reference is
kernels/lora.py's shrink and expand references.
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import device_sms, next_pow2, pdl_launch, pdl_wait, tl, triton


@triton.jit
def _fused_kernel(x_ptr, a_ptr, b_ptr, slots_ptr, y_ptr, K, N, RANK, TILES1, TILES2, C1, C2, stride_x, stride_as,
                  stride_ar, stride_bs, stride_bn, stride_y, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    tile = tl.program_id(1)
    # this tile's part, and where that part's columns start and end
    part = (tile >= TILES1).to(tl.int32) + (tile >= TILES2).to(tl.int32)
    first_tile = tl.where(part == 0, 0, tl.where(part == 1, TILES1, TILES2))
    col0 = tl.where(part == 0, 0, tl.where(part == 1, C1, C2))
    col_end = tl.where(part == 0, C1, tl.where(part == 1, C2, N))
    offs_n = col0 + (tile - first_tile) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < col_end
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < RANK
    offs_k = tl.arange(0, BLOCK_K)
    slot = tl.load(slots_ptr + t)
    on = slot >= 0
    adapter = tl.maximum(slot, 0).to(tl.int64)
    b = tl.load(b_ptr + adapter * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=on & nmask[:, None] & rmask[None, :], other=0.0)
    a_rows = a_ptr + adapter * stride_as + (part * RANK + offs_r)[:, None] * stride_ar
    a = tl.load(a_rows + offs_k[None, :], mask=on & rmask[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl_wait(PDL)  # every program: the kernel ends after the one before
    if on:
        x_row = x_ptr + t.to(tl.int64) * stride_x
        acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            x = tl.load(x_row + kk, mask=kk < K, other=0.0)
            # the next tile of A in flight while this one is used
            a_next = tl.load(a_rows + (kk + BLOCK_K)[None, :], mask=rmask[:, None] & (kk + BLOCK_K < K)[None, :],
                             other=0.0)
            acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
            a = a_next
        h = tl.sum(acc, 1)
        delta = tl.sum(b.to(tl.float32) * h[None, :], 1)
        out = y_ptr + t.to(tl.int64) * stride_y + offs_n
        y = tl.load(out, mask=nmask, other=0.0)
        tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=nmask)


# About this many programs a row: fewer read A fewer times, more spread the expand's tiles
PROGRAMS_PER_SM = 0.5
# A's tile a loop step: rank x BLOCK_K elements at most, held twice (this one and the next)
TILE_ELEMENTS = 8192


def lora_fused_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                      slices: list[int]) -> None:
    """y [T, out] += each part's B[slot] @ A[slot]'s ranks of that part @ x, in place, for rows
    with a slot; a [S, parts x rank, in], b [S, out, rank], ``slices`` the parts' output sizes."""
    if len(slices) > 3:
        raise ValueError(f"a fused projection of {len(slices)} parts; LoRA takes up to 3")
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape
    n, rank = b.shape[1], b.shape[2]
    block_r = next_pow2(rank)
    per_row = max(1, int(device_sms(x) * PROGRAMS_PER_SM) // t)
    block_n = max(16, min(256, next_pow2(triton.cdiv(n, per_row))))
    tiles = [triton.cdiv(s, block_n) for s in slices]
    ends = [sum(tiles[:i + 1]) for i in range(len(slices))]
    cols = [sum(slices[:i + 1]) for i in range(len(slices))]
    tiles1, tiles2 = (ends + ends[-1:] * 2)[:2]  # a part past the last: none
    c1, c2 = (cols + [n] * 2)[:2]
    _fused_kernel[(t, ends[-1])](x, a, b, slots, y, k, n, rank, tiles1, tiles2, c1, c2, x.stride(0), a.stride(0),
                                 a.stride(1), b.stride(0), b.stride(1), y.stride(0), BLOCK_N=block_n,
                                 BLOCK_R=block_r, BLOCK_K=min(next_pow2(k), max(64, TILE_ELEMENTS // block_r)),
                                 num_warps=4, **pdl_launch(y))
