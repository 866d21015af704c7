"""A projection's LoRA shrink and expand as one kernel, for the few rows of a small decode batch:
y[t, tile] += B[slot[t], tile] @ (A[slot[t], part] @ x[t]).

One program a row and a tile of one part's output columns (q/k/v or gate/up; a tile never spans
two parts): it takes the whole shrink of its part itself, reading that part's A (rank x in, a few
hundred KB, from L2 after the first program), then its tile of the expand. At a row or a few the
kernel boundary between a separate shrink and expand (the wait, the ramp, the partial sums' round
trip) costs more than those repeated reads. The slot, B's tile and A's first tile are loaded
before the PDL wait: the host wrote them before the step began. The torch reference is
kernels/lora.py's shrink and expand references.

A gate/up projection's kernel takes its down projection's shrink too (``lora_fused_gate_up``):
a program holds a tile of gate columns and the same tile of up columns, so once it has added
their deltas it has act(gate) * up for those columns, and their share of the down projection's
A @ that input: partial sums, one a tile, which the down projection's expand adds up.
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import device_sms, next_pow2, pdl_launch, pdl_wait, tl, triton
from kvship.kernels.activation import gelu_tanh_mul, silu_mul


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


@triton.jit
def _gate_up_kernel(x_ptr, a_ptr, b_ptr, slots_ptr, y_ptr, down_a_ptr, h_ptr, K, INTER, RANK, stride_x, stride_as,
                    stride_ar, stride_bs, stride_bn, stride_y, stride_ds, stride_dr, stride_hs, stride_h,
                    GELU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr):
    t = tl.program_id(0)
    tile = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # gate columns; up's are INTER further
    nmask = offs_n < INTER
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < RANK
    offs_k = tl.arange(0, BLOCK_K)
    slot = tl.load(slots_ptr + t)
    on = slot >= 0
    adapter = tl.maximum(slot, 0).to(tl.int64)
    bmask = on & nmask[:, None] & rmask[None, :]
    b_rows = b_ptr + adapter * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :]
    b_gate = tl.load(b_rows, mask=bmask, other=0.0)
    b_up = tl.load(b_rows + INTER * stride_bn, mask=bmask, other=0.0)
    # the down projection's A on this tile's columns of its input [rank, BLOCK_N]
    down_a = tl.load(down_a_ptr + adapter * stride_ds + offs_r[:, None] * stride_dr + offs_n[None, :],
                     mask=on & rmask[:, None] & nmask[None, :], other=0.0)
    gate_rows = a_ptr + adapter * stride_as + offs_r[:, None] * stride_ar
    up_rows = gate_rows + RANK * stride_ar
    first = on & rmask[:, None] & (offs_k < K)[None, :]
    a_gate = tl.load(gate_rows + offs_k[None, :], mask=first, other=0.0)
    a_up = tl.load(up_rows + offs_k[None, :], mask=first, other=0.0)
    pdl_wait(PDL)  # every program: the kernel ends after the one before
    if on:
        x_row = x_ptr + t.to(tl.int64) * stride_x
        acc_gate = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
            ahead = rmask[:, None] & (kk + BLOCK_K < K)[None, :]
            gate_next = tl.load(gate_rows + (kk + BLOCK_K)[None, :], mask=ahead, other=0.0)
            up_next = tl.load(up_rows + (kk + BLOCK_K)[None, :], mask=ahead, other=0.0)
            acc_gate += a_gate.to(tl.float32) * x
            acc_up += a_up.to(tl.float32) * x
            a_gate, a_up = gate_next, up_next
        out = y_ptr + t.to(tl.int64) * stride_y + offs_n
        dtype = y_ptr.dtype.element_ty
        gate = tl.load(out, mask=nmask, other=0.0).to(tl.float32)
        gate = (gate + tl.sum(b_gate.to(tl.float32) * tl.sum(acc_gate, 1)[None, :], 1)).to(dtype)
        up = tl.load(out + INTER, mask=nmask, other=0.0).to(tl.float32)
        up = (up + tl.sum(b_up.to(tl.float32) * tl.sum(acc_up, 1)[None, :], 1)).to(dtype)
        tl.store(out, gate, mask=nmask)
        tl.store(out + INTER, up, mask=nmask)
        # the down projection's input on these columns, rounded as act_and_mul's output is
        if GELU:
            v = gelu_tanh_mul(gate, up).to(dtype)
        else:
            v = silu_mul(gate, up).to(dtype)
        h = tl.sum(down_a.to(tl.float32) * v.to(tl.float32)[None, :], 1)
        tl.store(h_ptr + tile * stride_hs + t.to(tl.int64) * stride_h + offs_r, h, mask=rmask)


# The down projection's expand adds one partial sum a tile (unrolled): at most this many tiles.
MAX_GATE_UP_TILES = 64


def lora_fused_gate_up(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                       down_a: torch.Tensor, act: str) -> torch.Tensor:
    """``lora_fused_triton`` for a gate/up pair (y [T, 2 inter]), which also returns the down
    projection's shrink [tiles, T, rank] float32 (rows of slot -1: undefined) on act(gate) * up of y
    as updated, for A ``down_a`` [S, rank, inter]."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape
    inter, rank = y.shape[1] // 2, b.shape[2]
    if down_a.shape[1:] != (rank, inter):
        raise ValueError(f"the down projection's A {tuple(down_a.shape[1:])} does not follow a gate/up pair of "
                         f"{inter} features at rank {rank}")
    block_r = next_pow2(rank)
    per_row = max(1, int(device_sms(x) * PROGRAMS_PER_SM) // t)
    block_n = max(16, min(256, next_pow2(triton.cdiv(inter, per_row))), next_pow2(triton.cdiv(inter, MAX_GATE_UP_TILES)))
    tiles = triton.cdiv(inter, block_n)
    h = torch.empty(tiles, t, down_a.shape[1], dtype=torch.float32, device=x.device)
    _gate_up_kernel[(t, tiles)](x, a, b, slots, y, down_a, h, k, inter, rank, x.stride(0), a.stride(0), a.stride(1),
                                b.stride(0), b.stride(1), y.stride(0), down_a.stride(0), down_a.stride(1), h.stride(0),
                                h.stride(1), GELU=act == "gelu_tanh", BLOCK_N=block_n, BLOCK_R=block_r,
                                BLOCK_K=min(next_pow2(k), max(64, TILE_ELEMENTS // block_r)), num_warps=8,
                                **pdl_launch(y))
    return h
