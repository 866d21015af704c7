"""Greedy decoding's argmax over the vocabulary: tokens [B] = logits [B, V].argmax(-1).

torch's reduction gives each row to one block: at batch 1 that is one SM reading a 128k-entry
row, far slower than its bytes. Here the row is cut into chunks reduced in
parallel, then one small program per row picks the best chunk. Ties go to the lowest index,
as torch's argmax does; any float dtype works.

``argmax_torch`` is the reference; ``argmax_triton`` the kernels; ``argmax`` picks one.
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import next_pow2, pdl_launch, pdl_wait, tl, triton, use_triton

CHUNK = 4096


def argmax_torch(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@triton.jit
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, NUM_CHUNKS, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best = tl.max(x, 0)
    idx = tl.min(tl.where(x == best, offs, V), 0)  # first index holding the maximum
    tl.store(val_ptr + row * NUM_CHUNKS + chunk, best)
    tl.store(idx_ptr + row * NUM_CHUNKS + chunk, idx)


@triton.jit
def _pick_chunk_kernel(val_ptr, idx_ptr, out_ptr, NUM_CHUNKS, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < NUM_CHUNKS
    vals = tl.load(val_ptr + row * NUM_CHUNKS + offs, mask=m, other=float("-inf"))
    idxs = tl.load(idx_ptr + row * NUM_CHUNKS + offs, mask=m, other=0)
    best = tl.max(vals, 0)
    first = tl.min(tl.where(vals == best, offs, BLOCK), 0)  # earliest chunk: lowest index wins ties
    tl.store(out_ptr + row, tl.sum(tl.where(offs == first, idxs, 0), 0).to(tl.int64))


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``argmax_torch`` for [B, V] logits with a contiguous last dim."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    b, v = logits.shape
    chunks = triton.cdiv(v, CHUNK)
    vals = torch.empty(b, chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(b, chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b > 0:
        _chunk_max_kernel[(b, chunks)](logits, vals, idxs, v, logits.stride(0), chunks, CHUNK=CHUNK, num_warps=8,
                                       **pdl_launch(logits))
        _pick_chunk_kernel[(b,)](vals, idxs, out, chunks, BLOCK=next_pow2(chunks), num_warps=1,
                                 **pdl_launch(logits))
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if use_triton(logits):
        return argmax_triton(logits)
    return argmax_torch(logits)
