"""Reading a tensor into the GPU's L2 cache ahead of its use, the values dropped.

At batch 1 a mixture-of-experts layer's experts stream their weights below copy bandwidth (some
73% for Qwen3-30B-A3B on the H200), and the next layer's attention weights are known before they
run. ``warm_l2`` reads such weights with the ``evict_last`` policy from a few programs (on a side
stream: layers/prefetch.py), so that the GEMVs that follow may find them in L2. Whether they do on
a given GPU is what bench/l2_prefetch.py measures; the engine does it only when asked
(KVSHIP_L2_WARM).

There is no torch twin: on a CPU there is no cache to fill, and ``warm_l2`` does nothing there.
"""
from __future__ import annotations

import torch

from kvship.kernels._triton import tl, triton, use_triton


@triton.jit
def _warm_kernel(w_ptr, n, sink_ptr, BLOCK: tl.constexpr):
    """Reads w[0:n] (32-bit words) through L2 with evict_last, grid-strided; stores nothing
    unless the XOR of all the words is one value (so that the compiler keeps the loads)."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        acc ^= tl.load(w_ptr + start + offs, mask=start + offs < n, other=0, eviction_policy="evict_last")
    total = tl.xor_sum(acc, 0)
    if total == 0x7FFFFFFE:
        tl.store(sink_ptr, total)


def warm_l2(tensors: list[torch.Tensor], programs: int, sink: torch.Tensor) -> None:
    """Read each GPU tensor into L2 with ``programs`` programs (one launch a tensor); ``sink`` is
    an int32 scratch word on the same device, never written in practice. A tensor that is not
    contiguous, or not a whole number of 32-bit words, is left out."""
    for t in tensors:
        if use_triton(t):
            _launch(t, programs, sink)


def _launch(t: torch.Tensor, programs: int, sink: torch.Tensor) -> None:
    """The kernel over one tensor's words (also what the interpreter tests run on CPU tensors)."""
    if t.is_contiguous() and t.numel() * t.element_size() % 4 == 0:
        words = t.reshape(-1).view(torch.uint8).view(torch.int32)
        _warm_kernel[(programs,)](words, words.numel(), sink, BLOCK=2048, num_warps=8)
