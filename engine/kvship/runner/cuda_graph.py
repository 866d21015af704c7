"""CUDA graphs for decode steps: one graph per bucketed batch size, captured once after the KV
cache exists, replayed with the batch written into static input buffers (kernels/graph_inputs.py,
one launch). Removes the per-kernel launch cost that dominates small-batch decode. The graphs
write their logits as float32, the sampler's dtype, into one buffer they share (the next
replay overwrites it: the sampler's kernels are queued before it), so that no launch of its
own converts them and no graph keeps logits of its own. With ``keep_hidden`` they also write
the model's hidden states into a shared buffer (an MTP proposer reads them, core/mtp.py).

A hybrid model's graphs take each sequence's recurrent-state slot as one more input; padding
rows point at a scratch slot (``state_scratch``, no sequence's), where their throw-away state
goes, so that a replay never touches a slot it was not given.

With LoRA (``lora``, the model's layers/lora.py LoRABatch) each size has two graphs: one captured
with the adapters' kernels, one without; a step whose rows use no adapter replays the latter, at
the base model's speed. Both share one memory pool (they never run at once)."""
from __future__ import annotations

import logging

import torch

from kvship.kernels.graph_inputs import InFlightInputs, StaticInputs, StepInputs, stage_inputs
from kvship.layers.attention import AttentionMetadata
from kvship.layers.lora import LoRABatch

log = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class DecodeGraphs:
    def __init__(self, model, max_bs: int, max_blocks_per_seq: int, device: torch.device,
                 state_scratch: int | None = None, keep_hidden: bool = False, lora: LoRABatch | None = None):
        self.model = model
        self.lora = lora
        self.keep_hidden = keep_hidden
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        i32, i64 = torch.int32, torch.int64
        self.inputs = StaticInputs(
            input_ids=torch.zeros(self.max_bs, dtype=i64, device=device),
            positions=torch.zeros(self.max_bs, dtype=i64, device=device),
            slot_mapping=torch.full((self.max_bs,), -1, dtype=i64, device=device),
            seq_lens=torch.ones(self.max_bs, dtype=i32, device=device),
            block_tables=torch.zeros(self.max_bs, max_blocks_per_seq, dtype=i32, device=device),
            state_slots=None if state_scratch is None else torch.full((self.max_bs,), state_scratch, dtype=i64,
                                                                      device=device),
            state_scratch=state_scratch or 0)
        self.cu_seqlens_q = torch.arange(self.max_bs + 1, dtype=i32, device=device)
        self.rows = torch.arange(self.max_bs, dtype=i64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # with the LoRA kernels
        self.logits: torch.Tensor | None = None  # [max_bs, vocab] float32, made at capture
        self.hidden: torch.Tensor | None = None  # [max_bs, hidden] with keep_hidden, made at capture

    def _meta(self, bs: int) -> AttentionMetadata:
        s = self.inputs
        return AttentionMetadata(s.slot_mapping[:bs], s.block_tables[:bs], s.seq_lens[:bs],
                                 self.cu_seqlens_q[: bs + 1], 1, self.rows[:bs], num_decodes=bs,
                                 state_slots=None if s.state_slots is None else s.state_slots[:bs])

    def _forward(self, bs: int) -> None:
        hidden = self.model(self.inputs.input_ids[:bs], self.inputs.positions[:bs], self._meta(bs))
        logits = self.model.compute_logits(hidden)
        if self.logits is None:
            self.logits = torch.empty(self.max_bs, logits.shape[1], dtype=torch.float32, device=logits.device)
        self.logits[:bs].copy_(logits)
        if self.keep_hidden:
            if self.hidden is None:
                self.hidden = torch.empty(self.max_bs, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
            self.hidden[:bs].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for with_lora in ([False, True] if self.lora is not None else [False]):
            if self.lora is not None:  # the layers read it as the graph is captured
                self.lora.active = with_lora
            for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
                self._forward(bs)  # warm-up: triton compiles, allocator settles
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):  # NCCL watchdog thread
                    self._forward(bs)
                pool = g.pool()
                (self.lora_graphs if with_lora else self.graphs)[bs] = g
        if self.lora is not None:
            self.lora.active = False  # each step sets it (runner/lora_manager.py)
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s%s", self.sizes,
                 ", with and without the LoRA kernels" if self.lora is not None else "")

    def can_run(self, num_seqs: int, max_seqlen_q: int, num_blocks: int) -> bool:
        return max_seqlen_q == 1 and num_seqs <= self.max_bs and num_blocks <= self.inputs.block_tables.shape[1]

    @torch.inference_mode()
    def run(self, input_ids, positions, meta: AttentionMetadata, in_flight: InFlightInputs | None = None
            ) -> torch.Tensor:
        """Float32 logits [n, vocab]. ``in_flight``: the inputs the previous step is still sampling."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        stage_inputs(self.inputs, StepInputs(input_ids, positions, meta.slot_mapping, meta.seq_lens,
                                             meta.block_tables, in_flight, meta.state_slots), bs)
        (self.lora_graphs if self.lora is not None and self.lora.active else self.graphs)[bs].replay()
        return self.logits[:n]
