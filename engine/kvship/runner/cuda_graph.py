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
the base model's speed. Both share one memory pool (they never run at once).

CapturedSteps is what these share with the verify graphs (runner/verify_graphs.py)."""
from __future__ import annotations

import logging

import torch

from kvship.kernels.graph_inputs import InFlightInputs, StaticInputs, StepInputs, stage_inputs, stage_padding
from kvship.layers.attention import AttentionMetadata
from kvship.layers.lora import LoRABatch

log = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class CapturedSteps:
    """What decode and verify graphs share: a graph per bucketed batch size of ``rows_per_seq``
    query rows a sequence, captured largest first into one memory pool, writing float32 logits
    (and with ``keep_hidden`` the hidden states) into buffers made outside that pool."""

    rows_per_seq = 1

    def __init__(self, model, max_bs: int, keep_hidden: bool):
        self.model = model
        self.keep_hidden = keep_hidden
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # the graphs' memory pool, once captured
        self.logits: torch.Tensor | None = None  # [max_bs * rows_per_seq, vocab] float32, made at capture
        self.hidden: torch.Tensor | None = None  # [max_bs * rows_per_seq, hidden] with keep_hidden

    def _meta(self, bs: int) -> AttentionMetadata:
        raise NotImplementedError

    def _forward(self, bs: int) -> None:
        rows = bs * self.rows_per_seq
        hidden = self.model(self.inputs.input_ids[:rows], self.inputs.positions[:rows], self._meta(bs))
        logits = self.model.compute_logits(hidden)
        size = self.max_bs * self.rows_per_seq
        if self.logits is None:
            self.logits = torch.empty(size, logits.shape[1], dtype=torch.float32, device=logits.device)
        self.logits[:rows].copy_(logits)
        if self.keep_hidden:
            if self.hidden is None:
                self.hidden = torch.empty(size, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
            self.hidden[:rows].copy_(hidden)

    def _capture_sizes(self, graphs: dict, pool):
        """A graph per size into ``graphs``, in ``pool`` (None: a new one); returns the pool."""
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._forward(bs)  # warm-up: triton compiles, allocator settles
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):  # NCCL watchdog thread
                self._forward(bs)
            pool = g.pool()
            graphs[bs] = g
        return pool

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """``pool``: another set's memory pool to share (never replayed at the same time)."""
        self.pool = self._capture_sizes(self.graphs, pool)
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for %s batch sizes %s", type(self).__name__, self.sizes)

    def _replay(self, bs: int, graphs: dict | None = None) -> None:
        """The captured graph; without one (never captured: CPU tests) the same forward, eagerly."""
        graphs = self.graphs if graphs is None else graphs
        if bs in graphs:
            graphs[bs].replay()
        else:
            self._forward(bs)


class DecodeGraphs(CapturedSteps):
    def __init__(self, model, max_bs: int, max_blocks_per_seq: int, device: torch.device,
                 state_scratch: int | None = None, keep_hidden: bool = False, lora: LoRABatch | None = None):
        super().__init__(model, max_bs, keep_hidden)
        self.lora = lora
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
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # with the LoRA kernels

    def _meta(self, bs: int) -> AttentionMetadata:
        s = self.inputs
        return AttentionMetadata(s.slot_mapping[:bs], s.block_tables[:bs], s.seq_lens[:bs],
                                 self.cu_seqlens_q[: bs + 1], 1, self.rows[:bs], num_decodes=bs,
                                 state_slots=None if s.state_slots is None else s.state_slots[:bs])

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        stage_padding(self.inputs, self.max_bs)  # what every step launches first, compiled now
        if self.lora is None:
            return super().capture(pool)
        for with_lora in (False, True):
            self.lora.capture_state(with_lora)  # the layers read it as the graph is captured
            pool = self._capture_sizes(self.lora_graphs if with_lora else self.graphs, pool)
        self.pool = pool
        self.lora.active = False  # each step sets it (runner/lora_manager.py)
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s, with and without the LoRA kernels", self.sizes)

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
        self._replay(bs, self.lora_graphs if self.lora is not None and self.lora.active else None)
        return self.logits[:n]
