"""The grouped form of kernels/lora.py's shrink and expand (Punica's SGMV): a step's rows grouped
by adapter, each block of up to BLOCK_M rows of one adapter multiplied by its matrix on the
tensor cores, A or B read once a block rather than once a row. For steps with prompt chunks,
and for the decode graphs of many rows.

The host groups the rows each step (``group_rows``) into fixed device buffers (``RowGroups``):
``order``, the rows of each adapter together (rows of the base model left out), and ``blocks``
[capacity, 3] int32 (first index into ``order``, length, slot), the blocks past the step's of
length 0. A launch over T rows runs ``num_blocks(T, slots)`` block programs, as many as any
grouping of T rows can need: its grid depends on T alone, so a decode graph may hold it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvship.kernels._triton import device_sms, pdl_launch, pdl_wait, tl, triton
from kvship.kernels.activation import gelu_tanh_mul, silu_mul

# Rows a block: decode steps have few rows an adapter, prompt chunks many.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 32
# The grouped shrink's split of the input features, each over at least GROUP_MIN_SPLIT_K: each
# split's partial sums are read by every program of the expand, so fewer than the per-row kernel's.
# A program's loop stays within GROUP_MAX_SPLIT_K features all the same: its iterations run one
# after another, and a long input (an MLP's down projection) would leave a few programs looping.
MAX_GROUP_SPLIT = 4
GROUP_MIN_SPLIT_K = 256
GROUP_MAX_SPLIT_K = 1024


@dataclass
class RowGroups:
    order: torch.Tensor  # [max_tokens] int32
    blocks: torch.Tensor  # [capacity, 3] int32
    block_m: int  # the rows a block the host grouped them by


def num_blocks(num_rows: int, num_slots: int, block_m: int) -> int:
    """Blocks enough for any grouping of ``num_rows`` rows over ``num_slots`` adapters: each
    adapter's rows take ceil(n / block_m) <= n / block_m + 1 blocks."""
    return triton.cdiv(num_rows, block_m) + num_slots


def group_rows(slots: list[int], block_m: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, blocks [capacity, 3]) of a step's per-row slots (host side)."""
    s = np.asarray(slots, dtype=np.int32)
    order = np.argsort(s, kind="stable").astype(np.int32)
    order = order[s[order] >= 0]
    blocks = np.zeros((capacity, 3), dtype=np.int32)
    if len(order):
        ordered = s[order]
        run_starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        run_ends = np.r_[run_starts[1:], len(order)]
        starts = np.concatenate([np.arange(a, b, block_m) for a, b in zip(run_starts, run_ends)])
        ends = np.minimum(starts + block_m, np.repeat(run_ends, -(-(run_ends - run_starts) // block_m)))
        if len(starts) > capacity:
            raise RuntimeError(f"{len(starts)} LoRA row blocks exceed the buffer's {capacity}")
        blocks[:len(starts)] = np.stack([starts, ends - starts, ordered[starts]], 1)
    return order, blocks


@triton.jit
def shrink_input(ptrs, K, mask, GATED: tl.constexpr, GELU: tl.constexpr):
    """The shrink's input at ``ptrs``; GATED: a gate/up output [gate | up], act(gate) * up,
    rounded as act_and_mul's output is."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if GATED:
        up = tl.load(ptrs + K, mask=mask, other=0.0)
        if GELU:
            x = gelu_tanh_mul(x, up).to(ptrs.dtype.element_ty)
        else:
            x = silu_mul(x, up).to(ptrs.dtype.element_ty)
    return x


@triton.jit
def _block_rows(blocks_ptr, order_ptr, BLOCK_M: tl.constexpr):
    """This program's block: (its rows, which are real, the adapter's slot, how many rows)."""
    b = tl.program_id(0)
    start = tl.load(blocks_ptr + 3 * b)
    length = tl.load(blocks_ptr + 3 * b + 1)
    slot = tl.load(blocks_ptr + 3 * b + 2)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < length
    rows = tl.load(order_ptr + start + offs_m, mask=mmask, other=0).to(tl.int64)
    return rows, mmask, slot, length


@triton.jit
def _shrink_group_kernel(x_ptr, a_ptr, blocks_ptr, order_ptr, h_ptr, K, R, K_PER_SPLIT, stride_x, stride_as,
                         stride_ar, stride_hs, stride_h, GATED: tl.constexpr, GELU: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # every program, even an empty block's: the kernel ends after the one before
    rows, mmask, slot, length = _block_rows(blocks_ptr, order_ptr, BLOCK_M)
    if length > 0:
        split = tl.program_id(2)
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows[:, None] * stride_x
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        k_start = split * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < k_end
            x = shrink_input(x_rows + kk[None, :], K, mmask[:, None] & kmask[None, :], GATED, GELU)
            a = tl.load(a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar + kk[:, None],
                        mask=rmask[None, :] & kmask[:, None], other=0.0)
            acc += tl.dot(x, a.to(x.dtype))
        tl.store(h_ptr + split * stride_hs + rows[:, None] * stride_h + offs_r[None, :], acc,
                 mask=mmask[:, None] & rmask[None, :])


@triton.jit
def _expand_group_kernel(h_ptr, b_ptr, blocks_ptr, order_ptr, y_ptr, N, RANK, C1, C2, stride_hs, stride_h,
                         stride_bs, stride_bn, stride_y, SPLIT: tl.constexpr, PARTS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rows, mmask, slot, length = _block_rows(blocks_ptr, order_ptr, BLOCK_M)
    if length > 0:
        n0 = tl.program_id(1) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_r = tl.arange(0, BLOCK_R)
        rmask = offs_r < RANK
        w = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                    mask=nmask[None, :] & rmask[:, None], other=0.0)
        # the parts (q/k/v or gate/up) this tile's columns belong to, each with its own ranks
        part = (offs_n >= C1).to(tl.int32) + (offs_n >= C2).to(tl.int32)
        first = (n0 >= C1).to(tl.int32) + (n0 >= C2).to(tl.int32)
        last_n = tl.minimum(n0 + BLOCK_N, N) - 1
        last = (last_n >= C1).to(tl.int32) + (last_n >= C2).to(tl.int32)
        hmask = mmask[:, None] & rmask[None, :]
        delta = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for p in tl.static_range(PARTS):
            if (p >= first) & (p <= last):
                hp = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
                for s in tl.static_range(SPLIT):  # the shrink's partial sums added up
                    hp += tl.load(h_ptr + s * stride_hs + rows[:, None] * stride_h + p * RANK + offs_r[None, :],
                                  mask=hmask, other=0.0)
                wp = tl.where((part == p)[None, :], w, tl.zeros_like(w))
                delta += tl.dot(hp.to(w.dtype), wp)
        out = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
        omask = mmask[:, None] & nmask[None, :]
        y = tl.load(out, mask=omask, other=0.0)
        tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=omask)


def _grid_blocks(t: int, slots: int, groups: RowGroups) -> int:
    nb = num_blocks(t, slots, groups.block_m)
    if nb > groups.blocks.shape[0]:
        raise RuntimeError(f"{t} rows need {nb} LoRA row blocks; the buffer holds {groups.blocks.shape[0]}")
    return nb


def lora_shrink_grouped(x: torch.Tensor, a: torch.Tensor, groups: RowGroups, act: str | None = None
                        ) -> torch.Tensor:
    """kernels/lora.py's lora_shrink ([SPLIT, T, R]) for the rows ``groups`` holds."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape[0], x.shape[1] // 2 if act else x.shape[1]
    r = a.shape[1]
    nb = _grid_blocks(t, a.shape[0], groups)
    block_r = 16 if r <= 16 else 32  # the dot's N: at least 16
    r_blocks = triton.cdiv(r, block_r)
    busy = triton.cdiv(t, groups.block_m) * r_blocks  # blocks with rows, at the least
    split = max(1, min(MAX_GROUP_SPLIT, triton.cdiv(k, GROUP_MIN_SPLIT_K),
                         triton.cdiv(2 * device_sms(x), busy)), triton.cdiv(k, GROUP_MAX_SPLIT_K))
    k_per_split = triton.cdiv(triton.cdiv(k, split), 64) * 64
    split = triton.cdiv(k, k_per_split)
    h = torch.empty(split, t, r, dtype=torch.float32, device=x.device)
    _shrink_group_kernel[(nb, r_blocks, split)](
        x, a, groups.blocks, groups.order, h, k, r, k_per_split, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        h.stride(1), GATED=act is not None, GELU=act == "gelu_tanh", BLOCK_M=groups.block_m, BLOCK_R=block_r,
        BLOCK_K=64, **pdl_launch(x))
    return h


def lora_expand_grouped(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, groups: RowGroups,
                        slices: list[int]) -> None:
    """kernels/lora.py's lora_expand for the rows ``groups`` holds, every part in one launch."""
    if len(slices) > 3:
        raise ValueError(f"a fused projection of {len(slices)} parts; LoRA takes up to 3")
    t, n, rank = y.shape[0], b.shape[1], b.shape[2]
    nb = _grid_blocks(t, b.shape[0], groups)
    starts = [sum(slices[:i]) for i in range(1, len(slices))] + [n] * (3 - len(slices))
    block_n = 128  # wide: every program also reads its rows' partial sums
    _expand_group_kernel[(nb, triton.cdiv(n, block_n))](
        h, b, groups.blocks, groups.order, y, n, rank, starts[0], starts[1], h.stride(0), h.stride(1), b.stride(0),
        b.stride(1), y.stride(0), SPLIT=h.shape[0], PARTS=len(slices), BLOCK_M=groups.block_m, BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), **pdl_launch(y))
