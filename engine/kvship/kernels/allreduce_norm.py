"""Two-rank all-reduce fused with the residual add and RMSNorm that follow it (TP=2 decode).

One program per row: store this rank's partial sums into the peer's slot of a buffer both ranks
have mapped (PyTorch symmetric memory), raise a flag in the peer's memory, wait for the peer's
flag, read the peer's row locally, and finish as ``fused_add_rms_norm`` would. Both ranks get
bit-identical results (x0 + x1 == x1 + x0), as after NCCL. The flags reset themselves
(compare-and-swap 0 -> 1 to send, 1 -> 0 to wait), so graph replays need no host state; callers
alternate slots between calls (runner/tp/one_shot.py). No NVLink multicast.
``allreduce_add_rms_norm_torch`` is the reference."""
from __future__ import annotations

import torch

from kvship.kernels._triton import next_pow2, tl, triton
from kvship.kernels.norm import fused_add_rms_norm_torch, rms_rstd


def allreduce_add_rms_norm_torch(
    parts: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return fused_add_rms_norm_torch(total.to(parts[0].dtype), residual, weight, eps)


@triton.jit
def _allreduce_add_rms_norm_kernel(
    x_ptr, own_ptr, peer_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    send_flag_ptr, wait_flag_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    N, eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    mine = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    tl.store(peer_ptr + row * N + offs, mine, mask=mask)  # into the peer's memory
    tl.debug_barrier()  # every thread's part of the row is stored before the flag goes up
    while tl.atomic_cas(send_flag_ptr + row, 0, 1, sem="release", scope="sys") != 0:
        pass
    while tl.atomic_cas(wait_flag_ptr + row, 1, 0, sem="acquire", scope="sys") != 1:
        pass
    tl.debug_barrier()
    theirs = tl.load(own_ptr + row * N + offs, mask=mask, other=0.0, volatile=True)  # the peer stored it here
    reduced = (mine.to(tl.float32) + theirs.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
    r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
    h = (reduced.to(tl.float32) + r).to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * stride_res_out + offs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = rms_rstd(tl.sum(hf * hf, axis=0), eps, N)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (hf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def allreduce_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    own: torch.Tensor, peer: torch.Tensor, send_flags: torch.Tensor, wait_flags: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``: this rank's partial sums [rows, N]; ``own``: this rank's slot (the peer writes it),
    ``peer``: the peer's same slot (this rank writes it), flat, at least rows * N elements of x's
    dtype; ``send_flags``: the peer's int32 flags, ``wait_flags``: this rank's (at least ``rows``
    each, zero before first use)."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    r2 = residual.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = next_pow2(n)
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    if rows > 0:
        _allreduce_add_rms_norm_kernel[(rows,)](
            x2, own, peer, r2, weight, out, res_out, send_flags, wait_flags,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            n, eps, BLOCK=block, num_warps=num_warps,
        )
    return out.view(shape), res_out.view(shape)
