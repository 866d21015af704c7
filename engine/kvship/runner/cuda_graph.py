"""CUDA graphs for decode steps: one graph per bucketed batch size, captured once after the KV
cache exists, replayed with the batch copied into static input buffers. Removes the per-kernel
launch cost that dominates small-batch decode."""
from __future__ import annotations

import logging

import torch

from kvship.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class DecodeGraphs:
    def __init__(self, model, max_bs: int, max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(self.max_bs, dtype=i64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=i64, device=device)
        self.slot_mapping = torch.full((self.max_bs,), -1, dtype=i64, device=device)
        self.block_tables = torch.zeros(self.max_bs, max_blocks_per_seq, dtype=i32, device=device)
        self.seq_lens = torch.ones(self.max_bs, dtype=i32, device=device)
        self.cu_seqlens_q = torch.arange(self.max_bs + 1, dtype=i32, device=device)
        self.rows = torch.arange(self.max_bs, dtype=i64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.seq_lens[:bs],
                                 self.cu_seqlens_q[: bs + 1], 1, self.rows[:bs])

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._forward(bs)  # warm-up: triton compiles, allocator settles
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):  # NCCL watchdog thread
                self.logits[bs] = self._forward(bs)
            pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, num_seqs: int, max_seqlen_q: int, num_blocks: int) -> bool:
        return max_seqlen_q == 1 and num_seqs <= self.max_bs and num_blocks <= self.block_tables.shape[1]

    @torch.inference_mode()
    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
