"""Linear layers that know how to shard their weight across tensor-parallel ranks.

Each parameter carries a `weight_loader(param, ref, shard_id)` that reads only this rank's slice
of the checkpoint tensor (`ref` is a kvship.loader.WeightRef), so a rank never materialises the
whole matrix. With one rank they are plain linears.

With a quantization scheme (kvship.quant) the weight is built as its pieces arrive: quantized
checkpoint tensors come as QuantizedTensors (sliced for this rank exactly as 16-bit ones are),
16-bit ones are quantized on the spot for in-situ quantization, and once every piece of the
matrix is in (q, k and v; gate and up) the layer packs them for kvship.kernels.quant_linear
(on a CPU: for kvship.kernels.cpu_quant_linear, or dequantizes them with cpu_format "float32").
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from kvship.kernels.activation import act_and_mul
from kvship.kernels.cpu_quant_linear import CpuQuantLinear, cpu_quant_weight
from kvship.kernels.gemv import act_mul_linear, linear
from kvship.kernels.quant_linear import QWeight, pack, quant_linear, quant_linear_gated
from kvship.parallel import TPContext
from kvship.quant import QuantizedTensor, quantize
from kvship.quant.tensor import concat_rows

log = logging.getLogger(__name__)


def _rows(ref, start: int, size: int) -> torch.Tensor:
    """Rows [start, start+size) of a 1-D or 2-D checkpoint tensor."""
    return ref.load((slice(start, start + size),))


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, quant=None):
        super().__init__()
        self.tp = tp
        self.out_features = out_features  # this rank's
        self.quant = quant
        self.qweight: QWeight | None = None
        self.cpu_quant: CpuQuantLinear | None = None
        if quant is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        else:  # built by _finish() from the pieces the loader collects, on this device and dtype
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            self._dtype = torch.get_default_dtype()
            self._pieces: dict[int, torch.Tensor | QuantizedTensor] = {}
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return quant_linear(x, self.qweight, self.bias)
        if self.cpu_quant is not None:
            y = self.cpu_quant(x)
            return y if self.bias is None else y + self.bias
        return linear(x, self.weight, self.bias)

    def _store(self, param: nn.Parameter, offset: int, src) -> None:
        """Rows [offset, offset + len(src)) of ``param`` come from ``src``."""
        if param is not self.weight or self.quant is None:
            if isinstance(src, QuantizedTensor):  # a layer held in 16 bits whatever the checkpoint's format
                src = src.dequantize(param.dtype)  # (DeepSeek's kv_b_proj, whose per-head blocks are multiplied directly)
            param.data[offset : offset + src.shape[0]].copy_(src)
            return
        device = param.device
        if self.quant.insitu is not None:  # one matrix at a time, on the device (a GGUF block's values too)
            src = quantize((src.dequantize() if isinstance(src, QuantizedTensor) else src).to(device),
                           self.quant.insitu)
        self._pieces[offset] = src
        if sum(p.shape[0] for p in self._pieces.values()) == self.out_features:
            self._finish(device)

    def _finish(self, device: torch.device) -> None:
        pieces = [self._pieces[o] for o in sorted(self._pieces)]
        self._pieces = {}
        quantized = [isinstance(p, QuantizedTensor) for p in pieces]
        if not any(quantized):  # a layer the checkpoint keeps in 16 bits (e.g. listed in its ignore list)
            self.weight = nn.Parameter(torch.cat(pieces).to(device, self._dtype), requires_grad=False)
        elif not all(quantized):  # e.g. a GGUF file with v in a type kvship dequantizes: all 16-bit then
            log.info("a fused layer mixes quantized and 16-bit matrices: holding it dequantized")
            self.weight = nn.Parameter(torch.cat([p.dequantize(self._dtype) if isinstance(p, QuantizedTensor) else
                                                  p.to(self._dtype) for p in pieces]).to(device), requires_grad=False)
        elif device.type == "cpu" and self.quant.cpu_integer_format:  # int4 groups or int8 rows
            self.cpu_quant = CpuQuantLinear(cpu_quant_weight(concat_rows(pieces), self.quant.cpu_integer_format))
            self.weight = nn.Parameter(torch.empty(0, dtype=torch.int8), requires_grad=False)  # cpu_quant holds it
        elif device.type == "cpu":  # the reference path, as a 16-bit model: the dequantized matrix (float32
            # products, exactly as the format defines them), so every format runs and is checked on a CPU
            self.weight = nn.Parameter(concat_rows(pieces).dequantize(self._dtype), requires_grad=False)
        else:
            self.qweight = pack(concat_rows(pieces), device)
            self.weight = nn.Parameter(self.qweight.qweight, requires_grad=False)


def plain_weight(layer: nn.Module) -> torch.Tensor | None:
    """The 16-bit matrix a sharded linear layer multiplies by as it is; None for a quantized one
    (its own kernels) or another kind of layer."""
    if isinstance(layer, _Linear) and layer.qweight is None and layer.cpu_quant is None:
        return layer.weight
    return None


class ReplicatedLinear(nn.Linear):
    """nn.Linear whose one-row product takes the GEMV kernel inside CUDA graphs (kernels/gemv.py's
    ``linear``), for small matrices every rank holds whole: a router's, whose cuBLAS call at one
    token took longer than its bytes warrant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, quant=None):
        super().__init__(in_features, tp.shard(out_features, "output features"), bias, tp, quant)

    def weight_loader(self, param: nn.Parameter, ref, shard_id=None) -> None:
        size = self.out_features  # the weight's rows and the bias alike
        self._store(param, 0, _rows(ref, self.tp.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPContext, quant=None):
        self.out_sizes = [tp.shard(n, "output features") for n in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, tp, quant)

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """x @ W^T; with ``act``, for a gate/up pair held quantized, act(gate) * up ([.., out / 2]):
        in the one-row GEMV's epilogue, else the product and then act_and_mul. A 16-bit layer
        returns the product whole ([.., out]): the down projection (RowParallelLinear's
        ``gated_input``) applies the activation as its GEMV reads it."""
        if act is not None and self.qweight is not None:
            return quant_linear_gated(x, self.qweight, act)
        return super().forward(x)

    def weight_loader(self, param: nn.Parameter, ref, shard_id: int) -> None:
        size = self.out_sizes[shard_id]
        offset = sum(self.out_sizes[:shard_id])
        self._store(param, offset, _rows(ref, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Query heads are split across ranks; KV heads too, or replicated
    when there are fewer KV heads than ranks (each rank keeps the KV head its queries use)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPContext,
                 quant=None):
        self.head_dim = head_dim
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size={tp.size} must be a multiple of num_key_value_heads={num_kv_heads}")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        _Linear.__init__(self, hidden, out, bias, tp, quant)

    def weight_loader(self, param: nn.Parameter, ref, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            self._store(param, 0, _rows(ref, self.tp.rank * q_size, q_size))
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            self._store(param, offset, _rows(ref, self.kv_head_start * self.head_dim, kv_size))


class RowParallelLinear(_Linear):
    """Input features split across ranks; partial sums all-reduced. The bias is added once.
    With ``gated_input`` the layer takes a gate/up projection's output [T, 2 * in] and applies
    ``act``-and-mul first: SiLU inside the GEMV kernel for one-row inputs in CUDA graphs, GELU-tanh
    (Gemma) as a kernel of its own; an input of ``in`` features is already activated (the
    gate/up layer did it, MergedColumnParallelLinear's ``act``). With
    ``reduce=False`` it returns this rank's partial sums: the caller reduces them (an RMSNorm
    built with ``reduce_tp`` does, fused with the residual add)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, gated_input: bool = False,
                 reduce: bool = True, quant=None, act: str = "silu"):
        self.in_features = tp.shard(in_features, "input features")
        super().__init__(self.in_features, out_features, bias, tp, quant)
        if bias and not reduce:
            raise ValueError("a row-parallel linear with a bias must reduce its own output")
        self.gated_input = gated_input
        self.act = act
        self.reduce = reduce

    def weight_loader(self, param: nn.Parameter, ref, shard_id=None) -> None:
        if param is self.bias:  # not sharded
            param.data.copy_(ref.load())
            return
        size = self.in_features
        start = self.tp.rank * size
        self._store(param, 0, ref.load((slice(None), slice(start, start + size))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.gated_input and x.shape[-1] != self.in_features
        if self.qweight is not None:
            y = quant_linear(act_and_mul(x, self.act) if gated else x, self.qweight)
        elif self.cpu_quant is not None:
            y = self.cpu_quant(act_and_mul(x, self.act) if gated else x)
        elif gated:
            y = act_mul_linear(x, self.weight, self.act)
        else:
            y = linear(x, self.weight)
        if not self.reduce:
            return y
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
