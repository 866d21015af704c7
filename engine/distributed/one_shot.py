"""Small all-reduces on one host by direct peer loads over NVLink (PyTorch symmetric memory).

At batch-1 decode a tensor-parallel step does two all-reduces per layer of a few KiB each,
where NCCL's ring costs more in latency than in bandwidth. In a one-shot all-reduce every
rank copies its input into a buffer that all ranks have mapped, waits for the others, and sums
all peers' copies itself: one kernel, no multicast (kept off: it can take a shared host's GPUs
out of service). Larger tensors, other dtypes or any set-up failure fall back to NCCL.

Opt-in (--tp-all-reduce one-shot): on 2 x H200 it measured no faster than NCCL inside the
decode graphs (docs/tensor-parallel.md); it stays as the base for fusing the reduction with the
residual add and RMSNorm that follow it.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MAX_BYTES = 512 << 10  # past this, NCCL's bandwidth-optimal algorithms win
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class OneShotAllReduce:
    def __init__(self, group, device: torch.device, max_bytes: int = MAX_BYTES):
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # before the first allocation
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.buffer = symm_mem.empty(max_bytes // 4, dtype=torch.float32, device=device)  # viewed as x's dtype
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        if handle is None:
            raise RuntimeError("symmetric-memory rendezvous returned no handle")
        handle.barrier()

    def applies(self, x: torch.Tensor) -> bool:
        return x.dtype in _DTYPES and x.numel() * x.element_size() <= self.buffer.nbytes and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        staged = self.buffer.view(x.dtype)[:n]
        staged.copy_(x.view(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name).view_as(x)


def try_one_shot(group, device: torch.device, mode: str) -> OneShotAllReduce | None:
    """A checked OneShotAllReduce, or None (NCCL then does every reduction). Every rank must
    call this together; all of them agree on the outcome."""
    if mode != "one-shot" or device.type != "cuda":
        return None
    ok, reducer, why = 1, None, ""
    try:
        reducer = OneShotAllReduce(group, device)
        g = torch.Generator(device=device).manual_seed(1234 + dist.get_rank(group))
        x = torch.randn(3, 4096, device=device, generator=g).to(torch.bfloat16)
        want = x.clone()
        dist.all_reduce(want, group=group)
        got = reducer(x)
        torch.cuda.synchronize(device)
        if not torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2):
            ok, why = 0, "its sum differs from NCCL's"
    except Exception as e:  # noqa: BLE001 - any failure here means "use NCCL"
        ok, why = 0, f"{type(e).__name__}: {e}"
    agreed = torch.tensor([ok], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if agreed.item() == 1:
        log.info("tensor parallel: one-shot all-reduce over symmetric memory for tensors up to %d KiB",
                 MAX_BYTES >> 10)
        return reducer
    log.warning("tensor parallel: one-shot all-reduce unavailable (%s); NCCL does every all-reduce",
                why or "another rank could not set it up")
    return None
