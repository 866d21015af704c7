"""Tensor-parallel context: which rank this process is and how to reduce across ranks.
Passed down to every layer that shards a weight (no global process-group state)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed process group; None when size == 1
    cpu_group: object | None = None  # gloo group for control messages (step headers, block count)
    runtime: object | None = None  # kvship.runner.tp.launch.TPRuntime on rank 0 and the workers
    one_shot: object | None = None  # kvship.runner.tp.one_shot.OneShotAllReduce, for small tensors
    fused_norm: object | None = None  # kvship.runner.tp.one_shot.FusedAllReduceNorm (TP=2, small tensors)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (in place for NCCL; callers use the returned tensor)."""
        if self.size > 1:
            if self.one_shot is not None and self.one_shot.applies(x):
                return self.one_shot(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise largest over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_int(self, n: int) -> int:
        """The smallest of every rank's n (e.g. the KV blocks that fit on every GPU)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group if self.cpu_group is not None else self.group)
        return int(t.item())

    def shard(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={self.size}")
        return n // self.size


SINGLE = TPContext()
