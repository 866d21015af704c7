"""The two low-rank products of batched LoRA, each row of a step with its own adapter (or none).

``lora_shrink``: h[t] = A[slot[t]] @ x[t] for the stacked A of a layer's adapter slots
[S, R, in] (the parts of a fused projection side by side, ``rank`` rows each), as float32
partial sums [SPLIT, T, R] over slices of ``in`` (the expand adds them up). ``lora_expand``:
y[t, part's columns] += B[slot[t]] @ h[t, part's ranks] for every part at once, with B
[S, out, rank] (the parts' rows stacked as in y). A row whose slot is -1 has no adapter: shrink
leaves its h unwritten and expand adds nothing.

The Triton kernels here take one row per program (Punica's BGMV): fixed shapes and no host
reads, so they run inside the decode graphs; the shrink splits ``in`` over programs, so that a
small batch still fills the GPU, each program reading a few wide tiles (a latency-bound product:
one or two loads in flight per program beat a long loop). Both launch with PDL, as the base
model's kernels around them do. With ``act`` the shrink takes a gate/up output [T, 2 in] and
applies act(gate) * up as it reads it (the down projection's input), so the base layer keeps
its fused GEMV and no activation kernel runs for the adapters. From GROUPED_MIN_ROWS rows (a
step with prompt chunks, a large decode batch, in a graph or not) the grouped expand of
kernels/lora_segments.py runs instead, and the grouped shrink from ``grouped_shrink_from`` rows:
one row a program reads each row's adapter again, but the per-row shrink's wide tiles keep it the
faster of the two at a decode batch's few rows an adapter. The torch references group rows by
adapter (host-side).
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import device_sms, next_pow2, pdl_launch, pdl_wait, tl, triton, use_triton
from kvship.kernels.activation import act_and_mul_torch
from kvship.kernels.lora_segments import (
    GROUP_MAX_SPLIT_K,
    MAX_GROUP_SPLIT,
    RowGroups,
    lora_expand_grouped,
    lora_shrink_grouped,
    shrink_input,
)

# From this many rows a step takes the grouped expand, and the grouped shrink from the second
# (when it has its rows grouped); bench/lora.py --kernels times both forms at each.
GROUPED_MIN_ROWS = 32
GROUPED_SHRINK_MIN_ROWS = 64
# An input longer than the grouped shrink's splits cover at GROUP_MAX_SPLIT_K (an MLP's down
# projection) gives its programs long loops and the expand more partial sums to read: the
# per-row shrink stays the faster to this many times GROUPED_SHRINK_MIN_ROWS.
LONG_INPUT_ROWS_FACTOR = 4


def grouped_shrink_from(k: int) -> int:
    """Rows from which the grouped shrink takes an input of ``k`` features."""
    long_input = k > MAX_GROUP_SPLIT * GROUP_MAX_SPLIT_K
    return GROUPED_SHRINK_MIN_ROWS * (LONG_INPUT_ROWS_FACTOR if long_input else 1)


def lora_shrink_torch(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, act: str | None = None
                      ) -> torch.Tensor:
    x = act_and_mul_torch(x, act) if act else x
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
                   stride_h, GATED: tl.constexpr, GELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_wait(PDL)  # every program, even one without an adapter: the kernel ends after the one before
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        split = tl.program_id(2)
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        offs_k = tl.arange(0, BLOCK_K)
        rows = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar
        x_row = x_ptr + t.to(tl.int64) * stride_x
        acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        k_start = split * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < k_end
            x = shrink_input(x_row + kk, K, kmask, GATED, GELU)
            a = tl.load(rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(h_ptr + split * stride_hs + t.to(tl.int64) * stride_h + offs_r, tl.sum(acc, 1), mask=rmask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, N, RANK, C1, C2, stride_hs, stride_h, stride_bs, stride_bn,
                   stride_y, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_r = tl.arange(0, BLOCK_R)
        rmask = offs_r < RANK
        mask = nmask[:, None] & rmask[None, :]
        # Every load goes out before the first sum, whose barriers would hold a later load back:
        # B's tile, y's, and each part's ranks of this row as one [BLOCK_S, BLOCK_R] tile of the
        # shrink's partial sums spread over the threads (read split by split, each thread held
        # every split and the compiler issued the loads a few at a time).
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=mask, other=0.0)
        out = y_ptr + t.to(tl.int64) * stride_y + offs_n
        y = tl.load(out, mask=nmask, other=0.0)
        offs_s = tl.arange(0, BLOCK_S)
        h_tile = h_ptr + t.to(tl.int64) * stride_h + offs_s[:, None] * stride_hs + offs_r[None, :]
        hmask = (offs_s < SPLIT)[:, None] & rmask[None, :]
        t0 = tl.load(h_tile, mask=hmask, other=0.0)
        t1 = t0
        t2 = t0
        if PARTS > 1:
            t1 = tl.load(h_tile + RANK, mask=hmask, other=0.0)
        if PARTS > 2:
            t2 = tl.load(h_tile + 2 * RANK, mask=hmask, other=0.0)
        h0 = tl.sum(t0, 0)
        h1 = tl.sum(t1, 0) if PARTS > 1 else h0
        h2 = tl.sum(t2, 0) if PARTS > 2 else h0
        part = ((offs_n >= C1).to(tl.int32) + (offs_n >= C2).to(tl.int32))[:, None]  # q/k/v or gate/up
        h = tl.where(part == 0, h0[None, :], tl.where(part == 1, h1[None, :], h2[None, :]))
        delta = tl.sum(b.to(tl.float32) * h, 1)
        tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=nmask)


# The shrink's split of the input features: enough programs for about two an SM, each over at
# least MIN_SPLIT_K features (wide tiles), and at most MAX_SPLIT partial sums for the expand to add.
MIN_SPLIT_K = 512
MAX_SPLIT = 16
SHRINK_BLOCK_K = 512


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, act: str | None = None
                       ) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape[0], x.shape[1] // 2 if act else x.shape[1]
    r = a.shape[1]
    block_r = min(next_pow2(r), 16)
    r_blocks = triton.cdiv(r, block_r)
    split = max(1, min(triton.cdiv(k, MIN_SPLIT_K), MAX_SPLIT, triton.cdiv(2 * device_sms(x), t * r_blocks)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), 64) * 64
    split = triton.cdiv(k, k_per_split)
    h = torch.empty(split, t, r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(t, r_blocks, split)](x, a, slots, h, k, r, k_per_split, x.stride(0), a.stride(0), a.stride(1),
                                         h.stride(0), h.stride(1), GATED=act is not None, GELU=act == "gelu_tanh",
                                         BLOCK_R=block_r, BLOCK_K=min(SHRINK_BLOCK_K, next_pow2(k_per_split)),
                                         num_warps=4, **pdl_launch(x))
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
                                                 SPLIT=h.shape[0], BLOCK_S=next_pow2(h.shape[0]),
                                                 PARTS=len(slices), BLOCK_N=block_n,
                                                 BLOCK_R=block_r, **pdl_launch(y))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, groups: RowGroups | None = None,
                act: str | None = None) -> torch.Tensor:
    """[T, in] x, [S, R, in] stacked A, [T] int32 slots -> [SPLIT, T, R] float32 partial sums
    (rows of slot -1: undefined). ``groups``: the same slots' rows grouped by adapter, on the
    device (lora_segments.group_rows). ``act``: x is a gate/up output [T, 2 in], the product is
    taken on act(gate) * up."""
    if not use_triton(x):
        return lora_shrink_torch(x, a, slots, act)
    if groups is not None and x.shape[0] >= grouped_shrink_from(x.shape[1] // 2 if act else x.shape[1]):
        return lora_shrink_grouped(x, a, groups, act)
    return lora_shrink_triton(x, a, slots, act)


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, slices: list[int],
                groups: RowGroups | None = None) -> None:
    """y [T, out] += each part's B[slot] @ h's ranks of that part, in place, for rows with a slot;
    ``slices``: the parts' output sizes, summing to out."""
    if not use_triton(y):
        lora_expand_torch(y, h, b, slots, slices)
    elif groups is not None and y.shape[0] >= GROUPED_MIN_ROWS:
        lora_expand_grouped(y, h, b, groups, slices)
    else:
        lora_expand_triton(y, h, b, slots, slices)
