"""CUDA graphs for speculative verify steps (core/speculative.py): a decode with up to k
proposals a sequence is a query of up to q = k + 1 rows, ragged. Each sequence is padded to
exactly q rows, so that a graph per bucketed batch size fixes every shape: the attention's
prefill kernel reads the (constant) ``cu_seqlens_q`` of q rows a sequence from the device.

A sequence with n < q rows keeps its real rows first; its context length is raised by q - n,
so that the kernel, which places a sequence's rows at the context's last q positions, puts the
real ones at their true positions. The q - n phantom positions after them store nothing (slot
-1) and are masked for the real rows (causal), and their rotary position is 0. Their keys and
values are still read from whatever the table names there (a weight of 0 times a value: the
cache starts zeroed and holds only what the model stored, so it stays 0), and the table keeps
room for q positions past the context's end. Padding sequences are q phantom rows at positions
0..q-1."""
from __future__ import annotations

import torch

from kvship.kernels.graph_inputs import InFlightInputs, StaticInputs
from kvship.layers.attention import AttentionMetadata
from kvship.runner.cuda_graph import CapturedSteps

# The verify graphs' largest step in query rows: their float32 logits buffer holds this many
# rows of the vocabulary. Larger verify steps are compute-bound, where launch costs matter little.
VERIFY_GRAPH_MAX_ROWS = 512


def verify_graph_max_batch(num_speculative_tokens: int, disable_by_batch_size: int, max_num_seqs: int) -> int:
    """The largest batch the verify graphs cover (0: none): speculation stops above
    disable_by_batch_size running sequences."""
    return min(disable_by_batch_size, max_num_seqs, VERIFY_GRAPH_MAX_ROWS // (num_speculative_tokens + 1))


class VerifyGraphs(CapturedSteps):
    def __init__(self, model, max_bs: int, q: int, max_context: int, block_size: int, device: torch.device,
                 keep_hidden: bool = False):
        """``max_context``: the longest context a step may hold (max_model_len)."""
        super().__init__(model, max_bs, keep_hidden)
        self.rows_per_seq = self.q = q
        rows = self.max_bs * q
        i32, i64 = torch.int32, torch.int64
        self.width = -(-max_context // block_size)  # the widest table a step may send
        self.inputs = StaticInputs(
            input_ids=torch.zeros(rows, dtype=i64, device=device),
            positions=torch.zeros(rows, dtype=i64, device=device),
            slot_mapping=torch.full((rows,), -1, dtype=i64, device=device),
            seq_lens=torch.full((self.max_bs,), q, dtype=i32, device=device),
            block_tables=torch.zeros(self.max_bs, -(-(max_context + q) // block_size), dtype=i32, device=device))
        self.cu_seqlens_q = torch.arange(self.max_bs + 1, dtype=i32, device=device) * q
        self.flat = torch.arange(rows, dtype=i64, device=device)
        self.padded_rows: torch.Tensor | None = None  # the last step's padded row of each of its rows

    def _meta(self, bs: int) -> AttentionMetadata:
        s, rows = self.inputs, bs * self.q
        return AttentionMetadata(s.slot_mapping[:rows], s.block_tables[:bs], s.seq_lens[:bs],
                                 self.cu_seqlens_q[: bs + 1], self.q, self.flat[:rows], num_decodes=0)

    def can_run(self, meta: AttentionMetadata, positions: torch.Tensor) -> bool:
        """Any step of at most max_bs sequences of at most q new tokens each (a short prompt chunk
        too), beyond a plain decode's one; not a hybrid model's (its recurrent state would be
        stepped over the phantom rows)."""
        num_seqs, width = meta.block_tables.shape
        return (1 < meta.max_seqlen_q <= self.q and num_seqs <= self.max_bs and width <= self.width
                and meta.state_slots is None and positions.dim() == 1)

    @torch.inference_mode()
    def run(self, input_ids, positions, meta: AttentionMetadata, in_flight: InFlightInputs | None = None
            ) -> torch.Tensor:
        """Float32 logits of ``meta.logits_indices``' rows. Afterwards ``padded_rows`` maps each
        row of the step to its row in the graphs' buffers (``hidden``)."""
        if in_flight is not None:
            input_ids = in_flight.fill(input_ids)
        n, width = meta.block_tables.shape
        bs = next(s for s in self.sizes if s >= n)
        q, s, rows = self.q, self.inputs, bs * self.q
        cu = meta.cu_seqlens_q.long()
        flat = self.flat[: input_ids.shape[0]]
        seq = torch.searchsorted(cu[1:], flat, right=True)  # each row's sequence
        padded = seq * q + flat - cu[seq]
        for dst, src, pad in ((s.input_ids, input_ids, 0), (s.positions, positions, 0),
                              (s.slot_mapping, meta.slot_mapping, -1)):
            dst[:rows].fill_(pad)
            dst.index_copy_(0, padded, src)
        s.seq_lens[:n].copy_(meta.seq_lens + (q - (cu[1:] - cu[:-1])))
        s.seq_lens[n:bs].fill_(q)
        s.block_tables[:n, :width].copy_(meta.block_tables)
        self._replay(bs)
        self.padded_rows = padded
        return self.logits[padded[meta.logits_indices]]
