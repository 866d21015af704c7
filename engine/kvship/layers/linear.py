"""Linear layers that know how to shard their weight across tensor-parallel ranks.

Each parameter carries a `weight_loader(param, ref, shard_id)` that reads only this rank's slice
of the checkpoint tensor (`ref` is a kvship.loader.WeightRef), so a rank never materialises the
whole matrix. With one rank they are plain linears.
"""
from __future__ import annotations

import torch
from torch import nn

from kvship.kernels.gemv import linear, silu_mul_linear
from kvship.parallel import TPContext


def _rows(ref, start: int, size: int) -> torch.Tensor:
    """Rows [start, start+size) of a 1-D or 2-D checkpoint tensor."""
    return ref.load((slice(start, start + size),))


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, quant=None):
        super().__init__()
        if quant is not None:
            raise NotImplementedError("quantized linear layers")
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, quant=None):
        super().__init__(in_features, tp.shard(out_features, "output features"), bias, tp, quant)

    def weight_loader(self, param: nn.Parameter, ref, shard_id=None) -> None:
        size = param.shape[0]
        param.data.copy_(_rows(ref, self.tp.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPContext, quant=None):
        self.out_sizes = [tp.shard(n, "output features") for n in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, tp, quant)

    def weight_loader(self, param: nn.Parameter, ref, shard_id: int) -> None:
        size = self.out_sizes[shard_id]
        offset = sum(self.out_sizes[:shard_id])
        param.data[offset : offset + size].copy_(_rows(ref, self.tp.rank * size, size))


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
            dst, src = param.data[:q_size], _rows(ref, self.tp.rank * q_size, q_size)
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            dst = param.data[offset : offset + kv_size]
            src = _rows(ref, self.kv_head_start * self.head_dim, kv_size)
        dst.copy_(src)


class RowParallelLinear(_Linear):
    """Input features split across ranks; partial sums all-reduced. The bias is added once.
    With ``gated_input`` the layer takes a gate/up projection's output [T, 2 * in] and applies
    SiLU-and-mul first (inside the GEMV kernel for one-row inputs in CUDA graphs). With
    ``reduce=False`` it returns this rank's partial sums: the caller reduces them (an RMSNorm
    built with ``reduce_tp`` does, fused with the residual add)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, gated_input: bool = False,
                 reduce: bool = True, quant=None):
        super().__init__(tp.shard(in_features, "input features"), out_features, bias, tp, quant)
        if bias and not reduce:
            raise ValueError("a row-parallel linear with a bias must reduce its own output")
        self.gated_input = gated_input
        self.reduce = reduce

    def weight_loader(self, param: nn.Parameter, ref, shard_id=None) -> None:
        if param.dim() == 1:  # bias: not sharded
            param.data.copy_(ref.load())
            return
        size = param.shape[1]
        start = self.tp.rank * size
        param.data.copy_(ref.load((slice(None), slice(start, start + size))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = silu_mul_linear(x, self.weight) if self.gated_input else linear(x, self.weight)
        if not self.reduce:
            return y
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
