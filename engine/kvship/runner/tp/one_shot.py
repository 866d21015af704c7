"""Small all-reduces on one host by direct peer loads over NVLink (PyTorch symmetric memory).

At batch-1 decode a tensor-parallel step does two all-reduces per layer of a few KiB each,
where NCCL's ring costs more in latency than in bandwidth. In a one-shot all-reduce every
rank copies its input into a buffer that all ranks have mapped, waits for the others, and sums
all peers' copies itself: one kernel, no multicast (kept off: it can take a shared host's GPUs
out of service). Larger tensors, other dtypes or any set-up failure fall back to NCCL.

Opt-in (--tp-all-reduce one-shot): it measured no faster than NCCL inside the decode graphs
(docs/tensor-parallel.md); it stays as the base for fusing the reduction with the
residual add and RMSNorm that follow it (FusedAllReduceNorm below, at TP=2).
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


FUSED_SLOT_BYTES = 64 << 10  # one call's rows: batch <= 8 at hidden 4096 in bf16
FUSED_MAX_ROWS = 64


class FusedAllReduceNorm:
    """Two ranks on one host: the all-reduce of a row-parallel linear's partial sums fused with
    the residual add and RMSNorm after it, one kernel (kvship.kernels.allreduce_norm) reading the
    peer's rows over NVLink from PyTorch symmetric memory. Two slots, alternated by the caller's
    site number (consecutive calls use different slots, so a rank never overwrites rows its peer
    may still be reading), and one int32 flag per row in each rank's memory."""

    SLOTS = 2

    def __init__(self, group, device: torch.device, slot_bytes: int = FUSED_SLOT_BYTES,
                 max_rows: int = FUSED_MAX_ROWS):
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # before the first allocation
        import torch.distributed._symmetric_memory as symm_mem

        if dist.get_world_size(group) != 2:
            raise RuntimeError("the fused all-reduce + RMSNorm is written for two ranks")
        self.rank = dist.get_rank(group)
        self.slot_bytes, self.max_rows = slot_bytes, max_rows
        n_slot = slot_bytes // 4
        total = self.SLOTS * n_slot + max_rows  # float32 words; the flags (int32) at the end
        self.buffer = symm_mem.empty(total, dtype=torch.float32, device=device)
        self.buffer.zero_()
        handle = symm_mem.rendezvous(self.buffer, group.group_name)
        if handle is None:
            raise RuntimeError("symmetric-memory rendezvous returned no handle")
        peer = handle.get_buffer(1 - self.rank, (total,), torch.float32, 0)
        self.slots = [self.buffer[i * n_slot:(i + 1) * n_slot] for i in range(self.SLOTS)]
        self.peer_slots = [peer[i * n_slot:(i + 1) * n_slot] for i in range(self.SLOTS)]
        self.flags = self.buffer[self.SLOTS * n_slot:].view(torch.int32)
        self.peer_flags = peer[self.SLOTS * n_slot:].view(torch.int32)
        torch.cuda.synchronize(device)
        handle.barrier()  # both ranks' flags are zero before either kernel runs

    def self_test(self) -> None:
        """Compile and run the kernel on this GPU alone (its own slot as the peer's, local flags
        raised as if the peer had signalled), so that a kernel that cannot build fails here, on
        every rank, before any rank waits on its peer."""
        from kvship.kernels.allreduce_norm import allreduce_add_rms_norm_torch, allreduce_add_rms_norm_triton

        dev = self.buffer.device
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(2, 4096, device=dev).to(dtype)
            res, w = torch.randn_like(x), torch.ones(4096, device=dev, dtype=dtype)
            send, wait = torch.zeros(2, dtype=torch.int32, device=dev), torch.ones(2, dtype=torch.int32, device=dev)
            own = torch.empty(2 * 4096, device=dev, dtype=dtype)
            got = allreduce_add_rms_norm_triton(x, res, w, 1e-5, own, own, send, wait)
            want = allreduce_add_rms_norm_torch([x, x], res, w, 1e-5)
            torch.cuda.synchronize(dev)
            if send.tolist() != [1, 1] or wait.tolist() != [0, 0] or not all(
                    torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2) for a, b in zip(got, want)):
                raise RuntimeError(f"the kernel's local self-test failed ({dtype})")

    def applies(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        rows = x.numel() // max(1, x.shape[-1])
        return (x.is_cuda and x.dtype in _DTYPES and residual.dtype == x.dtype and residual.shape == x.shape
                and x.numel() * x.element_size() <= self.slot_bytes and rows <= self.max_rows)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 site: int) -> tuple[torch.Tensor, torch.Tensor]:
        from kvship.kernels.allreduce_norm import allreduce_add_rms_norm_triton

        slot = site % self.SLOTS
        return allreduce_add_rms_norm_triton(x, residual, weight, eps, self.slots[slot].view(x.dtype),
                                             self.peer_slots[slot].view(x.dtype), self.peer_flags, self.flags)


def _agree(ok: bool, device: torch.device, group) -> bool:
    t = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return t.item() == 1


def try_fused_norm(group, device: torch.device, mode: str) -> FusedAllReduceNorm | None:
    """A checked FusedAllReduceNorm (mode "fused", CUDA, two ranks), or None: NCCL then reduces and
    the norm runs on its own. Every rank calls this together; all agree on the outcome (set-up
    first, so that no rank runs the kernel while its peer cannot)."""
    if mode != "fused" or device.type != "cuda" or dist.get_world_size(group) != 2:
        return None
    reducer, why = None, ""
    try:
        reducer = FusedAllReduceNorm(group, device)
        reducer.self_test()
    except Exception as e:  # noqa: BLE001 - any failure here means "use NCCL"
        reducer, why = None, f"{type(e).__name__}: {e}"
    if _agree(reducer is not None, device, group):
        try:
            from kvship.kernels.allreduce_norm import allreduce_add_rms_norm_torch

            g = torch.Generator(device=device).manual_seed(4321 + dist.get_rank(group))
            for site, rows, dtype in ((1, 3, torch.bfloat16), (2, 1, torch.float32)):  # both slots; ends even
                x = torch.randn(rows, 4096, device=device, generator=g).to(dtype)
                res = torch.randn(rows, 4096, device=device, generator=torch.Generator(device=device).manual_seed(7))
                res = res.to(dtype)
                w = torch.ones(4096, device=device, dtype=dtype)
                parts = [torch.empty_like(x) for _ in range(2)]
                dist.all_gather(parts, x, group=group)
                want = allreduce_add_rms_norm_torch(parts, res, w, 1e-5)
                got = reducer(x, res, w, 1e-5, site)
                torch.cuda.synchronize(device)
                if not all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2) for a, b in zip(got, want)):
                    why = f"its result differs from NCCL's + RMSNorm ({dtype}, {rows} rows)"
                    break
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {e}"
        if _agree(not why, device, group):
            log.info("tensor parallel: all-reduce + residual add + RMSNorm fused in one kernel over symmetric "
                     "memory for up to %d rows / %d KiB", FUSED_MAX_ROWS, FUSED_SLOT_BYTES >> 10)
            return reducer
    log.warning("tensor parallel: fused all-reduce + RMSNorm unavailable (%s); NCCL reduces, the norm runs apart",
                why or "another rank could not set it up")
    return None
