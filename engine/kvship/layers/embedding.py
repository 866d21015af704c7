"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvship.kernels.cpu_quant_linear import CpuQuantLinear, cpu_quant_weight
from kvship.kernels.quant_linear import QWeight, pack, quant_linear
from kvship.parallel import TPContext
from kvship.quant import QuantizedTensor


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + tp.size - 1) // tp.size
        self.start = tp.rank * self.shard_size
        self.end = min(self.start + self.shard_size, vocab_size)
        # Padded to shard_size so every rank's shard has the same shape (needed by all_gather).
        self.weight = nn.Parameter(torch.zeros(self.shard_size, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, ref, shard_id=None) -> None:
        rows = ref.load((slice(self.start, self.end),))
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary; shares the embedding's weight when tied.

    A checkpoint whose output matrix is quantized (a GGUF file's output.weight: Q6_K in a Q4_K_M
    file) keeps it so on a GPU, multiplied from its codes by kernels/quant_linear.py as the layers'
    matrices are: at batch 1 the output matrix is read whole every token, and Llama-3-8B's in 16
    bits is 1.05 GB against 0.59 GB as Q6_K's 8-bit codes and scales. On a CPU it is multiplied
    as int4 groups or int8 rows (kernels/cpu_quant_linear.py), or held dequantized with ``quant.cpu_format`` "float32",
    as the layers' are. A tied head is the embedding's table, which lookups need dequantized: the
    head keeps its own quantized copy beside it when the file gives one (``load_quantized_copy``:
    SmolLM2, Qwen2.5 and Llama-3.2 GGUF files tie theirs), and reads that."""

    qweight: QWeight | None = None
    cpu_quant: CpuQuantLinear | None = None

    def __init__(self, vocab_size: int, dim: int, tp: TPContext, quant=None):
        super().__init__(vocab_size, dim, tp)
        self.cpu_format = None if quant is None else quant.cpu_integer_format

    def load_quantized_copy(self, ref) -> None:
        """A tied head's quantized rows (the embedding's matrix in its blocks): the head reads
        them instead of the embedding's table, which lookups keep using; on a CPU holding float32
        the table serves, as it holds the same values."""
        if self.weight.device.type != "cpu" or self.cpu_format:
            self.weight_loader(self.weight, ref)

    def weight_loader(self, param: nn.Parameter, ref, shard_id=None) -> None:
        rows = ref.load((slice(self.start, self.end),))
        if not isinstance(rows, QuantizedTensor):
            param.data[: rows.shape[0]].copy_(rows)
        elif param.device.type == "cpu" and self.cpu_format:
            self.cpu_quant = CpuQuantLinear(cpu_quant_weight(rows, self.cpu_format))
            self.weight = nn.Parameter(torch.empty(0, dtype=torch.int8), requires_grad=False)  # cpu_quant holds it
        elif param.device.type == "cpu":
            param.data[: rows.shape[0]].copy_(rows.dequantize(param.dtype))
        else:
            self.qweight = pack(rows, param.device)
            self.weight = nn.Parameter(self.qweight.qweight, requires_grad=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cpu_quant is not None:
            logits = F.pad(self.cpu_quant(hidden), (0, self.shard_size - self.cpu_quant.out_features))
        elif self.qweight is None:
            logits = F.linear(hidden, self.weight)
        else:  # this rank's rows, padded to the shard size every rank gathers
            logits = F.pad(quant_linear(hidden, self.qweight), (0, self.shard_size - self.qweight.n))
        if self.tp.size > 1:
            logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
